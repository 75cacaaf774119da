"""Behaviour of the endpoints beyond single table rows: leases, timers, peers, trust, counting."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig, LeaseConfig, RegistryConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.messages import MAX_ROOM, Abort, Done, Heartbeat, HeartbeatAck, Ready, RecvInit
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.core.registry import BootstrapRegistry, RegistrationRequired
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.routing import Attempts
from pd_fsm.core.timers import DeadlineHeap

L = "layout"


def _p(**kw: float) -> PrefillEndpoint:
    return PrefillEndpoint(L, random.Random(0), LeaseConfig(**kw) if kw else None)


def _kinds(out: list) -> list[str]:
    return [type(o).__name__ for o in out]


# --- the deadline heap ---


def test_heap_extend_is_lazy_and_fires_once_at_the_real_deadline() -> None:
    h: DeadlineHeap[int] = DeadlineHeap()
    h.set(1, 10.0)
    for t in range(20):
        h.set(1, 10.0 + t)  # heartbeats: no new heap entries
    assert len(h._heap) == 1
    assert h.pop_due(15.0) == []
    assert h.next_deadline() == 29.0
    assert h.pop_due(29.0) == [1]
    assert h.pop_due(100.0) == [] and h.next_deadline() is None


def test_heap_shorten_cancel_and_order() -> None:
    h: DeadlineHeap[str] = DeadlineHeap()
    h.set("a", 5.0)
    h.set("b", 3.0)
    h.set("a", 1.0)  # earlier: must fire at 1, not 5
    h.set("c", 2.0)
    h.cancel("c")
    assert h.pop_due(10.0) == ["a", "b"]


# --- P: the KV hold lease ------------------------------------------------------------------------


def test_lease_initial_then_extended_to_max_never_shorter() -> None:
    p = _p(initial=30.0, extension=20.0)
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    assert p.lease_expiry(1) == 30.0
    p.handle(ev.MessageReceived("d", Heartbeat(1, (1,))), 5.0)
    assert p.lease_expiry(1) == 30.0  # 5 + 20 < 30: never shorter
    p.handle(ev.MessageReceived("d", Heartbeat(2, (1,))), 25.0)
    assert p.lease_expiry(1) == 45.0
    assert p.handle(ev.TimeAdvanced(), 44.999) == []
    out = p.handle(ev.TimeAdvanced(), 45.0)
    assert _kinds(out) == ["ReleaseKV", "FailRequest"]
    assert "lease expired" in out[1].reason
    assert out[1].status == 504  # a timeout waiting for D: the gateway's, not our error
    assert p.poll(1) == KVPoll.Failed


def test_lease_expiry_releases_registered_kv_and_tells_d() -> None:
    p = _p()
    p.handle(ev.MessageReceived("d", RecvInit(1, "d", 2, L)), 0.0)
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    out = p.handle(ev.PrefillFinished(1, 5, 2), 1.0)
    uuid = out[0].uuid
    out = p.handle(ev.TimeAdvanced(), 30.0)  # D never pulled, never heartbeated
    assert _kinds(out) == ["SendMessage", "ReleaseKV"]
    assert isinstance(out[0].message, Abort) and out[1].uuid == uuid


def test_heartbeat_ack_reports_failed_and_unknown_rooms() -> None:
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    p.handle(ev.PrefillFailed(1, "oom"), 0.0)
    p.handle(ev.PrefillRequestAccepted(2), 0.0)
    (ack,) = p.handle(ev.MessageReceived("d", Heartbeat(7, (1, 2, 3))), 1.0)
    assert ack.message == HeartbeatAck(p.incarnation, 7, (1,), (3,))


# --- P: trust and counting -----------------------------------------------------------------------


def _p_transferring() -> tuple[PrefillEndpoint, int]:
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    p.handle(ev.MessageReceived("d-owner", RecvInit(1, "d-owner", 2, L)), 0.0)
    out = p.handle(ev.PrefillFinished(1, 5, 2), 0.0)
    return p, out[0].uuid


def test_forged_done_and_abort_from_another_peer_change_nothing() -> None:
    p, _ = _p_transferring()
    assert p.handle(ev.MessageReceived("mallory", Done(1, True)), 1.0) == []
    assert p.handle(ev.MessageReceived("mallory", Abort(1, "forged")), 1.0) == []
    assert p.handle(ev.MessageReceived("mallory", RecvInit(1, "mallory", 2, L)), 1.0) == []
    assert p.stats.foreign_peer == 3
    assert p.poll(1) == KVPoll.Transferring
    assert _kinds(p.handle(ev.MessageReceived("d-owner", Done(1, True)), 1.0)) == ["ReleaseKV"]


def test_duplicate_late_and_unknown_messages_are_counted_and_dropped() -> None:
    p, _ = _p_transferring()
    out = p.handle(ev.MessageReceived("d-owner", RecvInit(1, "d-owner", 2, L)), 1.0)
    assert p.stats.duplicates == 1 and _kinds(out) == []
    p.handle(ev.MessageReceived("d-owner", Done(1, True)), 1.0)
    assert p.handle(ev.MessageReceived("d-owner", Done(1, True)), 2.0) == []
    assert p.stats.late == 1
    assert p.handle(ev.MessageReceived("d-owner", Done(99, True)), 2.0) == []
    assert p.stats.unknown_room == 1


def test_duplicate_live_bootstrap_room_is_rejected_and_first_unaffected() -> None:
    p, _ = _p_transferring()
    out = p.handle(ev.PrefillRequestAccepted(1), 1.0)
    assert _kinds(out) == ["RejectRequest"] and "already live" in out[0].reason
    assert p.poll(1) == KVPoll.Transferring and p.stats.rejected == 1


def test_layout_mismatch_fails_the_room_before_any_registration() -> None:
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    out = p.handle(ev.MessageReceived("d", RecvInit(1, "d", 2, "other")), 0.0)
    assert _kinds(out) == ["SendMessage", "ReleaseKV", "FailRequest"]
    assert "layout mismatch" in out[2].reason and out[1].uuid is None
    assert p.stats.remote_errors == 1


def test_page_count_disagreement_is_a_remote_error() -> None:
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    p.handle(ev.MessageReceived("d", RecvInit(1, "d", 3, L)), 0.0)
    out = p.handle(ev.PrefillFinished(1, 5, 2), 0.0)
    assert "reserved 3 pages" in out[-1].reason and p.poll(1) == KVPoll.Failed


def test_endpoint_survives_remote_errors_and_serves_others() -> None:
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    p.handle(ev.PrefillRequestAccepted(2), 0.0)
    p.handle(ev.MessageReceived("d", RecvInit(1, "d", 2, L)), 0.0)
    p.handle(ev.MessageReceived("d", Done(1, True)), 0.0)  # DONE before READY: impossible
    assert p.poll(1) == KVPoll.Failed and p.poll(2) == KVPoll.Bootstrapping


def test_done_for_a_room_no_d_has_claimed_counts_as_foreign() -> None:
    """Before any RECV_INIT no D is bound to the room, so no DONE can be its peer's: a signed
    DONE from anyone is counted (``foreign_peer``) and the room goes on; the real D binds it."""
    p = _p()
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    for ok in (True, False):
        assert p.handle(ev.MessageReceived("mallory", Done(1, ok, "forged")), 1.0) == []
    assert p.stats.foreign_peer == 2 and p.stats.remote_errors == 0
    assert p.poll(1) == KVPoll.Bootstrapping
    p.handle(ev.MessageReceived("d-owner", RecvInit(1, "d-owner", 2, L)), 1.0)
    assert p.poll(1) == KVPoll.WaitingForInput


# --- D ---


def _d(**kw: float) -> DecodeEndpoint:
    return DecodeEndpoint("d", L, DecodeConfig(**kw))


def test_resolution_is_cached_per_prefill_and_refreshed_after_loss() -> None:
    d = _d(peer_timeout=15.0, heartbeat_interval=5.0)
    assert _kinds(d.handle(ev.DecodeRequestAccepted(1, "h:1", 1), 0.0)) == ["ResolvePeer"]
    assert d.handle(ev.DecodeRequestAccepted(2, "h:1", 1), 0.0) == []  # lookup already in flight
    out = d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    assert _kinds(out) == ["AllocateBlocks", "AllocateBlocks"]
    assert _kinds(d.handle(ev.DecodeRequestAccepted(3, "h:1", 1), 0.0)) == ["AllocateBlocks"]
    out = []
    for now in (5.0, 10.0, 15.0):  # two heartbeats unanswered and 15 s of silence
        out = d.handle(ev.TimeAdvanced(), now)
    assert Counter(_kinds(out))["FailRequest"] == 3
    fails = [o for o in out if isinstance(o, fx.FailRequest)]
    assert "2 heartbeats unanswered" in fails[-1].reason
    assert out[-1] == fx.ForgetPeer("p")  # no room needs P any more: close its connection
    assert "p" not in d.peers
    assert _kinds(d.handle(ev.DecodeRequestAccepted(4, "h:1", 1), 16.0)) == ["ResolvePeer"]


def test_heartbeats_are_batched_per_prefill() -> None:
    d = _d(heartbeat_interval=5.0, peer_timeout=100.0)
    for room in range(64):
        d.handle(ev.DecodeRequestAccepted(room, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    out = d.handle(ev.TimeAdvanced(), 5.0)
    assert len(out) == 1 and out[0].message == Heartbeat(1, tuple(range(64)))
    assert d.next_deadline() == 10.0


def _d_with_rooms(states: dict[int, str]) -> DecodeEndpoint:
    """D with one P ("p", transfer address "t-old", incarnation 111) and rooms brought to the
    given states: ALLOCATING, WAITING_FOR_READY (hello sent, before heartbeat seq 1) or
    TRANSFERRING (READY'd by incarnation 111)."""
    d = _d(heartbeat_interval=1.0, peer_timeout=100.0)
    for room in states:
        d.handle(ev.DecodeRequestAccepted(room, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t-old", L), 0.0)
    d.handle(ev.MessageReceived("p", HeartbeatAck(111, 0)), 0.0)
    for room, state in states.items():
        if state != "ALLOCATING":
            d.handle(ev.BlocksAllocated(room), 0.0)
        if state == "TRANSFERRING":
            ready = Ready(room, 5, 7, 1, L, incarnation=111, transfer_addr="h:7001")
            d.handle(ev.MessageReceived("p", ready), 0.0)
    assert {room: d.state_of(room) for room in states} == states
    d.handle(ev.TimeAdvanced(), 1.0)  # heartbeat seq 1 (after every hello)
    return d


def test_a_restarted_prefill_fails_only_what_its_previous_process_held() -> None:
    d = _d_with_rooms({1: "ALLOCATING", 2: "WAITING_FOR_READY", 3: "WAITING_FOR_READY",
                       4: "TRANSFERRING"})
    # The new process answers heartbeat 1: it knows room 3 (its hello reached the new P), not 2.
    out = d.handle(ev.MessageReceived("p", HeartbeatAck(222, 1, unknown_rooms=(2,))), 2.0)
    fails = {o.room: o.reason for o in out if isinstance(o, fx.FailRequest)}
    assert set(fails) == {2, 4}
    assert "restarted" in fails[4] and "does not know the room" in fails[2]
    assert fx.ForgetTransfer("h:7001") in out  # the connection to the dead transfer server
    assert d.state_of(1) == "ALLOCATING" and d.state_of(3) == "WAITING_FOR_READY"
    assert d.state_of(4) == "CANCELLING"  # its pull may still write: pages held until it reports
    assert d.stats.peer_restarts == 1 and d.peers["p"].incarnation == 222
    assert "h:1" in d.tracker.resolved  # P is back where it was: the route stays


def test_ready_from_a_new_incarnation_pulls_from_where_it_says() -> None:
    d = _d_with_rooms({1: "WAITING_FOR_READY", 2: "TRANSFERRING"})
    ready = Ready(1, 9, 7, 1, L, incarnation=222, transfer_addr="h:7002")
    out = d.handle(ev.MessageReceived("p", ready), 2.0)
    assert fx.ForgetTransfer("h:7001") in out
    assert [o.room for o in out if isinstance(o, fx.FailRequest)] == [2]
    pulls = [o for o in out if isinstance(o, fx.StartPull)]
    assert pulls == [fx.StartPull(1, "p", "h:7002", 9, 1)]  # not the cached "t-old"
    # The same incarnation again (or one not said) changes nothing.
    assert not [o for o in d.handle(ev.MessageReceived("p", HeartbeatAck(222, 2)), 3.0)
                if isinstance(o, fx.FailRequest | fx.ForgetTransfer)]
    assert d.stats.peer_restarts == 1


def test_ready_with_an_unusable_transfer_address_is_refused() -> None:
    d = _d_with_rooms({1: "WAITING_FOR_READY"})
    ready = Ready(1, 9, 7, 1, L, incarnation=111, transfer_addr="not an address")
    out = d.handle(ev.MessageReceived("p", ready), 2.0)
    assert not [o for o in out if isinstance(o, fx.StartPull)]
    assert d.poll(1) == KVPoll.Failed


def test_a_restarted_decode_frees_what_its_previous_process_claimed() -> None:
    p = _p()
    for room in (1, 2):
        p.handle(ev.PrefillRequestAccepted(room), 0.0)
        p.handle(ev.PrefillFinished(room, 7, 1), 0.0)
        p.handle(ev.MessageReceived("d", RecvInit(room, "d", 1, L, incarnation=5)), 0.0)
    assert p.poll(1) == KVPoll.Transferring
    # The same identity, a new process: it claims room 3 and heartbeats only that.
    p.handle(ev.PrefillRequestAccepted(3), 1.0)
    out = p.handle(ev.MessageReceived("d", RecvInit(3, "d", 1, L, incarnation=6)), 1.0)
    released = sorted(o.room for o in out if isinstance(o, fx.ReleaseKV))
    assert released == [1, 2] and p.poll(1) == KVPoll.Failed and p.poll(2) == KVPoll.Failed
    assert p.state_of(3) is not None and p.stats.peer_restarts == 1
    # Another D's rooms are not touched by this D's restart, and an old process is not
    # mistaken for a new one by a heartbeat that does not say.
    out = p.handle(ev.MessageReceived("d", Heartbeat(1, (3,))), 2.0)
    assert not [o for o in out if isinstance(o, fx.ReleaseKV)]


def test_unknown_room_fails_only_after_our_hello_preceded_the_heartbeat() -> None:
    d = _d(heartbeat_interval=1.0, peer_timeout=100.0)
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    d.handle(ev.TimeAdvanced(), 1.0)  # HB seq 1, sent before the hello
    d.handle(ev.BlocksAllocated(1), 1.5)  # RECV_INIT goes out after HB 1
    assert d.handle(ev.MessageReceived("p", HeartbeatAck(9, 1, (), (1,))), 1.6) == []
    d.handle(ev.TimeAdvanced(), 2.0)  # HB seq 2, after the hello
    out = d.handle(ev.MessageReceived("p", HeartbeatAck(9, 2, (), (1,))), 2.1)
    assert "does not know the room" in out[-1].reason
    assert _kinds(out) == ["SendMessage", "ReleaseBlocks", "FailRequest"]


def test_layout_mismatch_in_ready_is_refused_before_pulling() -> None:
    d = _d()
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 2), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    d.handle(ev.BlocksAllocated(1), 0.0)
    out = d.handle(ev.MessageReceived("p", Ready(1, 5, 7, 2, "other")), 0.0)
    assert "StartPull" not in _kinds(out) and "layout mismatch" in out[-1].reason


def test_ready_naming_shards_d_cannot_regroup_is_refused_before_pulling() -> None:
    """P registered its KV as 3 shards a pool; this D regroups from 1, 2 or 4 (its kv-heads'
    divisors): the room fails naming both, and nothing is pulled."""
    d = DecodeEndpoint("d", L, DecodeConfig(), pullable_kv_shards=frozenset({1, 2, 4}))
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 2), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    d.handle(ev.BlocksAllocated(1), 0.0)
    out = d.handle(ev.MessageReceived("p", Ready(1, 5, 7, 2, L, kv_shards=3)), 0.0)
    assert "StartPull" not in _kinds(out)
    assert "as 3 kv-head shards; this D regroups only [1, 2, 4]" in out[-1].reason
    d.handle(ev.DecodeRequestAccepted(2, "h:1", 2), 0.0)
    d.handle(ev.BlocksAllocated(2), 0.0)
    out = d.handle(ev.MessageReceived("p", Ready(2, 6, 7, 2, L, kv_shards=4)), 0.0)
    (pull,) = [o for o in out if isinstance(o, fx.StartPull)]
    assert pull.kv_shards == 4


def test_queue_timeout_is_503_and_ready_timeout_504() -> None:
    d = _d(queue_timeout=10.0, ready_timeout=20.0, peer_timeout=1e9)
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 1), 0.0)
    d.handle(ev.DecodeRequestAccepted(2, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    d.handle(ev.BlocksAllocated(2), 0.0)
    out = d.handle(ev.TimeAdvanced(), 10.0)
    fails = [o for o in out if isinstance(o, fx.FailRequest)]
    assert [(f.room, f.status) for f in fails] == [(1, 503)]
    out = d.handle(ev.TimeAdvanced(), 20.0)
    fails = [o for o in out if isinstance(o, fx.FailRequest)]
    assert [(f.room, f.status) for f in fails] == [(2, 504)]
    assert "ReleaseBlocks" in _kinds(out)


def test_abort_mid_pull_cancels_the_pull_and_frees_the_pages_at_once() -> None:
    d = _d()
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    d.handle(ev.BlocksAllocated(1), 0.0)
    d.handle(ev.MessageReceived("p", Ready(1, 5, 7, 1, L)), 0.0)
    out = d.handle(ev.Aborted(1, "client gone"), 1.0)
    # The pull is cancelled before the pages go: its KV can never be scattered into them.
    assert _kinds(out) == ["SendMessage", "CancelPull", "ReleaseBlocks", "FailRequest"]
    assert d.state_of(1) == "CANCELLING" and d.poll(1) == KVPoll.Failed
    assert d.handle(ev.PullSucceeded(1), 2.0) == [] and d.state_of(1) is None
    assert d.handle(ev.PullFailed(1, "late"), 3.0) == [] and d.stats.late == 1


def test_a_lost_prefill_frees_the_pages_of_its_rooms_mid_pull_and_drops_its_transfer() -> None:
    """P falls silent while two rooms pull from it: both fail with their pages freed at once
    (not when their pulls give up, which from a dead P can take the whole pull deadline), and
    D drops its connections to P's transfer server, which ends the pulls waiting on it."""
    d = _d_with_rooms({1: "TRANSFERRING", 2: "TRANSFERRING", 3: "WAITING_FOR_READY"})
    out: list[fx.DecodeEffect] = []
    now = 1.0
    while d.state_of(1) == "TRANSFERRING" and now < 120.0:
        now += 1.0
        out += d.handle(ev.TimeAdvanced(), now)
    assert d.state_of(1) == "CANCELLING"  # after the peer timeout (100 s), plus heartbeats
    cancelled = [o.room for o in out if isinstance(o, fx.CancelPull)]
    released = [o.room for o in out if isinstance(o, fx.ReleaseBlocks)]
    assert cancelled == [1, 2] and sorted(released) == [1, 2, 3]
    assert {d.state_of(r) for r in (1, 2)} == {"CANCELLING"} and d.state_of(3) is None
    assert [o for o in out if isinstance(o, fx.ForgetTransfer)] == [fx.ForgetTransfer("h:7001")]
    for room in (1, 2):
        assert d.handle(ev.PullFailed(room, "connection poisoned"), now) == []
    assert not d.rooms


# --- the registry ---

KEY = ("prefill", "p0", 0, 0, 0, 0)


def test_registry_ttl_heartbeat_and_reregistration() -> None:
    reg = BootstrapRegistry(RegistryConfig(ttl=15.0))
    reg.handle(ev.InstanceRegistered(KEY, {"v": 1}, "h:1"), 0.0)
    reg.handle(ev.InstanceHeartbeat(KEY), 10.0)
    assert reg.next_deadline() == 25.0
    reg.handle(ev.InstanceRegistered(KEY, {"v": 2}, "h:2"), 11.0)
    assert reg.resolve("h:1") == [] and reg.resolve("h:2") == [(KEY, {"v": 2})]
    out = reg.handle(ev.TimeAdvanced(), 26.0)
    assert _kinds(out) == ["InstanceExpired"] and len(reg) == 0
    out = reg.handle(ev.InstanceHeartbeat(KEY), 27.0)
    assert out == [RegistrationRequired(KEY)]


def test_registry_lists_by_role() -> None:
    reg = BootstrapRegistry()
    reg.handle(ev.InstanceRegistered(KEY, "p", "h:1"), 0.0)
    reg.handle(ev.InstanceRegistered(("decode", "d0", 0, 0, 0, 0), "d", None), 0.0)
    assert reg.instances("prefill") == ["p"] and reg.instances("decode") == ["d"]
    assert sorted(reg.instances()) == ["d", "p"]


# --- the room router ---


def test_router_round_robin_both_legs_uniform_rooms() -> None:
    router = RoomRouter(["p0", "p1", "p2"], ["d0", "d1"], random.Random(1))
    picks = []
    for i in range(300):
        (dispatch,) = router.handle(ev.RoomRequested(f"r{i}"), 0.0)
        assert 0 <= dispatch.room < MAX_ROOM
        picks.append((dispatch.prefill, dispatch.decode))
    assert [p for p, _ in picks[:6]] == ["p0", "p1", "p2", "p0", "p1", "p2"]
    assert [d for _, d in picks[:4]] == ["d0", "d1", "d0", "d1"]
    assert router.planner.decisions == {"prefill:round_robin": 300, "decode:round_robin": 300}
    rooms = list(router.rooms)
    assert len(set(rooms)) == 300
    assert sum(r >= MAX_ROOM // 2 for r in rooms) in range(110, 191)  # uniform, not sequential


def test_router_without_workers_replies_error() -> None:
    router = RoomRouter([], ["d0"], random.Random(1))
    (err,) = router.handle(ev.RoomRequested("r"), 0.0)
    assert err == fx.NoWorkers("r", "prefill") and "no prefill workers" in err.reason


def test_local_misuse_raises() -> None:
    from pd_fsm.core.errors import LocalProtocolError

    with pytest.raises(LocalProtocolError):
        _p().handle(ev.PrefillFinished(5, 1, 1), 0.0)
    with pytest.raises(LocalProtocolError):
        _d().handle(ev.BlocksAllocated(5), 0.0)
    with pytest.raises(LocalProtocolError):
        _p().handle(ev.BlocksAllocated(5), 0.0)


def test_a_stalled_decode_asks_before_declaring_prefill_lost() -> None:
    """D itself froze for 40 s (a long compile): it sends heartbeats first, judges after."""
    d = _d(heartbeat_interval=5.0, peer_timeout=15.0)
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    out = d.handle(ev.TimeAdvanced(), 40.0)
    assert _kinds(out) == ["SendMessage"] and isinstance(out[0].message, Heartbeat)
    d.handle(ev.MessageReceived("p", HeartbeatAck(3, out[0].message.seq)), 40.1)
    for now in (45.0, 50.0, 54.0):
        d.handle(ev.TimeAdvanced(), now)
    assert d.poll(1) == KVPoll.Bootstrapping  # P answered: still alive, still waiting
    for now in (55.0, 60.0):
        out = d.handle(ev.TimeAdvanced(), now)
    fails = [o for o in out if isinstance(o, fx.FailRequest)]
    assert d.poll(1) == KVPoll.Failed and "unanswered" in fails[-1].reason


def test_prefill_moving_address_forgets_the_old_connection() -> None:
    d = _d()
    d.handle(ev.DecodeRequestAccepted(1, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p-old", "t", L), 0.0)
    d.handle(ev.Aborted(1, "client gone"), 1.0)
    d.handle(ev.DecodeRequestAccepted(2, "h:1", 1), 2.0)  # cached: still p-old, no lookup
    d.handle(ev.Aborted(2, "client gone"), 3.0)
    out = d.handle(ev.PeerResolved("h:1", "p-new", "t2", L), 4.0)  # a later lookup: P moved
    assert out == [fx.ForgetPeer("p-old")] and "p-old" not in d.peers


# --- P: D refused the room before P's leg arrived (a null bootstrap_port) ---


def test_abort_before_our_leg_fails_the_leg_at_once_with_nothing_allocated() -> None:
    """D refused its leg (``bootstrap_port`` null) and sent ABORT before P's own leg arrived:
    P remembers the room (REFUSED) and fails the leg the moment it arrives, with D's reason,
    instead of holding it for a whole lease waiting for a RECV_INIT that never comes."""
    p = _p(initial=30.0)
    out = p.handle(ev.MessageReceived("d", Abort(1, "decode refused: bootstrap_port is null")), 0.0)
    assert out == [] and p.state_of(1) == "REFUSED" and p.poll(1) == KVPoll.Failed
    assert p.handle(ev.MessageReceived("d", Abort(1, "again")), 0.1) == []  # counted duplicate
    assert p.stats.duplicates == 1 and p.stats.unknown_room == 0
    out = p.handle(ev.PrefillRequestAccepted(1), 0.5)
    assert _kinds(out) == ["FailRequest"]  # no ReleaseKV: nothing was ever allocated
    assert out[0].status == 502
    assert "before this leg arrived" in out[0].reason and "bootstrap_port is null" in out[0].reason
    assert p.state_of(1) is None and p.poll(1) == KVPoll.Failed and not p.rooms
    assert p.next_deadline() is None  # the lease went with the room
    assert p.handle(ev.TimeAdvanced(), 100.0) == []  # and never releases anything later
    # Once answered, the room id is over: a later abort is late, a new request starts afresh.
    assert p.handle(ev.MessageReceived("d", Abort(1, "late")), 101.0) == []
    assert p.stats.late == 1
    assert _kinds(p.handle(ev.PrefillRequestAccepted(1), 102.0)) == []
    assert p.state_of(1) == "BOOTSTRAPPING"


def test_a_refused_room_whose_leg_never_comes_is_forgotten_at_lease_expiry() -> None:
    p = _p(initial=30.0)
    p.handle(ev.MessageReceived("d", Abort(1, "refused")), 0.0)
    assert p.lease_expiry(1) == 30.0
    assert p.handle(ev.TimeAdvanced(), 30.0) == []  # D already knows: nothing to send or free
    assert not p.rooms and p.poll(1) == KVPoll.Failed


def test_abort_after_our_leg_fails_the_waiting_leg_at_once() -> None:
    """The other order: P's leg is in (prefill running or done, no D yet) when D's ABORT for
    the refused room comes: the leg fails now and its pages are freed once."""
    p = _p(initial=30.0)
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    out = p.handle(ev.MessageReceived("d", Abort(1, "bootstrap_port is null")), 0.2)
    assert _kinds(out) == ["ReleaseKV", "FailRequest"]
    assert "bootstrap_port is null" in out[1].reason and p.state_of(1) is None
    p.handle(ev.PrefillRequestAccepted(2), 0.0)
    uuid = p.handle(ev.PrefillFinished(2, 5, 2), 0.1)[0].uuid
    out = p.handle(ev.MessageReceived("d", Abort(2, "bootstrap_port is null")), 0.2)
    assert _kinds(out) == ["ReleaseKV", "FailRequest"] and out[0].uuid == uuid


# --- liveness while the embedder is busy (StepStarted / StepEnded) ---


def test_p_answers_heartbeats_while_busy_through_its_own_effect() -> None:
    p = _p()
    (busy,) = p.handle(ev.StepStarted(), 0.0)
    assert isinstance(busy, fx.AckWhileBusy) and busy.incarnation == p.incarnation
    ack = busy.answer(Heartbeat(7, (1, 2), 3))
    assert ack == HeartbeatAck(p.incarnation, 7)  # alive; no room judged while busy
    assert busy.answer(HeartbeatAck(1, 1)) is None  # nothing else is answered meanwhile
    assert p.handle(ev.StepEnded(), 1.0) == [] and p.stats.busy_steps == 1


def test_a_busy_p_still_expires_leases_that_came_due() -> None:
    p = _p(initial=5.0)
    p.handle(ev.PrefillRequestAccepted(1), 0.0)
    out = p.handle(ev.StepStarted(), 6.0)
    assert _kinds(out) == ["ReleaseKV", "FailRequest", "AckWhileBusy"]


def test_d_repeats_its_last_heartbeats_while_busy() -> None:
    d = _d(heartbeat_interval=5.0)
    for room in (1, 2):
        d.handle(ev.DecodeRequestAccepted(room, "h:1", 1), 0.0)
    d.handle(ev.PeerResolved("h:1", "p", "t", L), 0.0)
    d.handle(ev.TimeAdvanced(), 5.0)  # the first heartbeat: seq 1
    (busy,) = d.handle(ev.StepStarted(), 6.0)
    assert isinstance(busy, fx.RepeatWhileBusy) and busy.interval == 5.0
    assert busy.heartbeats == (fx.SendMessage("p", Heartbeat(1, (1, 2), d.incarnation)),)
    assert d.handle(ev.StepEnded(), 7.0) == []
    idle = _d()
    assert idle.handle(ev.StepStarted(), 0.0) == [fx.RepeatWhileBusy((), 5.0)]


def test_d_tells_the_prefills_of_a_leg_it_refused_before_any_room() -> None:
    d = _d()
    out = d.handle(ev.LegRefused(9, ("p:1", "p:2"), "no port"), 0.0)
    assert out == [fx.SendMessage(p, Abort(9, "no port")) for p in ("p:1", "p:2")]
    assert d.stats.refusals_told == 2 and not d.rooms


def test_a_router_whose_decode_recomputes_leaves_a_failed_prefill_to_d() -> None:
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0"], random.Random(1), RouterConfig(decode_recomputes=True))
    (dispatch,) = router.handle(ev.RoomRequested("r"), 0.0)
    room = dispatch.room
    assert router.handle(ev.LegResponded(room, "prefill", False, "P died"), 0.1) == []
    assert router.poll(room) == "PREFILL_DONE"  # D's answer decides
    assert _kinds(router.handle(ev.LegResponded(room, "decode", True), 0.2)) == ["RelayDecode"]
    plain = RoomRouter(["p0"], ["d0"], random.Random(1))
    (dispatch,) = plain.handle(ev.RoomRequested("r"), 0.0)
    out = plain.handle(ev.LegResponded(dispatch.room, "prefill", False, "P died"), 0.1)
    assert _kinds(out) == ["AbortLeg", "ReplyError"]


# --- retries and migrations (issue 32) --------------------------------------------------------


def _reopen(out: list[fx.RouterEffect]) -> fx.ReopenRoom:
    (reopen,) = [e for e in out if isinstance(e, fx.ReopenRoom)]
    return reopen


def test_a_refused_leg_retries_on_other_workers_with_growing_jittered_backoff() -> None:
    from pd_fsm.core.config import RouterConfig

    cfg = RouterConfig(retry_limit=3, retry_backoff=0.1, room_timeout=60.0)
    router = RoomRouter(["p0", "p1"], ["d0", "d1"], random.Random(7), cfg)
    (first,) = router.handle(ev.RoomRequested("r"), 0.0)
    out = router.handle(ev.LegResponded(first.room, "decode", False, "HTTP 500", retryable=True),
                        1)
    assert _kinds(out) == ["AbortLeg", "ReopenRoom"] and out[0].leg == "prefill"
    reopen = _reopen(out)
    assert reopen.cause == "retry" and 0.05 <= reopen.delay < 0.1
    assert reopen.attempts.retries == 1 and reopen.attempts.avoid == (first.decode,)
    assert reopen.attempts.deadline == 60.0  # the first room's deadline goes on
    assert router.outcomes["RETRIED"] == 1 and not router.rooms
    # The next room avoids the worker that refused it.
    (second,) = router.handle(ev.RoomRequested("r", attempts=reopen.attempts), 2.0)
    assert second.decode != first.decode
    out = router.handle(ev.LegResponded(second.room, "prefill", False, "refused", refused=True), 2)
    assert _kinds(out) == ["AbortLeg", "ReopenRoom"] and out[0].leg == "decode"
    again = _reopen(out)
    assert 0.1 <= again.delay < 0.2 and again.attempts.avoid == (first.decode, second.prefill)
    assert router.next_deadline() is None


def test_retries_stop_at_the_limit_and_at_the_request_deadline() -> None:
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0"], random.Random(7), RouterConfig(retry_limit=1))
    spent = Attempts(retries=1)
    (room,) = router.handle(ev.RoomRequested("r", attempts=spent), 0.0)
    out = router.handle(ev.LegResponded(room.room, "decode", False, "no", refused=True), 0.1)
    assert _kinds(out) == ["AbortLeg", "ReplyError"]  # no retry left: the room fails
    late = Attempts(deadline=5.0)
    (room,) = router.handle(ev.RoomRequested("r", attempts=late), 4.99)
    assert router.next_deadline() == 5.0  # a retried room keeps its request's deadline
    out = router.handle(ev.LegResponded(room.room, "decode", False, "no", refused=True), 4.99)
    assert _kinds(out) == ["AbortLeg", "ReplyError"]  # a backoff would pass the deadline
    # A failure that is not a refusal (a 500 after work began) never retries.
    (room,) = router.handle(ev.RoomRequested("r"), 0.0)
    out = router.handle(ev.LegResponded(room.room, "decode", False, "HTTP 500"), 0.1)
    assert _kinds(out) == ["AbortLeg", "ReplyError"]


def test_a_decode_worker_breaking_off_mid_relay_migrates_a_migratable_request() -> None:
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0", "d1"], random.Random(7), RouterConfig(migration_limit=1))
    (room,) = router.handle(ev.RoomRequested("r", migratable=True), 0.0)
    router.handle(ev.LegResponded(room.room, "decode", True), 0.5)
    assert router.poll(room.room) == "RELAYING"
    out = router.handle(ev.LegResponded(room.room, "decode", False, "reset"), 1.0)
    assert _kinds(out) == ["AbortLeg", "ReopenRoom"]
    reopen = _reopen(out)
    assert (reopen.cause, reopen.delay, reopen.attempts.migrations) == ("migration", 0.0, 1)
    assert reopen.attempts.avoid == (room.decode,) and reopen.attempts.deadline is None
    assert router.outcomes["MIGRATED"] == 1
    # The limit reached, the next break fails the room as before (the stream ends in error).
    (second,) = router.handle(ev.RoomRequested("r", attempts=reopen.attempts, migratable=True),
                              1.0)
    assert second.decode != room.decode
    router.handle(ev.LegResponded(second.room, "decode", True), 1.5)
    out = router.handle(ev.LegResponded(second.room, "decode", False, "reset"), 2.0)
    assert _kinds(out) == ["AbortLeg"] and router.outcomes["FAILED"] == 1
    # A request the proxy cannot continue exactly is never migrated.
    (third,) = router.handle(ev.RoomRequested("r"), 3.0)
    router.handle(ev.LegResponded(third.room, "decode", True), 3.5)
    out = router.handle(ev.LegResponded(third.room, "decode", False, "reset"), 4.0)
    assert _kinds(out) == ["AbortLeg"]


def test_a_draining_decode_worker_hands_its_stream_off_and_a_failed_hand_off_migrates() -> None:
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0", "d1"], random.Random(7),
                        RouterConfig(migration_limit=1, breaker_threshold=1))
    (room,) = router.handle(ev.RoomRequested("r", migratable=True), 0.0)
    router.handle(ev.LegResponded(room.room, "decode", True), 0.5)
    out = router.handle(ev.LegResponded(room.room, "decode", False, "drain", handoff=True), 1.0)
    assert _kinds(out) == ["AbortLeg", "ReopenRoom"]  # no BreakerChanged: not a fault of D's
    reopen = _reopen(out)
    assert (reopen.cause, reopen.delay, reopen.attempts.handoffs) == ("handoff", 0.0, 1)
    assert reopen.attempts.migrations == 0 and reopen.attempts.avoid == (room.decode,)
    assert reopen.attempts.handed_off_by == room.decode  # its hand-off legs never go there
    assert router.outcomes["HANDED_OFF"] == 1
    # The hand-off room: D alone (the other one), no P leg.
    (leg,) = router.handle(ev.RoomRequested("r", attempts=reopen.attempts, migratable=True,
                                            handoff=True), 1.0)
    assert isinstance(leg, fx.DispatchLocal) and leg.reason == "handoff"
    assert leg.decode != room.decode and router.poll(leg.room) == "HANDOFF"
    # Its pull failed before any byte: the request falls back to a migration (a re-prefill).
    out = router.handle(ev.LegResponded(leg.room, "decode", False, "pull failed", False, True),
                        1.5)
    assert _kinds(out)[-1] == "ReopenRoom" and _reopen(out).cause == "migration"
    assert router.outcomes["MIGRATED"] == 1
    # A hand-off that succeeds relays like a room D prefilled alone.
    (ok,) = router.handle(ev.RoomRequested("r", attempts=reopen.attempts, migratable=True,
                                           handoff=True), 2.0)
    assert _kinds(router.handle(ev.LegResponded(ok.room, "decode", True), 2.5)) == ["RelayDecode"]
    assert router.poll(ok.room) == "LOCAL_RELAYING"
    # A request the proxy cannot continue is never handed off: the ticket fails the room.
    (plain,) = router.handle(ev.RoomRequested("q"), 3.0)
    router.handle(ev.LegResponded(plain.room, "decode", True), 3.5)
    out = router.handle(ev.LegResponded(plain.room, "decode", False, "drain", handoff=True), 4.0)
    assert "ReopenRoom" not in _kinds(out)


def test_a_refused_hand_off_leg_goes_to_another_decode_worker_with_its_ticket() -> None:
    """The proxy picks the hand-off room's D itself (the least loaded), and may pick one that
    is down while the draining D's gate found another up: a leg refused before that D took it
    is posted within the room to another D (the draining D still registers the KV), each D
    once; only when every other D refused does the request fall back to a re-prefill. The
    request's migrations are not used up by it, and it needs none left."""
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0", "d1", "d2", "d3"], random.Random(7),
                        RouterConfig(migration_limit=1, breaker_threshold=0))
    spent = Attempts(migrations=1, handoffs=1, avoid=("d0",), handed_off_by="d0")  # none left
    (leg,) = router.handle(ev.RoomRequested("r", attempts=spent, migratable=True,
                                            handoff=True), 0.0)
    assert isinstance(leg, fx.DispatchLocal) and leg.decode == "d1"  # ties: the list's order
    out = router.handle(ev.LegResponded(leg.room, "decode", False, "connect refused",
                                        refused=True, retryable=True), 0.1)
    assert out == [fx.RedirectDecode(leg.room, "", "d2")]
    assert router.poll(leg.room) == "HANDOFF"
    # Taken there: relayed as any hand-off room that was taken.
    assert _kinds(router.handle(ev.LegResponded(leg.room, "decode", True), 0.2)) == [
        "RelayDecode"]
    assert router.outcomes["MIGRATED"] == 0

    # Every other D refuses in turn (a draining one's 503, a stale role's 409 alike), never one
    # twice, d3 last (it failed the request before), never the draining d0; then, a migration
    # left, the request falls back to a re-prefill avoiding them all.
    handed = Attempts(handoffs=1, avoid=("d3", "d0"), handed_off_by="d0")
    (leg,) = router.handle(ev.RoomRequested("q", attempts=handed, migratable=True, handoff=True),
                           1.0)
    refusers = [leg.decode]
    for _ in range(2):
        (redirect,) = router.handle(ev.LegResponded(leg.room, "decode", False, "503 draining",
                                                    refused=True), 1.1)
        assert isinstance(redirect, fx.RedirectDecode) and redirect.decode not in refusers
        refusers.append(redirect.decode)
    assert refusers in (["d1", "d2", "d3"], ["d2", "d1", "d3"])
    out = router.handle(ev.LegResponded(leg.room, "decode", False, "refused", refused=True),
                        1.2)
    reopen = _reopen(out)
    assert reopen.cause == "migration" and set(reopen.attempts.avoid) == {"d0", *refusers}
    # A pull that failed (not a refusal: the D took the leg) falls back at once, as before.
    (leg,) = router.handle(ev.RoomRequested("s", attempts=handed, migratable=True, handoff=True),
                           2.0)
    out = router.handle(ev.LegResponded(leg.room, "decode", False, "pull failed", False, True),
                        2.1)
    assert _reopen(out).cause == "migration"


def test_a_refused_hand_off_leg_tries_a_decode_worker_whose_breaker_is_open_before_a_prefill(
        ) -> None:
    """The routable Ds are preferred; with none left the hand-off leg still goes to a D whose
    breaker is open (it may be back: a restart), as a re-prefill would, not to a re-prefill."""
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0", "d1", "d2"], random.Random(7),
                        RouterConfig(breaker_threshold=1, breaker_cooldown=60.0))
    router.breakers.outcome("d1", False, True, 0.0, [])  # one fault: open
    assert router.breakers.state("d1") == "OPEN"
    handed = Attempts(handoffs=1, avoid=("d0",), handed_off_by="d0")
    (leg,) = router.handle(ev.RoomRequested("r", attempts=handed, migratable=True, handoff=True),
                           1.0)
    assert leg.decode == "d2"  # the routable one
    out = router.handle(ev.LegResponded(leg.room, "decode", False, "refused", refused=True), 1.1)
    assert [e for e in out if isinstance(e, fx.RedirectDecode)] == [
        fx.RedirectDecode(leg.room, "", "d1")]


def test_a_worker_that_keeps_failing_is_routed_around_then_probed() -> None:
    from pd_fsm.core.config import RouterConfig

    cfg = RouterConfig(breaker_threshold=2, breaker_cooldown=10.0, retry_limit=0)
    router = RoomRouter(["p0"], ["d0", "d1"], random.Random(3), cfg)

    def room_on(decode: str, now: float) -> int:
        for _ in range(20):
            (d,) = [e for e in router.handle(ev.RoomRequested("r"), now)
                    if isinstance(e, fx.DispatchRoom)]
            if d.decode == decode:
                return d.room
            router.handle(ev.LegResponded(d.room, "decode", True), now)
            router.handle(ev.RelayFinished(d.room), now)
        raise AssertionError(f"never routed to {decode}")

    out: list[fx.RouterEffect] = []
    for now in (1.0, 2.0):  # two refusals in a row: the second trips it
        out += router.handle(ev.LegResponded(room_on("d0", now), "decode", False, "refused",
                                             refused=True), now)
    assert router.breakers.state("d0") == "OPEN"
    assert [e for e in out if isinstance(e, fx.BreakerChanged)] == [
        fx.BreakerChanged("d0", "CLOSED", "OPEN")]
    # Open: every room goes to d1 for the cool-down.
    for i in range(6):
        (d,) = [e for e in router.handle(ev.RoomRequested(f"x{i}"), 3.0)
                if isinstance(e, fx.DispatchRoom)]
        assert d.decode == "d1"
        router.handle(ev.LegResponded(d.room, "decode", True), 3.0)
        router.handle(ev.RelayFinished(d.room), 3.0)
    assert router.next_deadline() == 12.0  # the cool-down's end
    changed = router.handle(ev.TimeAdvanced(), 12.0)
    assert changed == [fx.BreakerChanged("d0", "OPEN", "HALF_OPEN")]
    probe = room_on("d0", 12.5)
    assert router.breakers.state("d0") == "PROBING"
    out = router.handle(ev.LegResponded(probe, "decode", True), 13.0)
    assert fx.BreakerChanged("d0", "PROBING", "CLOSED") in out
    assert router.breakers.changes == {"CLOSED->OPEN": 1, "OPEN->HALF_OPEN": 1,
                                       "PROBING->CLOSED": 1}


def test_failures_that_are_not_the_workers_do_not_open_its_breaker() -> None:
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0"], random.Random(3), RouterConfig(breaker_threshold=1))
    (d,) = router.handle(ev.RoomRequested("r"), 0.0)
    router.handle(ev.LegResponded(d.room, "decode", False, "HTTP 400: bad max_tokens"), 0.1)
    assert router.breakers.state("d0") == "CLOSED"
    router.set_workers(["p0"], [])  # a worker that leaves the lists is forgotten
    assert router.breakers.states() == {"p0": "CLOSED"}


def test_a_worker_that_changed_role_starts_its_breaker_afresh() -> None:
    """Its faults were the old role's (refused legs while it drained for the switch): as P it
    is routed at once, not skipped for the cool-down; a worker keeping its role keeps its
    breaker."""
    from pd_fsm.core.config import RouterConfig

    router = RoomRouter(["p0"], ["d0", "d1"], random.Random(3),
                        RouterConfig(breaker_threshold=1, breaker_cooldown=60.0))
    for d in ("d0", "d1"):
        router.breakers.outcome(d, False, True, 0.0, [])
    assert router.breakers.states() == {"p0": "CLOSED", "d0": "OPEN", "d1": "OPEN"}
    router.set_workers(["p0", "d0"], ["d1"])  # d0 switched to prefill, probed serving
    assert router.breakers.states() == {"p0": "CLOSED", "d0": "CLOSED", "d1": "OPEN"}
    turns = [router.handle(ev.RoomRequested(f"r{i}"), 1.0)[0] for i in range(4)]
    assert {t.prefill for t in turns} == {"p0", "d0"}  # round robin over both P


def test_a_decode_leg_refused_before_taking_the_room_moves_to_another_d_in_the_room() -> None:
    """P's prefill is not redone: the other D claims the KV P holds for the same room."""
    router = RoomRouter(["p0"], ["d0", "d1"], random.Random(7))
    (room,) = router.handle(ev.RoomRequested("r"), 0.0)
    out = router.handle(ev.LegResponded(room.room, "decode", False, "connect error",
                                        refused=True, retryable=True), 0.1)
    other = "d1" if room.decode == "d0" else "d0"
    assert out == [fx.RedirectDecode(room.room, "p0", other)]
    assert router.poll(room.room) == "DISPATCHED"  # the same room, P's leg untouched
    router.handle(ev.LegResponded(room.room, "decode", True), 0.5)
    assert router.poll(room.room) == "RELAYING"
    # With no other D, the refusal retries the whole request instead.
    alone = RoomRouter(["p0"], ["d0"], random.Random(7))
    (room,) = alone.handle(ev.RoomRequested("r"), 0.0)
    out = alone.handle(ev.LegResponded(room.room, "decode", False, "connect error",
                                       refused=True, retryable=True), 0.1)
    assert _kinds(out) == ["AbortLeg", "ReopenRoom"]


def test_a_refused_decode_leg_goes_to_a_d_the_request_failed_on_when_no_other_is_left() -> None:
    """Issue 32 (sim seed 534, ``--decode 3 --role-switches 1``): a handed-off stream whose
    hand-off pull failed (its draining D crashed) re-prefills avoiding the taker, a D that then
    crashes is avoided too, and the retry's D is down: every D is one the request failed on,
    and its retries are spent. The refused leg goes within the room to one of them (the taker is
    up), not to the client as a 502; never to a D that refused the room, and to the D that
    handed the stream off only last."""
    router = RoomRouter(["p0"], ["d0", "d1", "d2", "d3"], random.Random(7))
    spent = Attempts(retries=2, migrations=1, handoffs=1, avoid=("d2", "d0", "d1", "d3"),
                     handed_off_by="d3")
    (room,) = router.handle(ev.RoomRequested("r", attempts=spent), 0.0)
    first = room.decode
    seen = [first]
    for now in (0.1, 0.2):
        out = router.handle(ev.LegResponded(room.room, "decode", False, "connect refused",
                                            refused=True, retryable=True), now)
        (redirect,) = out
        assert isinstance(redirect, fx.RedirectDecode) and redirect.prefill == "p0"
        assert redirect.decode not in seen and redirect.decode != "d3", (seen, redirect)
        seen.append(redirect.decode)
    # Its redirects are spent (retry_limit) and so are its retries: the room fails now.
    out = router.handle(ev.LegResponded(room.room, "decode", False, "connect refused",
                                        refused=True, retryable=True), 0.3)
    assert _kinds(out) == ["AbortLeg", "ReplyError"]
    # A D the request did not fail on still comes first.
    router = RoomRouter(["p0"], ["d0", "d1", "d2"], random.Random(7))
    (room,) = router.handle(ev.RoomRequested("r", attempts=Attempts(avoid=("d1",))), 0.0)
    out = router.handle(ev.LegResponded(room.room, "decode", False, "connect refused",
                                        refused=True), 0.1)
    assert out == [fx.RedirectDecode(room.room, "p0", ({"d0", "d2"} - {room.decode}).pop())]
