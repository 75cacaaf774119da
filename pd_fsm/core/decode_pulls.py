"""D's pulls: P's offers of KV (KV_PART, READY) judged, kept in page order, and pulled.

An offer is checked on arrival for what can be judged alone (layout, shards, address,
checksums); where its pages start, only when it is handled: a part in flight may end where they
do, so STREAMING defers P's next message (``DeferMessage``) until the part reports, and one that
starts past the pages D holds or pulls waits the same way (the side channel may deliver out of
order). With kv checksums, every pull is verified against READY's sums and a mismatch re-pulls
once, from READY's spare registration. Runs kv_receiver's StartPull, StartPartPull, StartRepull,
KeepPart and DeferMessage for ``DecodeEndpoint``; it steps no room itself.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pd_fsm.core import effects as fx
from pd_fsm.core.decode_peers import Peer
from pd_fsm.core.decode_room import ReceiverRoom, offer_start
from pd_fsm.core.messages import KVPart, Ready
from pd_fsm.core.rooms import Cause
from pd_fsm.core.stats import EndpointStats
from pd_fsm.core.tables import KV_RECEIVER

_S, _T = KV_RECEIVER.S, KV_RECEIVER.T

_Fx = fx.DecodeEffect

_HOST_PORT = re.compile(r"[A-Za-z0-9.\-]{1,253}:[0-9]{1,5}|\[[0-9A-Fa-f:.]{2,45}\]:[0-9]{1,5}")


class Pulls:
    """What D pulls, from whom: ``peers`` is the peer tracker's (a pull goes to the transfer
    address P last named)."""

    def __init__(self, layout_hash: str, pullable_kv_shards: frozenset[int], kv_checksum: bool,
                 peers: Mapping[str, Peer], stats: EndpointStats) -> None:
        self._layout_hash = layout_hash
        self._pullable_kv_shards = pullable_kv_shards
        self._kv_checksum = kv_checksum
        self._peers = peers
        self._stats = stats

    # -- P's offers ---------------------------------------------------------------------------

    def judge(self, r: ReceiverRoom, m: KVPart | Ready) -> tuple[str, str]:
        """The trigger P's offer steps the room with, and what is wrong with it ("": nothing).
        What can be judged alone is judged on arrival; where its pages start, only when it is
        handled (a part in flight may end where they do: STREAMING defers the message)."""
        trigger = _T.PartReceived if isinstance(m, KVPart) else _T.ReadyReceived
        problem = self._check_offer(m)
        # Where the next offer must start: after our pages, and after the part in flight.
        expected = r.skip if r.part is None else r.part.first_page + r.part.n_pages
        start = offer_start(r, m)
        if not problem and start < expected:
            problem = (f"P offers pages from {start}, we hold or pull up to {expected}; "
                       "refusing to pull")
        if not problem and start == expected and r.state != _S.STREAMING:
            problem = _check_pages(r, m)
        if start > expected:
            trigger = _T.OfferAheadReceived
        return trigger, problem

    def defer(self, r: ReceiverRoom, m: KVPart | Ready) -> bool:
        """Whether ``m`` is to be kept for later (DeferMessage): not P's duplicate of one kept."""
        if m in r.deferred:
            self._stats.duplicates += 1
            return False
        r.incoming = m  # DeferMessage keeps it
        return True

    def take(self, r: ReceiverRoom, m: KVPart | Ready) -> None:
        """The offer the room waited for: where this pull comes from (a P restarted after it
        lost the room with it), and what READY says of the KV."""
        if r.state != _S.WAITING_FOR_READY:
            return
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
            if self._kv_checksum:  # else READY's are not ours to verify (_check_offer)
                r.kv_checksums, r.repull_uuid = m.kv_checksums, m.repull_uuid

    def next_deferred(self, r: ReceiverRoom) -> KVPart | Ready | None:
        """The kept message that starts where the room's pages now end (taken from the kept
        ones), if P sent it already; one that starts further on stays kept."""
        nxt = next((m for m in r.deferred if offer_start(r, m) == r.skip), None)
        if nxt is not None:
            r.deferred.remove(nxt)
        return nxt

    def _check_offer(self, m: KVPart | Ready) -> str:
        """What is wrong with P's offer of KV (a part or READY) whatever the room's state."""
        name = "KV_PART" if isinstance(m, KVPart) else "READY"
        if m.layout_hash != self._layout_hash:
            return (f"KV layout mismatch (P {m.layout_hash}, D {self._layout_hash}); refusing to "
                    "pull")
        if m.kv_shards not in self._pullable_kv_shards:
            return (f"P registered its KV as {m.kv_shards} kv-head shards; this D regroups "
                    f"only {sorted(self._pullable_kv_shards)}; refusing to pull")
        if m.transfer_addr and not _HOST_PORT.fullmatch(m.transfer_addr):
            return f"{name} names an unusable transfer address {m.transfer_addr[:80]!r}"
        if self._kv_checksum:
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

    # -- effects of kv_receiver ---------------------------------------------------------------

    def _fx_StartPull(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        out.append(self._pull(r, r.uuid))

    def _fx_StartPartPull(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.peer is not None and r.part is not None
        transfer_addr = r.transfer_addr or self._peers[r.peer].transfer_addr
        sums = r.part.kv_checksums if self._kv_checksum else ()
        out.append(fx.StartPull(r.room, r.peer, transfer_addr, r.part.uuid, r.part.n_pages,
                                r.part.first_page, r.part.kv_shards, sums, part=True))

    def _fx_DeferMessage(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.incoming is not None
        r.deferred.append(r.incoming)
        r.incoming = None

    def _fx_KeepPart(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        assert r.part is not None
        r.skip = r.part.first_page + r.part.n_pages
        r.part = None

    def _fx_StartRepull(self, r: ReceiverRoom, now: float, out: list[_Fx], why: Cause) -> None:
        # The same pull, of the spare registration: the first one was consumed by the pull
        # that brought the corrupted bytes (registrations are one-shot).
        assert r.repull_uuid
        self._stats.kv_checksum_repulls += 1
        out.append(self._pull(r, r.repull_uuid, repull=True))

    def _pull(self, r: ReceiverRoom, uuid: int, repull: bool = False) -> fx.StartPull:
        assert r.peer is not None
        transfer_addr = r.transfer_addr or self._peers[r.peer].transfer_addr
        return fx.StartPull(r.room, r.peer, transfer_addr, uuid, r.n_pages - r.skip, r.skip,
                            r.kv_shards, r.kv_checksums, repull)


def _check_pages(r: ReceiverRoom, m: KVPart | Ready) -> str:
    """Whether P's offer starts where the room's pages end (our prefix cache's, then the parts
    pulled) and, for a part, leaves the last page to READY."""
    if isinstance(m, Ready):
        if m.n_pages != r.n_pages - r.skip:
            return (f"P offers {m.n_pages} pages, we wait for {r.n_pages - r.skip}; "
                    "refusing to pull")
    elif m.first_page != r.skip or not 0 < m.n_pages < r.n_pages - r.skip:
        return (f"P offers pages {m.first_page}..{m.first_page + m.n_pages} as a part; we "
                f"hold {r.skip} of {r.n_pages} and the last comes with READY; refusing to "
                "pull")
    return ""
