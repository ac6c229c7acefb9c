"""What a rollout worker needs from an inference engine: ``WorkerEngine``, which `sim`, the step engines' worker
(``dora.rollout.engines.stepped``, over `torch` or `vllm`: ``StepEngine``) and any custom engine implement.

The rollout actor owns the socket and the clock and calls these from its event loop. The contract:

- ``loaded(version, uri, sha256, keep, inline)``: take the version's weights (``uri`` from the ``Assign``; a
  ``sim://`` URI names weights that do not exist). ``inline``: the ``Assign``'s copy of a small version's files
  (a LoRA adapter folder with its manifest, ``dora.store.inline``), which an engine may load instead of reading
  ``uri``, once they check against ``sha256``; full weights never come inline. Raise ``EngineError`` to refuse
  (requests still running, a digest mismatch); the engine must then still be on its previous version.
- **A version per request**: every sampled token of a trajectory comes from the one version its request
  names (C1). ``held_versions()`` are the versions a ``Generate`` or ``MigrateIn`` may name now, at most
  ``max_versions`` of them. An engine of full weights holds one, its loaded version (``max_versions``
  1); one of adapter versions (LoRA) may hold several, and a load while requests run keeps every version
  they name, and those in ``keep``, beside the new one (the others leave), or is refused if that needs more
  than ``max_versions``.
- ``submit(Generate, now)``: queue ``n_samples`` samples of a group, with the request's seed, under
  the version it names.
- ``advance(now)``: make progress (a time-driven engine catches up to ``now``; a compute-driven one
  runs one step) and keep what finished for ``take_finished``; ``next_event_s`` says how soon to call
  again (0: now; None: idle). A turn of the worker is ``begin_step(now)`` then ``end_step(done)``: an engine
  whose step may take long returns it from ``begin_step`` to be run on the engine's thread
  (``dora.rollout.offloop``) while the worker heartbeats; by default the engine advances in ``begin_step``.
- ``result(sample, broker_epoch)``: the ``FinishedSample`` for a finished sample: token ids, the
  behaviour log-prob of every sampled token, ``(version, tokens)`` segments (the version its request
  ran under), reward, finish reason.
- ``export(group, attempt, now)`` / ``import_(MigrateIn, now)``: hand a group's unfinished samples to
  another worker holding the same version (token prefix, log-probs, RNG state and, where the engine
  can, its KV cache) and resume them there, under the version the ``MigrateIn`` names.
- ``cancel``, ``clear`` (drop everything: the session ended), ``busy``, ``load`` (running sequences,
  KV or slot use 0..1), ``tokens_generated`` (a progress counter for the stall watchdog).
- ``counters()``: the worker's cumulative counters since it started, ``<source>_<what>`` (a reward service's
  calls, an agent's failed episodes: docs/metrics.md#worker-counters), sent in its heartbeats when not empty.
- What an engine may not do, with defaults that say so: held-out evaluation (``evaluate``, ``evaluating``,
  ``take_evaluated``, ``drop_evaluations``: by default it cannot), giving the accelerator's memory back while
  paused (``asleep``: by default never), more than one version (``max_versions``: by default 1).

A custom engine from an embedding stack subclasses ``WorkerEngine``, implements its abstract calls and is passed to
``dora.rollout.actor.RolloutActor``; see ``examples/custom_engine.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from dora.ids import Finish
from dora.samples import FinishedSample
from dora.wire import messages as m


class EngineError(RuntimeError):
    """A request the engine refuses (bad weights, a load while generating, an unknown request)."""


@dataclass(slots=True, kw_only=True)
class Sample:
    """One sample of a leased group inside a step-driven engine (torch, vllm): the request and what it made."""

    group_id: int
    attempt: int
    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    """Per token: 1 sampled by the model, 0 appended by an environment (an episode's observation, logprob 0)."""
    finish: Finish | None = None
    turn_start: int = 0
    """Where the current assistant turn began in ``tokens``; ``max_tokens`` bounds each turn."""
    stops: frozenset[int] = frozenset()
    """Token ids besides EOS that end a turn (``finish`` STOP)."""
    keep_kv: bool = False
    """An episode's sequence: when its turn ends, its cache is kept for the next turn."""
    version: int | None = None
    """The version it runs under, every token of it (C1): the one its request named, or the engine's when it was
    submitted."""

    @property
    def key(self) -> tuple[int, int, int]:
        return self.group_id, self.attempt, self.index

    def release(self) -> None:
        """Let go of what the engine kept for it between turns (an ended episode's): nothing, unless an engine's
        sample keeps its own cache."""

    def observe(self, tokens: list[int]) -> None:
        """Append an environment's tokens (not sampled: mask 0, log-prob 0) to a sample whose turn ended, and open
        its next turn (an engine's ``extend`` then queues it)."""
        if self.finish is None or not tokens:
            raise EngineError("extend needs a sequence whose turn ended, and at least one token")
        self.tokens += tokens
        self.logprobs += [0.0] * len(tokens)
        self.mask += [0] * len(tokens)
        self.finish = None
        self.turn_start = len(self.tokens)


@dataclass(slots=True, kw_only=True)
class SampleState:
    """A sample as a step engine hands it over (``export``, a migration) and resumes it (``import_``)."""

    index: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    rng_state: bytes = b""
    """The sampler's state: its seed, 8 bytes little-endian (empty: seed 0)."""
    kv: tuple[np.ndarray, ...] = ()
    """Its KV cache, keys and values per layer (empty: the engine re-prefills prompt + prefix)."""
    mask: np.ndarray | None = None
    """Per token: 1 sampled by the model, 0 appended by an environment (None: every token sampled)."""
    turn_start: int = 0
    """An episode's: where its open turn began in ``token_ids``."""
    paused: bool = False
    """An episode's that ended its turn and waits on its environment: resumed, not queued (``extend`` goes on)."""


class WorkerEngine(ABC):
    """An engine as the rollout worker drives it (the module's docstring). The abstract calls are every engine's own;
    the others are the honest defaults of an engine that lacks the capability."""

    name: str
    paused: bool = False
    """Set while an elastic worker has yielded its accelerators (the worker does not step it then); an engine whose
    progress follows the clock skips the paused time when the worker wakes it."""

    @property
    @abstractmethod
    def tokens_generated(self) -> int:
        """Tokens generated so far: the progress the broker's stall watchdog reads from heartbeats."""

    @property
    def max_versions(self) -> int:
        """The versions the engine holds at most (1: full weights)."""
        return 1

    @property
    def asleep(self) -> bool:
        """Paused with the accelerator's memory given back."""
        return False

    @abstractmethod
    def held_versions(self) -> set[int]:
        """The versions a Generate or MigrateIn may name now."""

    @abstractmethod
    def busy(self) -> bool: ...
    @abstractmethod
    def load_seconds(self) -> float: ...
    @abstractmethod
    def loaded(self, version: int, uri: str = "", sha256: str = "", keep: frozenset[int] = frozenset(),
               inline: Mapping[str, bytes] = {}) -> None: ...  # fmt: skip
    @abstractmethod
    def submit(self, gen: m.Generate, now: float) -> None: ...
    @abstractmethod
    def export(self, group: int, attempt: int, now: float) -> list[m.RequestState]: ...
    @abstractmethod
    def import_(self, mig: m.MigrateIn, now: float) -> None: ...
    @abstractmethod
    def cancel(self, group: int, attempt: int, now: float) -> None: ...
    @abstractmethod
    def advance(self, now: float) -> None: ...
    @abstractmethod
    def take_finished(self) -> list[Any]: ...
    @abstractmethod
    def next_event_s(self) -> float | None: ...
    @abstractmethod
    def result(self, sample: Any, broker_epoch: int) -> FinishedSample: ...
    @abstractmethod
    def load(self) -> tuple[int, float]: ...
    @abstractmethod
    def clear(self) -> None: ...

    def begin_step(self, now: float) -> Callable[[], list[Any]] | None:
        """The first half of a turn, on the worker's loop: the step to run on the engine's thread, or None when the
        turn is done here (by default the engine advances here)."""
        self.advance(now)
        return None

    def end_step(self, seqs: list[Any]) -> None:
        """The second half, on the loop again, with what the step returned (``seqs``; none: it ran in
        ``begin_step``)."""
        return None

    def evaluate(self, msg: m.Evaluate, now: float) -> bool:
        """Sample a held-out row on the weights loaded now; False: this engine cannot (the request is dropped)."""
        return False

    def evaluating(self) -> bool:
        """Whether held-out evaluation requests are in progress."""
        return False

    def take_evaluated(self) -> list[m.EvalFinished]:
        """The held-out rows evaluated since the last call."""
        return []

    def drop_evaluations(self) -> None:
        """Cancel every held-out evaluation request (weights swapped under them)."""
        return None

    def counters(self) -> dict[str, float]:
        """Cumulative counters since the worker started (never lower on a later call), by ``<source>_<what>``
        with units; the broker sums them over the run's workers. None by default."""
        return {}


S = TypeVar("S", bound=Sample)


class StepEngine(Protocol[S]):
    """A step-driven engine (torch, vLLM) as ``StepWorkerEngine`` and multi-turn episodes drive it: requests of
    samples ``S``, stepped by ``step``."""

    name: str

    @property
    def version(self) -> int | None: ...
    @property
    def max_versions(self) -> int: ...
    @property
    def tokens_generated(self) -> int: ...
    @property
    def asleep(self) -> bool: ...
    def held_versions(self) -> set[int]: ...
    def relabel(self, version: int) -> None: ...
    def load_weights(self, version: int, path: str, digest: str | None, keep: frozenset[int] = ...,
                     inline: Mapping[str, bytes] = ...) -> None: ...  # fmt: skip
    def submit(self, *, group_id: int, attempt: int, prompt: list[int], n: int, max_tokens: int,
               temperature: float = ..., top_p: float = ..., seed: int = ..., stops: frozenset[int] = ...,
               keep_kv: bool = ..., version: int | None = ..., index: int = ...) -> list[S]: ...  # fmt: skip
    def extend(self, seq: S, tokens: list[int]) -> None: ...
    def state(self, seq: S, *, with_kv: bool = ...) -> SampleState: ...
    def export(self, group_id: int, attempt: int, *, with_kv: bool = ...) -> list[SampleState]: ...
    def import_(self, *, group_id: int, attempt: int, prompt: list[int], requests: list[SampleState],
                max_tokens: int, temperature: float = ..., top_p: float = ..., stops: frozenset[int] = ...,
                keep_kv: bool = ..., version: int | None = ...) -> list[S]: ...  # fmt: skip
    def cancel(self, group_id: int, attempt: int) -> None: ...
    def groups(self) -> set[tuple[int, int]]: ...
    def load(self) -> tuple[int, float]: ...
    def __len__(self) -> int: ...
    def step(self) -> list[S]: ...
    def sleep(self) -> None: ...
    def wake(self) -> None: ...


def ran_under(sample: Sample, engine: StepEngine[Any]) -> int:
    """The version a finished sample ran under: its request's (a sample that records none: the engine's)."""
    version = engine.version if sample.version is None else sample.version
    if version is None:
        raise EngineError("a sample finished with no weights loaded")
    return version
