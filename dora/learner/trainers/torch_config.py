"""The torch trainer's settings (``dora.learner.main.make_trainer`` fills them from ``[learner]`` and ``[run]``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dora.learner.logprobs import CHUNK_BYTES

if TYPE_CHECKING:
    from dora.config.models import LoraSection


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerConfig:
    lr: float = 1e-4
    micro_batch: int = 16
    """Trajectories per forward/backward (gradient accumulation over a batch)."""
    micro_batch_tokens: int | None = None
    """A token budget per forward/backward instead: trajectories in order while rows x the longest prompt +
    completion stays within it (one longer than it alone). None or 0: ``micro_batch`` trajectories each."""
    balance: str = "tokens"
    """How trajectories go to ranks (``dora.balance``): ``tokens`` (greedy, longest first, a group whole where
    its rank stays within an even share) or ``stride`` (every world-th, in length order)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward instead of keeping them."""
    peak_tflops: float | None = None
    """The accelerator's peak (TFLOP/s) an MFU is reckoned against; None: by CUDA device name, none on a CPU."""
    logprob_chunk_bytes: int = CHUNK_BYTES
    """Float32 logits made at once when scoring (``dora.learner.logprobs``)."""
    temperature: float = 1.0
    """The rollout temperature: the behaviour log-probs were taken at it, so the learner scores at it too."""
    top_p: float = 1.0
    """The rollout nucleus: the engines sampled from it, so the learner scores over the same nucleus."""
    mini_batches: int = 1
    """Optimizer steps per pass over a train batch (``dora.learner.schedule``: whole groups in each)."""
    epochs: int = 1
    """Passes over each train batch."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay, on matrices (parameters of two or more dimensions) only."""
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    """Train batches in the run (``core.total_steps``): the length a decay of the learning rate spans."""
    max_grad_norm: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    """``bfloat16``: compute in bf16 (FSDP2 MixedPrecisionPolicy, or autocast on one rank); fp32 master weights."""
    checkpoint_dir: str | None = None
    keep_checkpoints: int = 2
    offload_between_steps: bool = False
    """On a GPU: weights and optimizer state to host memory after each publish, back for the next use."""
    publish_dtype: str = "float32"
    """The dtype of the published versions' floating-point weights (the engines')."""
    lora: LoraSection | None = None
    """Train LoRA adapters on the frozen model (``dora.hf.lora``); a version is an adapter folder."""
