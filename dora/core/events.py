"""What the pure core takes in (events) and gives back (actions).

The broker actor turns wire messages into events and actions into wire messages; the simulator
turns actions into virtual-time work and that work back into events. Neither decides anything.
Payloads (token arrays, exported KV state) are opaque to the core: it stores and hands them back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dora.ids import AttemptId, Finish, GroupId, WorkerId

Segments = tuple[tuple[int, int], ...]
"""A trajectory's version history: ((version, n_tokens), ...) in generation order."""


# ---------------------------------------------------------------- events (past tense: facts)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerJoined:
    worker_id: WorkerId
    slots: int
    """Sequences the worker runs at once (its credit); a group takes group_size of them."""
    elastic: bool = False
    """It shares its accelerators with the trainer: it yields them for every train step (see ``Lend``)."""
    holds: int = 1
    """Versions its engine can serve at once: 1 for full weights, more for a LoRA engine's adapter slots."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerLost:
    worker_id: WorkerId
    reason: str = "expired"


@dataclass(frozen=True, slots=True, kw_only=True)
class LeaseLost:
    """The worker saw the command that gave it this lease's work (a Generate or MigrateIn) go by without
    it arriving, or it handed the work on and its answer was lost: it does not hold the group."""

    worker_id: WorkerId
    group_id: GroupId
    attempt: AttemptId


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionLoaded:
    worker_id: WorkerId
    version: int


class Result(Protocol):
    """What the core reads of one finished sample: the wire's sample header is one, and so is a ``SampleResult``."""

    @property
    def group_id(self) -> GroupId: ...
    @property
    def attempt(self) -> AttemptId: ...
    @property
    def index(self) -> int:
        """Sample index within the group, 0 <= index < group_size."""

    @property
    def segments(self) -> Segments: ...
    @property
    def finish(self) -> Finish: ...
    @property
    def reward(self) -> float | None:
        """The sample's reward: with ``filter_uniform`` the core finds a group whose rewards are all equal when it
        finishes, and consumes it as filtered (None: unknown, never equal to anything). Read for nothing else."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleResult:
    """A finished sample as the simulator reports it (a ``Result``)."""

    group_id: GroupId
    attempt: AttemptId
    index: int
    segments: Segments
    finish: Finish = Finish.STOP
    reward: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultsReported:
    """A worker's report of finished samples, as it came (one wire message, or one sample of the simulator's). Each
    sample is taken in order, exactly as if it came alone; the decisions that follow (leases, orchestration,
    batches) are made once after."""

    worker_id: WorkerId
    samples: Sequence[Result]
    payloads: Sequence[Any]
    """Each sample's payload, in the same order: opaque, handed back in its ReadySample."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GroupExported:
    """The source worker of a migration stopped the group's running samples and exported them."""

    worker_id: WorkerId
    group_id: GroupId
    attempt: AttemptId
    n_requests: int
    state: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Lent:
    """An elastic worker paused the requests it still holds and handed its accelerators to the trainer."""

    worker_id: WorkerId


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReported:
    worker_id: WorkerId
    kv_use: float
    """Fraction of KV cache / slots in use, 0..1."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick:
    """Periodic timer: lets the orchestrator rebalance workers left on draining versions."""


@dataclass(frozen=True, slots=True, kw_only=True)
class VersionPublished:
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchRequested:
    """The learner holds version ``step`` and asks for train batch ``step``."""

    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LearnerLost:
    reason: str = "expired"


Event = (
    WorkerJoined
    | WorkerLost
    | LeaseLost
    | VersionLoaded
    | ResultsReported
    | GroupExported
    | Lent
    | LoadReported
    | Tick
    | VersionPublished
    | BatchRequested
    | LearnerLost
)


# ---------------------------------------------------------------- actions (imperative: commands)


@dataclass(frozen=True, slots=True, kw_only=True)
class Lease:
    """Generate ``n_samples`` samples of prompt group ``group_id`` on ``version``."""

    worker_id: WorkerId
    group_id: GroupId
    attempt: AttemptId
    version: int
    n_samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Pin:
    """Serve ``version`` from now on. ``interrupt``: swap weights under running requests (partial mode only).
    ``keep``: older versions a multi-version worker goes on serving beside it (groups of them run there)."""

    worker_id: WorkerId
    version: int
    interrupt: bool = False
    keep: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Lend:
    """Elastic worker: pause every request still held (their state kept, to go on under the same weights) and
    hand the accelerators to the trainer for one train step; answer with ``Lent``."""

    worker_id: WorkerId


@dataclass(frozen=True, slots=True, kw_only=True)
class Reclaim:
    """A yielded worker takes its accelerators back, reloads ``version`` (the weights it served) and goes on
    with the requests it held; answer with ``VersionLoaded``. (A worker that held nothing gets a ``Pin``
    of the newest version instead.)"""

    worker_id: WorkerId
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportGroup:
    """Stop the group's running samples and export them (token prefix, KV where possible)."""

    worker_id: WorkerId
    target: WorkerId
    group_id: GroupId
    attempt: AttemptId
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ImportGroup:
    """Continue an exported group on a worker that holds the same version."""

    worker_id: WorkerId
    source: WorkerId
    group_id: GroupId
    attempt: AttemptId
    version: int
    n_requests: int
    state: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Revoke:
    """Abort a group on a worker; its lease is void."""

    worker_id: WorkerId
    group_id: GroupId
    attempt: AttemptId


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadySample:
    index: int
    segments: Segments
    finish: Finish
    payload: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadyGroup:
    group_id: GroupId
    version: int
    samples: tuple[ReadySample, ...]
    deadline: int
    """The last step allowed to train it: in [version, version + K]."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeliverBatch:
    """Train batch ``step``: exactly train_groups whole groups, earliest deadline first."""

    step: int
    groups: tuple[ReadyGroup, ...]
    redelivery: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Retire:
    """No worker serves ``version`` and all its groups are consumed: its weights may be deleted."""

    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Refused:
    """An event was acknowledged and dropped (stale attempt, unknown worker, ...). For logs and metrics."""

    reason: str
    worker_id: WorkerId | None = None
    group_id: GroupId | None = None
    attempt: AttemptId | None = None
    index: int | None = None
    """The sample, when a result was refused."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished:
    """All total_steps batches were trained."""

    steps: int


Action = (
    Lease | Pin | Lend | Reclaim | ExportGroup | ImportGroup | Revoke | DeliverBatch | Retire | Refused | RunFinished
)


@dataclass(slots=True)
class Outbox:
    """Actions collected while one event is handled."""

    actions: list[Action] = field(default_factory=list)

    def emit(self, action: Action) -> None:
        self.actions.append(action)
