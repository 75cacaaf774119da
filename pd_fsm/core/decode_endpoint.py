"""DecodeEndpoint: D's side of every room (table kv_receiver), plus per-P heartbeats.

Rooms wait in per-state deadlines (resolve, queue, READY, transfer). P's liveness is tracked per
P, not per room: one batched HB per P every ``heartbeat_interval`` lists the rooms D still wants;
P's HB_ACK (or any message) proves P alive; silence for ``peer_timeout`` or a new incarnation in
an ack fails every room of that P with PeerLost and drops the cached resolution.
"""

from __future__ import annotations

import re

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.messages import (
    MAX_ROOMS_PER_HEARTBEAT,
    Abort,
    Done,
    Heartbeat,
    HeartbeatAck,
    KVPart,
    Ready,
    RecvInit,
    TokenLogprob,
)
from pd_fsm.core.rooms import Cause, RoomMachines
from pd_fsm.core.tables import KV_RECEIVER
from pd_fsm.core.timers import DeadlineHeap

# The table's names as attributes (tables.Names): never spelled as strings here.
_S, _T = KV_RECEIVER.S, KV_RECEIVER.T

_Fx = fx.DecodeEffect

_HOST_PORT = re.compile(r"[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")


class _ReceiverRoom:
    __slots__ = (
        "bootstrap_addr",
        "deferred",
        "first_logprob",
        "first_token",
        "first_top",
        "hello_seq",
        "incarnation",
        "incoming",
        "kv_checksums",
        "kv_shards",
        "n_pages",
        "part",
        "peer",
        "repull_uuid",
        "room",
        "skip",
        "state",
        "transfer_addr",
        "uuid",
    )

    def __init__(self, room: int, bootstrap_addr: str, n_pages: int) -> None:
        self.room = room
        self.state = KV_RECEIVER.initial
        self.bootstrap_addr = bootstrap_addr
        self.n_pages = n_pages  # the prompt's
        self.skip = 0  # of those, held already (our prefix cache): not pulled
        self.peer: str | None = None
        self.uuid = -1
        self.first_token = -1
        self.first_logprob = 0.0
        self.first_top: tuple[TokenLogprob, ...] = ()
        self.hello_seq = -1  # last heartbeat seq sent before our RECV_INIT
        self.incarnation = 0  # of the P process that sent READY (0: none yet, or not said)
        self.transfer_addr = ""  # where READY said to pull from ("": the registry's address)
        self.kv_shards = 1  # arrays per pool P registered (READY's)
        # READY's, when we verify pulls (kv_checksum): what each pulled array must sum to, and
        # the spare registration a re-pull takes after a mismatch (0: none).
        self.kv_checksums: tuple[int, ...] = ()
        self.repull_uuid = 0
        # Streamed KV: the part being pulled (its pages follow ``skip``), P's message being
        # stepped, and those P sent while a part was in flight (handled when it reports).
        self.part: KVPart | None = None
        self.incoming: KVPart | Ready | None = None
        self.deferred: list[KVPart | Ready] = []


class _Peer:
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


class DecodeEndpoint(RoomMachines[_ReceiverRoom, fx.DecodeEffect]):
    table = KV_RECEIVER
    peer_role = "P"

    def _apply(
        self, r: _ReceiverRoom, trigger: str, now: float, out: list[_Fx], reason: str
    ) -> None:
        self._go(r, trigger, now, out, reason)

    def __init__(
        self,
        identity: str,
        layout_hash: str,
        config: DecodeConfig | None = None,
        incarnation: int = 0,
        pullable_kv_shards: frozenset[int] = frozenset({1}),
        kv_checksum: bool = False,
    ) -> None:
        self.config = config or DecodeConfig()
        super().__init__(self.config.recently_finished)
        self.identity = identity  # our reply_to: P answers the socket this names
        self.layout_hash = layout_hash
        # The per-pool shard counts a READY may name: those our KV regroups from (P's tp sizes
        # that split our kv-heads evenly). Any other is refused before a pull.
        self.pullable_kv_shards = pullable_kv_shards
        # Verify every pull against READY's checksums, re-pull once on a mismatch; a READY
        # without them is refused (P and D must agree: both run kv checksums, or neither).
        self.kv_checksum = kv_checksum
        # Ours, new on every process start (0: not said): P frees a restarted D's old rooms.
        self.incarnation = incarnation
        self.peers: dict[str, _Peer] = {}
        self._resolved: dict[str, str] = {}  # bootstrap_addr -> peer addr (cache)
        self._resolving: dict[str, list[int]] = {}  # bootstrap_addr -> rooms waiting
        self._hb_timers: DeadlineHeap[str] = DeadlineHeap()
        self._live_timers: DeadlineHeap[str] = DeadlineHeap()
        # Each waiting state's window, as the table names it (a column, not Python): a name
        # that is no config field fails here, at construction.
        unknown = [t.window for t in self.table.timeouts.values()
                   if not _is_seconds(getattr(self.config, t.window, None))]
        if unknown:
            raise TypeError(f"kv_receiver [timeouts] name no DecodeConfig window: {unknown}")
        self._state_timeout: dict[str, float] = {
            s: float(getattr(self.config, t.window)) for s, t in self.table.timeouts.items()
        }

    # -- entry point --------------------------------------------------------------------------

    def handle(self, event: ev.DecodeEvent, now: float) -> list[fx.DecodeEffect]:
        """The one entry point: ``event`` at time ``now``; the effects to carry out, in order."""
        out: list[fx.DecodeEffect] = []
        self.stats.events += 1
        self._fire_due(now, out)
        match event:
            case ev.MessageReceived():
                self._on_message(event, now, out)
            case ev.DecodeRequestAccepted():
                self._on_request(event, now, out)
            case ev.PeerResolved():
                self._on_peer_resolved(event, now, out)
            case ev.PeerResolutionFailed():
                self._on_peer_unresolved(event, now, out)
            case ev.BlocksAllocated():
                self._on_blocks(event, now, out)
            case ev.PullSucceeded():
                self._on_pull_succeeded(event, now, out)
            case ev.PullFailed():
                self._on_pull_failed(event, now, out)
            case ev.ChecksumMismatched():
                self._on_checksum_mismatched(event, now, out)
            case ev.Aborted():
                self._on_aborted(event, now, out)
            case ev.StepStarted():
                self.stats.busy_steps += 1
                repeat = [
                    fx.SendMessage(addr, Heartbeat(peer.hb_seq, batch, self.incarnation))
                    for addr, peer in sorted(self.peers.items())
                    for batch in _batches(sorted(peer.rooms))
                ]
                out.append(fx.RepeatWhileBusy(tuple(repeat), self.config.heartbeat_interval))
            case ev.LegRefused():
                self.stats.refusals_told += len(event.prefills)
                out.extend(fx.SendMessage(peer, Abort(event.room, event.reason))
                           for peer in event.prefills)
            case ev.TimeAdvanced() | ev.StepEnded():
                pass  # what is due fired above
            case _:  # an embedder without a type checker
                raise LocalProtocolError(f"DecodeEndpoint cannot handle {type(event).__name__}")
        return out

    def next_deadline(self) -> float | None:
        found = [
            d
            for d in (
                self._room_timers.next_deadline(),
                self._hb_timers.next_deadline(),
                self._live_timers.next_deadline(),
            )
            if d is not None
        ]
        return min(found) if found else None

    def room_deadline(self, room: int) -> float | None:
        return self._room_timers.get(room)

    # -- stepping with per-state deadlines -----------------------------------------------------

    def _go(
        self,
        r: _ReceiverRoom,
        trigger: str,
        now: float,
        out: list[_Fx],
        reason: str = "",
        status: int = 0,
    ) -> None:
        before = r.state
        self._step(r, trigger, now, out, self._cause(trigger, reason, status))
        if r.state != before and r.room in self.rooms:
            self._room_timers.set(r.room, now + self._state_timeout[r.state])

    # -- local events -------------------------------------------------------------------------

    def _on_request(self, e: ev.DecodeRequestAccepted, now: float, out: list[_Fx]) -> None:
        if e.room in self.rooms:
            self.stats.rejected += 1
            out.append(fx.RejectRequest(e.room, f"bootstrap_room {e.room} is already live here"))
            return
        r = _ReceiverRoom(e.room, e.bootstrap_addr, e.n_pages)
        self._admit(r)
        self._go(r, _T.RequestAccepted, now, out)
        if r.peer is not None:  # P was in the resolution cache: no lookup needed
            self._go(r, _T.PeerResolved, now, out)

    def _on_peer_resolved(self, e: ev.PeerResolved, now: float, out: list[_Fx]) -> None:
        previous = self._resolved.get(e.bootstrap_addr)
        self._resolved[e.bootstrap_addr] = e.peer
        if previous is not None and previous != e.peer:
            self._forget_if_idle(previous, out)  # P moved: its old address is of no use now
        peer = self.peers.get(e.peer)
        if peer is None:
            self.peers[e.peer] = _Peer(e.peer, e.transfer_addr, e.layout_hash)
        else:
            peer.transfer_addr = e.transfer_addr
            peer.layout_hash = e.layout_hash
        for room in self._resolving.pop(e.bootstrap_addr, ()):
            r = self.rooms.get(room)
            if r is not None and r.state == _S.RESOLVING:
                r.peer = e.peer
                self._go(r, _T.PeerResolved, now, out)

    def _on_peer_unresolved(self, e: ev.PeerResolutionFailed, now: float, out: list[_Fx]) -> None:
        reason = f"cannot resolve prefill at {e.bootstrap_addr}: {e.reason}"
        for room in self._resolving.pop(e.bootstrap_addr, ()):
            r = self.rooms.get(room)
            if r is not None and r.state == _S.RESOLVING:
                self._go(r, _T.PeerUnresolved, now, out, reason)

    def _on_blocks(self, e: ev.BlocksAllocated, now: float, out: list[_Fx]) -> None:
        r = self._live_local(e.room, _T.BlocksAllocated)
        if r is not None:
            if not 0 <= e.skip_pages < r.n_pages:
                raise LocalProtocolError(
                    f"room {e.room}: {e.skip_pages} cached pages of {r.n_pages} (at least the "
                    "last prompt page comes from P)"
                )
            r.skip = e.skip_pages
            self._go(r, _T.BlocksAllocated, now, out)

    def _on_pull_succeeded(self, e: ev.PullSucceeded, now: float, out: list[_Fx]) -> None:
        r = self._live_local(e.room, _T.PullSucceeded)
        if r is None:
            return
        self._go(r, _T.PullSucceeded, now, out)
        # A part landed (STREAMING -> WAITING_FOR_READY): what P sent meanwhile, in page
        # order, until one of them starts the next pull (or fails the room); one that starts
        # further on stays kept.
        while r.state == _S.WAITING_FOR_READY and r.room in self.rooms:
            nxt = next((m for m in r.deferred if _starts(r, m) == r.skip), None)
            if nxt is None:
                return
            r.deferred.remove(nxt)
            self._on_room_message(r, self.peers.get(r.peer or ""), nxt, now, out)

    def _on_pull_failed(self, e: ev.PullFailed, now: float, out: list[_Fx]) -> None:
        r = self._live_local(e.room, _T.PullFailed)
        if r is not None:
            self._go(r, _T.PullFailed, now, out, f"KV transfer failed: {e.reason}")

    def _on_checksum_mismatched(
        self, e: ev.ChecksumMismatched, now: float, out: list[_Fx]
    ) -> None:
        r = self._live_local(e.room, _T.ChecksumMismatched)
        if r is not None and not (r.kv_checksums or (r.part is not None and r.part.kv_checksums)):
            raise LocalProtocolError(
                f"ChecksumMismatched for room {e.room}, whose pull had no checksums to verify"
            )
        self.stats.kv_checksum_mismatches += 1  # every one, also those of a room already over
        if r is None:
            return
        again = " (and on the re-pull)" if r.state == _S.REPULLING else ""
        self._go(r, _T.ChecksumMismatched, now, out, f"KV corrupted in flight{again}: {e.reason}")

    def _on_aborted(self, e: ev.Aborted, now: float, out: list[_Fx]) -> None:
        r = self.rooms.get(e.room)
        if r is None:
            self.stats.unknown_room += 1
        elif self._has_row(r, _T.Aborted):
            self._go(r, _T.Aborted, now, out, e.reason)
        else:
            self.stats.late += 1

    def _live_local(self, room: int, what: str) -> _ReceiverRoom | None:
        r = self.rooms.get(room)
        if r is None:
            if room in self._finished:
                self.stats.late += 1
                return None
            raise LocalProtocolError(f"{what} for room {room}, which was never accepted here")
        return r

    # -- messages from P ----------------------------------------------------------------------

    def _on_message(self, e: ev.MessageReceived, now: float, out: list[_Fx]) -> None:
        self.stats.messages += 1
        m = e.message
        peer = self.peers.get(e.peer)
        if peer is not None:
            peer.last_heard = now
            peer.unanswered = 0
            if peer.rooms:
                self._live_timers.set(e.peer, now + self.config.peer_timeout)
        if isinstance(m, HeartbeatAck):
            if peer is not None:
                self._on_ack(peer, m, now, out)
            else:
                self.stats.unknown_room += 1
            return
        if isinstance(m, RecvInit | Done | Heartbeat):
            self.stats.unexpected += 1
            return
        r = self.rooms.get(m.room)
        if r is None:
            if m.room in self._finished:
                self.stats.late += 1
            else:
                self.stats.unknown_room += 1
            return
        if r.peer != e.peer:
            self.stats.foreign_peer += 1
            return
        self._on_room_message(r, peer, m, now, out)

    def _on_room_message(
        self, r: _ReceiverRoom, peer: _Peer | None, m: KVPart | Ready | Abort, now: float,
        out: list[_Fx],
    ) -> None:
        """P's message for the room ``r`` (from the room's P): checked, then stepped. What
        can be judged alone is judged on arrival; where its pages start, only when it is
        handled (a part in flight may end where they do: STREAMING defers the message)."""
        if isinstance(m, Abort):
            self._remote(r, _T.AbortReceived, now, out, f"prefill aborted the room: {m.reason}")
            return
        trigger = _T.PartReceived if isinstance(m, KVPart) else _T.ReadyReceived
        problem = self._check_offer(m)
        # Where the next offer must start: after our pages, and after the part in flight.
        expected = r.skip if r.part is None else r.part.first_page + r.part.n_pages
        start = _starts(r, m)
        if not problem and start < expected:
            problem = (f"P offers pages from {start}, we hold or pull up to {expected}; "
                       "refusing to pull")
        if not problem and start == expected and r.state != _S.STREAMING:
            problem = self._check_pages(r, m)
        if problem:
            self._violated(r, now, out, problem)
            return
        if start > expected:
            trigger = _T.OfferAheadReceived
        if trigger == _T.OfferAheadReceived or r.state == _S.STREAMING:
            if m in r.deferred:  # P's duplicate of a message already kept
                self.stats.duplicates += 1
                return
            r.incoming = m  # DeferMessage keeps it
            self._remote(r, trigger, now, out, "")
            return
        if peer is not None:
            self._note_incarnation(peer, m.incarnation, now, out)
            if m.transfer_addr:
                peer.transfer_addr = m.transfer_addr
        if r.state == _S.WAITING_FOR_READY:
            # Where this pull comes from (a P restarted after it lost the room with it).
            r.incarnation = m.incarnation
            r.transfer_addr = m.transfer_addr
            r.kv_shards = m.kv_shards
            if isinstance(m, KVPart):
                r.part = m
            else:
                r.uuid = m.uuid
                r.first_token = m.first_token
                r.first_logprob = m.first_logprob
                r.first_top = m.first_top
                if self.kv_checksum:  # else READY's are not ours to verify (_check_offer)
                    r.kv_checksums, r.repull_uuid = m.kv_checksums, m.repull_uuid
        self._remote(r, trigger, now, out, "")

    def _check_offer(self, m: KVPart | Ready) -> str:
        """What is wrong with P's offer of KV (a part or READY) whatever the room's state."""
        name = "KV_PART" if isinstance(m, KVPart) else "READY"
        if m.layout_hash != self.layout_hash:
            return f"KV layout mismatch (P {m.layout_hash}, D {self.layout_hash}); refusing to pull"
        if m.kv_shards not in self.pullable_kv_shards:
            return (f"P registered its KV as {m.kv_shards} kv-head shards; this D regroups "
                    f"only {sorted(self.pullable_kv_shards)}; refusing to pull")
        if m.transfer_addr and not _HOST_PORT.fullmatch(m.transfer_addr):
            return f"{name} names an unusable transfer address {m.transfer_addr[:80]!r}"
        if self.kv_checksum:
            # A D that verifies never takes unverifiable KV for verified: P without checksums is
            # refused (the adapter refuses such a P earlier, from its registry record, naming
            # the flag). A D that does not verify ignores the checksums: P's cost, no harm. A
            # part has no spare: a corrupted one is not pulled again.
            spare_missing = isinstance(m, Ready) and m.repull_uuid in (0, m.uuid)
            if not m.kv_checksums or spare_missing:
                return (f"{name} carries no KV checksums (or no spare registration), and this D "
                        "verifies every pull: P and D must both run KV checksums; refusing to "
                        "pull")
            if len(m.kv_checksums) % m.kv_shards:
                return (f"{name} carries {len(m.kv_checksums)} KV checksums for {m.kv_shards} "
                        "shards per pool; refusing to pull")
        return ""

    def _check_pages(self, r: _ReceiverRoom, m: KVPart | Ready) -> str:
        """Whether P's offer starts where the room's pages end (our prefix cache's, then the
        parts pulled) and, for a part, leaves the last page to READY."""
        if isinstance(m, Ready):
            if m.n_pages != r.n_pages - r.skip:
                return (f"P offers {m.n_pages} pages, we wait for {r.n_pages - r.skip}; "
                        "refusing to pull")
        elif m.first_page != r.skip or not 0 < m.n_pages < r.n_pages - r.skip:
            return (f"P offers pages {m.first_page}..{m.first_page + m.n_pages} as a part; we "
                    f"hold {r.skip} of {r.n_pages} and the last comes with READY; refusing to "
                    "pull")
        return ""

    def _on_ack(self, peer: _Peer, m: HeartbeatAck, now: float, out: list[_Fx]) -> None:
        self._note_incarnation(peer, m.incarnation, now, out)
        for room in m.failed_rooms:
            r = self.rooms.get(room)
            if r is not None and r.peer == peer.addr:
                self._remote(r, _T.AbortReceived, now, out, "prefill reports the room failed")
        for room in m.unknown_rooms:
            r = self.rooms.get(room)
            # Only a room whose hello went out before this heartbeat: P should know it by now.
            if (
                r is not None
                and r.peer == peer.addr
                and r.state == _S.WAITING_FOR_READY
                and 0 <= r.hello_seq < m.seq
            ):
                reason = f"prefill {peer.addr} does not know the room (restarted or lost our hello)"
                self._go(r, _T.PeerLost, now, out, reason)

    def _note_incarnation(self, peer: _Peer, incarnation: int, now: float, out: list[_Fx]) -> None:
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
        self.stats.peer_restarts += 1
        reason = f"prefill {peer.addr} restarted (its rooms are gone)"
        for room in sorted(peer.rooms):
            r = self.rooms.get(room)
            if r is not None and r.incarnation not in (0, incarnation):
                self._go(r, _T.PeerLost, now, out, reason)
        out.append(fx.ForgetTransfer(peer.transfer_addr))

    # -- timers -------------------------------------------------------------------------------

    def _fire_due(self, now: float, out: list[_Fx]) -> None:
        if not (
            self._room_timers.maybe_due(now)
            or self._live_timers.maybe_due(now)
            or self._hb_timers.maybe_due(now)
        ):
            return
        for room in self._room_timers.pop_due(now):
            r = self.rooms[room]
            # The state's own status: a queue timeout is overload (503, retry elsewhere), the
            # others are upstream timeouts (504).
            timeout = self.table.timeouts[r.state]
            why = timeout.message(self._state_timeout[r.state], r.bootstrap_addr)
            self._go(r, _T.TimedOut, now, out, why, timeout.status)
        for addr in self._live_timers.pop_due(now):
            peer = self.peers.get(addr)
            if peer is None or not peer.rooms:
                continue
            if peer.unanswered >= self.config.heartbeat_misses:
                silent = now - peer.last_heard
                reason = (
                    f"prefill {addr} silent for {silent:.1f} s "
                    f"({peer.unanswered} heartbeats unanswered)"
                )
                self._lose_peer(peer, now, out, reason)
            else:  # we were not asking (stalled, or just started): ask, then judge
                self._live_timers.set(addr, now + self.config.heartbeat_interval)
        for addr in self._hb_timers.pop_due(now):
            peer = self.peers.get(addr)
            if peer is not None and peer.rooms:
                peer.unanswered += 1
                for batch in _batches(sorted(peer.rooms)):
                    peer.hb_seq += 1
                    heartbeat = Heartbeat(peer.hb_seq, batch, self.incarnation)
                    out.append(fx.SendMessage(addr, heartbeat))
                self._hb_timers.set(addr, now + self.config.heartbeat_interval)

    def _lose_peer(self, peer: _Peer, now: float, out: list[_Fx], reason: str) -> None:
        for addr in [a for a, p in self._resolved.items() if p == peer.addr]:
            del self._resolved[addr]  # look P up again next time: it may have moved
        peer.incarnation = None
        for room in sorted(peer.rooms):
            r = self.rooms.get(room)
            if r is not None:
                self._go(r, _T.PeerLost, now, out, reason)
        self._forget_if_idle(peer.addr, out)

    def _forget_if_idle(self, addr: str, out: list[_Fx]) -> None:
        """Drop what we keep for a P no room needs (rooms mid-pull still need it for DONE)."""
        peer = self.peers.get(addr)
        if peer is None or peer.rooms or addr in self._resolved.values():
            return
        del self.peers[addr]
        self._hb_timers.cancel(addr)
        self._live_timers.cancel(addr)
        out.append(fx.ForgetPeer(addr))

    # -- effects (names from the tables) ------------------------------------------------------

    def _fx_ResolvePeer(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        addr = r.bootstrap_addr
        peer = self._resolved.get(addr)
        if peer is not None:
            r.peer = peer  # cached: _on_request steps PeerResolved right after this row
            return
        waiting = self._resolving.get(addr)
        if waiting is None:
            self._resolving[addr] = [r.room]
            out.append(fx.ResolvePeer(addr))
        else:
            waiting.append(r.room)

    def _fx_JoinHeartbeats(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        peer = self.peers[r.peer]
        if not peer.rooms:
            # First room for an idle P: its silence is measured from now, not from long ago.
            peer.last_heard = now
            peer.unanswered = 0
            self._live_timers.set(peer.addr, now + self.config.peer_timeout)
            self._hb_timers.set(peer.addr, now + self.config.heartbeat_interval)
        peer.rooms.add(r.room)

    def _fx_LeaveHeartbeats(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        if r.peer is not None:
            peer = self.peers.get(r.peer)
            if peer is not None:
                peer.rooms.discard(r.room)

    def _fx_AllocateBlocks(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.AllocateBlocks(r.room, r.n_pages))

    def _fx_CancelAllocation(
        self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause
    ) -> None:
        out.append(fx.CancelAllocation(r.room))

    def _fx_SendRecvInit(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        r.hello_seq = self.peers[r.peer].hb_seq
        msg = RecvInit(r.room, self.identity, r.n_pages, self.layout_hash, self.incarnation,
                       r.skip)
        out.append(fx.SendMessage(r.peer, msg))

    def _fx_StartPull(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(self._pull(r, r.uuid))

    def _fx_StartPartPull(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None and r.part is not None
        transfer_addr = r.transfer_addr or self.peers[r.peer].transfer_addr
        sums = r.part.kv_checksums if self.kv_checksum else ()
        out.append(fx.StartPull(r.room, r.peer, transfer_addr, r.part.uuid, r.part.n_pages,
                                r.part.first_page, r.part.kv_shards, sums, part=True))

    def _fx_DeferMessage(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.incoming is not None
        r.deferred.append(r.incoming)
        r.incoming = None

    def _fx_KeepPart(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.part is not None
        r.skip = r.part.first_page + r.part.n_pages
        r.part = None

    def _fx_StartRepull(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        # The same pull, of the spare registration: the first one was consumed by the pull
        # that brought the corrupted bytes (registrations are one-shot).
        assert r.repull_uuid
        self.stats.kv_checksum_repulls += 1
        out.append(self._pull(r, r.repull_uuid, repull=True))

    def _pull(self, r: _ReceiverRoom, uuid: int, repull: bool = False) -> fx.StartPull:
        assert r.peer is not None
        transfer_addr = r.transfer_addr or self.peers[r.peer].transfer_addr
        return fx.StartPull(r.room, r.peer, transfer_addr, uuid, r.n_pages - r.skip, r.skip,
                            r.kv_shards, r.kv_checksums, repull)

    def _fx_SendDone(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        out.append(fx.SendMessage(r.peer, Done(r.room, True)))

    def _fx_SendDoneFailed(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None
        out.append(fx.SendMessage(r.peer, Done(r.room, False, why.reason[:512])))

    def _fx_SendAbort(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        if r.peer is not None:
            out.append(fx.SendMessage(r.peer, Abort(r.room, why.reason[:512])))

    def _fx_ReleaseBlocks(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.ReleaseBlocks(r.room))

    def _fx_CompleteTransfer(
        self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause
    ) -> None:
        out.append(fx.CompleteTransfer(r.room, r.first_token, r.first_logprob, r.first_top))

    def _fx_FailRequest(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(fx.FailRequest(r.room, why.reason, why.status))

    def _fx_CountLate(self, r: _ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        self.stats.late += 1


def _starts(r: _ReceiverRoom, m: KVPart | Ready) -> int:
    """The first prompt page P's offer carries (READY: the pages after its ``n_pages`` from the
    prompt's end)."""
    return m.first_page if isinstance(m, KVPart) else r.n_pages - m.n_pages


def _is_seconds(value: object) -> bool:
    """A window's value: a number of seconds (an int is fine, a bool or a missing field not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _batches(rooms: list[int]) -> list[tuple[int, ...]]:
    """A peer's rooms in heartbeat-sized batches (none without rooms)."""
    return [tuple(rooms[i : i + MAX_ROOMS_PER_HEARTBEAT])
            for i in range(0, len(rooms), MAX_ROOMS_PER_HEARTBEAT)]
