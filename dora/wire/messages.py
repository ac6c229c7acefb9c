"""Every message that crosses a process boundary.

Rules: frozen, slotted, keyword-only dataclasses; commands are imperative (``Generate``), events
past tense (``SamplesFinished``). Token ids, log-probs and KV state are numpy arrays and travel as
raw frames (dtype + shape + bytes), never as lists. New fields go last and carry a default; that
does not bump ``WIRE_VERSION``. Removing, renaming or retyping a field does.

``Hello`` and ``Reject`` are frozen forever: a peer of any wire version must be able to say hello
and to read why it was turned away.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Protocol

import numpy as np
from msgspec import UNSET, UnsetType

from dora.ids import AttemptId, Finish, GroupId, WorkerId
from dora.samples import finite, non_negative

WIRE_VERSION = 6
"""Bumped on every removal, rename or retype of a message or field; its history is in the git log of this file."""

Array = np.ndarray
"""Sent out of band as a raw frame; received as a read-only view on the frame's memory."""

Json = Any
"""Plain msgpack data (None, bool, int, float, str, bytes, lists and str-keyed maps of them)."""


class Role(StrEnum):
    ROLLOUT = "rollout"
    LEARNER = "learner"
    CLIENT = "client"


# ---------------------------------------------------------------- handshake and liveness (all roles)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello:
    KIND: ClassVar[str] = "hello"
    wire_version: int
    role: Role
    peer_id: str
    """Worker id for a rollout worker, rank name for the learner, anything for a client."""
    pid: int
    host: str
    slurm_job_id: str | None = None
    slots: int = 0
    """Rollout: sequences the engine runs at once (its credit)."""
    engine: str = ""
    learner_version: int | None = None
    """Learner: the version its weights hold (0 fresh, a checkpoint's when resumed); None without weights."""
    elastic: bool = False
    """Rollout: it shares its accelerators with the trainer and yields them for each train step."""
    holds: int = 1
    """Rollout: versions its engine serves at once (1: full weights; a LoRA engine's adapter versions)."""
    weights_endpoint: str = ""
    """Rollout: its chunk server (the weights' data plane), which relays the versions its node fetched to the nodes
    below it in the relay tree; empty: none (it reads the learner's store)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Reject:
    KIND: ClassVar[str] = "reject"
    reason: str
    wire_version: int
    """The broker's wire version."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Welcome:
    KIND: ClassVar[str] = "welcome"
    broker_epoch: int
    heartbeat_interval_s: float
    liveness: int
    newest_version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    KIND: ClassVar[str] = "heartbeat"
    tokens_generated: int = 0
    """Monotonic progress counter; heartbeats without progress while work is held mean a stall."""
    running: int = 0
    kv_use: float = 0.0
    seen: int = 0
    """Rollout: the highest command ``seq`` received from the broker this session (0: none yet). Broker (its
    answer to a rollout heartbeat): the ``seq`` of the last command it sent, so a lost last command shows."""
    holding: Array | None = None
    """Rollout: int64 (n, 2) rows (group_id, attempt) of every lease it holds: samples running, or results
    sent and not yet acknowledged. A command it saw whose lease is not here was lost on the way."""
    version: int = -1
    """Rollout: the version whose weights are loaded (-1: none)."""
    loading: int = -1
    """Rollout: the version being loaded now (-1: none)."""
    yielded: bool = False
    """Rollout (elastic): its accelerators are the trainer's now; its requests are paused."""
    counters: dict[str, float] | UnsetType = UNSET
    """Rollout: its process's cumulative counters since it started, ``<source>_<what>`` with units
    (``reward_service_calls``, ``agent_failed``; docs/metrics.md#worker-counters). Unset (a worker with none to
    report) it is left out of the encoding, so such a heartbeat's bytes are those of before the field; read it
    through ``counted``."""

    def __post_init__(self) -> None:
        non_negative("tokens_generated", self.tokens_generated)
        non_negative("running", self.running)
        non_negative("seen", self.seen)
        if not 0.0 <= self.kv_use <= 1.0:
            raise ValueError(f"kv_use must be in [0, 1], got {self.kv_use}")
        if self.holding is not None and (self.holding.ndim != 2 or self.holding.shape[1:] != (2,)):
            raise ValueError(f"holding must have shape (n, 2), got {self.holding.shape}")
        for name, value in self.counted().items():
            finite(f"counters[{name!r}]", value)
            non_negative(f"counters[{name!r}]", value)

    def held(self) -> set[tuple[int, int]]:
        """The (group_id, attempt) leases reported held."""
        return set() if self.holding is None else {(int(g), int(a)) for g, a in self.holding.tolist()}

    def counted(self) -> dict[str, float]:
        """The worker's cumulative counters (empty: none reported)."""
        return {} if isinstance(self.counters, UnsetType) else self.counters


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye:
    KIND: ClassVar[str] = "goodbye"
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Disconnect:
    """The broker declared the peer dead; it must say Hello again (its leases are void)."""

    KIND: ClassVar[str] = "disconnect"
    reason: str


# ---------------------------------------------------------------- broker <-> rollout


@dataclass(frozen=True, slots=True, kw_only=True)
class Generate:
    """Lease: generate ``n_samples`` samples of one prompt on ``version``."""

    KIND: ClassVar[str] = "generate"
    group_id: GroupId
    attempt: AttemptId
    version: int
    prompt_ids: Array
    n_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    broker_epoch: int = 0
    seq: int = 0
    """The broker's number for this command to this worker (1, 2, ... per session; 0: unnumbered)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleHeader:
    """A finished sample without its arrays: all the broker decides on. Its token ids, log-probs and (when
    ``masked``) loss mask are ``[offset, offset + tokens)`` of the packed arrays that travel beside it."""

    group_id: GroupId
    attempt: AttemptId
    index: int
    segments: tuple[tuple[int, int], ...]
    """(version, tokens) runs in generation order; one run when C1 holds."""
    reward: float
    finish: Finish
    offset: int
    tokens: int
    checksum: int
    """xxh3-64 of the sample's packed token ids, log-probs and (when masked) loss mask: the learner checks it."""
    masked: bool = False
    turns: tuple[tuple[int, int, int], ...] | None = None
    """(start, end, version) of each assistant turn of an episode; None: one turn."""
    gen_time_s: float = 0.0
    broker_epoch: int = 0
    reward_components: dict[str, float] = field(default_factory=dict)
    reward_error: str = ""

    def __post_init__(self) -> None:  # on every sample the broker takes: one test for the common case
        if self.index < 0 or self.offset < 0 or self.tokens < 0 or not math.isfinite(self.reward):
            for name in ("index", "offset", "tokens"):
                non_negative(name, getattr(self, name))
            finite("reward", self.reward)
        for name, part in self.reward_components.items():
            finite(f"reward_components[{name!r}]", part)


PACKED_DTYPES: dict[str, np.dtype[Any]] = {
    "token_ids": np.dtype("<i4"), "logprobs": np.dtype("<f4"), "loss_mask": np.dtype("|u1")
}  # fmt: skip
"""The one dtype of each packed array kind."""


def _packed_arrays(token_ids: Array, logprobs: Array, loss_mask: Array | None) -> int:
    """Check one payload source (its three arrays, 1-D, of the packed dtypes and one length); return the length."""
    for name, arr in (("token_ids", token_ids), ("logprobs", logprobs), ("loss_mask", loss_mask)):
        if arr is not None and (arr.dtype != PACKED_DTYPES[name] or arr.ndim != 1 or len(arr) != len(token_ids)):
            raise ValueError(f"packed {name} must be 1-D {PACKED_DTYPES[name]} of {len(token_ids)}, got "
                             f"{arr.dtype} {arr.shape}")  # fmt: skip
    return len(token_ids)


def _spans(headers: tuple[SampleHeader, ...], sizes: Sequence[int], masks: Sequence[bool], sources: Sequence[int],
           where: str) -> None:  # fmt: skip
    """Every header's tokens lie inside its source; a masked one's source carries a loss mask."""
    for h, k in zip(headers, sources, strict=True):
        if not 0 <= k < len(sizes) or h.offset + h.tokens > sizes[k]:
            raise ValueError(f"{where}: sample {h.group_id}/{h.index} spans [{h.offset}, {h.offset + h.tokens}) "
                             "outside its payload")  # fmt: skip
        if h.masked and not masks[k]:
            raise ValueError(f"{where}: sample {h.group_id}/{h.index} is masked but its payload has no loss mask")


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplesFinished:
    """What a worker's engine finished since it last reported: headers, and each array kind packed into one frame
    (``dora.wire.packed``). The broker decodes the headers only and forwards the frames to the learner untouched;
    it takes the samples in order, exactly as if each came alone, and answers with one ResultAcks."""

    KIND: ClassVar[str] = "samples_finished"
    samples: tuple[SampleHeader, ...]
    token_ids: Array
    """int32, every sample's token ids one after the other."""
    logprobs: Array
    """float32, one per token."""
    loss_mask: Array | None = None
    """uint8, one per token; present when some sample is masked (an unmasked sample's part is all 1)."""

    def __post_init__(self) -> None:
        n = _packed_arrays(self.token_ids, self.logprobs, self.loss_mask)
        _spans(self.samples, (n,), (self.loss_mask is not None,), (0,) * len(self.samples), "samples_finished")


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultAck:
    """The broker took (or refused, with a reason) a result; the worker may forget it."""

    group_id: GroupId
    attempt: AttemptId
    index: int
    accepted: bool
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResultAcks:
    """The answers to one SamplesFinished, in its order."""

    KIND: ClassVar[str] = "result_acks"
    acks: tuple[ResultAck, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Assign:
    """Serve ``version`` from now on: load the weights at ``uri`` and check their sha256 first. ``keep``: older
    versions a multi-version worker goes on serving beside it (requests of them still run there). ``sources`` and
    ``inline``: as the version's ``WeightsPublished`` carried them."""

    KIND: ClassVar[str] = "assign"
    version: int
    uri: str
    sha256: str
    interrupt: bool = False
    seq: int = 0
    keep: tuple[int, ...] = ()
    sources: tuple[str, ...] = ()
    inline: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class Yield:
    """Elastic worker: pause what it holds and hand its accelerators to the trainer; answer ``Yielded``."""

    KIND: ClassVar[str] = "yield"
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Yielded:
    KIND: ClassVar[str] = "yielded"


@dataclass(frozen=True, slots=True, kw_only=True)
class Resume:
    """A yielded worker takes its accelerators back and goes on serving ``version`` (the weights it holds) with
    the requests it kept; answer ``WeightsLoaded``."""

    KIND: ClassVar[str] = "resume"
    version: int
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsLoaded:
    KIND: ClassVar[str] = "weights_loaded"
    version: int
    load_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestState:
    """One running sample handed between two workers of the same version."""

    index: int
    token_ids: Array
    logprobs: Array
    rng_state: bytes = b""
    kv: tuple[Array, ...] = ()
    """Engine-specific KV tensors; empty means the target re-prefills prompt + prefix."""
    loss_mask: Array | None = None
    """An episode's: as in SampleFinished (None: every token was sampled)."""
    turns: Array | None = None
    """An episode's turns so far: as in SampleFinished."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrateOut:
    KIND: ClassVar[str] = "migrate_out"
    group_id: GroupId
    attempt: AttemptId
    version: int
    target: WorkerId
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrationExported:
    KIND: ClassVar[str] = "migration_exported"
    group_id: GroupId
    attempt: AttemptId
    requests: tuple[RequestState, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class MigrateIn:
    KIND: ClassVar[str] = "migrate_in"
    group_id: GroupId
    attempt: AttemptId
    version: int
    source: WorkerId
    prompt_ids: Array
    requests: tuple[RequestState, ...]
    max_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel:
    KIND: ClassVar[str] = "cancel"
    group_id: GroupId
    attempt: AttemptId
    seq: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RetireVersion:
    """Nobody serves ``version`` any more and its groups are consumed; caches of it may go."""

    KIND: ClassVar[str] = "retire_version"
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Evaluate:
    """Sample a held-out row on ``version``, the worker's own weights, and score it: evaluation, not training.
    Unnumbered and outside every lease: the broker sends it again to some worker of the version if no answer
    comes, and a worker not serving exactly ``version`` drops it."""

    KIND: ClassVar[str] = "evaluate"
    version: int
    round: int
    """The evaluation round (one per evaluated version and broker epoch)."""
    row: int
    prompt_ids: Array
    n_samples: int
    max_tokens: int
    temperature: float
    seed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalFinished:
    """A held-out row's scores on ``version``: one reward and one completion length per sample."""

    KIND: ClassVar[str] = "eval_finished"
    version: int
    round: int
    row: int
    rewards: Array
    lengths: Array
    failed: int = 0
    """Samples whose reward failed (scored 0 with a reason)."""


# ---------------------------------------------------------------- broker <-> learner


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestBatch:
    KIND: ClassVar[str] = "request_batch"
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchGroup:
    """One group of a TrainBatch: its prompt's span of the batch's packed prompts, and its samples' headers with,
    for each, the payload source of the batch that holds its arrays."""

    group_id: GroupId
    version: int
    prompt_offset: int
    prompt_tokens: int
    samples: tuple[SampleHeader, ...]
    sources: tuple[int, ...]
    """Per sample: the index into the batch's ``token_ids``/``logprobs``/``loss_mask`` sources."""

    def __post_init__(self) -> None:
        if len(self.sources) != len(self.samples):
            raise ValueError(f"group {self.group_id}: {len(self.sources)} sources for {len(self.samples)} samples")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainBatch:
    """The learner's batch on the wire. The samples' arrays are the workers' packed payloads as the broker received
    them (a source per SamplesFinished it drew from: one frame per array kind); ``dora.wire.packed.unpack_batch``
    checks them and gives the learner its ``Batch``."""

    KIND: ClassVar[str] = "train_batch"
    step: int
    groups: tuple[BatchGroup, ...]
    prompt_ids: Array
    """int32, every group's prompt one after the other."""
    token_ids: tuple[Array, ...] = ()
    logprobs: tuple[Array, ...] = ()
    loss_mask: tuple[Array | None, ...] = ()
    redelivery: bool = False

    def __post_init__(self) -> None:
        if not len(self.token_ids) == len(self.logprobs) == len(self.loss_mask):
            raise ValueError("a train batch needs token_ids, logprobs and loss_mask for every source")
        sizes = [_packed_arrays(*arrays) for arrays in zip(self.token_ids, self.logprobs, self.loss_mask, strict=True)]
        masks = [mask is not None for mask in self.loss_mask]
        if self.prompt_ids.dtype != PACKED_DTYPES["token_ids"] or self.prompt_ids.ndim != 1:
            raise ValueError(
                f"packed prompt_ids must be 1-D int32, got {self.prompt_ids.dtype} {self.prompt_ids.shape}"
            )
        for g in self.groups:
            if g.prompt_offset < 0 or g.prompt_tokens < 0 or g.prompt_offset + g.prompt_tokens > len(self.prompt_ids):
                raise ValueError(f"group {g.group_id}: prompt span outside the batch's prompts")
            _spans(g.samples, sizes, masks, g.sources, f"group {g.group_id}")


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsPublished:
    """Version ``version`` is durable in the learner's store at ``uri``, with digest ``sha256``. ``sources``: data-plane
    endpoints that serve its files chunk by chunk (a worker without the learner's store reads it from them);
    ``inline``: a small version's files (a LoRA adapter folder with its manifest) carried in the message itself."""

    KIND: ClassVar[str] = "weights_published"
    version: int
    uri: str
    sha256: str
    publish_s: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    sources: tuple[str, ...] = ()
    inline: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishAck:
    """The broker took ``version`` (journalled, when it keeps a journal): the learner may checkpoint it."""

    KIND: ClassVar[str] = "publish_ack"
    version: int


# ---------------------------------------------------------------- status clients


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusRequest:
    KIND: ClassVar[str] = "status_request"


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply:
    KIND: ClassVar[str] = "status_reply"
    snapshot: Json


class Message(Protocol):
    """A top-level message: the envelope names it by its kind."""

    KIND: ClassVar[str]


MESSAGES: tuple[type[Message], ...] = (
    Hello, Reject, Welcome, Heartbeat, Goodbye, Disconnect,
    Generate, SamplesFinished, ResultAcks,
    Assign, WeightsLoaded, Yield, Yielded, Resume, MigrateOut, MigrationExported, MigrateIn,
    Cancel, RetireVersion, Evaluate, EvalFinished,
    RequestBatch, TrainBatch, WeightsPublished, PublishAck,
    StatusRequest, StatusReply,
)  # fmt: skip
"""Every top-level message type, by kind."""


def check_hello(hello: Hello) -> Reject | None:
    """The broker's answer to a Hello that it must turn away, or None to accept it."""
    if hello.wire_version != WIRE_VERSION:
        return Reject(
            reason=f"wire version mismatch: peer speaks {hello.wire_version}, broker speaks {WIRE_VERSION}; "
            "run the same dora release on every node",
            wire_version=WIRE_VERSION,
        )
    if hello.role is Role.ROLLOUT and hello.slots <= 0:
        return Reject(reason=f"a rollout worker must offer slots > 0, got {hello.slots}", wire_version=WIRE_VERSION)
    return None
