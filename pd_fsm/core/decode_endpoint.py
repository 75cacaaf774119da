"""DecodeEndpoint: D's side of every room (table kv_receiver).

Rooms wait in per-state deadlines (resolve, queue, READY, transfer). The endpoint is the one entry
point and steps the rooms; what it keeps is split by concern into the parts it holds, which run
the table's other effects: P's addresses and liveness (``decode_peers.PeerTracker``: the lookup
cache, batched per-P heartbeats, PeerLost on silence or a new incarnation), P's offers of KV and
the pulls of them (``decode_pulls.Pulls``: checked, kept in page order, verified and re-pulled),
and the messages to P and orders to our scheduler that keep nothing (``decode_outbox``).
"""

from __future__ import annotations

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig
from pd_fsm.core.decode_outbox import ReceiverOutbox
from pd_fsm.core.decode_peers import Peer, PeerTracker
from pd_fsm.core.decode_pulls import Pulls
from pd_fsm.core.decode_room import ReceiverRoom
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.messages import (
    Abort,
    Done,
    Heartbeat,
    HeartbeatAck,
    KVPart,
    Ready,
    RecvInit,
)
from pd_fsm.core.rooms import Cause, RoomMachines
from pd_fsm.core.tables import KV_RECEIVER

# The table's names as attributes (tables.Names): never spelled as strings here.
_S, _T = KV_RECEIVER.S, KV_RECEIVER.T

_Fx = fx.DecodeEffect


class DecodeEndpoint(RoomMachines[ReceiverRoom, fx.DecodeEffect]):
    table = KV_RECEIVER
    peer_role = "P"
    effect_parts = (PeerTracker, Pulls, ReceiverOutbox)

    def _apply(
        self, r: ReceiverRoom, trigger: str, now: float, out: list[_Fx], reason: str
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
        self.tracker = PeerTracker(self.config, incarnation, self.rooms, self.stats, self._go,
                                   self._remote)
        self.peers: dict[str, Peer] = self.tracker.peers  # the P's we know, by address
        self.pulls = Pulls(layout_hash, pullable_kv_shards, kv_checksum, self.peers, self.stats)
        self.outbox = ReceiverOutbox(identity, layout_hash, incarnation, self.peers)
        self._bind_effects(self.tracker, self.pulls, self.outbox)
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
                self.tracker.on_resolved(event, now, out)
            case ev.PeerResolutionFailed():
                self.tracker.on_unresolved(event, now, out)
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
                out.append(self.tracker.while_busy())
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
        found = [d for d in (self._room_timers.next_deadline(), self.tracker.next_deadline())
                 if d is not None]
        return min(found) if found else None

    def room_deadline(self, room: int) -> float | None:
        return self._room_timers.get(room)

    # -- stepping with per-state deadlines -----------------------------------------------------

    def _go(
        self,
        r: ReceiverRoom,
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

    def _fire_due(self, now: float, out: list[_Fx]) -> None:
        """The rooms whose state's deadline passed, then P's that are due (silence, heartbeats)."""
        if self._room_timers.maybe_due(now):
            for room in self._room_timers.pop_due(now):
                r = self.rooms[room]
                # The state's own status: a queue timeout is overload (503, retry elsewhere),
                # the others are upstream timeouts (504).
                timeout = self.table.timeouts[r.state]
                why = timeout.message(self._state_timeout[r.state], r.bootstrap_addr)
                self._go(r, _T.TimedOut, now, out, why, timeout.status)
        self.tracker.fire_due(now, out)

    # -- local events -------------------------------------------------------------------------

    def _on_request(self, e: ev.DecodeRequestAccepted, now: float, out: list[_Fx]) -> None:
        if e.room in self.rooms:
            self.stats.rejected += 1
            out.append(fx.RejectRequest(e.room, f"bootstrap_room {e.room} is already live here"))
            return
        r = ReceiverRoom(e.room, e.bootstrap_addr, e.n_pages)
        self._admit(r)
        self._go(r, _T.RequestAccepted, now, out)
        if r.peer is not None:  # P was in the resolution cache: no lookup needed
            self._go(r, _T.PeerResolved, now, out)

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
        # order, until one of them starts the next pull (or fails the room).
        while r.state == _S.WAITING_FOR_READY and r.room in self.rooms:
            nxt = self.pulls.next_deferred(r)
            if nxt is None:
                return
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

    def _live_local(self, room: int, what: str) -> ReceiverRoom | None:
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
        peer = self.tracker.heard(e.peer, now)
        if isinstance(m, HeartbeatAck):
            if peer is not None:
                self.tracker.on_ack(peer, m, now, out)
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
        self, r: ReceiverRoom, peer: Peer | None, m: KVPart | Ready | Abort, now: float,
        out: list[_Fx],
    ) -> None:
        """P's message for the room ``r`` (from the room's P): checked, then stepped (an offer
        that cannot be pulled yet is kept: ``Pulls.judge``)."""
        if isinstance(m, Abort):
            self._remote(r, _T.AbortReceived, now, out, f"prefill aborted the room: {m.reason}")
            return
        trigger, problem = self.pulls.judge(r, m)
        if problem:
            self._violated(r, now, out, problem)
            return
        if trigger == _T.OfferAheadReceived or r.state == _S.STREAMING:
            if self.pulls.defer(r, m):
                self._remote(r, trigger, now, out, "")
            return
        if peer is not None:
            self.tracker.on_offer(peer, m, now, out)
        self.pulls.take(r, m)
        self._remote(r, trigger, now, out, "")

    # -- effects (names from the tables; the others are the parts') ----------------------------

    def _fx_CountLate(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        self.stats.late += 1


def _is_seconds(value: object) -> bool:
    """A window's value: a number of seconds (an int is fine, a bool or a missing field not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)
