"""The KV P registers for D to pull, and the messages that offer it (KV_PART, READY), for
``PrefillEndpoint``.

Each registration has a fresh random uuid (unguessable, never another room's): the whole
prompt's (RegisterKV), or only the pages D lacks once D says which it holds (NarrowKV), and with
streamed KV one per part written while P still prefills (RegisterPart). With kv checksums on, a
spare registration is drawn beside each (D's one re-pull) and READY or a part waits for the
embedder's sums of what it registered (KVChecksummed, fed back in the same driver step). Runs
kv_sender's RegisterKV, NarrowKV, RegisterPart, SendPart, SendReady and ReleaseKV.
"""

from __future__ import annotations

import random

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.messages import KVPart, Ready
from pd_fsm.core.prefill_room import SenderRoom
from pd_fsm.core.rooms import Cause
from pd_fsm.core.stats import EndpointStats

_Fx = fx.PrefillEffect


@attrs.frozen
class Offering:
    """What every READY and KV_PART of this P names besides the room's own."""

    layout_hash: str
    incarnation: int  # of this process: D reads a change as "P restarted, its rooms are gone"
    transfer_addr: str  # D pulls from here, not from a route it cached before we restarted
    kv_shards: int  # arrays per pool a registration holds (our tp size)


class Registrations:
    def __init__(self, offering: Offering, rng: random.Random, kv_checksum: bool,
                 stats: EndpointStats) -> None:
        self._offering = offering
        self._rng = rng
        self._kv_checksum = kv_checksum
        self._stats = stats

    def on_checksummed(self, r: SenderRoom | None, e: ev.KVChecksummed, out: list[_Fx]) -> None:
        """The embedder's sums of a registration of room ``r`` (None: no longer live)."""
        if not self._kv_checksum:
            raise LocalProtocolError("KVChecksummed, but this endpoint runs no KV checksums")
        if r is not None and r.part_held is not None and r.part_held.uuid == e.uuid:
            part, r.part_held = r.part_held, None
            assert r.peer is not None  # a part is registered only for a bound D
            out.append(fx.SendMessage(r.peer, attrs.evolve(part, kv_checksums=e.checksums)))
            return
        if r is None or r.uuid != e.uuid:
            self._stats.late += 1  # the room ended, or NarrowKV replaced that registration
            return
        r.kv_checksums = e.checksums
        if r.ready_held:
            r.ready_held = False
            out.append(self._ready(r))

    def _new_registration(self, r: SenderRoom) -> int:
        # Fresh random uuids, not the room id: unguessable and never reused for another room.
        # (The spare is drawn only with checksums on, so without them the draws are as before.)
        r.uuid = uuid = self._rng.getrandbits(64)
        r.spare_uuid = self._rng.getrandbits(64) if self._kv_checksum else None
        r.kv_checksums = None  # the new registration's come with KVChecksummed
        return uuid

    def _ready(self, r: SenderRoom) -> fx.SendMessage:
        assert r.peer is not None and r.uuid is not None
        o = self._offering
        ready = Ready(
            r.room, r.uuid, r.first_token, r.n_pages - r.sent, o.layout_hash,
            r.first_logprob,
            o.incarnation, o.transfer_addr, r.first_top, o.kv_shards,
            r.kv_checksums or (), r.spare_uuid or 0,
        )
        return fx.SendMessage(r.peer, ready)

    # -- effects of kv_sender -----------------------------------------------------------------

    def _fx_RegisterKV(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        uuid = self._new_registration(r)
        out.append(fx.RegisterKV(r.room, uuid, r.sent, r.spare_uuid))

    def _fx_NarrowKV(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        old, old_spare = r.uuid, r.spare_uuid
        assert old is not None  # PREFILLED_NO_PEER: registered at PrefillFinished
        uuid = self._new_registration(r)
        out.append(fx.NarrowKV(r.room, uuid, r.d_skip, old, r.spare_uuid, old_spare))

    def _fx_RegisterPart(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        uuid = self._rng.getrandbits(64)
        r.parts.append(uuid)
        out.append(fx.RegisterPart(r.room, uuid, r.sent, r.part_end - r.sent, self._kv_checksum))

    def _fx_SendPart(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        assert r.peer is not None and r.parts  # RegisterPart ran first, in the same row
        o = self._offering
        part = KVPart(r.room, r.parts[-1], r.sent, r.part_end - r.sent, o.layout_hash,
                      o.incarnation, o.transfer_addr, o.kv_shards)
        r.sent = r.part_end
        if self._kv_checksum:
            # As READY: the part goes once the embedder has summed what it registered
            # (KVChecksummed for the part's uuid, fed back in this same driver step).
            r.part_held = part
            return
        out.append(fx.SendMessage(r.peer, part))

    def _fx_SendReady(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        if self._kv_checksum and r.kv_checksums is None:
            # Registered in this same step (RegisterKV / NarrowKV just ran): READY goes as soon
            # as the embedder has the checksums of what it registered (KVChecksummed, fed back
            # before the step's messages leave), never without them.
            r.ready_held = True
            return
        out.append(self._ready(r))

    def _fx_ReleaseKV(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        out.append(fx.ReleaseKV(r.room, r.uuid, r.spare_uuid, tuple(r.parts)))
