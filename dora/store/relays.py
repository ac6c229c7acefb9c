"""Which servers each node fetches a version from: a tree of relays rooted at the learner, so the learner sends each
byte of a version to ``fanout`` nodes, not to every node, and each node passes on what it fetched as it comes.

Pure: no sockets, no files; the broker computes it from the rollout workers' hellos (their hosts and their chunk
servers' endpoints) and puts each node's sources in its workers' ``Assign``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

__all__ = ["RelayTree", "node_relays", "relay_sources"]


def relay_sources(order: Sequence[str], learner: Sequence[str], fanout: int) -> dict[str, tuple[str, ...]]:
    """Each node's sources, keyed by its relay endpoint: the node at position ``i`` of ``order`` sits at place
    ``i + 1`` of a ``fanout``-ary tree whose root (place 0) is the learner, so it fetches from its parent's relay,
    then, if that one fails, from the learner itself (``learner``: its endpoints, always last). The learner's direct
    children are the first ``fanout`` nodes; ``fanout`` 1 makes a chain; 0 (or less) sends every node to the
    learner. A node listed twice is placed once."""
    nodes = list(dict.fromkeys(order))
    fallback = tuple(learner)
    if fanout < 1:
        return dict.fromkeys(nodes, fallback)
    out: dict[str, tuple[str, ...]] = {}
    for i, node in enumerate(nodes):
        parent = i // fanout  # place (i + 1)'s parent is place i // fanout; place 0 is the learner
        out[node] = fallback if parent == 0 else (nodes[parent - 1], *fallback)
    return out


def node_relays(workers: Iterable[tuple[str, str, str]]) -> dict[str, str]:
    """Each host's relay, from its workers' (host, name, chunk server endpoint): the endpoint of the first worker by
    name that has one (workers of one host share its store, so any of their servers serves what the host holds)."""
    out: dict[str, str] = {}
    for host, _, endpoint in sorted(workers):
        if endpoint and host not in out:
            out[host] = endpoint
    return out


class RelayTree:
    """The relay tree over the rollout workers the broker holds, computed again only after they changed (a hello, a
    loss): a publish assigns every worker at once, and each Assign names its node's sources."""

    def __init__(self, fanout: int) -> None:
        self.fanout = fanout
        self._relays: dict[str, str] | None = None
        self._tree: dict[str, tuple[str, ...]] = {}
        self._learner: tuple[str, ...] = ()

    def changed(self) -> None:
        self._relays = None

    def sources(self, host: str, learner: tuple[str, ...],
                workers: Callable[[], Iterable[tuple[str, str, str]]]) -> tuple[str, ...]:  # fmt: skip
        """The sources of a worker on ``host``: its node's parent relay, then ``learner`` (the version's published
        sources; none: none). ``workers``: every rollout worker's (host, name, chunk server endpoint)."""
        if not learner:
            return ()
        if self._relays is None or learner != self._learner:
            self._relays = node_relays(workers())
            self._tree = relay_sources([self._relays[h] for h in sorted(self._relays)], learner, self.fanout)
            self._learner = learner
        relay = self._relays.get(host)
        return self._tree.get(relay, learner) if relay is not None else learner
