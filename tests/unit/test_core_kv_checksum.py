"""KV checked on arrival (issue 31 §3), in the core: P's READY carries the checksums of what it
registered and a spare registration; D verifies every pull against them, pulls once more on a
mismatch, and fails the room (502) on a second one. Both sides must agree to use checksums."""

from __future__ import annotations

import random
from typing import Any

import pytest

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import LeaseConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.messages import Done, Ready, RecvInit
from pd_fsm.core.prefill_endpoint import PrefillEndpoint

L = "layout"
D = "d"
SUMS = (0xDEADBEEF, 7)


def _kinds(out: list[Any]) -> list[str]:
    return [type(o).__name__ for o in out]


def _readies(out: list[Any]) -> list[Ready]:
    return [o.message for o in out if isinstance(o, fx.SendMessage)
            and isinstance(o.message, Ready)]


def _p(kv_checksum: bool = True) -> PrefillEndpoint:
    return PrefillEndpoint(L, random.Random(0), LeaseConfig(), kv_checksum=kv_checksum)


# --- P ------------------------------------------------------------------------------------------


def test_p_holds_ready_until_the_registration_has_its_checksums() -> None:
    """D said hello first: the row registers, sends READY and answers the leg in one step, but
    READY goes only once the checksums of what was registered are known (KVChecksummed, which
    the embedder feeds back in the same driver step); it names them and the spare."""
    p = _p()
    p.handle(ev.MessageReceived(D, RecvInit(1, D, 2, L)), 0.0)
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    out = p.handle(ev.PrefillFinished(1, 5, 2), 0.0)
    assert _kinds(out) == ["RegisterKV", "CompleteRequest"] and p.state_of(1) == "TRANSFERRING"
    reg = out[0]
    assert reg.spare_uuid is not None and reg.spare_uuid != reg.uuid
    (ready,) = _readies(p.handle(ev.KVChecksummed(1, reg.uuid, SUMS), 0.0))
    assert (ready.uuid, ready.kv_checksums, ready.repull_uuid) == (reg.uuid, SUMS, reg.spare_uuid)
    out = p.handle(ev.MessageReceived(D, Done(1, True)), 1.0)
    (release,) = [o for o in out if isinstance(o, fx.ReleaseKV)]
    assert (release.uuid, release.spare_uuid) == (reg.uuid, reg.spare_uuid)  # both go


def test_p_registered_before_d_said_hello_sends_ready_at_once() -> None:
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    (reg,) = p.handle(ev.PrefillFinished(1, 5, 2), 0.0)
    assert p.handle(ev.KVChecksummed(1, reg.uuid, SUMS), 0.0) == []  # no D to tell yet
    (ready,) = _readies(p.handle(ev.MessageReceived(D, RecvInit(1, D, 2, L)), 1.0))
    assert ready.kv_checksums == SUMS and ready.repull_uuid == reg.spare_uuid


def test_p_narrowed_registration_gets_new_checksums_and_spare() -> None:
    """D's late hello says it holds the first page: both registrations are replaced, and READY
    waits for the narrowed registration's checksums (the old ones are late)."""
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    (reg,) = p.handle(ev.PrefillFinished(1, 5, 3), 0.0)
    p.handle(ev.KVChecksummed(1, reg.uuid, SUMS), 0.0)
    out = p.handle(ev.MessageReceived(D, RecvInit(1, D, 3, L, skip_pages=1)), 1.0)
    assert _kinds(out) == ["NarrowKV", "CompleteRequest"]
    narrow = out[0]
    assert (narrow.replaces, narrow.replaces_spare) == (reg.uuid, reg.spare_uuid)
    late = p.stats.late
    assert p.handle(ev.KVChecksummed(1, reg.uuid, SUMS), 1.0) == []  # the replaced one's
    assert p.stats.late == late + 1
    (ready,) = _readies(p.handle(ev.KVChecksummed(1, narrow.uuid, (1, 2)), 1.0))
    assert (ready.uuid, ready.n_pages, ready.kv_checksums, ready.repull_uuid) == (
        narrow.uuid, 2, (1, 2), narrow.spare_uuid)


def test_p_without_checksums_is_unchanged_and_refuses_them() -> None:
    p = _p(kv_checksum=False)
    p.handle(ev.MessageReceived(D, RecvInit(1, D, 2, L)), 0.0)
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    out = p.handle(ev.PrefillFinished(1, 5, 2), 0.0)
    assert out[0].spare_uuid is None
    (ready,) = _readies(out)
    assert ready.kv_checksums == () and ready.repull_uuid == 0
    with pytest.raises(LocalProtocolError, match="runs no KV checksums"):
        p.handle(ev.KVChecksummed(1, out[0].uuid, SUMS), 0.0)


# --- D ------------------------------------------------------------------------------------------


def _d_pulling(kv_checksum: bool = True, ready: Ready | None = None) -> tuple[DecodeEndpoint,
                                                                             list[Any]]:
    d = DecodeEndpoint(D, L, kv_checksum=kv_checksum)
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 2), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t:1", L), 0.0)
    d.handle(ev.BlocksAllocated(1), 0.0)
    ready = ready or Ready(1, 5, 7, 2, L, kv_checksums=SUMS, repull_uuid=6)
    return d, d.handle(ev.MessageReceived("p", ready), 0.0)


def _pull(out: list[Any]) -> fx.StartPull:
    (pull,) = [o for o in out if isinstance(o, fx.StartPull)]
    return pull


def test_d_verifies_against_readys_checksums_and_repulls_the_spare_once() -> None:
    d, out = _d_pulling()
    first = _pull(out)
    assert (first.uuid, first.kv_checksums, first.repull) == (5, SUMS, False)
    out = d.handle(ev.ChecksumMismatched(1, "array 0 sums to 0x1"), 1.0)
    again = _pull(out)
    assert _kinds(out) == ["StartPull"] and d.state_of(1) == "REPULLING"
    assert (again.uuid, again.kv_checksums, again.repull) == (6, SUMS, True)
    assert d.poll(1) == KVPoll.Transferring  # still heartbeating P, which holds both
    out = d.handle(ev.PullSucceeded(1), 2.0)
    assert "CompleteTransfer" in _kinds(out) and d.poll(1) == KVPoll.Success
    assert (d.stats.kv_checksum_mismatches, d.stats.kv_checksum_repulls) == (1, 1)


def test_d_fails_the_room_when_the_repull_is_corrupted_too() -> None:
    d, _ = _d_pulling()
    d.handle(ev.ChecksumMismatched(1, "array 0 sums to 0x1"), 1.0)
    out = d.handle(ev.ChecksumMismatched(1, "array 0 sums to 0x2"), 2.0)
    assert _kinds(out) == ["SendMessage", "ReleaseBlocks", "FailRequest"]
    done, fail = out[0].message, out[-1]
    assert isinstance(done, Done) and not done.ok
    assert fail.status == 502  # a transfer failure: the recompute policy takes it
    assert "KV corrupted in flight (and on the re-pull): array 0 sums to 0x2" in fail.reason
    assert d.poll(1) == KVPoll.Failed
    assert (d.stats.kv_checksum_mismatches, d.stats.kv_checksum_repulls) == (2, 1)


def test_d_counts_a_mismatch_reported_after_the_room_failed() -> None:
    d, _ = _d_pulling()
    d.handle(ev.Aborted(1, "client gone"), 1.0)  # CANCELLING: pages freed, the pull runs
    out = d.handle(ev.ChecksumMismatched(1, "array 0"), 2.0)
    assert out == [] and d.stats.kv_checksum_mismatches == 1 and d.state_of(1) is None


@pytest.mark.parametrize("ready", [Ready(1, 5, 7, 2, L),
                                   Ready(1, 5, 7, 2, L, kv_checksums=SUMS),
                                   Ready(1, 5, 7, 2, L, kv_checksums=SUMS, repull_uuid=5)])
def test_d_that_verifies_refuses_a_ready_without_checksums_or_spare(ready: Ready) -> None:
    d, out = _d_pulling(ready=ready)
    assert "StartPull" not in _kinds(out) and d.poll(1) == KVPoll.Failed
    assert "no KV checksums" in out[-1].reason and "both run KV checksums" in out[-1].reason


def test_d_that_does_not_verify_ignores_readys_checksums() -> None:
    d, out = _d_pulling(kv_checksum=False)
    assert _pull(out).kv_checksums == ()
    with pytest.raises(LocalProtocolError, match="no checksums to verify"):
        d.handle(ev.ChecksumMismatched(1, "x"), 1.0)
