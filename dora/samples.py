"""The in-process forms of finished samples: what an engine hands its worker, and the learner's batch unpacked.

Neither crosses a process as such: ``dora.wire.packed`` packs finished samples into a ``SamplesFinished`` (headers
beside one frame per array kind) and unpacks a ``TrainBatch`` into a ``Batch`` of read-only views on its frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dora.ids import AttemptId, Finish, GroupId

Array = np.ndarray


def finite(name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def non_negative(name: str, value: int | float) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FinishedSample:
    """A finished sample as an engine hands it to its worker. It travels packed: a ``SampleHeader``
    in a ``SamplesFinished``, its arrays in that message's payload frames (``dora.wire.packed.pack_samples``)."""

    group_id: GroupId
    attempt: AttemptId
    index: int
    segments: Array
    """int32 (n, 2): (version, tokens) runs in generation order; one row when C1 holds."""
    token_ids: Array
    logprobs: Array
    """Behaviour log-prob of every sampled token under the version that sampled it."""
    reward: float
    finish: Finish
    gen_time_s: float = 0.0
    broker_epoch: int = 0
    reward_components: dict[str, float] = field(default_factory=dict)
    """The named parts of the reward when the reward function returned a dict (``dora.tasks.rewards``)."""
    reward_error: str = ""
    """Why the reward is 0.0 when scoring failed (it raised, timed out, returned junk); empty when it scored."""
    loss_mask: Array | None = None
    """uint8 per token: 1 sampled by the model, 0 appended by an environment (an episode's observations, whose
    log-probs are 0 and which are never trained on). None: every token was sampled."""
    turns: Array | None = None
    """int32 (n, 3): (start, end, version) of each assistant turn of an episode, in tokens; None: one turn."""

    def __post_init__(self) -> None:
        non_negative("index", self.index)
        finite("reward", self.reward)
        for name, part in self.reward_components.items():
            finite(f"reward_components[{name!r}]", part)
        if self.token_ids.shape != self.logprobs.shape:
            raise ValueError(f"token_ids {self.token_ids.shape} and logprobs {self.logprobs.shape} differ")
        if self.segments.ndim != 2 or self.segments.shape[1:] != (2,):
            raise ValueError(f"segments must have shape (n, 2), got {self.segments.shape}")
        _episode_arrays(self.token_ids, self.loss_mask, self.turns)


def _episode_arrays(token_ids: Array, loss_mask: Array | None, turns: Array | None) -> None:
    if loss_mask is not None and loss_mask.shape != token_ids.shape:
        raise ValueError(f"loss_mask {loss_mask.shape} and token_ids {token_ids.shape} differ")
    if turns is not None and (turns.ndim != 2 or turns.shape[1:] != (3,)):
        raise ValueError(f"turns must have shape (n, 3), got {turns.shape}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainSample:
    index: int
    token_ids: Array
    logprobs: Array
    reward: float
    finish: Finish
    segments: Array | None = None
    """int32 (n, 2) (version, tokens) runs, so the learner can check C1 itself."""
    loss_mask: Array | None = None
    """uint8 per token, 1 = sampled by the model (trained on), 0 = an environment's (never); None: all 1."""
    turns: Array | None = None
    """int32 (n, 3) (start, end, version) of an episode's assistant turns, so the learner checks C1 per turn."""

    def __post_init__(self) -> None:
        _episode_arrays(self.token_ids, self.loss_mask, self.turns)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainGroup:
    group_id: GroupId
    version: int
    prompt_ids: Array
    samples: tuple[TrainSample, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """A TrainBatch unpacked and checked: every array a read-only view on the received frames."""

    step: int
    groups: tuple[TrainGroup, ...]
    redelivery: bool = False
