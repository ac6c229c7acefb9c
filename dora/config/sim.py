"""Configuration of a simulated cluster: `dora sim --config FILE.toml`.

Sections: ``[run]``, ``[core]`` (the same CoreConfig the broker uses), ``[cluster]``, ``[engine]``,
``[trainer]``, ``[workload]``, ``[model]`` and ``[lora]``. Every key is checked; an unknown key or a bad value
is one clear error. ``examples/sim/*.toml`` document where each number comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from dora.config import ConfigError, CoreConfig
from dora.ids import Mode

Placement = Literal["colocated", "disaggregated", "elastic"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSection:
    """One simulated run per mode, on a virtual clock."""

    steps: int = 12
    """Train steps per simulated run."""
    warmup_steps: int = 2
    """Steps left out of the steady-state metrics (the paper averages iterations after warm-up)."""
    cooldown_steps: int | None = None
    """Steps simulated after the measured ones, left out of the window's metrics. The core stops dispatching once
    the run's last batch is dispatched, so a run's last steps train work dispatched earlier with nothing new behind
    it: a window that ended there would count work done before it and none done for after it, which no long run
    does (docs/benchmarks.md, "Measurements the code is built on", has how much that overstates). While
    the cooldown runs, the core still dispatches for the steps after the window. None = K + 2."""
    search_steps: int = 8
    """Measured steps of each short run the split search tries (cluster.rollout_gpus or elastic_gpus left open):
    warmup_steps, then these, then the cooldown; at most the run's own. Step times can swing 3x from one step to
    the next (a version's tail), so a few steps rank splits by chance."""
    seed: int = 0
    """Seeds the workload's lengths and the fault schedule (the same for every mode)."""
    tick_s: float = 30.0
    """Orchestrator timer (virtual seconds)."""
    faults: int = 0
    """Random worker kills per run (same times and victims for every mode)."""
    restart_s: float = 60.0
    """Virtual seconds before a killed worker joins again."""

    def __post_init__(self) -> None:
        if self.steps < 1 or not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"run.steps must be >= 1 and 0 <= run.warmup_steps < steps; got {self}")
        if self.tick_s <= 0 or self.restart_s < 0 or self.faults < 0:
            raise ConfigError("run.tick_s must be > 0, run.restart_s and run.faults >= 0")
        if self.search_steps < 1:
            raise ConfigError(f"run.search_steps must be >= 1; got {self.search_steps}")
        if self.cooldown_steps is not None and self.cooldown_steps < 0:
            raise ConfigError(f"run.cooldown_steps must be >= 0; got {self.cooldown_steps}")

    def cooldown(self, staleness: int) -> int:
        """The steps simulated after the measured ones, for a run whose staleness bound is ``staleness``."""
        return staleness + 2 if self.cooldown_steps is None else self.cooldown_steps


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterSection:
    """The accelerators and how they are split between rollout and training."""

    total_gpus: int = 32
    """Accelerators in the cluster (rollout workers and trainer together)."""
    gpus_per_worker: int = 4
    """Accelerators per inference-engine replica (one rollout worker = one DP group)."""
    rollout_gpus: int | None = None
    """Disaggregated placement: accelerators in the rollout pool (the rest train). None = search the
    split with the best steady-state throughput for each mode, and report it. Elastic placement: the
    accelerators that roll out (default all); those beyond them only train."""
    elastic_gpus: int | None = None
    """Elastic placement: of the rollout accelerators, those that also train: they roll out while the
    trainer waits for a batch and yield for each train step; the others (standalone) always roll out.
    None = search the count with the best steady-state throughput. Colocated is every accelerator
    elastic, disaggregated none."""
    host_link_bytes_per_s: float = 0.0
    """Accelerator <-> host memory bandwidth per accelerator, paid by role switches (colocated, elastic):
    engine weights and held KV offloaded at a yield and loaded back, the trainer's state around each
    step. 0 = role switches cost nothing."""
    placement: dict[str, Placement] = field(
        default_factory=lambda: {"sync": "colocated", "one_step": "disaggregated", "partial": "colocated",
                                 "dora": "disaggregated", "drop_stale": "disaggregated"}
    )  # fmt: skip
    """Per mode: colocated (every accelerator alternates rollout and training), disaggregated (a rollout pool
    and a trainer pool) or elastic (standalone rollout workers plus elastic ones that also train); a mode
    not listed is disaggregated."""

    def __post_init__(self) -> None:
        if self.gpus_per_worker < 1 or self.total_gpus < 2 * self.gpus_per_worker:
            raise ConfigError("cluster.total_gpus must hold at least two workers of cluster.gpus_per_worker")
        for key in ("rollout_gpus", "elastic_gpus"):
            gpus = getattr(self, key)
            if gpus is not None and not (
                self.gpus_per_worker <= gpus <= self.total_gpus and gpus % self.gpus_per_worker == 0
            ):
                raise ConfigError(f"cluster.{key} must be a multiple of gpus_per_worker, at most total_gpus")
        if self.host_link_bytes_per_s < 0:
            raise ConfigError("cluster.host_link_bytes_per_s must be >= 0")
        bad = sorted(set(self.placement) - {m.value for m in Mode})
        if bad:
            raise ConfigError(f"cluster.placement: unknown mode {bad[0]!r}")

    def placement_of(self, mode: Mode) -> Placement:
        return self.placement.get(mode.value, "disaggregated")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineSection:
    """The numbers of the sim engine's timing model (``dora.sim.engine``): one inference-engine replica as a live
    run's ``sim`` engine (run.engine) and `dora sim` model it. A decode step takes tpot_scale x (tpot_base_s +
    tpot_per_seq_s x running sequences). A live worker's slots, whatever its engine, are [rollout]'s."""

    tpot_base_s: float = 0.02
    """Seconds per decode step, fixed part."""
    tpot_per_seq_s: float = 0.0001
    """Seconds per decode step added by each running sequence."""
    tpot_scale: float = 1.0
    """Multiplies both decode terms: hardware-derived terms, one fitted scale."""
    kv_budget_tokens: int = 1 << 40
    """KV cache capacity in tokens (prompt + generated of every running sequence)."""
    prefill_s_per_token: float = 0.0
    """Prefill cost; also the re-prefill cost of partial after a weight swap and of migration without KV."""
    kv_bytes_per_token: float = 0.0
    """KV cache bytes per token, shipped by a migration with kv_transfer."""
    transfer_bytes_per_s: float = 1e11
    """Worker-to-worker bandwidth for KV migration."""
    kv_transfer: bool = True
    """Migration ships the KV cache; False = the target re-prefills prompt + generated prefix."""
    load_s: float = 1.0
    """Time for a replica to receive and load a new version's weights."""
    keep_kv: bool = True
    """`dora sim`, multi-turn episodes: one waiting on a tool call keeps its KV cache (prefix caching; running
    sequences evict it, oldest first, when they need the room); False = it re-prefills its whole context
    when it resumes."""
    weight_bytes: float = 0.0
    """`dora sim`, role switches: bytes of one replica's weights, offloaded to host memory when it yields to
    the trainer and loaded back when it resumes the same version (see cluster.host_link_bytes_per_s)."""
    wake_s: float = 0.0
    """`dora sim`: fixed seconds for a replica to take its accelerators back after a yield."""
    yield_kv: Literal["offload", "drop"] = "offload"
    """`dora sim`: what a yielding replica does with the KV cache of the requests it holds: offload it to
    host memory and back, or drop it and re-prefill them when it resumes."""

    def __post_init__(self) -> None:
        if self.tpot_base_s <= 0 or self.tpot_per_seq_s < 0 or self.tpot_scale <= 0 or self.kv_budget_tokens < 1:
            raise ConfigError("engine: tpot_base_s > 0, tpot_per_seq_s >= 0, tpot_scale > 0, kv_budget_tokens >= 1")
        if min(self.prefill_s_per_token, self.kv_bytes_per_token, self.load_s, self.weight_bytes, self.wake_s) < 0:
            raise ConfigError("engine: costs must be >= 0")
        if self.transfer_bytes_per_s <= 0:
            raise ConfigError("engine.transfer_bytes_per_s must be > 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimEngineSection(EngineSection):
    """`dora sim`'s ``[engine]``: the sim engine's timing model, and how many sequences each simulated replica
    decodes and is leased at once (a live run sets those for its workers in [rollout])."""

    max_slots: int = 256
    """Sequences a replica decodes at once (vLLM's max_num_seqs)."""
    credit_slots: int = 0
    """Sequences leased to a replica at once (its credit); 0 = 2 x max_slots, so a queue waits in the engine."""

    def __post_init__(self) -> None:
        EngineSection.__post_init__(self)
        if self.max_slots < 1 or self.credit_slots < 0:
            raise ConfigError(f"engine.max_slots must be >= 1 and engine.credit_slots >= 0; got {self.max_slots} "
                              f"and {self.credit_slots}")  # fmt: skip

    @property
    def credit(self) -> int:
        """The replica's credit: credit_slots, or 2 x max_slots when it is 0."""
        return self.credit_slots or 2 * self.max_slots


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSection:
    """The numbers of the sim trainer's timing model (``dora.sim.trainer``): `dora sim`'s trainer and a live run's
    ``sim`` trainer (run.trainer). ``data_parallel = "fluid"``: a train step takes step_fixed_s + tokens x
    gpu_s_per_token / trainer GPUs, then the version's write (publish_s, or weights_gb x write_s_per_gb), or with
    overlap_publish its copy aside, the write going on in the background. Otherwise the batch's sequences are
    trained in ``updates_per_step`` optimizer updates, each split over the data-parallel replicas
    (``model_parallel_gpus`` accelerators each) and ended by a barrier, so every update lasts as long as its
    busiest replica."""

    gpu_s_per_token: float = 0.001
    """Accelerator-seconds of training per token of the batch."""
    step_fixed_s: float = 5.0
    """Seconds of each train step that do not depend on the batch's tokens."""
    publish_s: float = 1.0
    """Seconds to publish a version after its step (weight transfer to the store), a flat cost used while
    weights_gb is 0; with weights_gb > 0 the per-GB costs below replace it."""
    weights_gb: float = 0.0
    """`dora sim`: GB of one version as published (bf16 weights; scaled to the adapter's bytes in a LoRA run).
    0: the write costs publish_s and no copy is modelled (as before the per-GB costs); > 0: the write costs
    weights_gb x write_s_per_gb, the copy weights_gb x snapshot_s_per_gb, and publish_s is not used."""
    snapshot_s_per_gb: float = 0.05
    """`dora sim`, with weights_gb > 0 and overlap_publish: seconds per GB to copy the weights aside (into a
    pinned host buffer) before the background write: the publish's share of the step's critical path. 0.05 s/GB
    (20 GB/s) is the figure used: bench/weights.py's target for that copy, and under half the pinned host-link rate
    bench/role_switch.py measured on an H100 (47-50 GB/s, 0.02 s/GB), left that low because a sharded trainer
    gathers the whole version into one host's buffer. Assumed, not tuned to any result."""
    write_s_per_gb: float = 2.17
    """`dora sim`, with weights_gb > 0: seconds per GB to write a version durably into the store (files, digests,
    fsync), in line after the step or, with overlap_publish, in the background. 2.17 s/GB is the in-line publish
    of a 0.99 GB bf16 model folder measured on an H100 host (docs/gpus.md, bench/gpu.py): the figure used, not
    tuned to any result."""
    overlap_publish: bool = False
    """`dora sim`: the learner writes each version in the background (the live learner.overlap_publish): its
    step ends after the copy (snapshot), it asks for the next batch at once, and the version is published when
    the write ends; a step that ends while the previous write runs waits for it (one write in flight). K = 0
    stays sync (the next batch needs the new version) and elastic workers' batches wait for the publish (the
    core's rules). False: the write is in the step, as before. Off by default so that configs written before
    it keep their numbers."""
    state_bytes: float = 0.0
    """Bytes of the trainer's state (parameters, gradients, optimizer), loaded from host memory before each
    step and offloaded after it when the trainer shares its accelerators (colocated, elastic)."""
    data_parallel: Literal["fluid", "count", "stride", "tokens"] = "fluid"
    """How an update's sequences go to the data-parallel replicas. ``fluid``: work divides perfectly over the
    accelerators (no replica waits for another); ``count``: each replica takes an equal number of consecutive
    sequences, in the batch's order (a plain data loader's split); ``stride`` and ``tokens``: the torch learner's
    two ``learner.balance`` assignments (dora/balance.py), the same function: every world-th sequence in the
    learner's length order, or greedy by tokens, longest first to the least loaded replica, a group whole where
    its replica stays within an even share."""
    updates_per_step: int = 1
    """Optimizer updates per train step (mini-batches of the batch's sequences, in order); each ends with a
    barrier across the data-parallel replicas. Not used when fluid."""
    model_parallel_gpus: int = 1
    """Accelerators of one data-parallel replica (tensor x pipeline parallel). The trainer has
    trainer GPUs // this many replicas; accelerators left over idle. Not used when fluid."""

    def __post_init__(self) -> None:
        costs = (self.gpu_s_per_token, self.step_fixed_s, self.publish_s, self.state_bytes, self.weights_gb,
                 self.snapshot_s_per_gb, self.write_s_per_gb)  # fmt: skip
        if min(costs) < 0:
            raise ConfigError("trainer: costs must be >= 0")
        if self.updates_per_step < 1 or self.model_parallel_gpus < 1:
            raise ConfigError("trainer.updates_per_step and trainer.model_parallel_gpus must be >= 1")
        if self.data_parallel not in ("fluid", "count", "stride", "tokens"):
            raise ConfigError(f"trainer.data_parallel must be fluid, count, stride or tokens; "
                              f"got {self.data_parallel!r}")  # fmt: skip

    @property
    def write_s(self) -> float:
        """Seconds to write one version: weights_gb x write_s_per_gb, or publish_s when weights_gb is 0."""
        return self.weights_gb * self.write_s_per_gb if self.weights_gb else self.publish_s

    @property
    def snapshot_s(self) -> float:
        """Seconds to copy one version aside before a background write (0 when weights_gb is 0)."""
        return self.weights_gb * self.snapshot_s_per_gb


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentSection:
    """One component of a mixture workload."""

    weight: float = 1.0
    """Relative share of prompts drawn from this component."""
    median: float = 1200.0
    """Median output length in tokens."""
    sigma: float = 1.18
    """Lognormal sigma of output lengths (larger: a longer tail)."""

    def __post_init__(self) -> None:
        if self.weight <= 0 or self.median <= 0 or self.sigma < 0:
            raise ConfigError(f"workload.components: weight > 0, median > 0 and sigma >= 0; got {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadSection:
    """Synthetic prompts and output lengths: the sim engine's and `dora sim`'s workload. ``dora.sim.workload``
    draws each sample's lengths, turns and reward from it."""

    distribution: Literal["lognormal", "mixture"] = "lognormal"
    """Output lengths: one lognormal (median, sigma), or a mixture of components."""
    median: float = 1200.0
    """lognormal: median output length in tokens."""
    sigma: float = 1.18
    """lognormal: sigma of output lengths (larger: a longer tail)."""
    components: tuple[ComponentSection, ...] = ()
    """mixture only: [[workload.components]] tables of weight, median, sigma."""
    cap: int = 30_720
    """Longest output in tokens; a sample reaching it finishes by length."""
    difficulty_sigma: float = 0.5
    """Spread of a per-prompt length factor shared by a group's samples (0 = independent samples)."""
    prompt_tokens: float = 150.0
    """Median prompt length in tokens."""
    prompt_sigma: float = 0.3
    """Lognormal sigma of prompt lengths."""
    turns: float = 1.0
    """`dora sim`: median assistant turns per episode, scaled by the prompt's difficulty. With max_turns > 1,
    median/sigma/components give the tokens of each turn, cap those of the whole episode, and every turn but
    the last ends in a tool call. The live sim engine runs an episode as one turn of its total length."""
    turns_sigma: float = 0.0
    """Lognormal sigma of the turn count."""
    max_turns: int = 1
    """Most assistant turns in an episode (1 = single-turn, the default)."""
    tool_s: float = 0.0
    """Median seconds of one tool call, on the wall clock: the episode holds its lease but no decode slot."""
    tool_sigma: float = 0.0
    """Lognormal sigma of tool-call seconds."""
    observation_tokens: float = 0.0
    """Median tokens a tool result appends to the episode (prefilled when it resumes; trained, not sampled)."""
    observation_sigma: float = 0.0
    """Lognormal sigma of observation tokens."""
    uniform_share: float = 0.0
    """The probability that a group's samples all get the same reward (no GRPO signal; drawn per group and
    attempt): in `dora sim`, whose other groups get rewards 0 and 1, and in the live sim engine, whose other groups
    keep their length-based rewards (uniform too, now and then). With core.filter_uniform such groups are
    filtered and replaced, and `dora sim` reports what that costs in throughput; without it they are trained."""

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0:
            raise ConfigError(f"workload: median > 0 and sigma >= 0; got {self.median} and {self.sigma}")
        if self.cap < 1 or self.prompt_tokens < 1:
            raise ConfigError(f"workload.cap and workload.prompt_tokens must be >= 1; got {self.cap} and "
                              f"{self.prompt_tokens}")  # fmt: skip
        if not 0.0 <= self.uniform_share <= 1.0:
            raise ConfigError(f"workload.uniform_share must be in [0, 1]; got {self.uniform_share}")
        if self.max_turns < 1 or not 1 <= self.turns <= self.max_turns:
            raise ConfigError(f"workload: need 1 <= turns <= max_turns; got {self.turns} and {self.max_turns}")
        if min(self.turns_sigma, self.tool_s, self.tool_sigma, self.observation_tokens, self.observation_sigma) < 0:
            raise ConfigError("workload: turns_sigma, tool_s, tool_sigma, observation_tokens, observation_sigma >= 0")
        if self.distribution == "mixture" and not self.components:
            raise ConfigError("workload.distribution = 'mixture' needs [[workload.components]]")
        if self.distribution == "lognormal" and self.components:
            raise ConfigError("workload.components is only for distribution = 'mixture'")


LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of one decoder block (Llama / Qwen2 naming), what ``[lora].target_modules`` may name."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSection:
    """The model's dimensions (`dora sim`), from which a LoRA run's adapter sizes and training cost are derived
    (``dora.sim.lora``). A decoder block holds the linear layers q, k, v, o (attention) and gate, up, down (a gated
    MLP); the defaults are Qwen2.5-32B's, the paper's model (its config.json)."""

    hidden_size: int = 5120
    """Width of the residual stream."""
    intermediate_size: int = 27648
    """Width of the MLP (gate and up project to it, down projects back)."""
    layers: int = 64
    """Decoder blocks."""
    attention_heads: int = 40
    """Query heads."""
    kv_heads: int = 8
    """Key and value heads (grouped-query attention)."""
    head_dim: int = 128
    """Width of one attention head."""
    vocab_size: int = 152064
    """Tokens of the vocabulary (rows of the input embedding and of the output layer)."""
    tied_embeddings: bool = False
    """The output layer shares the input embedding's weights (counted once in the weights' bytes)."""
    bytes_per_param: float = 2.0
    """Bytes of one weight as published and served (bf16: 2), for full weights and adapters alike."""
    activation_recompute: bool = True
    """The trainer recomputes activations in the backward (one more forward per token, full and LoRA alike). The
    paper configs' trainer.gpu_s_per_token is read as 8 x parameters FLOP per token (their comment), i.e. with it."""

    def __post_init__(self) -> None:
        dims = (self.hidden_size, self.intermediate_size, self.layers, self.attention_heads, self.kv_heads,
                self.head_dim, self.vocab_size)  # fmt: skip
        if min(dims) < 1 or self.bytes_per_param <= 0:
            raise ConfigError("model: dimensions must be >= 1 and bytes_per_param > 0")
        if self.attention_heads % self.kv_heads:
            raise ConfigError("model.attention_heads must be a multiple of model.kv_heads")


@dataclass(frozen=True, slots=True, kw_only=True)
class SimLoraSection:
    """`dora sim`: train LoRA adapters on the frozen model instead of every weight (``rank`` > 0). A version is then
    an adapter: workers load and the trainer publishes its bytes, not the model's; the trainer computes no weight
    gradients of the frozen model (``dora.sim.lora`` derives both costs from ``[model]``); and each worker of a
    mode that never swaps weights under running requests holds ``core.max_staleness + 1`` versions at once, so it
    loads a new one while it goes on decoding the others'."""

    rank: int = 0
    """The adapters' rank r (0: full fine-tuning, no adapters)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """The linear layers of each block given adapters (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
    down_proj); ``all-linear``: all seven (PEFT's rule: every linear layer but the output layer)."""
    load_fixed_s: float = 0.1
    """Seconds a worker takes to put a received adapter into its engine, beside the transfer at
    engine.transfer_bytes_per_s (assumed: a few hundred small tensors copied in; engine.load_s keeps the full
    weights' ~1 s)."""

    def __post_init__(self) -> None:
        if self.rank < 0 or self.load_fixed_s < 0:
            raise ConfigError("lora.rank and lora.load_fixed_s must be >= 0")
        if self.target_modules != ("all-linear",) and (
            not self.target_modules or set(self.target_modules) - set(LINEAR_MODULES)
        ):
            raise ConfigError(f"lora.target_modules must name modules of {list(LINEAR_MODULES)} (or be "
                              f"['all-linear']); got {list(self.target_modules)}")  # fmt: skip

    @property
    def modules(self) -> tuple[str, ...]:
        return LINEAR_MODULES if self.target_modules == ("all-linear",) else self.target_modules


@dataclass(frozen=True, slots=True, kw_only=True)
class SimConfig:
    run: RunSection = field(default_factory=RunSection)
    core: CoreConfig = field(default_factory=CoreConfig)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    engine: SimEngineSection = field(default_factory=SimEngineSection)
    trainer: TrainerSection = field(default_factory=TrainerSection)
    workload: WorkloadSection = field(default_factory=WorkloadSection)
    model: ModelSection = field(default_factory=ModelSection)
    lora: SimLoraSection = field(default_factory=SimLoraSection)

    def __post_init__(self) -> None:
        if self.engine.credit < self.core.group_size:
            raise ConfigError("engine credit (credit_slots, or 2 x max_slots) must hold at least one group")

    def for_mode(self, mode: Mode) -> SimConfig:
        core = replace(self.core, mode=mode)
        return replace(self, core=replace(core, total_steps=self.run.steps + self.run.cooldown(core.staleness)))


DEMO = {
    "run": {"steps": 12, "warmup_steps": 2, "tick_s": 5.0, "restart_s": 10.0},
    "core": {"train_groups": 32, "group_size": 8, "max_staleness": 2},
    "cluster": {"total_gpus": 16, "gpus_per_worker": 1, "rollout_gpus": 8},
    "engine": {"tpot_base_s": 0.02, "tpot_per_seq_s": 0.0001, "max_slots": 64, "prefill_s_per_token": 2e-5,
               "load_s": 1.0},
    "trainer": {"gpu_s_per_token": 0.002, "step_fixed_s": 2.0, "publish_s": 0.5},
    "workload": {"median": 400.0, "sigma": 1.1, "cap": 8192, "prompt_tokens": 100.0},
}  # fmt: skip
"""Built-in small cluster used when no --config is given: it runs in seconds."""
