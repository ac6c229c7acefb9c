"""Peer liveness from application heartbeats: silence and stalls. Pure: the caller passes ``now``.

A peer is **dead** when nothing was heard from it for ``interval_s * liveness`` (``quiet`` names the ones
that missed a heartbeat, so the caller can probe their connections meanwhile). It is **stalled**
when it keeps sending heartbeats but its progress counter (tokens generated) has not moved for
``stall_timeout_s`` while it holds work: a hung engine behind a live event loop. Both end its leases
the same way; the difference is only in the reason logged. Time in which the judge itself did not listen
(``absent``) counts against nobody.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PeerState:
    last_seen: float
    timeout_s: float
    progress: int = 0
    progress_at: float = 0.0
    busy: bool = False


class Liveness:
    def __init__(self, interval_s: float, liveness: int, stall_timeout_s: float) -> None:
        if interval_s <= 0 or liveness < 2 or stall_timeout_s <= 0:
            raise ValueError("need interval_s > 0, liveness >= 2 and stall_timeout_s > 0")
        self.timeout_s = interval_s * liveness
        self.stall_timeout_s = stall_timeout_s
        self._peers: dict[str, PeerState] = {}

    def __contains__(self, peer: str) -> bool:
        return peer in self._peers

    def joined(self, peer: str, now: float, *, timeout_s: float | None = None) -> None:
        """Start watching ``peer``; ``timeout_s`` overrides the silence window for this one peer."""
        self._peers[peer] = PeerState(last_seen=now, timeout_s=timeout_s or self.timeout_s, progress_at=now)

    def heard(self, peer: str, now: float) -> None:
        """Any message from the peer proves it is alive."""
        state = self._peers.get(peer)
        if state is not None:
            state.last_seen = now

    def progressed(self, peer: str, now: float, progress: int, *, busy: bool) -> None:
        """A heartbeat with the peer's monotonic progress counter and whether it holds work."""
        state = self._peers.get(peer)
        if state is None:
            return
        state.last_seen = now
        if progress != state.progress or not busy or not state.busy:
            state.progress, state.progress_at = progress, now
        state.busy = busy

    def absent(self, seconds: float) -> None:
        """The judge itself did not listen for ``seconds`` (its loop held, or not run by a loaded machine): that
        time is nobody's silence, and no peer's progress was watched. Every peer's windows start that much later."""
        for st in self._peers.values():
            st.last_seen += seconds
            st.progress_at += seconds

    def forget(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def quiet(self, now: float, after_s: float) -> list[str]:
        """Peers not heard from for more than ``after_s`` (and not yet dead): worth a message, whose send finds a
        crashed peer's closed connection long before its silence window ends."""
        return [peer for peer, st in self._peers.items() if now - st.last_seen > after_s]

    def expired(self, now: float) -> list[tuple[str, str]]:
        """Peers to declare dead now, with the reason ("silent" or "stalled"); they are forgotten."""
        out = []
        for peer, st in self._peers.items():
            if now - st.last_seen > st.timeout_s:
                out.append((peer, "silent"))
            elif st.busy and now - st.progress_at > self.stall_timeout_s:
                out.append((peer, "stalled"))
        for peer, _ in out:
            del self._peers[peer]
        return out
