"""What a rollout worker needs from an inference engine. `sim`, `torch` (and any custom engine) implement it.

The rollout actor owns the socket and the clock and calls these from its event loop. The contract:

- ``loaded(version, uri, sha256)``: take the version's weights (``uri`` from the ``Assign``; a
  ``sim://`` URI names weights that do not exist). Raise ``EngineError`` to refuse (requests still
  running, a digest mismatch); the engine must then still be on its previous version.
- **A version per request**: every sampled token of a trajectory comes from the one version its request
  names (C1). ``held_versions()`` are the versions a ``Generate`` or ``MigrateIn`` may name now, at most
  ``max_versions`` of them. An engine of full weights holds one, its loaded version (``max_versions``
  1); one of adapter versions (LoRA) may hold several, and a load while requests run keeps every version
  they name beside the new one (the others leave), or is refused if that needs more than
  ``max_versions``.
- ``submit(Generate, now)``: queue ``n_samples`` samples of a group, with the request's seed, under
  the version it names.
- ``advance(now)``: make progress (a time-driven engine catches up to ``now``; a compute-driven one
  runs one step) and keep what finished for ``take_finished``; ``next_event_s`` says how soon to call
  again (0: now; None: idle).
- ``result(sample, broker_epoch)``: the ``SampleFinished`` for a finished sample: token ids, the
  behaviour log-prob of every sampled token, ``(version, tokens)`` segments (the version its request
  ran under), reward, finish reason.
- ``export(group, attempt, now)`` / ``import_(MigrateIn, now)``: hand a group's unfinished samples to
  another worker holding the same version (token prefix, log-probs, RNG state and, where the engine
  can, its KV cache) and resume them there, under the version the ``MigrateIn`` names.
- ``cancel``, ``clear`` (drop everything: the session ended), ``busy``, ``load`` (running sequences,
  KV or slot use 0..1), ``tokens_generated`` (a progress counter for the stall watchdog).

A custom engine from an embedding stack implements these methods and is passed to
``dora.rollout.actor.RolloutActor``; see ``examples/custom_engine.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

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


class WorkerEngine(Protocol):
    name: str
    paused: bool
    """Set while an elastic worker has yielded its accelerators (the worker does not call ``advance`` then); an
    engine whose progress follows the clock skips the paused time when the worker wakes it."""

    max_versions: int
    """The versions the engine holds at most (1: full weights)."""

    @property
    def tokens_generated(self) -> int: ...

    def held_versions(self) -> set[int]: ...

    def busy(self) -> bool: ...
    def load_seconds(self) -> float: ...
    def loaded(self, version: int, uri: str = "", sha256: str = "") -> None: ...
    def submit(self, gen: m.Generate, now: float) -> None: ...
    def export(self, group: int, attempt: int, now: float) -> list[m.RequestState]: ...
    def import_(self, mig: m.MigrateIn, now: float) -> None: ...
    def cancel(self, group: int, attempt: int, now: float) -> None: ...
    def advance(self, now: float) -> None: ...
    def take_finished(self) -> list[Any]: ...
    def next_event_s(self) -> float | None: ...
    def result(self, sample: Any, broker_epoch: int) -> FinishedSample: ...
    def load(self) -> tuple[int, float]: ...
    def clear(self) -> None: ...


def ran_under(sample: Any, engine: Any) -> int:
    """The version a finished sample ran under: its request's (an engine's sample that records none: the engine's)."""
    version = getattr(sample, "version", None)
    return engine.version if version is None else version
