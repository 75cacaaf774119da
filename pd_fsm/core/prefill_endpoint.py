"""PrefillEndpoint: P's side of every room (tables kv_sender + kv_hold_lease).

One entry point, ``handle(event, now) -> list[effect]``. Due lease expiries fire first, then the
event. Messages from D are validated here (layout hash, page count, which D owns the room); a
message the tables have no row for fails that room through ``ProtocolViolated`` and the endpoint
keeps serving. What the endpoint keeps is split by concern into the parts it holds: each room's
KV hold lease (``prefill_lease.Leases``, table kv_hold_lease), the KV registered for D and the
READY and KV_PART that offer it (``prefill_kv.Registrations``), and what the rows say to D and
answer our leg (``prefill_outbox``).
"""

from __future__ import annotations

import random
from typing import ClassVar

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import LeaseConfig
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.messages import Abort, Done, Heartbeat, HeartbeatAck, RecvInit
from pd_fsm.core.prefill_kv import Offering, Registrations
from pd_fsm.core.prefill_lease import Leases
from pd_fsm.core.prefill_outbox import SenderOutbox
from pd_fsm.core.prefill_room import SenderRoom
from pd_fsm.core.rooms import Cause, RoomMachines
from pd_fsm.core.tables import KV_HOLD_LEASE, KV_SENDER

# The tables' names as attributes (tables.Names): never spelled as strings here.
_T = KV_SENDER.T
_LS, _LT = KV_HOLD_LEASE.S, KV_HOLD_LEASE.T

_Fx = fx.PrefillEffect

_LEASE = KV_HOLD_LEASE.transitions


class PrefillEndpoint(RoomMachines[SenderRoom, fx.PrefillEffect]):
    table = KV_SENDER
    peer_role = "D"
    effect_parts = (Registrations, SenderOutbox)
    # Who runs each room's kv_hold_lease (the simulator plants a bug through it).
    leases_type: ClassVar[type[Leases]] = Leases

    def __init__(
        self,
        layout_hash: str,
        rng: random.Random,
        config: LeaseConfig | None = None,
        incarnation: int | None = None,
        transfer_addr: str = "",
        kv_shards: int = 1,
        kv_checksum: bool = False,
    ) -> None:
        self.config = config or LeaseConfig()
        super().__init__(self.config.recently_finished)
        self.layout_hash = layout_hash
        # Changes on every process start; D reads a change as "P restarted, its rooms are gone".
        self.incarnation = rng.getrandbits(63) if incarnation is None else incarnation
        # Named in every READY: D pulls from here, not from a route it cached before we restarted.
        self.transfer_addr = transfer_addr
        # Named in every READY: how many arrays per pool a registration holds (our tp size).
        self.kv_shards = kv_shards
        # READY names the checksums of what we registered (the embedder computes them after its
        # gather: KVChecksummed) and a spare registration of it, for D's one re-pull.
        self.kv_checksum = kv_checksum
        self._d_incarnations: dict[str, int] = {}  # D identity -> its current process
        self.leases = self.leases_type(self.config, self._room_timers, self._on_lease_expired)
        offering = Offering(layout_hash, self.incarnation, transfer_addr, kv_shards)
        self.registrations = Registrations(offering, rng, kv_checksum, self.stats)
        self.outbox = SenderOutbox()
        self._bind_effects(self.registrations, self.outbox)

    # -- entry point --------------------------------------------------------------------------

    def handle(self, event: ev.PrefillEvent, now: float) -> list[fx.PrefillEffect]:
        """The one entry point: ``event`` at time ``now``; the effects to carry out, in order."""
        out: list[fx.PrefillEffect] = []
        self.stats.events += 1
        if self._room_timers.maybe_due(now):
            for room in self._room_timers.pop_due(now):
                self.leases.step(self.rooms[room], _LT.Expired, now, out)
        match event:
            case ev.MessageReceived():
                self._on_message(event, now, out)
            case ev.PrefillRequestAccepted():
                self._on_request(event, now, out)
            case ev.PrefillFinished():
                self._on_prefill_finished(event, now, out)
            case ev.PartPrefilled():
                self._on_part_prefilled(event, now, out)
            case ev.PrefillFailed():
                self._on_prefill_failed(event, now, out)
            case ev.KVChecksummed():
                self.registrations.on_checksummed(self.rooms.get(event.room), event, out)
            case ev.Aborted():
                self._on_aborted(event, now, out)
            case ev.StepStarted():
                self.stats.busy_steps += 1
                out.append(fx.AckWhileBusy(self.incarnation))
            case ev.TimeAdvanced() | ev.StepEnded():
                pass  # leases that are due were expired above
            case _:  # an embedder without a type checker
                raise LocalProtocolError(f"PrefillEndpoint cannot handle {type(event).__name__}")
        return out

    def lease_expiry(self, room: int) -> float | None:
        r = self.rooms.get(room)
        return None if r is None or r.lease != _LS.LEASED else r.expires_at

    # -- local events -------------------------------------------------------------------------

    def _on_request(self, e: ev.PrefillRequestAccepted, now: float, out: list[_Fx]) -> None:
        r = self.rooms.get(e.room)
        if r is not None and (r.has_request or not self._has_row(r, _T.RequestAccepted)):
            self.stats.rejected += 1
            out.append(fx.RejectRequest(e.room, f"bootstrap_room {e.room} is already live here"))
            return
        if r is None:
            r = SenderRoom(e.room)
            self._admit(r)
        r.has_request = True
        # REFUSED (D aborted the room first): the row fails our leg at once, with D's reason:
        # 502, the other half of the request failed.
        cause = Cause(_T.RequestAccepted, _NO_REASON)
        if r.refusal:
            cause = Cause(_T.RequestAccepted,
                          f"D aborted the room before this leg arrived: {r.refusal}", 502)
        self._step(r, _T.RequestAccepted, now, out, cause)

    def _on_prefill_finished(self, e: ev.PrefillFinished, now: float, out: list[_Fx]) -> None:
        r = self._live_local(e.room, _T.PrefillFinished)
        if r is None:
            return
        r.first_token = e.first_token
        r.first_logprob = e.first_logprob
        r.first_top = e.first_top
        r.n_pages = e.n_pages
        if r.d_pages >= 0 and r.d_pages != e.n_pages:
            self._violated(
                r, now, out, f"D reserved {r.d_pages} pages, the prompt needs {e.n_pages}"
            )
            return
        self._step(r, _T.PrefillFinished, now, out, Cause(_T.PrefillFinished, _NO_REASON))

    def _on_part_prefilled(self, e: ev.PartPrefilled, now: float, out: list[_Fx]) -> None:
        r = self._live_local(e.room, _T.PartPrefilled)
        if r is None:
            return
        r.written = max(r.written, e.pages)
        # The last prompt page always goes with READY (it carries the first token's row).
        end = e.pages if r.d_pages < 0 else min(e.pages, r.d_pages - 1)
        if end <= r.sent:
            return  # no whole page written past what D holds or was sent: no part yet
        r.part_end = end
        self._step(r, _T.PartPrefilled, now, out, Cause(_T.PartPrefilled, _NO_REASON))

    def _on_prefill_failed(self, e: ev.PrefillFailed, now: float, out: list[_Fx]) -> None:
        r = self._live_local(e.room, _T.PrefillFailed)
        if r is not None:
            self._step(r, _T.PrefillFailed, now, out, self._cause(_T.PrefillFailed, e.reason))

    def _on_aborted(self, e: ev.Aborted, now: float, out: list[_Fx]) -> None:
        r = self.rooms.get(e.room)
        if r is None:
            self.stats.unknown_room += 1  # /abort_request for a room we do not hold: nothing to do
            return
        if self._has_row(r, _T.Aborted):
            # Our own client's abort is not a server error (the table's status: 499, as on D).
            self._step(r, _T.Aborted, now, out, self._cause(_T.Aborted, e.reason))
        else:
            self.stats.late += 1

    def _live_local(self, room: int, what: str) -> SenderRoom | None:
        r = self.rooms.get(room)
        if r is None:
            if room in self._finished:
                self.stats.late += 1  # failed (lease, abort) while our forward was in flight
                return None
            raise LocalProtocolError(f"{what} for room {room}, which was never accepted here")
        return r

    # -- messages from D ----------------------------------------------------------------------

    def _on_message(self, e: ev.MessageReceived, now: float, out: list[fx.PrefillEffect]) -> None:
        self.stats.messages += 1
        m = e.message
        match m:
            case Heartbeat():
                self._on_heartbeat(e.peer, m, now, out)
            case RecvInit():
                self._on_recv_init(e.peer, m, now, out)
            case Done():
                self._on_done(e.peer, m, now, out)
            case Abort():
                self._on_abort(e.peer, m, now, out)
            case _:
                self.stats.unexpected += 1  # READY / HB_ACK: only D receives those

    def _room_for(self, peer: str, room: int) -> SenderRoom | None:
        """The live room, if ``peer`` may speak for it; counts the reason otherwise."""
        r = self.rooms.get(room)
        if r is None:
            if room in self._finished:
                self.stats.late += 1
            else:
                self.stats.unknown_room += 1
            return None
        if r.peer is not None and r.peer != peer:
            self.stats.foreign_peer += 1
            return None
        return r

    def _on_recv_init(self, peer: str, m: RecvInit, now: float, out: list[_Fx]) -> None:
        r = self.rooms.get(m.room)
        if r is None:
            if m.room in self._finished:
                self.stats.late += 1
                out.append(fx.SendMessage(peer, Abort(m.room, "room already finished on P")))
                return
            r = SenderRoom(m.room)
            self._admit(r)
        elif r.peer is not None and r.peer != peer:
            self.stats.foreign_peer += 1
            return
        self._note_d_incarnation(peer, m.incarnation, now, out)
        # The first hello sets the room's terms; D's retries of it change nothing (the table's
        # CountDuplicate rows): a retry saying other pages must neither move what is sent nor
        # start a stream (found by tests/property/test_core_reference.py).
        first = r.peer is None
        if first:
            r.peer = peer  # BindPeer reads it; set first so SendAbort below reaches this D
            r.d_incarnation = m.incarnation
        if m.layout_hash != self.layout_hash:
            self._violated(
                r, now, out, f"KV layout mismatch (D {m.layout_hash}, P {self.layout_hash})"
            )
            return
        if r.n_pages >= 0 and m.n_pages != r.n_pages:
            self._violated(
                r, now, out, f"D reserved {m.n_pages} pages, the prompt needs {r.n_pages}"
            )
            return
        if m.skip_pages >= max(m.n_pages, 1):
            self._violated(r, now, out, f"D holds {m.skip_pages} of {m.n_pages} pages: the "
                                        "last prompt page always comes from P")
            return
        if first:
            r.d_pages, r.d_skip, r.sent = m.n_pages, m.skip_pages, m.skip_pages
        trigger = _T.PartialRecvInitReceived if m.skip_pages else _T.RecvInitReceived
        self._remote(r, trigger, now, out, "")
        if (first and r.room in self.rooms and r.written > r.sent
                and self._has_row(r, _T.PartPrefilled)):
            # D's hello came after some of our chunks ran (it waited for a forward): what
            # they wrote goes to D now, not with the next chunk.
            self._on_part_prefilled(ev.PartPrefilled(r.room, r.written), now, out)

    def _on_done(self, peer: str, m: Done, now: float, out: list[_Fx]) -> None:
        r = self._room_for(peer, m.room)
        if r is None:
            return
        if r.peer is None:
            # No D has sent RECV_INIT for this room, so none can have pulled it: this DONE is
            # not from the room's peer. Counted and dropped; it must not fail (as a protocol
            # violation) a room that its real D has yet to claim.
            self.stats.foreign_peer += 1
            return
        trigger = _T.DoneReceived if m.ok else _T.DoneFailedReceived
        self._remote(r, trigger, now, out, m.reason or "D reported a failed transfer")

    def _on_abort(self, peer: str, m: Abort, now: float, out: list[_Fx]) -> None:
        # Unlike DONE, an ABORT counts on a room no D has claimed yet: D aborts a room it gave up
        # on while still waiting for pages, before its RECV_INIT (kv_receiver ALLOCATING rows),
        # so that P frees the KV now rather than at lease expiry. Once bound, only that D.
        if m.room not in self.rooms and m.room not in self._finished:
            # Before our own leg: D refused its leg (a null bootstrap_port) or gave up on it.
            # Remember the room (REFUSED, for a lease window) so our leg fails when it arrives
            # instead of waiting a whole lease for a RECV_INIT that will never come.
            fresh = SenderRoom(m.room)
            fresh.refusal = m.reason or "aborted"
            self._admit(fresh)
            self._remote(fresh, _T.AbortReceived, now, out, f"D aborted: {m.reason}")
            return
        r = self._room_for(peer, m.room)
        if r is not None:
            self._remote(r, _T.AbortReceived, now, out, f"D aborted: {m.reason}")

    def _note_d_incarnation(self, peer: str, incarnation: int, now: float, out: list[_Fx]) -> None:
        """A D that restarted keeps its identity (the same instance id, so the same reply_to)
        but names a new incarnation. Rooms its previous process claimed will never be pulled or
        heartbeated again: free their KV now rather than at lease expiry. A scan of the live
        rooms, paid once per D restart."""
        if incarnation == 0:
            return
        previous = self._d_incarnations.get(peer)
        self._d_incarnations[peer] = incarnation
        if previous is None or previous == incarnation:
            return
        self.stats.peer_restarts += 1
        gone = [
            r for r in self.rooms.values()
            if r.peer == peer and r.d_incarnation not in (0, incarnation)
        ]
        for r in gone:
            self._remote(r, _T.AbortReceived, now, out, f"decode {peer} restarted (room gone)")

    def _on_heartbeat(self, peer: str, m: Heartbeat, now: float, out: list[_Fx]) -> None:
        self._note_d_incarnation(peer, m.incarnation, now, out)
        failed: list[int] = []
        unknown: list[int] = []
        rooms, finished = self.rooms, self._finished
        for room in m.rooms:
            r = rooms.get(room)
            if r is None:
                if room in finished:
                    if finished[room] is not KVPoll.Success:
                        failed.append(room)
                else:
                    unknown.append(room)  # D can be ahead of our own leg; D decides what it means
                continue
            if r.peer is not None and r.peer != peer:
                self.stats.foreign_peer += 1
                continue
            if (r.lease, _LT.HeartbeatReceived) in _LEASE:  # a heartbeat extends a held lease
                self.leases.step(r, _LT.HeartbeatReceived, now, out)
        ack = HeartbeatAck(self.incarnation, m.seq, tuple(failed), tuple(unknown))
        out.append(fx.SendMessage(peer, ack))

    # -- the lease ----------------------------------------------------------------------------

    def _on_lease_expired(self, r: SenderRoom, now: float, out: list[_Fx], why: str) -> None:
        """kv_hold_lease's ExpireRoom: the room fails (its KV is freed without D)."""
        self.stats.lease_expired += 1
        # The status the table gives the trigger (504: a timeout waiting for D).
        self._step(r, _T.LeaseExpired, now, out, self._cause(_T.LeaseExpired, why))

    # -- effects (names from the tables; the others are the parts') ----------------------------

    def _fx_GrantLease(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        self.leases.step(r, _LT.Granted, now, out)  # SetExpiry

    def _fx_ReleaseLease(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        self.leases.step(r, _LT.Released, now, out)
        self._room_timers.cancel(r.room)


# A step caused by our own event, which carries no reason of its own: what a client would read.
_NO_REASON = "failed"
