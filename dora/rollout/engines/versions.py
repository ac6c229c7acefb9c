"""The versions a step engine (torch, vLLM) holds: written once for both.

An engine of full weights holds one version, the one it loaded (or was labelled with: a version that carries no
weights, as the sim learner's). An engine of adapter versions (a LoRA run) holds up to ``most`` of them, each served
by a handle of its own (a lane of the torch engine's stacked adapters, a vLLM ``LoRARequest``), and a load keeps the
versions requests still name beside the new one. Requests run under the version they name, if it is held, or the
current one, the newest loaded (C1: every token of a request from that one version).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Set
from typing import Any, Generic, TypeVar

from dora.rollout.engines.base import EngineError

H = TypeVar("H")


class Versions(Generic[H]):
    def __init__(self, most: int, current: int | None, handle: H) -> None:
        """``most``: the versions held at most; ``current``: the start model's label, if any, served by ``handle``."""
        self.most = most
        self.current = current
        """The newest version loaded, which requests run under unless they name another (None: none yet)."""
        self.handle = handle
        """What serves the current version."""
        self.by_version: dict[int, H] = {} if current is None else {current: handle}

    def held(self) -> set[int]:
        """The versions a request may name now."""
        return set(self.by_version)

    def of(self, version: int) -> H:
        """What serves ``version`` (held)."""
        return self.by_version[version]

    def runs_under(self, version: int | None) -> int:
        """The version a new request runs under (None: the current one); EngineError if it is not held."""
        if self.current is None:
            raise EngineError("no weights loaded")
        if version is None:
            return self.current
        if version not in self.by_version:
            held = ", ".join(f"v{v}" for v in sorted(self.by_version))
            raise EngineError(f"a request for v{version}: this engine holds {held}")
        return version

    def take(self, version: int, handle: H, kept: Set[int] = frozenset()) -> None:
        """``version`` is loaded, served by ``handle``, and is the current one. The versions not in ``kept`` leave,
        and so does any other that ``handle`` served (a lane filled anew)."""
        stay = {v: h for v, h in self.by_version.items() if v in kept and v != version and h != handle}
        self.by_version = stay | {version: handle}
        self.current, self.handle = version, handle

    def relabel(self, version: int, kept: Set[int] = frozenset()) -> None:
        """The current weights are ``version`` too (a version that carries no weights); the versions not in ``kept``
        leave."""
        self.by_version = {v: h for v, h in self.by_version.items() if v in kept} | {version: self.handle}
        self.current = version


class ReadsVersions:
    """What an engine says of the versions it holds, read from its ``versions``."""

    versions: Versions[Any]

    @property
    def version(self) -> int | None:
        """The current version: the newest loaded, which requests run under unless they name another."""
        return self.versions.current

    @property
    def max_versions(self) -> int:
        """The versions the engine holds at most (1: full weights)."""
        return self.versions.most

    def held_versions(self) -> set[int]:
        """The versions a request (a Generate or MigrateIn) may name now."""
        return self.versions.held()


class HoldsVersions(ReadsVersions, ABC):
    """An engine that keeps its ``versions`` itself. ``adapted``: its versions are adapters (a load or a relabel
    keeps the versions requests still name); ``named``: those versions."""

    @property
    @abstractmethod
    def adapted(self) -> bool: ...

    @abstractmethod
    def named(self, keep: frozenset[int] = frozenset()) -> set[int]: ...

    def relabel(self, version: int) -> None:
        """Label the current weights ``version`` (a version that carries no weights, as the sim learner's)."""
        self.versions.relabel(version, self.named() if self.adapted else frozenset())
