"""Every (state, trigger) pair of the room tables, against the compiled endpoints.

For each pair the room is driven into ``state`` along a path found in the table itself, then
``trigger`` is fired and the outcome compared with the table: a row gives the next state and the
external effects in order; a missing row gives, for a remote trigger, the ProtocolViolated row
(the room fails, the endpoint goes on) and, for a local one, a LocalProtocolError — except the
few local triggers the endpoints answer without a row (documented per case below).
"""

from __future__ import annotations

import pytest

from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import ALL_TABLES, KV_RECEIVER, KV_SENDER
from tests.support.core_harness import ROOM, DecodeHarness, PrefillHarness, external_kinds, path_to

SENDER_EXTERNAL = {
    "RegisterKV",
    "SendReady",
    "SendAbort",
    "ReleaseKV",
    "CompleteRequest",
    "FailRequest",
}
RECEIVER_EXTERNAL = {
    "ResolvePeer",
    "AllocateBlocks",
    "CancelAllocation",
    "SendRecvInit",
    "StartPull",
    "SendDone",
    "SendDoneFailed",
    "SendAbort",
    "ReleaseBlocks",
    "CompleteTransfer",
    "FailRequest",
}


def _pairs(table, transient=("NEW",)):  # NEW never persists: both endpoints step out of it at once
    return [(s, t) for s, t in table.pairs() if s not in transient]


def _expected_effects(effects, external, peer_bound):
    return [e for e in effects if e in external and (e != "SendAbort" or peer_bound)]


@pytest.mark.parametrize(("state", "trigger"), _pairs(KV_SENDER))
def test_sender_pair(state: str, trigger: str) -> None:
    h = PrefillHarness()
    for step in path_to(KV_SENDER, state):
        h.fire(step)
    if state in KV_SENDER.terminal:
        assert h.state is None and h.ep.poll(ROOM) == KV_SENDER.poll_of[state]
        if trigger == "LeaseExpired":
            return  # a retired room has no lease left to expire
        out = h.fire(trigger)
        kinds = set(external_kinds(out))
        assert not kinds & {"RegisterKV", "ReleaseKV", "CompleteRequest"}, "retired room touched KV"
        if trigger != "RequestAccepted":  # a new request may reuse a finished room id
            assert h.state is None
        return
    assert h.state == state
    room = h.ep.rooms[ROOM]
    bound = room.peer is not None or trigger in ("RecvInitReceived", "ProtocolViolated")
    row = KV_SENDER.step(state, trigger)
    if row is None and trigger in KV_SENDER.remote_triggers:
        row = KV_SENDER.step(state, "ProtocolViolated")
        assert row is not None, f"{state} has no ProtocolViolated row"
        before = h.ep.stats.remote_errors
        out = h.fire(trigger)
        assert h.ep.stats.remote_errors == before + 1
    elif row is None:
        if trigger == "RequestAccepted":
            out = h.fire(trigger)
            assert external_kinds(out) == ["RejectRequest"] and h.state == state
        elif trigger == "Aborted":
            out = h.fire(trigger)
            assert out == [] and h.state == state
        else:
            with pytest.raises(LocalProtocolError):
                h.fire(trigger)
        return
    else:
        out = h.fire(trigger)
    target = row.target
    assert (h.state or _terminal_of(h, KV_SENDER)) == target
    assert external_kinds(out) == _expected_effects(row.effects, SENDER_EXTERNAL, bound)


def _terminal_of(h, table) -> str:
    poll = h.ep.poll(ROOM)
    matches = [s for s in table.terminal if table.poll_of[s] == poll]
    assert len(matches) == 1
    return matches[0]


def _receiver_delivers(h: DecodeHarness, trigger: str) -> bool:
    """PeerLost reaches only rooms in P's heartbeat set; PeerResolved/Unresolved only rooms
    waiting in RESOLVING (they are answers to a lookup, not messages to one room); a P's message
    only rooms bound to that P (before resolution any P is a stranger: counted as foreign)."""
    room = h.ep.rooms[ROOM]
    if trigger in KV_RECEIVER.remote_triggers or trigger == "ProtocolViolated":
        return room.peer is not None
    if trigger == "PeerLost":
        peer = h.ep.peers.get(room.peer) if room.peer else None
        return peer is not None and ROOM in peer.rooms
    if trigger in ("PeerResolved", "PeerUnresolved"):
        return room.state == "RESOLVING"
    return True


@pytest.mark.parametrize(("state", "trigger"), _pairs(KV_RECEIVER))
def test_receiver_pair(state: str, trigger: str) -> None:
    h = DecodeHarness()
    for step in path_to(KV_RECEIVER, state):
        h.fire(step)
    if state in KV_RECEIVER.terminal:
        assert h.state is None and h.ep.poll(ROOM) == KV_RECEIVER.poll_of[state]
        if trigger in ("TimedOut", "PeerLost", "PeerResolved", "PeerUnresolved"):
            return  # nothing left to time out, no heartbeat membership, no lookup pending
        if trigger in ("BlocksAllocated", "PullSucceeded", "PullFailed"):
            out = h.fire(trigger)  # late local report for a finished room: counted, dropped
            assert out == [] and h.ep.stats.late >= 1
            return
        out = h.fire(trigger)
        kinds = set(external_kinds(out))
        assert not kinds & {"ReleaseBlocks", "StartPull", "CompleteTransfer"}
        if trigger != "RequestAccepted":
            assert h.state is None
        return
    assert h.state == state
    room = h.ep.rooms[ROOM]
    bound = room.peer is not None
    if not _receiver_delivers(h, trigger):
        out = h.fire(trigger)
        assert h.state == state and not [k for k in external_kinds(out) if k != "FailRequest"]
        return
    row = KV_RECEIVER.step(state, trigger)
    if row is None and trigger in KV_RECEIVER.remote_triggers:
        row = KV_RECEIVER.step(state, "ProtocolViolated")
        assert row is not None, f"{state} has no ProtocolViolated row"
        out = h.fire(trigger)
    elif row is None:
        if trigger == "RequestAccepted":
            out = h.fire(trigger)
            assert external_kinds(out) == ["RejectRequest"] and h.state == state
        elif trigger == "Aborted":
            assert h.fire(trigger) == [] and h.state == state
        else:
            with pytest.raises(LocalProtocolError):
                h.fire(trigger)
        return
    else:
        out = h.fire(trigger)
    assert (h.state or _terminal_of(h, KV_RECEIVER)) == row.target
    assert external_kinds(out) == _expected_effects(row.effects, RECEIVER_EXTERNAL, bound)


@pytest.mark.parametrize("table", list(ALL_TABLES.values()), ids=lambda t: t.name)
def test_every_state_has_a_documented_meaning(table) -> None:
    assert all(doc for doc in table.states.values())
    assert all(r.reason for r in table.rows)


# --- instance_lease, through BootstrapRegistry ---

from pd_fsm.core import effects as fx  # noqa: E402
from pd_fsm.core import events as ev  # noqa: E402
from pd_fsm.core.registry import Acknowledged, BootstrapRegistry, RegistrationRequired  # noqa: E402
from pd_fsm.core.router import RoomRouter  # noqa: E402
from pd_fsm.core.tables import INSTANCE_LEASE  # noqa: E402
from pd_fsm.core.tables import ROOM as ROOM_TABLE  # noqa: E402

KEY = ("prefill", "p0", 0, 0, 0, 0)


def _registry_fire(reg: BootstrapRegistry, trigger: str, now: float) -> list:
    if trigger == "Expired":
        return reg.handle(ev.TimeAdvanced(), reg.expires_at(KEY) or now)
    return reg.handle(
        {
            "Registered": ev.InstanceRegistered(KEY, {"id": "p0"}, "127.0.0.1:8998"),
            "HeartbeatReceived": ev.InstanceHeartbeat(KEY),
            "Deregistered": ev.InstanceDeregistered(KEY),
        }[trigger],
        now,
    )


_REGISTRY_EFFECT = {"AskToRegister": RegistrationRequired, "DropRecord": None, "StoreRecord": None}


@pytest.mark.parametrize(("state", "trigger"), list(INSTANCE_LEASE.pairs()))
def test_instance_lease_pair(state: str, trigger: str) -> None:
    reg = BootstrapRegistry()
    for step in path_to(INSTANCE_LEASE, state):
        _registry_fire(reg, step, 1.0)
    if state in INSTANCE_LEASE.terminal:
        assert reg.state_of(KEY) == "NONE"  # forgotten: a terminal key is a new key again
        return
    row = INSTANCE_LEASE.step(state, trigger)
    if trigger == "Expired" and state == "NONE":
        assert reg.handle(ev.TimeAdvanced(), 1e9) == []  # nothing to expire
        return
    assert row is not None, f"instance_lease must answer every remote trigger in {state}"
    out = _registry_fire(reg, trigger, 2.0)
    after = reg.state_of(KEY)
    assert after == (row.target if row.target not in INSTANCE_LEASE.terminal else "NONE")
    asked = any(isinstance(o, RegistrationRequired) for o in out)
    assert asked == ("AskToRegister" in row.effects)
    assert any(isinstance(o, fx.InstanceExpired) for o in out) == (trigger == "Expired")
    assert any(isinstance(o, Acknowledged) for o in out) == (row.target == "ALIVE")
    if row.target == "ALIVE":
        assert reg.expires_at(KEY) == 2.0 + reg.config.ttl
        assert reg.resolve("127.0.0.1:8998") == [(KEY, {"id": "p0"})]
    else:
        assert reg.resolve("127.0.0.1:8998") == []


# --- room, through RoomRouter ---

_ROOM_EVENTS = {
    "PrefillResponded": ("prefill", True),
    "PrefillFailed": ("prefill", False),
    "DecodeResponded": ("decode", True),
    "DecodeFailed": ("decode", False),
}
_ROOM_EFFECTS = {
    "PostBothLegs": ["DispatchRoom"],
    "RelayDecode": ["RelayDecode"],
    "AbortDecodeLeg": ["AbortLeg"],
    "AbortPrefillLeg": ["AbortLeg"],
    "AbortBothLegs": ["AbortLeg", "AbortLeg"],
    "ReplyError": ["ReplyError"],
}


def _room_fire(router: RoomRouter, room: int, trigger: str) -> list:
    if trigger in _ROOM_EVENTS:
        leg, ok = _ROOM_EVENTS[trigger]
        return router.handle(ev.LegResponded(room, leg, ok, "" if ok else "boom"), 1.0)
    if trigger == "ClientDisconnected":
        return router.handle(ev.ClientDisconnected(room), 1.0)
    if trigger == "RelayFinished":
        return router.handle(ev.RelayFinished(room), 1.0)
    if trigger == "TimedOut":
        return router.handle(ev.TimeAdvanced(), 1e9)
    raise AssertionError(trigger)


@pytest.mark.parametrize(("state", "trigger"), _pairs(ROOM_TABLE, transient=("ALLOCATED",)))
def test_room_pair(state: str, trigger: str) -> None:
    import random

    router = RoomRouter(["http://p0", "http://p1"], ["http://d0"], random.Random(3))
    out = router.handle(ev.RoomRequested("req-1"), 0.0)
    assert [type(o).__name__ for o in out] == ["DispatchRoom"]
    room = out[0].room
    for step in path_to(ROOM_TABLE, state, start="DISPATCHED"):  # RoomRequested dispatched it
        _room_fire(router, room, step)
    if trigger == "Dispatched":
        return  # only RoomRequested dispatches; there is no event that re-dispatches a room
    if state in ROOM_TABLE.terminal:
        assert router.poll(room) is None
        if trigger != "TimedOut":
            dropped = router.dropped
            assert _room_fire(router, room, trigger) == [] and router.dropped == dropped + 1
        return
    row = ROOM_TABLE.step(state, trigger)
    out = _room_fire(router, room, trigger)
    if row is None:
        assert out == [] and router.poll(room) == state and router.dropped == 1
        return
    expected = [k for e in row.effects for k in _ROOM_EFFECTS[e]]
    assert [type(o).__name__ for o in out] == expected
    assert router.poll(room) == (None if row.target in ROOM_TABLE.terminal else row.target)
