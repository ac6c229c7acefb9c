"""One run's configuration, shared by `dora broker`, `dora rollout` and `dora learner`.

Every process reads the same TOML file and uses the sections it needs, so a run is described once.

``run.engine`` names the rollout workers' engine (sim, torch or vllm) and ``[rollout]`` sets up the worker and that
engine, whichever it is (its slots among them); ``run.trainer`` names the learner's trainer (sim or torch) and
``[learner]`` sets up the learner and that trainer. The ``[engine]``, ``[trainer]`` and ``[workload]`` sections are
the simulator's numbers only, for the ``sim`` engine and trainer: a live run with them follows the same timing and
length models as `dora sim` (``dora.sim.engine``, ``dora.sim.trainer``, ``dora.sim.workload``), scaled in real
time by ``run.time_scale``.
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, field, replace
from typing import Literal

from dora.config import ConfigError, CoreConfig
from dora.config.models import LearnerSection, RolloutSection, SftSection
from dora.config.sim import EngineSection, TrainerSection, WorkloadSection


@dataclass(frozen=True, slots=True, kw_only=True)
class LogConfig:
    """Structured logs (structlog): one JSON object per line, or console rendering."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written."""
    format: Literal["auto", "json", "console"] = "auto"
    """auto: console on a terminal, JSON lines otherwise."""

    def __post_init__(self) -> None:
        if self.level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log.level must be debug, info, warning or error; got {self.level!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LiveRun:
    """The run as a whole: sampling settings every worker gets from the broker, and what `dora run` starts."""

    seed: int = 0
    """Seeds each group's sampling (with its attempt), the sim engine's lengths, and the learner's torch RNG."""
    time_scale: float = 0.01
    """Real seconds per simulated second for the sim engine and trainer (0.01: 100x faster than real)."""
    max_tokens: int = 30_720
    """Most tokens generated per sample (torch, vllm and custom engines; the sim engine's lengths are capped by
    workload.cap instead)."""
    temperature: float = 1.0
    """Sampling temperature; the learner scores at it too, since the behaviour log-probs were taken at it."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    workers: int = 2
    """`dora run`: rollout workers to start on this machine."""
    elastic_workers: int = 0
    """`dora run`: how many of the workers are elastic (rollout.elastic: they share the machine's cores with the
    learner and yield them for each train step); 0 = none (disaggregated), run.workers = all (colocated). The
    first ones (w0, w1, ...) are elastic. rollout.elastic = true makes every worker elastic."""
    engine: str = "sim"
    """`dora run`: the workers' engine (sim, torch, vllm)."""
    trainer: str = "sim"
    """`dora run`: the learner's trainer (sim, torch)."""
    dir: str = "runs"
    """`dora run`: where each run gets its own directory (logs, metrics.jsonl, plots, weight store)."""
    threads: int = 0
    """`dora run`: CPU threads per process (OMP_NUM_THREADS); 0 = this machine's cores shared out among the
    standalone workers and learner ranks, the elastic workers splitting the learner ranks' share. Oversubscribed
    OpenMP threads spin against each other and slow every CPU step manyfold (docs/benchmarks.md)."""
    worker_start_timeout_s: float = 600.0
    """`dora run`: seconds the rollout workers have, from their start, to join the broker, all of them (the first
    leases wait for the whole fleet); past it, `dora run` stops every process, prints each missing worker's last
    log line and exits 1. A worker that exits is reported at once, whatever this is. Leave room for a slow engine
    start: vLLM loading and compiling a large model, or starting on CPU."""
    gpus: int | str | tuple[int, ...] = "auto"
    """`dora run`: the GPUs it may give its processes: ``auto`` (every visible one: CUDA_VISIBLE_DEVICES's, else
    every GPU torch counts), a count (the first that many visible) or a list of GPU ids (``[0, 1]``, ids as
    CUDA_VISIBLE_DEVICES or nvidia-smi name them). The learner takes learner.gpus, elastic workers share those,
    standalone workers get rollout.gpus_per_worker GPUs each of the rest; each process is told its own through
    CUDA_VISIBLE_DEVICES. A layout that does not fit is refused before any process starts. No GPU visible: every
    process runs as without this setting."""
    share_gpus: bool = False
    """`dora run`: when run.gpus has too few GPUs for every standalone worker to get its own beside the learner's,
    let the standalone workers share them (the free ones first, then the learner's), each process sized to fit
    beside the others (small models on one GPU); false: such a layout is refused."""

    def __post_init__(self) -> None:
        gpus = self.gpus
        if isinstance(gpus, str) and gpus != "auto":
            try:
                gpus = tuple(int(x) for x in gpus.strip().strip("[]").split(",") if x.strip())
            except ValueError:
                raise ConfigError(f"run.gpus must be auto, a count or a list of GPU ids; got {self.gpus!r}") from None
            object.__setattr__(self, "gpus", gpus)
        if (isinstance(gpus, int) and gpus < 1) or (isinstance(gpus, tuple) and not gpus):
            raise ConfigError(f"run.gpus must be auto, a count >= 1 or a list of GPU ids; got {self.gpus!r}")
        if isinstance(gpus, tuple) and (min(gpus) < 0 or len(set(gpus)) < len(gpus)):
            raise ConfigError(f"run.gpus: GPU ids are >= 0, each once; got {list(gpus)}")
        if self.threads < 0:
            raise ConfigError(f"run.threads must be >= 0; got {self.threads}")
        if not self.worker_start_timeout_s > 0:
            raise ConfigError(f"run.worker_start_timeout_s must be > 0; got {self.worker_start_timeout_s}")
        if self.time_scale <= 0:
            raise ConfigError(f"run.time_scale must be > 0; got {self.time_scale}")
        if self.workers < 1:
            raise ConfigError(f"run.workers must be >= 1; got {self.workers}")
        if not 0 <= self.elastic_workers <= self.workers:
            raise ConfigError(f"run.elastic_workers must be in [0, run.workers = {self.workers}]; "
                              f"got {self.elastic_workers}")  # fmt: skip
        if self.engine not in ("sim", "torch", "vllm") or self.trainer not in ("sim", "torch"):
            raise ConfigError(f"run.engine must be sim, torch or vllm and run.trainer sim or torch; "
                              f"got {self.engine!r}, {self.trainer!r}")  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class BrokerSection:
    """The broker's socket and timings; workers and the learner read the liveness settings from here too."""

    bind: str = "tcp://127.0.0.1:5555"
    """ROUTER endpoint (tcp://host:port, port 0 = any free port, or ipc://path)."""
    discovery_file: str | None = "broker.json"
    """Where the bound endpoint is published (written atomically); None = only the ready line."""
    advertise: str | None = None
    """Host written into the discovery file when ``bind`` is a wildcard (tcp://0.0.0.0:PORT or tcp://*:PORT):
    None = this node's name (``SLURMD_NODENAME`` under Slurm). Set it when peers reach the broker by another name."""
    discovery_wait_s: float = 60.0
    """Rollout workers and the learner wait this long at start for the discovery file to appear (processes of one
    job start together). A discovery file in a directory that does not exist is an error at once."""
    heartbeat_interval_s: float = 0.5
    """Seconds between heartbeats, both ways (the broker tells every peer in its Welcome)."""
    liveness: int = 20
    """Missed heartbeat intervals before a silent peer is declared dead (10 s by default: a loaded 2-core machine
    was seen to leave a runnable process unrun for 3.7 s). A peer that crashed is found sooner, about two intervals
    after its last heartbeat: its connection is closed, and the heartbeat the broker sends a peer that missed one
    finds it unreachable. The window is for a peer whose connection stays up: hung, or on a node that lost power
    or its network."""
    stall_timeout_s: float = 30.0
    """A worker holding work whose progress counter does not move for this long is declared dead."""
    learner_timeout_s: float = 300.0
    """Silence after which the learner is declared dead and its batch is held for a new one. Longer
    than the rollout window: a learner may block for a while (a checkpoint, a long step), and
    declaring it dead early would void a step it is about to publish."""
    tick_s: float = 2.0
    """Orchestrator timer (re-partition of workers across versions)."""
    max_message_bytes: int = 256 << 20
    """ZeroMQ MAXMSGSIZE of the broker's socket: a larger incoming message closes that peer's connection."""
    hwm: int = 100_000
    """ZeroMQ send and receive high-water marks of the broker's socket, in messages per peer (a send that
    finds the pipe full is kept and retried, never dropped)."""
    exit_when_done: bool = True
    """Exit 0 once the run's total_steps are trained (after telling the peers)."""
    strict: bool = False
    """Re-check every core invariant from scratch after every event (slow; for tests and debugging)."""
    journal: str | None = None
    """Append-only journal (fsync'd) of the cursor and every trained step; a broker started on an existing
    journal resumes that run. None: no journal (a restarted broker starts the run over)."""
    metrics_bind: str | None = None
    """``host:port`` where the broker serves Prometheus metrics over HTTP (``GET /metrics``); port 0 = any free
    port. The URL it got is in the ready line and the discovery file (``metrics_url``). None: no endpoint.
    `dora run` sets ``127.0.0.1:0``."""
    metrics_file: str | None = None
    """JSON lines, one per train step: step, version, step_s, staleness (cumulative histogram), live_versions,
    max_staleness, the learner's metrics, elapsed_s and the wall-clock time ``t``. Appended to, so a broker
    resumed from its journal goes on in the same file. None: not written (`dora run`: its run directory)."""
    timeline_file: str | None = None
    """JSON lines, one per worker event (joined, assigned a version, weights loaded, lost) and per published
    version, each with the wall-clock time ``t``: what `dora plot` draws the worker timeline from. Appended to.
    None: not written (`dora run`: its run directory)."""
    eval_file: str | None = None
    """Append one JSON line per held-out evaluation round here (eval.every_steps; `dora run` sets it)."""

    def __post_init__(self) -> None:
        if min(self.heartbeat_interval_s, self.stall_timeout_s, self.tick_s, self.learner_timeout_s) <= 0:
            raise ConfigError("broker: heartbeat_interval_s, stall_timeout_s, learner_timeout_s and tick_s must be > 0")
        if self.discovery_wait_s < 0:
            raise ConfigError(f"broker.discovery_wait_s must be >= 0; got {self.discovery_wait_s}")
        if self.liveness < 2:
            raise ConfigError(f"broker.liveness must be >= 2 (missed heartbeats before death); got {self.liveness}")
        if self.metrics_bind is not None:
            split_host_port(self.metrics_bind)


def split_host_port(bind: str) -> tuple[str, int]:
    """``host:port`` (``[::1]:port`` for IPv6) as (host, port); a ConfigError naming broker.metrics_bind if not."""
    host, sep, port = bind.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"broker.metrics_bind must be host:port (port 0 = any free port), got {bind!r}")
    return host, int(port)


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskSection:
    """The prompts (the broker encodes them) and the reward (the workers score with it): a built-in task, or
    the user's dataset (a JSONL or Parquet file, or a datasets save_to_disk folder)."""

    name: str = "synthetic"
    """synthetic (token arrays for the sim engine), arithmetic or countdown; dataset when task.dataset is set."""
    seed: int = 0
    """The task's seed: item i is a pure function of (seed, i); a dataset's epoch order is seeded by it."""
    tokenizer: str | None = None
    """Folder holding tokenizer.json (the model folder); the broker encodes prompts with it."""
    reward: str | None = None
    """`module:function` scoring `(completion: str, item) -> float` on the workers (the broker imports it too, so
    keep its module free of heavy imports), or a reward service's `http(s)://host:port/path` (called in batches,
    see dora.tasks.remote_reward); default: the task's own."""
    reward_timeout_s: float = 5.0
    """A reward call taking longer scores 0 (with the reason); the worker goes on."""
    reward_service_timeout_s: float = 10.0
    """Reward service: one POST's timeout (per socket operation)."""
    reward_service_retries: int = 2
    """Reward service: retries of a failed POST (same ids, 0.1 s backoff doubling); then its samples score 0."""
    reward_batch_size: int = 32
    """Reward service: samples per POST at most."""
    dataset: str | None = None
    """The user's dataset: a .jsonl/.json file (JSON lines), a .parquet file, or a folder written by
    datasets' save_to_disk. Every row is checked before any process starts."""
    prompt_field: str = "prompt"
    """dataset: the column holding the prompt text (sent as one user turn)."""
    messages_field: str | None = None
    """dataset: the column holding the prompt as chat turns (a list of {role, content}), instead of
    prompt_field; needs chat_template = true."""
    answer_field: str = "answer"
    """dataset: the column holding the reference answer the reward compares with."""
    system_prompt: str | None = None
    """A system turn put before every prompt."""
    split: str | None = None
    """dataset: the split of a save_to_disk folder holding several (default: train, or the only one)."""
    max_prompt_tokens: int | None = None
    """Prompts longer than this (rendered, in tokens) are filtered out: counted, reported at start and in the
    metrics, and never dispatched. None: no limit."""
    chat_template: bool = False
    """Render each prompt with the model folder's chat template (with the generation prompt); false: the
    prompt text as it is."""
    env: str | None = None
    """`module:Class`: a multi-turn environment (see dora.envs): each sample is an episode of assistant turns and
    environment answers, scored by the environment (task.reward is not used). Needs chat_template = true."""
    max_turns: int = 8
    """env: assistant turns per episode at most (the environment scores the last one, then the episode ends)."""
    max_episode_tokens: int = 1024
    """env: tokens per episode at most, the environment's included; rollout.max_tokens bounds each turn."""
    turn_end: tuple[str, ...] = ()
    """env: tokens (their text, each one token of the vocabulary) that end an assistant turn, besides the model's
    own stops; empty: the chat template's end of turn (the special token it writes after an assistant's content)."""
    env_timeout_s: float = 10.0
    """env: an environment call (reset or step) taking longer ends its episode (reason: timeout)."""
    env_failure: str = "zero"
    """env: an episode whose environment failed (raised, timed out, answered junk) scores 0 and is trained
    (zero), or is kept out of the loss (mask); either way its group is trained whole and the failure counted."""
    agent: str | None = None
    """`module:function`: an agent written against the OpenAI API (see dora.rollout.agents). Each sample is one
    call `await agent(row, client)`, `client` an `openai.AsyncOpenAI` bound to an endpoint serving that episode
    alone, every completion under the one version its group was dispatched on; it returns the episode's reward
    (a number), or None to leave the last answer to task.reward. Agent episodes never migrate. Needs
    chat_template = true; task.max_turns, max_episode_tokens, env_timeout_s (the agent's time between its calls)
    and env_failure apply as to environments."""
    tool_parser: str = "auto"
    """agent: how completions are read into OpenAI `tool_calls`: a vLLM tool-call parser's name (`hermes`,
    `llama3_json`, `mistral`, ...), or auto: the one the model's chat template writes (none: tools are refused)."""

    reward_model: str | None = None
    """A reward model: a sequence-classification model folder (one label) that scores each sample's rendered prompt
    and completion as one text, with its own tokenizer; served by `dora reward` (which `dora run` starts), its score
    is the reward component `model`."""
    reward_judge: str | None = None
    """An LLM judge: a causal LM folder that answers task.judge_template greedily, at fixed weights, in `dora reward`
    (served by one of dora's own engines: task.judge_engine); the first number of its answer over
    task.judge_max_score, clipped to [0, 1], is the reward component `judge` (an answer without a number scores the
    sample 0, with the reason)."""
    judge_template: str = (
        "Rate the response to the prompt from 0 (wrong) to 10 (fully correct); the reference answer is "
        "{answer}. Reply with the number only.\n\nPrompt:\n{prompt}\n\nResponse:\n{completion}\n\nScore:"
    )
    """reward_judge: the judge's prompt; {prompt} (as the policy saw it, rendered), {completion} and {answer} are
    filled in ({{ and }} for braces), then the judge's own chat template is applied if it has one."""
    judge_max_tokens: int = 16
    """reward_judge: tokens the judge answers at most."""
    judge_max_score: float = 10.0
    """reward_judge: the judge's scale; its number is divided by this and clipped to [0, 1]."""
    judge_engine: str = "torch"
    """reward_judge: the dora engine that serves the judge in `dora reward`, its folder loaded once as version 0:
    `torch` (dora's torch engine, on task.reward_device: float32 on the CPU, bfloat16 on a GPU) or `vllm` (the vllm
    extra; on vLLM's platform, the first device CUDA_VISIBLE_DEVICES shows on a GPU machine)."""
    reward_weights: dict[str, float] = field(default_factory=dict)
    """Several rewards combined: source -> weight; the reward is the weighted sum and each source's value is a
    reward component (metrics.jsonl). A source is `model` (task.reward_model), `judge` (task.reward_judge) or what
    task.reward takes (a built-in name such as `exact`, a `module:function`, a reward service URL). Empty: the one
    source set (reward_model or reward_judge alone, else task.reward)."""
    reward_server: str | None = None
    """The URL of the `dora reward` serving reward_model and reward_judge (`dora run` starts one and sets this);
    the workers call it as a reward service."""
    reward_server_bind: str = "127.0.0.1:0"
    """`dora reward`: host:port it listens on (port 0: any free port; it prints and logs its URL)."""
    reward_server_batch_size: int = 32
    """`dora reward`: samples scored per forward at most, gathered from every worker's requests."""
    reward_server_wait_s: float = 0.01
    """`dora reward`: how long the first waiting sample waits for others to fill its batch."""
    reward_device: str = "cpu"
    """`dora reward`: the torch device of the reward model and of the judge's torch engine (cpu, cuda, cuda:N)."""

    def __post_init__(self) -> None:
        if self.dataset is not None and self.name == "synthetic":
            object.__setattr__(self, "name", "dataset")  # the dataset is the task
        if self.name not in ("synthetic", "arithmetic", "countdown", "dataset"):
            raise ConfigError(f"task.name must be synthetic, arithmetic, countdown or dataset; got {self.name!r}")
        if self.dataset is not None and self.name != "dataset":
            raise ConfigError(f"task.dataset is set, so the task is that dataset: leave task.name out (or set it to "
                              f"'dataset'), not {self.name!r}")  # fmt: skip
        if self.name == "dataset" and self.dataset is None:
            raise ConfigError("task.name = 'dataset' needs task.dataset (a .jsonl or .parquet file or a folder)")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ConfigError(f"task.max_prompt_tokens must be >= 1 or unset; got {self.max_prompt_tokens}")
        if self.messages_field is not None and not self.chat_template:
            raise ConfigError("task.messages_field (chat turns) needs task.chat_template = true")
        if self.env is not None and not self.chat_template:
            raise ConfigError("task.env (multi-turn episodes) needs task.chat_template = true")
        if self.agent is not None and not self.chat_template:
            raise ConfigError("task.agent (episodes through the OpenAI API) needs task.chat_template = true")
        if self.agent is not None and self.env is not None:
            raise ConfigError("task.agent and task.env are two ways to run episodes: set one of them")
        if self.reward_service_timeout_s <= 0 or self.reward_service_retries < 0 or self.reward_batch_size < 1:
            raise ConfigError(f"task.reward_service_timeout_s must be > 0, reward_service_retries >= 0 and "
                              f"reward_batch_size >= 1; got {self.reward_service_timeout_s}, "
                              f"{self.reward_service_retries}, {self.reward_batch_size}")  # fmt: skip
        if self.env_failure not in ("zero", "mask"):
            raise ConfigError(f"task.env_failure must be 'zero' or 'mask'; got {self.env_failure!r}")
        for name in ("max_turns", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"task.{name} must be >= 1; got {getattr(self, name)}")
        if not self.env_timeout_s > 0:
            raise ConfigError(f"task.env_timeout_s must be > 0; got {self.env_timeout_s}")
        check_reward_sources(self)


def check_reward_sources(t: TaskSection) -> None:
    """task.reward_model, reward_judge, reward_weights and the reward server's settings, each mistake one line."""
    for key, name in (("reward_model", "model"), ("reward_judge", "judge")):
        if getattr(t, key) is not None and t.reward_weights and name not in t.reward_weights:
            raise ConfigError(f"task.{key} is set but task.reward_weights has no {name!r} source (give it a weight)")
        if getattr(t, key) is None and name in t.reward_weights:
            raise ConfigError(f"task.reward_weights names {name!r} but task.{key} is unset")
    served = [k for k in ("reward_model", "reward_judge") if getattr(t, k) is not None]
    if not t.reward_weights and (len(served) > 1 or (served and t.reward is not None)):
        raise ConfigError(f"task.{' and task.'.join(served)}{' and task.reward' * (t.reward is not None)} are "
                          f"several rewards: weigh them in task.reward_weights")  # fmt: skip
    if t.reward_weights and t.reward is not None:
        raise ConfigError("task.reward_weights names every reward source: put task.reward's there, with its weight")
    if (served or t.reward_weights) and t.env is not None:
        raise ConfigError("task.env scores its own episodes: task.reward_model, reward_judge and reward_weights "
                          "are for completions")  # fmt: skip
    for name, weight in t.reward_weights.items():
        if not name or len(name) > 64 or name == "reward":
            raise ConfigError(f"task.reward_weights: source {name!r} must be 1 to 64 characters and not 'reward'")
        if not math.isfinite(weight):
            raise ConfigError(f"task.reward_weights.{name} must be a finite number; got {weight}")
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(t.judge_template) if f is not None}
    except ValueError as e:
        raise ConfigError(f"task.judge_template is not a template: {e} (write {{{{ and }}}} for braces)") from None
    if not fields <= {"prompt", "completion", "answer"} or "completion" not in fields:
        raise ConfigError(f"task.judge_template may hold {{prompt}}, {{completion}} and {{answer}}, and needs "
                          f"{{completion}}; got {sorted(fields)}")  # fmt: skip
    if t.judge_engine not in ("torch", "vllm"):
        raise ConfigError(f"task.judge_engine must be 'torch' or 'vllm'; got {t.judge_engine!r}")
    if t.judge_max_tokens < 1 or not t.judge_max_score > 0:
        raise ConfigError(f"task.judge_max_tokens must be >= 1 and judge_max_score > 0; got {t.judge_max_tokens}, "
                          f"{t.judge_max_score}")  # fmt: skip
    if t.reward_server_batch_size < 1 or not t.reward_server_wait_s >= 0:
        raise ConfigError(f"task.reward_server_batch_size must be >= 1 and reward_server_wait_s >= 0; got "
                          f"{t.reward_server_batch_size}, {t.reward_server_wait_s}")  # fmt: skip
    device, _, index = t.reward_device.partition(":")
    if device not in ("cpu", "cuda") or (index and (device != "cuda" or not index.isdigit())):
        raise ConfigError(f"task.reward_device must be cpu, cuda or cuda:N; got {t.reward_device!r}")
    host, sep, port = t.reward_server_bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"task.reward_server_bind must be host:port (port 0: any free port); got "
                          f"{t.reward_server_bind!r}")  # fmt: skip
    if t.reward_server is not None and not t.reward_server.startswith(("http://", "https://")):
        raise ConfigError(f"task.reward_server must be the http(s) URL `dora reward` printed; got {t.reward_server!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SecuritySection:
    """CURVE encryption and authentication of every connection."""

    keys: str | None = None
    """Directory from `dora keys generate`: CURVE on every connection; only its keys connect, each as its role."""
    auth_timeout_s: float = 30.0
    """A client that has no answer from the broker this long after starting stops with an error (CURVE
    handshakes fail silently)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricsSection:
    """Where the broker sends each train step's numbers besides ``broker.metrics_file``: TensorBoard event files
    and Weights & Biases (the names are in dora/broker/sinks.py). Both are off unless set; each needs its extra
    (``pip install 'dora-rl[tensorboard]'``, ``'dora-rl[wandb]'``)."""

    tensorboard_dir: str | None = None
    """Directory for TensorBoard event files (``tensorboard --logdir`` it); one new file per broker start. `dora
    run` and `dora slurm config` resolve a relative path against the run directory. None: no TensorBoard."""
    wandb_project: str | None = None
    """Weights & Biases project to log the run to (one wandb run per broker start). None: no wandb."""
    wandb_mode: str = "offline"
    """``offline`` (written under wandb_dir; upload later with ``wandb sync``) or ``online`` (needs a login)."""
    wandb_dir: str | None = None
    """Directory wandb writes its ``wandb/`` folder of runs in. None: beside ``broker.metrics_file``, or the
    current directory. `dora run` and `dora slurm config` resolve a relative path against the run directory."""
    wandb_run_name: str | None = None
    """Display name of the wandb run. None: wandb picks one."""

    def __post_init__(self) -> None:
        for key in ("tensorboard_dir", "wandb_project", "wandb_dir", "wandb_run_name"):
            if getattr(self, key) == "":
                raise ConfigError(f"metrics.{key} must not be empty (leave it out to turn it off)")
        if self.wandb_mode not in ("offline", "online"):
            raise ConfigError(f"metrics.wandb_mode must be offline or online; got {self.wandb_mode!r}")
        if self.wandb_project is not None and any(c in self.wandb_project for c in "/\\#?%:"):
            raise ConfigError(f"metrics.wandb_project must not contain any of / \\ # ? % :; got {self.wandb_project!r}")
        for key in ("wandb_dir", "wandb_run_name"):
            if getattr(self, key) is not None and self.wandb_project is None:
                raise ConfigError(f"metrics.{key} is set but metrics.wandb_project is not (no wandb run without it)")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSection:
    """Held-out evaluation: a dataset the run never trains on, in the layout of [task] (the same fields, chat
    template and reward), scored per completion. `dora run` evaluates the starting model and the final version
    and prints both; `dora eval` evaluates a model folder or a weight-store version alone."""

    dataset: str | None = None
    """The held-out rows: a .jsonl/.json or .parquet file or a datasets save_to_disk folder. None: no evaluation."""
    split: str | None = None
    """The split of a save_to_disk folder holding several."""
    limit: int | None = None
    """Evaluate the first this many rows only. None: every row."""
    samples: int = 1
    """Completions per row (pass@k is reported for k = 1, 2, 4, ... up to it); 1 with greedy decoding."""
    temperature: float = 0.0
    """0: greedy decoding (exact-match accuracy); above 0: sampling, for pass@k."""
    max_tokens: int | None = None
    """Most tokens per completion. None: run.max_tokens."""

    every_steps: int = 0
    """During a run, the rollout workers evaluate every this many versions (and version 0), each round on
    exactly one version, outside every training decision; 0: only `dora run`'s before and after. A round under
    way when the last step is published is waited for before the workers are let go."""

    def __post_init__(self) -> None:
        if self.samples < 1 or self.temperature < 0 or (self.temperature == 0 and self.samples > 1):
            raise ConfigError("eval.samples must be >= 1 and eval.temperature >= 0; greedy decoding "
                              f"(temperature 0) takes one sample; got samples={self.samples}, "
                              f"temperature={self.temperature}")  # fmt: skip
        if self.every_steps < 0:
            raise ConfigError(f"eval.every_steps must be >= 0; got {self.every_steps}")
        if (self.limit is not None and self.limit < 1) or (self.max_tokens is not None and self.max_tokens < 1):
            raise ConfigError("eval.limit and eval.max_tokens must be >= 1 or unset")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    run: LiveRun = field(default_factory=LiveRun)
    core: CoreConfig = field(default_factory=CoreConfig)
    broker: BrokerSection = field(default_factory=BrokerSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    task: TaskSection = field(default_factory=TaskSection)
    learner: LearnerSection = field(default_factory=LearnerSection)
    engine: EngineSection = field(default_factory=EngineSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    workload: WorkloadSection = field(default_factory=WorkloadSection)
    log: LogConfig = field(default_factory=LogConfig)
    security: SecuritySection = field(default_factory=SecuritySection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    eval: EvalSection = field(default_factory=EvalSection)
    sft: SftSection = field(default_factory=SftSection)

    def __post_init__(self) -> None:
        replacing = self.learner.filter_uniform_groups == "replace"
        if self.core.filter_uniform and not replacing:
            raise ConfigError("core.filter_uniform is set by learner.filter_uniform_groups = 'replace' in a live run "
                              f"(it is {self.learner.filter_uniform_groups!r})")  # fmt: skip
        if replacing and not self.core.filter_uniform:  # the broker's core filters; the learner masks what is left
            object.__setattr__(self, "core", replace(self.core, filter_uniform=True))
        if self.task.agent is not None and self.core.migrate:  # an agent talks to one worker's endpoint
            object.__setattr__(self, "core", replace(self.core, migrate=False))
        if self.learner.mini_batches > self.core.train_groups:
            raise ConfigError(f"learner.mini_batches = {self.learner.mini_batches} is more than core.train_groups = "
                              f"{self.core.train_groups}: a mini-batch holds whole groups, at least one")  # fmt: skip
        if self.learner.lr_schedule != "constant" and self.core.total_steps is None:
            raise ConfigError(f"learner.lr_schedule = {self.learner.lr_schedule!r} decays over the run, which needs "
                              "its length: set core.total_steps")  # fmt: skip
        credit = self.rollout.credit
        if credit < self.core.group_size:
            raise ConfigError(
                f"a rollout worker accepts {credit} sequences at once (rollout.credit_slots, else 2 x "
                f"rollout.max_slots), fewer than one group of core.group_size = {self.core.group_size}: a group "
                f"goes to one worker whole, so none could ever be leased"
            )
