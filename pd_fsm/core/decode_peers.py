"""D's prefill peers: where each P is (the bootstrap lookup, cached), and whether it is alive.

P's liveness is tracked per P, not per room: one batched HB per P every ``heartbeat_interval``
lists the rooms D still wants; P's HB_ACK (or any message) proves P alive; silence for
``peer_timeout`` or a new incarnation in an ack fails every room of that P with PeerLost and
drops the cached resolution. Runs kv_receiver's ResolvePeer, JoinHeartbeats and LeaveHeartbeats
for ``DecodeEndpoint``, and steps its rooms (PeerResolved, PeerLost, ...) through the endpoint.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig
from pd_fsm.core.decode_room import ReceiverRoom, StepRoom
from pd_fsm.core.messages import MAX_ROOMS_PER_HEARTBEAT, Heartbeat, HeartbeatAck, KVPart, Ready
from pd_fsm.core.rooms import Cause
from pd_fsm.core.stats import EndpointStats
from pd_fsm.core.tables import KV_RECEIVER
from pd_fsm.core.timers import DeadlineHeap

_S, _T = KV_RECEIVER.S, KV_RECEIVER.T

_Fx = fx.DecodeEffect


class Peer:
    __slots__ = (
        "addr",
        "hb_seq",
        "incarnation",
        "last_heard",
        "layout_hash",
        "rooms",
        "transfer_addr",
        "unanswered",
    )

    def __init__(self, addr: str, transfer_addr: str, layout_hash: str) -> None:
        self.addr = addr
        self.transfer_addr = transfer_addr
        self.layout_hash = layout_hash
        self.rooms: set[int] = set()  # rooms in the batched heartbeat
        self.last_heard = 0.0
        self.incarnation: int | None = None
        self.hb_seq = 0
        self.unanswered = 0  # heartbeats sent since P last said anything


class PeerTracker:
    """The P's of D's rooms, by side-channel address. ``rooms`` is the endpoint's (read here);
    ``go`` and ``remote`` step one of them with a trigger of ours or of P's."""

    def __init__(self, config: DecodeConfig, incarnation: int, rooms: Mapping[int, ReceiverRoom],
                 stats: EndpointStats, go: StepRoom, remote: StepRoom) -> None:
        self._config = config
        self._incarnation = incarnation  # ours, named in every heartbeat
        self._rooms = rooms
        self._stats = stats
        self._go = go
        self._remote = remote
        self.peers: dict[str, Peer] = {}
        self.resolved: dict[str, str] = {}  # bootstrap_addr -> peer addr (cache)
        self._resolving: dict[str, list[int]] = {}  # bootstrap_addr -> rooms waiting
        self._hb_timers: DeadlineHeap[str] = DeadlineHeap()
        self._live_timers: DeadlineHeap[str] = DeadlineHeap()

    # -- the bootstrap lookup -----------------------------------------------------------------

    def on_resolved(self, e: ev.PeerResolved, now: float, out: list[_Fx]) -> None:
        previous = self.resolved.get(e.bootstrap_addr)
        self.resolved[e.bootstrap_addr] = e.peer
        if previous is not None and previous != e.peer:
            self._forget_if_idle(previous, out)  # P moved: its old address is of no use now
        peer = self.peers.get(e.peer)
        if peer is None:
            self.peers[e.peer] = Peer(e.peer, e.transfer_addr, e.layout_hash)
        else:
            peer.transfer_addr = e.transfer_addr
            peer.layout_hash = e.layout_hash
        for r in self._waiting(e.bootstrap_addr):
            r.peer = e.peer
            self._go(r, _T.PeerResolved, now, out, "")

    def on_unresolved(self, e: ev.PeerResolutionFailed, now: float, out: list[_Fx]) -> None:
        reason = f"cannot resolve prefill at {e.bootstrap_addr}: {e.reason}"
        for r in self._waiting(e.bootstrap_addr):
            self._go(r, _T.PeerUnresolved, now, out, reason)

    def _waiting(self, bootstrap_addr: str) -> Iterator[ReceiverRoom]:
        """The rooms still waiting for the lookup of ``bootstrap_addr`` (it is over)."""
        for room in self._resolving.pop(bootstrap_addr, ()):
            r = self._rooms.get(room)
            if r is not None and r.state == _S.RESOLVING:
                yield r

    # -- what P says --------------------------------------------------------------------------

    def heard(self, addr: str, now: float) -> Peer | None:
        """Any message from ``addr`` proves that P alive; its record, if we keep one."""
        peer = self.peers.get(addr)
        if peer is not None:
            peer.last_heard = now
            peer.unanswered = 0
            if peer.rooms:
                self._live_timers.set(addr, now + self._config.peer_timeout)
        return peer

    def on_ack(self, peer: Peer, m: HeartbeatAck, now: float, out: list[_Fx]) -> None:
        self._note_incarnation(peer, m.incarnation, now, out)
        for room in m.failed_rooms:
            r = self._rooms.get(room)
            if r is not None and r.peer == peer.addr:
                self._remote(r, _T.AbortReceived, now, out, "prefill reports the room failed")
        for room in m.unknown_rooms:
            r = self._rooms.get(room)
            # Only a room whose hello went out before this heartbeat: P should know it by now.
            if (
                r is not None
                and r.peer == peer.addr
                and r.state == _S.WAITING_FOR_READY
                and 0 <= r.hello_seq < m.seq
            ):
                reason = f"prefill {peer.addr} does not know the room (restarted or lost our hello)"
                self._go(r, _T.PeerLost, now, out, reason)

    def on_offer(self, peer: Peer, m: KVPart | Ready, now: float, out: list[_Fx]) -> None:
        """P's part or READY, about to be pulled: which process sent it, and where it is."""
        self._note_incarnation(peer, m.incarnation, now, out)
        if m.transfer_addr:
            peer.transfer_addr = m.transfer_addr

    def _note_incarnation(self, peer: Peer, incarnation: int, now: float, out: list[_Fx]) -> None:
        """P names its incarnation in every ack and READY. A new one means P restarted (at the
        same side-channel address): what its previous process held is gone. Rooms READY'd by that
        process fail now (their KV died with it); rooms still waiting for READY are judged by the
        new process's acks (``unknown_rooms``), since the new P may well hold their hello. The
        route stays (P is back where it was) but not the transfer connection: one to a dead
        transfer server fails every later pull on it."""
        if incarnation == 0 or peer.incarnation == incarnation:
            return
        previous, peer.incarnation = peer.incarnation, incarnation
        if previous is None:
            return
        self._stats.peer_restarts += 1
        reason = f"prefill {peer.addr} restarted (its rooms are gone)"
        for room in sorted(peer.rooms):
            r = self._rooms.get(room)
            if r is not None and r.incarnation not in (0, incarnation):
                self._go(r, _T.PeerLost, now, out, reason)
        out.append(fx.ForgetTransfer(peer.transfer_addr))

    # -- heartbeats and silence ---------------------------------------------------------------

    def while_busy(self) -> fx.RepeatWhileBusy:
        """The heartbeats to repeat while the embedder runs a step (StepStarted)."""
        repeat = [
            fx.SendMessage(addr, Heartbeat(peer.hb_seq, batch, self._incarnation))
            for addr, peer in sorted(self.peers.items())
            for batch in _batches(sorted(peer.rooms))
        ]
        return fx.RepeatWhileBusy(tuple(repeat), self._config.heartbeat_interval)

    def fire_due(self, now: float, out: list[_Fx]) -> None:
        """Judge the P's whose silence is due, then send the heartbeats that are."""
        if not (self._live_timers.maybe_due(now) or self._hb_timers.maybe_due(now)):
            return
        config = self._config
        for addr in self._live_timers.pop_due(now):
            peer = self.peers.get(addr)
            if peer is None or not peer.rooms:
                continue
            if peer.unanswered >= config.heartbeat_misses:
                silent = now - peer.last_heard
                reason = (
                    f"prefill {addr} silent for {silent:.1f} s "
                    f"({peer.unanswered} heartbeats unanswered)"
                )
                self._lose(peer, now, out, reason)
            else:  # we were not asking (stalled, or just started): ask, then judge
                self._live_timers.set(addr, now + config.heartbeat_interval)
        for addr in self._hb_timers.pop_due(now):
            peer = self.peers.get(addr)
            if peer is not None and peer.rooms:
                peer.unanswered += 1
                for batch in _batches(sorted(peer.rooms)):
                    peer.hb_seq += 1
                    heartbeat = Heartbeat(peer.hb_seq, batch, self._incarnation)
                    out.append(fx.SendMessage(addr, heartbeat))
                self._hb_timers.set(addr, now + config.heartbeat_interval)

    def next_deadline(self) -> float | None:
        found = [d for d in (self._hb_timers.next_deadline(), self._live_timers.next_deadline())
                 if d is not None]
        return min(found) if found else None

    def _lose(self, peer: Peer, now: float, out: list[_Fx], reason: str) -> None:
        for addr in [a for a, p in self.resolved.items() if p == peer.addr]:
            del self.resolved[addr]  # look P up again next time: it may have moved
        peer.incarnation = None
        transfer_addrs = {peer.transfer_addr}
        for room in sorted(peer.rooms):
            r = self._rooms.get(room)
            if r is not None:
                transfer_addrs.add(r.transfer_addr)
                self._go(r, _T.PeerLost, now, out, reason)
        # Its rooms' pulls are cancelled; those still waiting on a dead transfer server (one
        # on a fresh connection waits to its deadline) end now, and free their pull threads.
        out.extend(fx.ForgetTransfer(a) for a in sorted(transfer_addrs) if a)
        self._forget_if_idle(peer.addr, out)

    def _forget_if_idle(self, addr: str, out: list[_Fx]) -> None:
        """Drop what we keep for a P no room needs (rooms mid-pull still need it for DONE)."""
        peer = self.peers.get(addr)
        if peer is None or peer.rooms or addr in self.resolved.values():
            return
        del self.peers[addr]
        self._hb_timers.cancel(addr)
        self._live_timers.cancel(addr)
        out.append(fx.ForgetPeer(addr))

    # -- effects of kv_receiver ---------------------------------------------------------------

    def _fx_ResolvePeer(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        addr = r.bootstrap_addr
        peer = self.resolved.get(addr)
        if peer is not None:
            r.peer = peer  # cached: the endpoint steps PeerResolved right after this row
            return
        waiting = self._resolving.get(addr)
        if waiting is None:
            self._resolving[addr] = [r.room]
            out.append(fx.ResolvePeer(addr))
        else:
            waiting.append(r.room)

    def _fx_JoinHeartbeats(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        peer = self.peers[r.peer]
        if not peer.rooms:
            # First room for an idle P: its silence is measured from now, not from long ago.
            peer.last_heard = now
            peer.unanswered = 0
            self._live_timers.set(peer.addr, now + self._config.peer_timeout)
            self._hb_timers.set(peer.addr, now + self._config.heartbeat_interval)
        peer.rooms.add(r.room)

    def _fx_LeaveHeartbeats(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        if r.peer is not None:
            peer = self.peers.get(r.peer)
            if peer is not None:
                peer.rooms.discard(r.room)


def _batches(rooms: list[int]) -> list[tuple[int, ...]]:
    """A peer's rooms in heartbeat-sized batches (none without rooms)."""
    return [tuple(rooms[i : i + MAX_ROOMS_PER_HEARTBEAT])
            for i in range(0, len(rooms), MAX_ROOMS_PER_HEARTBEAT)]
