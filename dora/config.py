"""Typed configuration shared by every process.

Each section is a frozen dataclass whose ``__post_init__`` rejects bad values with a message
that names the key, so a user mistake is reported as one line, never as a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass

from dora.ids import Mode


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key and the value."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """Scheduling knobs of the pure core, shared by the broker and the simulator."""

    mode: Mode = Mode.DORA
    """sync | one_step | partial | dora."""
    max_staleness: int = 1
    """K: a trajectory dispatched on version v is trained at learner version u with u - v <= K.
    Applies to `partial` and `dora`; `sync` is K = 0 and `one_step` is K = 1 by definition."""
    train_groups: int = 8
    """B: groups per train batch (TBS = train_groups x group_size samples), exactly."""
    group_size: int = 4
    """G: samples per prompt; a group runs on one worker and carries one version."""
    rollout_groups: int | None = None
    """Watermark of outstanding (running or queued) groups in the streaming modes; None = 2 x train_groups.
    The wave modes (sync, one_step) dispatch exactly train_groups groups per wave."""
    total_steps: int | None = None
    """Train steps in the run; the core never dispatches more than total_steps x train_groups groups,
    so nothing dispatched is left untrained at the end. None = unbounded."""
    legacy_fill: bool = True
    """dora: fill idle slots of non-newest, non-oldest versions when their deadline is not the next step."""
    kv_rebalance_threshold: float = 0.9
    """dora: a worker reporting KV/slot use at or above this fraction triggers a re-partition."""
    max_group_failures: int = 3
    """A group whose generation errors this many times stops the run (it can be neither trained nor dropped)."""

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", Mode(self.mode))
        except ValueError:
            raise ConfigError(f"mode must be one of {', '.join(m.value for m in Mode)}; got {self.mode!r}") from None
        _at_least("max_staleness", self.max_staleness, 0)
        _at_least("train_groups", self.train_groups, 1)
        _at_least("group_size", self.group_size, 1)
        _at_least("max_group_failures", self.max_group_failures, 1)
        if self.rollout_groups is not None:
            _at_least("rollout_groups", self.rollout_groups, 1)
        if self.total_steps is not None:
            _at_least("total_steps", self.total_steps, 1)
        if not 0.0 < self.kv_rebalance_threshold <= 1.0:
            raise ConfigError(f"kv_rebalance_threshold must be in (0, 1]; got {self.kv_rebalance_threshold}")

    @property
    def staleness(self) -> int:
        """The bound K actually enforced for this mode."""
        if self.mode is Mode.SYNC:
            return 0
        if self.mode is Mode.ONE_STEP:
            return 1
        return self.max_staleness

    @property
    def watermark(self) -> int:
        """Outstanding-group target of the streaming modes."""
        return self.rollout_groups if self.rollout_groups is not None else 2 * self.train_groups

    @property
    def waves(self) -> bool:
        """sync and one_step dispatch whole batches (waves); partial and dora stream."""
        return self.mode in (Mode.SYNC, Mode.ONE_STEP)

    @property
    def prompt_budget(self) -> int | None:
        return None if self.total_steps is None else self.total_steps * self.train_groups


def _at_least(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}; got {value!r}")
