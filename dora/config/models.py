"""The sections of the processes that run a model: a rollout worker and its engine (``[rollout]``), the learner
(``[learner]``) and the supervised warm start (``[sft]``): their models, devices, dtypes and GPUs. Where each process
runs is ``dora.launch.placement``'s; ``dora.config.run.RunConfig`` holds these with every other section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dora.config import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutSection:
    """A rollout worker (`dora rollout`) and its engine, whichever run.engine names (sim, torch or vllm): the
    worker's slots and, for torch and vllm, the model it serves. The sim engine's timing model is [engine]."""

    max_slots: int = 256
    """Sequences the worker's engine decodes at once: the rows of the torch engine's slot cache, vLLM's
    max_num_seqs, the sim engine's batch."""
    credit_slots: int = 0
    """Sequences leased to the worker at once, its credit (the slots the broker counts for it); 0 = 2 x max_slots,
    so a queue waits in the engine. At least core.group_size: a group is leased to one worker whole."""
    reconnect_max_s: float = 32.0
    """Cap of the reconnect backoff (1 s, doubling) after the broker is lost; it starts over after a welcome."""
    model: str | None = None
    """The model of the torch and vllm engines (the version-0 weights): a model folder, a hub id (org/name), or
    ``"dora:tiny"``, dora's tiny model, built on first use into ~/.cache/dora. A path that does not exist, or an
    empty folder, is an error."""
    device: str = "cpu"
    """torch engine: the torch device it runs on (cpu, cuda, cuda:1). vLLM runs on its own platform's device.
    Under `dora run` on GPUs, ``cuda`` is the first of the worker's own GPUs (run.gpus)."""
    dtype: str = "auto"
    """torch and vllm engines: the model's dtype (float32, bfloat16, float16); auto: bfloat16 on CUDA (vllm: its
    platform is CUDA or ROCm; torch: rollout.device is a GPU), float32 on the CPU."""
    kv_cache_mib: int | None = None
    """vllm: KV cache memory in MiB; None: 256 on the CPU (vLLM there would otherwise take most of the machine's
    memory), and on a GPU whatever rollout.gpu_memory_utilization leaves beside the weights and activations."""
    gpu_memory_utilization: float = 0.9
    """vllm on a GPU: the fraction of each of its GPUs' memory the engine may use (weights, activations, KV cache;
    vLLM's own setting). vLLM checks at start that this much is free, even with rollout.kv_cache_mib set: workers
    sharing a GPU (elastic ones, run.share_gpus) need fractions that add up to at most 1."""
    enforce_eager: bool | str = "auto"
    """vllm: run eagerly, with no CUDA graphs (true), or capture them (false: faster decoding, a slower start);
    auto: false on a GPU, true on the CPU."""
    tensor_parallel_size: int = 1
    """vllm: GPUs one engine shards the model over (vLLM's tensor parallelism, its ``mp`` executor: one process per
    GPU beside the worker's). It must divide rollout.gpus_per_worker. The torch engine runs on one device."""
    gpus_per_worker: int = 0
    """`dora run` on GPUs: the GPUs each rollout worker gets (CUDA_VISIBLE_DEVICES); 0: rollout.tensor_parallel_size
    (1 unless set)."""
    max_model_len: int | None = None
    """The longest prompt + completion the torch and vllm engines run, in tokens; None: the model's own limit
    (max_position_embeddings). Above that limit, or below the longest prompt + run.max_tokens, it is refused at
    start."""
    elastic: bool = False
    """This worker shares its accelerators (on CPU: its cores) with the learner: the broker asks it to yield them
    for each train step; it pauses what it holds meanwhile and goes on, on the same weights, after the publish."""
    sleep_on_yield: bool = False
    """Elastic workers on accelerators: while yielded, the engine gives the accelerator's memory back (vllm: it
    sleeps at level 1, weights to host memory and KV cache freed, which needs CUDA, ROCm or XPU; torch on a GPU:
    caches dropped, model to host memory); what it held is re-prefilled on the same weights when it resumes.
    Off: a yield only stops decoding."""
    store: str = ""
    """A node-local directory for the versions this worker receives over the weights' data plane: fetched chunk by
    chunk from the learner's chunk server (or another node's, relaying it), each chunk checked, then loaded from
    here; workers of one host share it (one fetches, the others load what it wrote). Empty: the worker reads the
    learner's store (learner.store), which must then be a filesystem every node shares."""
    weights_bind: str = ""
    """With rollout.store: where this worker's chunk server listens, relaying what its node fetched to the nodes
    below it; empty: tcp on this host's address, a free port."""
    relay_fanout: int = 2
    """With rollout.store: how many nodes the learner, and each node after it, passes a version on to (a tree of
    relays: the learner sends each byte to this many nodes); 1: a chain; 0: every node fetches from the learner."""
    fetch_timeout_s: float = 10.0
    """With rollout.store: how long a fetch waits for a source's answer before it leaves it for the next one (the
    learner last)."""

    def __post_init__(self) -> None:
        if self.relay_fanout < 0 or self.fetch_timeout_s <= 0:
            raise ConfigError(f"rollout.relay_fanout must be >= 0 and rollout.fetch_timeout_s > 0; got "
                              f"{self.relay_fanout}, {self.fetch_timeout_s}")  # fmt: skip
        if self.max_slots < 1 or self.credit_slots < 0:
            raise ConfigError(f"rollout.max_slots must be >= 1 and rollout.credit_slots >= 0; got {self.max_slots} "
                              f"and {self.credit_slots}")  # fmt: skip
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"rollout.dtype must be auto, float32, bfloat16 or float16; got {self.dtype!r}")
        if self.kv_cache_mib is not None and self.kv_cache_mib < 1:
            raise ConfigError(f"rollout.kv_cache_mib must be >= 1 or unset; got {self.kv_cache_mib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"rollout.gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.enforce_eager not in (True, False, "auto"):
            raise ConfigError(f"rollout.enforce_eager must be true, false or auto; got {self.enforce_eager!r}")
        if self.tensor_parallel_size < 1 or self.gpus_per_worker < 0:
            raise ConfigError(f"rollout.tensor_parallel_size must be >= 1 and rollout.gpus_per_worker >= 0; got "
                              f"{self.tensor_parallel_size}, {self.gpus_per_worker}")  # fmt: skip
        if self.gpus_each % self.tensor_parallel_size:
            raise ConfigError(f"rollout.tensor_parallel_size = {self.tensor_parallel_size} does not divide "
                              f"rollout.gpus_per_worker = {self.gpus_per_worker}: an engine shards over "
                              f"tensor_parallel_size of its worker's GPUs")  # fmt: skip

    @property
    def credit(self) -> int:
        """The worker's credit: credit_slots, or 2 x max_slots when it is 0."""
        return self.credit_slots or 2 * self.max_slots

    @property
    def gpus_each(self) -> int:
        """GPUs per rollout worker under `dora run` on GPUs: rollout.gpus_per_worker, else tensor_parallel_size."""
        return self.gpus_per_worker or self.tensor_parallel_size

    def engine_dtype(self, cuda: bool) -> str:
        """rollout.dtype with auto resolved: bfloat16 on CUDA (``cuda``: the engine runs there), else float32."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if cuda else "float32"


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraSection:
    """LoRA (`[learner.lora]`): the torch learner trains low-rank adapters through the peft library, on a frozen
    base model (learner.model), and each version it publishes is an adapter folder (adapter_config.json +
    adapter_model.safetensors, as PEFT saves one) with its digest manifest. Only the adapters get gradients,
    optimizer state and checkpoints."""

    rank: int = 16
    """The adapters' rank r: each targeted weight W is used as W + alpha / rank x B A, B (out x r), A (r x in)."""
    alpha: float = 32.0
    """The numerator of the adapters' scale alpha / rank."""
    dropout: float = 0.0
    """Dropout on an adapter's input while the learner takes a step (never where the engines sample); above 0, the
    learner's log-probs of a trajectory see that noise, its behaviour log-probs do not."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """The modules given adapters, by the last part of their name (q_proj, v_proj, c_attn, ...); ``all-linear``:
    every linear layer but the output embedding (PEFT's rule)."""

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError(f"learner.lora.rank must be >= 1; got {self.rank}")
        if self.alpha <= 0:
            raise ConfigError(f"learner.lora.alpha must be > 0; got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"learner.lora.dropout must be in [0, 1); got {self.dropout}")
        if not self.target_modules or not all(self.target_modules):
            raise ConfigError("learner.lora.target_modules must name a module (or be ['all-linear'])")


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnerSection:
    """The learner (`dora learner`): its trainer, loss, weight store and checkpoints."""

    audit_file: str | None = None
    """JSON lines, one per trained step: the groups it trained (for exactly-once checks)."""
    sim_gpus: int = 1
    """Accelerators the sim trainer stands for (its step time is the trainer model's for this many)."""
    model: str | None = None
    """torch trainer: the model it starts from, a folder, a hub id or ``"dora:tiny"`` (the same version 0 the
    rollout workers load)."""
    ranks: int = 1
    """`dora run`: learner processes (torchrun --nproc-per-node); more than one shards the model with FSDP2."""
    gpus: tuple[int, ...] = ()
    """`dora run` on GPUs: the GPU ids of the learner's ranks, one rank per GPU (learner.ranks of them), each rank
    on its own (``cuda:<local rank>``), NCCL between them; empty: the first learner.ranks GPUs of run.gpus."""
    store: str = "weights"
    """Weight store directory (published versions, retired by the broker): read by every rollout worker without a
    rollout.store, so then on a filesystem they all share."""
    weights_bind: str = ""
    """Where the learner's chunk server listens: the weights' data plane, which serves every published version
    chunk by chunk to the rollout workers with a rollout.store; empty: tcp on this host's address, a free port."""
    overlap_publish: bool = True
    """Write each version in the background: the step ends once the weights are copied aside, the learner asks
    for the next batch and trains it while the copy is written, digested and made durable, and the broker hears of
    the version (and dispatches on it) only then. At most one write is in flight; a step whose version is
    checkpointed, the last step and a drain wait for the write before the next batch. False: every step writes its
    version before asking for the next batch."""
    lr: float = 1e-4
    """torch trainer: AdamW learning rate (betas 0.9, 0.99), the peak of learner.lr_schedule."""
    micro_batch: int = 16
    """torch trainer: trajectories per forward/backward; gradients accumulate over the batch."""
    micro_batch_tokens: int = 0
    """torch trainer: a token budget per forward/backward instead of micro_batch: a micro-batch takes a rank's
    trajectories in order (a group's samples together, groups by length) while rows x its longest prompt +
    completion stays within it; a longer trajectory is one alone. 0: micro_batch trajectories each."""
    balance: Literal["tokens", "stride"] = "tokens"
    """torch trainer over several ranks: how the batch's trajectories go to ranks. ``tokens``: greedy, longest
    first to the rank with the fewest tokens, a group whole where its rank stays within an even share (the
    busiest rank holds at most an even share + one trajectory); ``stride``: every world-th in length order
    (equal counts; with a group size a multiple of the ranks, every group's longest on the last rank). The step
    waits for the busiest rank; its metric ``rank_imbalance`` is busiest / mean tokens. The simulator's
    trainer.data_parallel prices the same two."""
    activation_checkpointing: bool = False
    """torch trainer: recompute each decoder block's activations in the backward instead of keeping them
    (transformers' gradient checkpointing, non-reentrant; with FSDP2 too): less memory, about a third more
    compute. Samples are then scored as whole rows (a group's prompt runs once per sample)."""
    peak_tflops: float = 0.0
    """torch trainer: the accelerator's peak TFLOP/s the step's ``mfu`` metric is reckoned against (6 x
    parameters x tokens / step time / ranks / peak). 0: a CUDA device's dense bf16 peak from a table by name (H100
    989, H200 989, A100 312, ...); on a CPU, or a GPU not listed, no mfu is reported."""
    max_grad_norm: float = 1.0
    """torch trainer: gradients are clipped to this global norm before each step."""
    clip_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + clip_high (DAPO's clip-higher raises it, e.g. 0.28)."""
    token_level: bool = False
    """Loss reduction: false = mean per trajectory, then over trajectories (GRPO); true = mean over every token
    of the batch (DAPO), so long answers weigh per token."""
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"] = "grpo"
    """How a trajectory's advantage comes from its group's rewards: ``grpo`` (minus the group mean, over the group's
    std), ``dr_grpo`` (minus the group mean), ``rloo`` (minus the mean of the group's other rewards), ``reinforce_pp``
    (minus the group mean, then whitened over the whole batch: REINFORCE++ with a group baseline)."""
    mini_batches: int = 1
    """torch trainer: optimizer steps per pass over a train batch. The batch's groups are cut into this many
    mini-batches of whole groups (sizes differing by at most one group; the ranks balanced within each), each
    trained to one AdamW step (the DORA paper: 16). At most core.train_groups."""
    epochs: int = 1
    """torch trainer: passes over each train batch (the first in the batch's order, later ones shuffled). Steps per
    batch: mini_batches x epochs. With more than one, the batch is scored once first at its starting weights
    (the proximal policy): a forward of the batch more."""
    ratio: Literal["token", "sequence"] = "token"
    """The ratio clipped: per token (PPO, GRPO, DAPO), or per trajectory as the geometric mean of its tokens' ratios
    (GSPO; its paper clips at 3e-4 below and 4e-4 above: set clip_low and clip_high to match)."""
    is_cap: float = 0.0
    """The decoupled correction, capped: with it (or is_mask) the clip is taken against the proximal policy (the
    learner's weights when it took the batch), and each token's term is weighted by proximal / behaviour
    probability, at most is_cap (e.g. 2). 0: no correction: the clip is against the behaviour log-probs, and the
    clipped ratio is the importance weight."""
    is_mask: float = 0.0
    """The decoupled correction, masked: tokens (or trajectories, with is_level = sequence) whose proximal /
    behaviour weight is outside [1 / is_mask, is_mask] are left out of the loss (e.g. 2). 0: off. With is_cap too,
    a weight is masked first, then capped."""
    is_level: Literal["token", "sequence"] = "token"
    """The correction's weight per token, or per trajectory (the geometric mean of its tokens' weights)."""
    kl_coef: float = 0.0
    """torch trainer: weight of a KL(policy || reference) term in the loss, the reference being the start model:
    with LoRA, the model with its adapters off (no memory more); with full weights, a frozen copy on the learner's
    device (one more copy of the weights in float32, sharded across ranks as the model is). 0: no term, no copy."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """The per-token KL estimate, with d = log policy - log reference at the sampled token: k1 = d, k2 = d^2 / 2,
    k3 = exp(-d) - 1 + d (unbiased and never negative). The step metric ``kl_ref`` is k3's whichever trains."""
    entropy_coef: float = 0.0
    """torch trainer: weight of an entropy bonus (the loss minus entropy_coef x the entropy of the tempered
    distribution at each sampled position). 0: none; the step metric ``entropy`` is measured either way."""
    weight_decay: float = 0.0
    """torch trainer: AdamW's decoupled weight decay, applied to matrices only (biases and norm gains keep theirs)."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    """torch trainer: after the warmup, the learning rate stays (constant), or falls to lr x min_lr_ratio at the
    run's last optimizer step (core.total_steps x steps per batch), linearly or along a half cosine."""
    warmup_steps: int = 0
    """torch trainer: optimizer steps over which the learning rate rises linearly from lr / warmup_steps to lr."""
    min_lr_ratio: float = 0.0
    """torch trainer: where a linear or cosine decay ends, as a share of lr."""
    filter_uniform_groups: bool | Literal["replace"] = False
    """Groups whose rewards are all equal (zero advantage: no signal). false: trained as they are. true: masked
    out of the loss and counted (the batch still holds train_groups groups, fewer of them carry signal).
    "replace" (DAPO dynamic sampling that refills): the broker consumes each one as filtered when it finishes,
    never trains it, and fills the batch with other whole groups, dispatching one more group for each; at most
    core.max_filtered per step (then the step's uniform groups are trained, masked as with true, so a run whose
    groups all come back uniform still ends). `dora audit` counts the filtered groups."""
    loss: str | None = None
    """torch trainer: `module:function` called instead of `dora.learner.loss:policy_loss`, with the same
    arguments, returning the same (loss, metrics); the contract is in dora/learner/loss.py. None: policy_loss."""
    dtype: str = "float32"
    """torch trainer: ``bfloat16`` computes in bf16 (FSDP2 MixedPrecisionPolicy; autocast on one rank), master
    weights, optimizer state and gradient reduction stay fp32."""
    checkpoint_dir: str | None = None
    """torch trainer: where checkpoints go (model, optimizer, RNG, version, trained group ids); the learner
    resumes from the newest one there. None: no checkpoints (`dora run` puts them in the run directory)."""
    checkpoint_every: int = 10
    """Steps between checkpoints (the last step is always checkpointed)."""
    keep_checkpoints: int = 2
    """Checkpoints kept; older ones are deleted after a new one is written."""
    checkpoint_on_stop: bool = True
    """On SIGTERM, checkpoint the newest committed version before exiting if it is not checkpointed yet (SIGUSR1
    always does, at the next step boundary). Checkpoints are written atomically: a SIGKILL during one loses only it."""
    device: str = "auto"
    """torch trainer: ``auto`` (this rank's GPU, ``cuda:<local rank>``, when there is one, else the CPU), ``cpu``,
    ``cuda`` (``cuda:<local rank>``) or a torch device string. GPUs use NCCL between ranks, CPUs gloo."""
    publish_dtype: str = "auto"
    """The dtype each published version's floating-point weights are written in (float32, bfloat16, float16);
    auto: the rollout engines' (rollout.dtype; its auto is read on the learner's device: bfloat16 when the learner is
    on a GPU, float32 on the CPU). The learner keeps float32 master weights either way."""
    publish_shard_mib: int = 5120
    """A version's weights go in one model.safetensors up to this size, else in shards of at most this size with
    model.safetensors.index.json (as a hub checkpoint)."""
    offload_between_steps: bool = False
    """torch trainer on a GPU shared with elastic workers: after each publish its weights and optimizer state go to
    host memory, and come back for the next step (or a checkpoint), so the workers get the GPU's memory while the
    learner waits. No effect on a CPU."""
    lora: LoraSection | None = None
    """torch trainer: train LoRA adapters instead of every weight (the `[learner.lora]` table below); none: full
    weights. Setting any of its keys turns it on."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"learner.dtype must be float32 or bfloat16; got {self.dtype!r}")
        if self.checkpoint_every < 1 or self.keep_checkpoints < 1:
            raise ConfigError("learner.checkpoint_every and learner.keep_checkpoints must be >= 1")
        if self.ranks < 1 or self.micro_batch < 1:
            raise ConfigError("learner.ranks and learner.micro_batch must be >= 1")
        if self.micro_batch_tokens < 0 or self.peak_tflops < 0:
            raise ConfigError(f"learner.micro_batch_tokens and learner.peak_tflops must be >= 0 (0: off); got "
                              f"{self.micro_batch_tokens} and {self.peak_tflops}")  # fmt: skip
        if self.balance not in ("tokens", "stride"):
            raise ConfigError(f"learner.balance must be tokens or stride; got {self.balance!r}")
        if self.gpus and len(self.gpus) != self.ranks:
            raise ConfigError(f"learner.gpus names {len(self.gpus)} GPU(s) ({list(self.gpus)}) but learner.ranks = "
                              f"{self.ranks}: the learner runs one rank per GPU")  # fmt: skip
        if self.gpus and (min(self.gpus) < 0 or len(set(self.gpus)) < len(self.gpus)):
            raise ConfigError(f"learner.gpus: GPU ids are >= 0, each once; got {list(self.gpus)}")
        if self.publish_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"learner.publish_dtype must be auto, float32, bfloat16 or float16; "
                              f"got {self.publish_dtype!r}")  # fmt: skip
        if self.publish_shard_mib < 1:
            raise ConfigError(f"learner.publish_shard_mib must be >= 1; got {self.publish_shard_mib}")
        if self.mini_batches < 1 or self.epochs < 1 or self.warmup_steps < 0:
            raise ConfigError(f"learner.mini_batches and learner.epochs must be >= 1 and learner.warmup_steps >= 0; "
                              f"got {self.mini_batches}, {self.epochs}, {self.warmup_steps}")  # fmt: skip
        bad_cap, bad_mask = bool(self.is_cap) and self.is_cap < 1, bool(self.is_mask) and self.is_mask <= 1
        if bad_cap or bad_mask or min(self.is_cap, self.is_mask) < 0:
            raise ConfigError(f"learner.is_cap must be >= 1 and learner.is_mask > 1 (0: off); got {self.is_cap}, "
                              f"{self.is_mask}")  # fmt: skip
        if self.kl_coef < 0 or self.entropy_coef < 0 or self.weight_decay < 0:
            raise ConfigError(f"learner.kl_coef, entropy_coef and weight_decay must be >= 0; got {self.kl_coef}, "
                              f"{self.entropy_coef}, {self.weight_decay}")  # fmt: skip
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"learner.min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SftSection:
    """`dora sft`: a supervised warm start on the task dataset's (prompt, answer) rows, so RL starts from a model
    that already answers a little. The prompts are rendered exactly as RL renders them (task.chat_template,
    task.system_prompt); the loss is on the answer tokens (the answer, then EOS) only."""

    model: str | None = None
    """The model to start from: a folder, a hub id, or ``"dora:tiny"`` (dora's tiny model, built on first use);
    None: rollout.model."""
    out: str | None = None
    """The model folder to write (required): weights, config and the start folder's tokenizer files, written
    atomically; an existing model folder there is replaced. Point rollout.model at it for `dora run`."""
    epochs: int = 10
    """Passes over the dataset's kept rows, each in a new order seeded by sft.seed and the epoch. The defaults
    suit the tiny model on examples/data/arithmetic (2000 rows: about 50 s on 2 CPU cores, 29-43% held-out
    exact match); a pretrained model wants 1-3 epochs at an lr near 1e-5."""
    lr: float = 1e-3
    """AdamW learning rate (betas 0.9, 0.99; no weight decay), warmed up over the first steps, then decayed
    along a cosine to a tenth of it by the last step."""
    batch_size: int = 32
    """Rows per optimizer step (one forward/backward, right-padded); the loss is the mean over the batch's answer
    tokens."""
    max_answer_tokens: int = 64
    """Answer tokens (the EOS included) trained per row; longer answers are cut, and counted in the report."""
    seed: int = 0
    """Seeds torch and the order of the rows in each epoch."""
    threads: int = 0
    """torch CPU threads per rank; 0 = this machine's cores shared out among the ranks."""
    trace_field: str | None = None
    """task.env: the dataset column holding each row's recorded episode after the opening (chat turns); task.agent:
    each row's recorded conversation, {"tools", "messages"} (the first request, then each answer with its tool calls
    and the tool results). The assistant turns are trained on (max_answer_tokens bounds their tokens), the rest is
    context."""
    device: str = "auto"
    """``auto`` (this rank's GPU, ``cuda:<local rank>``, when there is one, else the CPU), ``cpu``, ``cuda``
    (``cuda:<local rank>``) or a torch device string (``cuda:1``: one rank only). GPUs use NCCL between ranks,
    CPUs gloo."""
    dtype: str = "auto"
    """``auto`` (bfloat16 on a GPU, float32 on the CPU), ``float32`` or ``bfloat16``: bf16 computes in bfloat16
    (autocast on one rank, FSDP2's MixedPrecisionPolicy over several) while the master weights, AdamW's state and
    the gradient reduction stay float32, and the folder written is float32 either way."""
    ranks: int = 1
    """Processes that train together, each on its share of every batch's rows (the batch, its loss and its gradient
    are the one-rank run's), the model sharded with FSDP2 per decoder block as the learner's; rank 0 prints and
    writes sft.out. More than one: `dora sft` starts itself under ``python -m torch.distributed.run --standalone
    --nproc-per-node=<ranks>`` on this node, unless it already is one of several ranks (torchrun's, or srun's
    tasks: then sft.ranks must equal their number)."""
    lora: bool = False
    """Train adapters shaped as `[learner.lora]` says (its defaults when the config has none) on the frozen start
    model instead of every weight, then merge them into it: sft.out is a full model folder either way, and a LoRA
    run trains its own adapters on it. The optimizer holds the adapters alone."""

    def __post_init__(self) -> None:
        for key in ("epochs", "batch_size", "max_answer_tokens", "ranks"):
            if getattr(self, key) < 1:
                raise ConfigError(f"sft.{key} must be >= 1; got {getattr(self, key)}")
        if not self.lr > 0:
            raise ConfigError(f"sft.lr must be > 0; got {self.lr}")
        if self.threads < 0:
            raise ConfigError(f"sft.threads must be >= 0 (0 = all cores); got {self.threads}")
        for key in ("model", "out"):
            if getattr(self, key) == "":
                raise ConfigError(f"sft.{key} must not be empty (a model folder)")
        if not re.fullmatch(r"auto|cpu|(cuda|xpu|mps|hpu|npu)(:\d+)?", self.device):
            raise ConfigError(f"sft.device must be auto, cpu, cuda or a torch device string (cuda:1); "
                              f"got {self.device!r}")  # fmt: skip
        if self.ranks > 1 and self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"sft.device must be auto, cpu or cuda (each rank its own cuda:<local rank>) with "
                              f"sft.ranks = {self.ranks}; got {self.device!r}")  # fmt: skip
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"sft.dtype must be auto, float32 or bfloat16; got {self.dtype!r}")
