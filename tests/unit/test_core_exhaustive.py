"""Every (state, trigger) pair of every state table, against the compiled core.

The pairs are generated from the compiled tables (``ALL_TABLES``: every table, every state x every
trigger), and each is driven through the code that executes that table: kv_sender and
kv_hold_lease through PrefillEndpoint, kv_receiver through DecodeEndpoint, instance_lease through
BootstrapRegistry, room through RoomRouter, worker_breaker through WorkerBreakers, proxy_session
through ProxySession, proxy_sequence through SequenceSession. The room (lease, key) is brought
into ``state`` along a path of the table's own rows, the event(s) that make ``trigger`` are fed
in, and what the code did is recorded (every step it took, with that step's effects; an error;
its counters). Then:

* every step taken must be a row, with that row's effects in order (checked for all steps);
* a pair with a row must take it;
* a pair without a row: a trigger caused by the peer (``remote = true``, and ProtocolViolated,
  which the endpoint raises on a peer's impossible message) fails the room through the state's
  ProtocolViolated row, counts a remote error and never raises; a local trigger raises
  LocalProtocolError, except for the inputs the code answers without a row for a stated reason
  (``_no_row``: a request reusing a live room id, an abort or a late report racing the room's
  end, a message for a room that is not live here);
* a pair the public API cannot produce is listed in ``UNREACHABLE`` with the reason. Each is
  fired anyway and must leave the room untouched (so the list is exactly the unreachable set: a
  change that makes one reachable fails here), the rows among them must be exactly
  ``DEAD_ROWS``, and for each missing row the table guard itself (the code's ``_step``) refuses
  the pair with LocalProtocolError.

``KNOWN_BUGS`` are pairs where the code does not do what the above demands; they are run with
``xfail(strict=True)``, so fixing one fails here until it is removed from the list.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.breakers import WorkerBreakers
from pd_fsm.core.config import RouterConfig
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.messages import MAX_ROOM, Heartbeat, HeartbeatAck
from pd_fsm.core.registry import BootstrapRegistry
from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.routing import Prompt, RoutingConfig
from pd_fsm.core.session import ProxySession, SequenceSession
from pd_fsm.core.tables import (
    ALL_TABLES,
    INSTANCE_LEASE,
    KV_HANDOFF,
    KV_HOLD_LEASE,
    KV_RECEIVER,
    KV_SENDER,
    PROXY_SEQUENCE,
    PROXY_SESSION,
    ROLE_SWITCH,
    WORKER_BREAKER,
    StateTable,
)
from pd_fsm.core.tables import ROOM as ROOM_TABLE
from tests.support.core_harness import (
    D_ID,
    ROOM,
    DecodeHarness,
    PrefillHarness,
    external_kinds,
)

# --- what cannot be produced through the public API, and why --------------------------------

_NO_TIMER = "no timer runs for it: the room (lease, key) does not exist here, or is already over"
_LOOKUP = "a lookup answer (PeerResolved / PeerUnresolved) reaches only rooms waiting in RESOLVING"
_NOT_IN_HB = "PeerLost reaches only rooms in P's heartbeat set (joined in ALLOCATING, left on fail)"
_LEASE_GRANT = "a lease is granted only when its room comes into existence (a NEW row's GrantLease)"
_LEASE_ONCE = (
    "ReleaseLease and expiry act only on a LEASED lease, and the room retires with its lease: "
    "a RELEASED or EXPIRED lease is gone (a new request for the id gets a new lease from NONE)"
)
_DISPATCH = "only RoomRequested dispatches, and it always draws a new room"

UNREACHABLE: dict[tuple[str, str, str], str] = {
    ("kv_sender", "NEW", "LeaseExpired"): _NO_TIMER,
    ("kv_sender", "SUCCEEDED", "LeaseExpired"): _NO_TIMER,
    ("kv_sender", "FAILED", "LeaseExpired"): _NO_TIMER,
    ("kv_receiver", "NEW", "TimedOut"): _NO_TIMER,
    ("kv_receiver", "SUCCEEDED", "TimedOut"): _NO_TIMER,
    ("kv_receiver", "FAILED", "TimedOut"): _NO_TIMER,
    **{
        ("kv_receiver", s, t): _LOOKUP
        for s in ("NEW", "ALLOCATING", "WAITING_FOR_READY", "STREAMING", "TRANSFERRING",
                  "REPULLING", "CANCELLING", "SUCCEEDED", "FAILED")
        for t in ("PeerResolved", "PeerUnresolved")
    },
    ("kv_receiver", "NEW", "PeerLost"): _NOT_IN_HB,
    ("kv_receiver", "RESOLVING", "PeerLost"): _NOT_IN_HB,
    ("kv_receiver", "CANCELLING", "PeerLost"): _NOT_IN_HB + " (CANCELLING left it)",
    ("kv_receiver", "SUCCEEDED", "PeerLost"): _NOT_IN_HB,
    ("kv_receiver", "FAILED", "PeerLost"): _NOT_IN_HB,
    ("kv_hold_lease", "NONE", "Released"): _LEASE_GRANT + "; nothing to release before it",
    ("kv_hold_lease", "NONE", "Expired"): _NO_TIMER,
    ("kv_hold_lease", "LEASED", "Granted"): _LEASE_GRANT,
    **{
        ("kv_hold_lease", s, t): _LEASE_ONCE
        for s in ("RELEASED", "EXPIRED")
        for t in ("Granted", "Released", "Expired")
    },
    ("instance_lease", "NONE", "Expired"): _NO_TIMER,
    ("instance_lease", "EXPIRED", "Expired"): _NO_TIMER,
    ("instance_lease", "DEREGISTERED", "Expired"): _NO_TIMER,
    ("room", "ALLOCATED", "TimedOut"): _NO_TIMER,
    ("room", "ALLOCATED", "ClientDisconnected"): (
        "a room is drawn and dispatched in one call (RoomRequested): no event finds it ALLOCATED"
    ),
    **{
        ("room", s, t): _DISPATCH
        for s in ("DISPATCHED", "PREFILL_DONE", "RELAYING", "COMPLETED", "FAILED", "CANCELLED",
                  "LOCAL", "LOCAL_RELAYING", "RETRIED", "MIGRATED")
        for t in ("Dispatched", "DispatchedLocal")
    },
    ("room", "COMPLETED", "TimedOut"): _NO_TIMER,
    ("room", "FAILED", "TimedOut"): _NO_TIMER,
    ("room", "CANCELLED", "TimedOut"): _NO_TIMER,
    **{
        ("room", s, "DecodeBroke"): (
            "DecodeBroke is what a decode leg failing mid-relay becomes: before the relay the "
            "same failure is DecodeFailed or DecodeRetryable"
        )
        for s in ("DISPATCHED", "PREFILL_DONE", "LOCAL")
    },
    **{
        ("room", s, t): (
            "a decode leg failing mid-relay has sent bytes: it is DecodeBroke or DecodeFailed, "
            "never refused or retryable"
        )
        for s in ("RELAYING", "LOCAL_RELAYING")
        for t in ("DecodeRetryable", "DecodeRefused")
    },
    ("room", "LOCAL", "DecodeRefused"): (
        "a room D prefills alone has no P holding KV: a refused leg retries the whole request "
        "(DecodeRetryable), nothing is redirected"
    ),
    **{("worker_breaker", s, "CooledDown"): "only an OPEN breaker has a cool-down running"
       for s in ("CLOSED", "HALF_OPEN", "PROBING")},
    **{("worker_breaker", s, "ProbeDispatched"): (
        "a room routed to a worker is its probe only while HALF_OPEN (OPEN and PROBING workers "
        "are routed to only when every worker of the role is, and then it is no probe)")
       for s in ("CLOSED", "OPEN", "PROBING")},
    **{("worker_breaker", "FORGOTTEN", t): (
        "a worker no longer listed has no breaker: its late legs are ignored, nothing routes "
        "to it, and listed again it starts a new one, CLOSED")
       for t in ("LegSucceeded", "LegFaulted", "Tripped", "CooledDown", "ProbeDispatched",
                 "WorkerRemoved")},
    ("room", "RETRIED", "TimedOut"): _NO_TIMER,
    ("room", "MIGRATED", "TimedOut"): _NO_TIMER,
    ("room", "HANDED_OFF", "TimedOut"): _NO_TIMER,
    **{("kv_handoff", s, "LeaseExpired"): "only an OFFERED hand-off has a lease running"
       for s in ("NONE", "RELEASED", "EXPIRED", "WAITING_FOR_PAGES", "PULLING", "ABANDONED",
                 "TAKEN", "FAILED", "DROPPED", "WITHDRAWN")},
    **{("kv_handoff", s, "PageWaitEnded"): (
        "only a claim WAITING_FOR_PAGES has a wait running (PagesReserved cancels it)")
       for s in ("NONE", "OFFERED", "RELEASED", "EXPIRED", "PULLING", "ABANDONED", "TAKEN",
                 "FAILED", "DROPPED", "WITHDRAWN")},
    **{("role_switch", s, "DrainTimedOut"): "only a DRAINING worker has a drain deadline running"
       for s in ("SERVING", "SWITCHING", "RESTORING", "FAILED")},
    **{
        ("room", s, "DispatchedHandoff"): _DISPATCH
        for s in ("DISPATCHED", "PREFILL_DONE", "RELAYING", "COMPLETED", "FAILED", "CANCELLED",
                  "LOCAL", "LOCAL_RELAYING", "RETRIED", "MIGRATED", "HANDED_OFF", "HANDOFF")
    },
    **{("room", s, t): _DISPATCH for s in ("HANDED_OFF", "HANDOFF")
       for t in ("Dispatched", "DispatchedLocal")},
    **{
        ("room", s, "HandoffFailed"): (
            "HandoffFailed is what a failed leg becomes in a HANDOFF room only: elsewhere the "
            "same failure is DecodeFailed, DecodeRetryable, DecodeRefused or DecodeBroke"
        )
        for s in ("DISPATCHED", "PREFILL_DONE", "RELAYING", "LOCAL", "LOCAL_RELAYING")
    },
    **{
        ("room", s, "DecodeHandedOff"): (
            "D sends a hand-off ticket only in its stream, which the proxy reads only while it "
            "relays it: before the relay there is no ticket to read"
        )
        for s in ("DISPATCHED", "PREFILL_DONE", "LOCAL", "HANDOFF")
    },
    **{
        ("room", "HANDOFF", t): (
            "a failed hand-off leg becomes DecodeRefused (refused, another D left), "
            "HandoffFailed (a migration left) or DecodeFailed: it is never a retry or a break "
            "mid-relay"
        )
        for t in ("DecodeRetryable", "DecodeBroke")
    },
}
# Rows no input can ever take (they are in UNREACHABLE): harmless, but a row added for an
# unreachable pair must be seen, so the set is asserted exactly.
DEAD_ROWS = {
    ("kv_receiver", "CANCELLING", "PeerLost"),
    ("room", "ALLOCATED", "ClientDisconnected"),
}

KNOWN_BUGS: dict[tuple[str, str, str], str] = {
}

def _path(table: StateTable, target: str, start: str | None = None) -> list[str]:
    """Shortest trigger path from ``start`` (the initial state by default) to ``target`` over
    the table's rows, leaving out ProtocolViolated and the dead rows (no input takes them);
    KeyError when there is none."""
    first = table.initial if start is None else start
    prev: dict[str, tuple[str, str] | None] = {first: None}
    frontier = [first]
    while frontier and target not in prev:
        nxt = []
        for state in frontier:
            for row in table.rows:
                if (
                    row.source == state
                    and row.target not in prev
                    and row.trigger != "ProtocolViolated"
                    and (table.name, row.source, row.trigger) not in DEAD_ROWS
                ):
                    prev[row.target] = (state, row.trigger)
                    nxt.append(row.target)
        frontier = nxt
    steps: list[str] = []
    node = target
    while (link := prev[node]) is not None:
        node, trigger = link
        steps.append(trigger)
    return steps[::-1]


# --- observing what the code did ---------------------------------------------------------------


@attrs.define
class Step:
    source: str
    trigger: str
    target: str
    effects: list[Any]
    bound: bool = False  # the room had a peer after the step (SendAbort goes only to a bound one)
    lease: list[tuple[str, str, str]] = attrs.Factory(list)  # kv_hold_lease steps inside it
    in_heartbeats: bool = False  # D: the room is in its P's heartbeat set after the step


@attrs.define
class Seen:
    steps: list[Step] = attrs.Factory(list)  # the steps the watched room (lease, key) took
    lease_steps: list[tuple[str, str, str]] = attrs.Factory(list)
    out: list[Any] = attrs.Factory(list)
    error: Exception | None = None

    def took(self, state: str, trigger: str) -> bool:
        return any(s.source == state and s.trigger == trigger for s in self.steps)


def _fire(seen: Seen, fire: Callable[[], list[Any]]) -> Seen:
    seen.steps.clear()
    seen.lease_steps.clear()
    seen.out = []
    seen.error = None
    try:
        seen.out = fire()
    except LocalProtocolError as exc:
        seen.error = exc
    return seen


def _counters(obj: Any) -> dict[str, int]:
    if hasattr(obj, "stats"):
        return dict(obj.stats.as_dict())
    return {"dropped": obj.dropped} if isinstance(obj, RoomRouter) else {}


# --- kv_sender and kv_hold_lease: PrefillEndpoint ------------------------------------------------

SENDER_EXTERNAL = {"RegisterKV", "RegisterPart", "SendPart", "NarrowKV", "SendReady",
                   "SendAbort", "ReleaseKV", "CompleteRequest", "FailRequest"}
RECEIVER_EXTERNAL = {"ResolvePeer", "AllocateBlocks", "CancelAllocation", "SendRecvInit",
                     "StartPull", "StartPartPull", "StartRepull", "SendDone", "SendDoneFailed",
                     "SendAbort", "CancelPull", "ReleaseBlocks", "CompleteTransfer",
                     "FailRequest"}


class Prefill:
    """PrefillEndpoint with every step of room ROOM (and of its lease) recorded."""

    def __init__(self) -> None:
        self.h = PrefillHarness()
        self.ep = self.h.ep
        self.seen = Seen()
        self._inner_lease: list[tuple[str, str, str]] | None = None
        step, lease_step = self.ep._step, self.ep.leases.step

        def recorded_step(r: Any, trigger: str, now: float, out: list[Any], ctx: Any) -> None:
            source, n, outer = r.state, len(out), self._inner_lease
            self._inner_lease = []
            try:
                step(r, trigger, now, out, ctx)
            finally:
                inner, self._inner_lease = self._inner_lease, outer
            if r.room == ROOM:
                self.seen.steps.append(
                    Step(source, trigger, r.state, out[n:], r.peer is not None, inner)
                )

        def recorded_lease_step(r: Any, trigger: str, now: float, out: list[Any]) -> None:
            source = r.lease
            lease_step(r, trigger, now, out)
            if r.room == ROOM:
                self.seen.lease_steps.append((source, trigger, r.lease))
                if self._inner_lease is not None:
                    self._inner_lease.append((source, trigger, r.lease))

        self.ep._step = recorded_step  # type: ignore[method-assign]
        self.ep.leases.step = recorded_lease_step  # type: ignore[method-assign]

    @property
    def state(self) -> str | None:
        return self.ep.state_of(ROOM)

    def events(self, trigger: str) -> list[Any]:
        return self.h.events_for(trigger)

    def fire(self, trigger: str) -> Seen:
        def go() -> list[Any]:
            if trigger == "LeaseExpired":
                expiry = self.ep.lease_expiry(ROOM)
                self.h.now = expiry if expiry is not None else self.h.now + 1e6
                return self.ep.handle(ev.TimeAdvanced(), self.h.now)
            return [o for e in self.events(trigger) for o in self.ep.handle(e, self.h.now)]

        return _fire(self.seen, go)

    def reach(self, state: str) -> None:
        for trigger in _path(KV_SENDER, state):
            assert self.fire(trigger).error is None
        assert self.state == (None if state in KV_SENDER.terminal or state == "NEW" else state)


def _check_sender_step(p: Prefill, step: Step) -> None:
    row = KV_SENDER.step(step.source, step.trigger)
    assert row is not None, f"kv_sender stepped ({step.source}, {step.trigger}) without a row"
    assert step.target == row.target
    want = [e for e in row.effects if e in SENDER_EXTERNAL and (e != "SendAbort" or step.bound)]
    assert external_kinds(step.effects) == want, (step.source, step.trigger)
    lease = [{"GrantLease": ("NONE", "Granted", "LEASED"),
              "ReleaseLease": ("LEASED", "Released", "RELEASED")}[e]
             for e in row.effects if e in ("GrantLease", "ReleaseLease")]
    assert step.lease == lease, (step.source, step.trigger)
    if "BindPeer" in row.effects:
        assert step.bound


# --- kv_receiver: DecodeEndpoint ---------------------------------------------------------------


class Decode:
    """DecodeEndpoint with every step of room ROOM recorded."""

    def __init__(self) -> None:
        self.h = DecodeHarness()
        self.ep = self.h.ep
        self.seen = Seen()
        step = self.ep._step

        def recorded_step(r: Any, trigger: str, now: float, out: list[Any], ctx: Any) -> None:
            source, n = r.state, len(out)
            step(r, trigger, now, out, ctx)
            if r.room == ROOM:
                peer = self.ep.peers.get(r.peer) if r.peer is not None else None
                in_hb = peer is not None and ROOM in peer.rooms
                self.seen.steps.append(
                    Step(source, trigger, r.state, out[n:], r.peer is not None, in_heartbeats=in_hb)
                )

        self.ep._step = recorded_step  # type: ignore[method-assign]

    @property
    def state(self) -> str | None:
        return self.ep.state_of(ROOM)

    def fire(self, trigger: str) -> Seen:
        def go() -> list[Any]:
            if trigger == "TimedOut":
                if self.ep.room_deadline(ROOM) is not None:
                    return self.h.fire("TimedOut")  # P kept talking: the room's own deadline
                self.h.now += 1e6
                return self.ep.handle(ev.TimeAdvanced(), self.h.now)
            if trigger == "PeerLost":
                return self._p_falls_silent()
            return [o for e in self.h.events_for(trigger) for o in self.ep.handle(e, self.h.now)]

        return _fire(self.seen, go)

    def _p_falls_silent(self) -> list[Any]:
        """P answers nothing from now on: time passes one heartbeat at a time, well past the
        peer timeout, but never up to the room's own deadline (that would be TimedOut)."""
        cfg, out = self.h.config, []
        horizon = self.h.now + cfg.peer_timeout + (cfg.heartbeat_misses + 2) * (
            cfg.heartbeat_interval
        )
        deadline = self.ep.room_deadline(ROOM)
        limit = horizon if deadline is None else min(horizon, deadline)
        while self.h.now + cfg.heartbeat_interval < limit and not self.seen.steps:
            self.h.now += cfg.heartbeat_interval
            out += self.ep.handle(ev.TimeAdvanced(), self.h.now)
        return out

    def reach(self, state: str) -> None:
        for trigger in _path(KV_RECEIVER, state):
            assert self.fire(trigger).error is None
        assert self.state == (None if state in KV_RECEIVER.terminal or state == "NEW" else state)


def _check_receiver_step(d: Decode, step: Step) -> None:
    row = KV_RECEIVER.step(step.source, step.trigger)
    assert row is not None, f"kv_receiver stepped ({step.source}, {step.trigger}) without a row"
    assert step.target == row.target
    # SendAbort only to a bound P; ResolvePeer only when P is not known yet (else the row
    # binds the cached P at once).
    want = [
        e for e in row.effects
        if e in RECEIVER_EXTERNAL and (e != "SendAbort" or step.bound)
        and (e != "ResolvePeer" or not step.bound)
    ]
    assert external_kinds(step.effects) == want, (step.source, step.trigger)
    if "JoinHeartbeats" in row.effects:
        assert step.in_heartbeats
    if "LeaveHeartbeats" in row.effects:
        assert not step.in_heartbeats


# --- expectations for a pair without a row ------------------------------------------------------


@attrs.frozen
class Expect:
    kind: str  # row | violated | local_error | counted | new_room | unreachable | forgotten
    why: str = ""
    counter: str = ""  # counted: the counter that goes up by one
    effects: tuple[str, ...] = ()  # counted: the effects the answer may carry


_NOT_LIVE = "a message for a room that is not live here is counted and dropped: nothing to fail"


def _no_row(table: StateTable, state: str, trigger: str, live: bool, bound: bool) -> Expect:
    """What the code must do for (state, trigger) without a row (``live``: the room exists
    here; ``bound``: it has a peer)."""
    name = table.name
    remote = trigger in table.remote_triggers or trigger == "ProtocolViolated"
    initial, terminal = state == table.initial, state in table.terminal
    if name in ("kv_sender", "kv_receiver"):
        if trigger == "RequestAccepted":
            if terminal:
                return Expect("new_room", "a new request may reuse a finished room id")
            return Expect("counted", "a live room id reused: refused (409)", "rejected",
                          ("RejectRequest",))
        if trigger == "Aborted":
            why = "an abort may race the room's end (or name a room never seen): counted"
            return Expect("counted", why, "late" if live else "unknown_room")
        if initial and remote:
            return Expect("counted", _NOT_LIVE, "unknown_room")
        if terminal and remote:
            # P answers a late hello (RECV_INIT, the impossible one too) with ABORT: D stops.
            hello = name == "kv_sender" and trigger in (
                "RecvInitReceived", "PartialRecvInitReceived", "ProtocolViolated")
            return Expect("counted", _NOT_LIVE, "late", ("SendAbort",) if hello else ())
        if terminal:  # a local report (prefill, pages, pull) that raced the room's end
            return Expect("counted", "a local report for a room that just ended", "late")
        if remote and not bound:
            if name == "kv_receiver":
                return Expect("counted", "before P is resolved any P is a stranger",
                              "foreign_peer")
            if trigger in ("DoneReceived", "DoneFailedReceived"):
                why = "no D claimed the room (no RECV_INIT): a DONE is from no room's peer"
                return Expect("counted", why, "foreign_peer")
        if remote:
            return Expect("violated", "a peer's fault: the room fails, the endpoint goes on")
        return Expect("local_error", "our own code fed a trigger the table forbids")
    if name == "room":
        return Expect("counted", "a response or client event the room does not expect (or for "
                      "a room not live): dropped and counted", "dropped")
    if name in ("proxy_session", "proxy_sequence"):
        return Expect("local_error", "the proxy fed what it sent in an order the table forbids")
    if name == "instance_lease" and terminal:
        return Expect("forgotten", "a key in a terminal state is forgotten: it is NONE again")
    if name == "kv_hold_lease" and trigger == "HeartbeatReceived":
        return Expect("counted", "D heartbeats a room P has no lease for: the ack says so")
    raise AssertionError(f"no rule for ({name}, {state}, {trigger}) without a row")


def _expect(table: StateTable, state: str, trigger: str, live: bool, bound: bool) -> Expect:
    key = (table.name, state, trigger)
    if key in UNREACHABLE:
        return Expect("unreachable", UNREACHABLE[key])
    if table.step(state, trigger) is not None:
        return Expect("row")
    return _no_row(table, state, trigger, live, bound)


def _check_pair_outcome(
    table: StateTable, state: str, trigger: str, exp: Expect, seen: Seen,
    before: dict[str, int], after: dict[str, int], state_after: str | None,
    state_before: str | None,
) -> None:
    delta = {k: after[k] - before.get(k, 0) for k in after}
    if exp.kind == "local_error":
        assert isinstance(seen.error, LocalProtocolError), f"expected LocalProtocolError: {seen}"
        assert not seen.steps and state_after == state_before
        return
    assert seen.error is None, f"({state}, {trigger}) raised {seen.error!r}"
    if exp.kind == "row":
        row = table.step(state, trigger)
        assert row is not None and seen.steps, f"({state}, {trigger}) took no step"
        first = seen.steps[0]
        assert (first.source, first.trigger, first.target) == (state, trigger, row.target)
        if trigger == "ProtocolViolated":
            assert delta["remote_errors"] == 1
    elif exp.kind == "violated":
        row = table.step(state, "ProtocolViolated")
        assert row is not None, f"{table.name}: {state} has no ProtocolViolated row"
        assert seen.steps, f"({state}, {trigger}) took no step"
        first = seen.steps[0]
        assert (first.source, first.trigger, first.target) == (state, "ProtocolViolated",
                                                               row.target)
        assert delta["remote_errors"] == 1
    elif exp.kind == "new_room":
        row = table.step(table.initial, trigger)
        assert row is not None and seen.steps
        first = seen.steps[0]
        assert (first.source, first.trigger, first.target) == (table.initial, trigger,
                                                               row.target)
    elif exp.kind == "counted":
        assert not seen.steps, f"({state}, {trigger}) stepped: {seen.steps}"
        assert state_after == state_before
        if exp.counter:
            assert delta[exp.counter] == 1, (exp.counter, delta)
        kinds = [k for k in external_kinds(seen.out) if k not in ("ForgetPeer",)]
        assert kinds == list(exp.effects), kinds
    elif exp.kind == "unreachable":
        assert not seen.took(state, trigger), f"({state}, {trigger}) is reachable: {seen.steps}"
        assert state_after == state_before
    else:
        raise AssertionError(exp.kind)


def _room_pair(kind: str, state: str, trigger: str) -> None:
    table = KV_SENDER if kind == "kv_sender" else KV_RECEIVER
    side: Prefill | Decode = Prefill() if kind == "kv_sender" else Decode()
    side.reach(state)
    room = side.ep.rooms.get(ROOM)
    live, bound = room is not None, room is not None and room.peer is not None
    exp = _expect(table, state, trigger, live, bound)
    before, state_before = _counters(side.ep), side.state
    seen = side.fire(trigger)
    _check_pair_outcome(table, state, trigger, exp, seen, before, _counters(side.ep),
                        side.state, state_before)
    check = _check_sender_step if kind == "kv_sender" else _check_receiver_step
    for step in seen.steps:
        check(side, step)  # type: ignore[arg-type]
    counted = {"CountDuplicate": "duplicates", "CountLate": "late"}
    after = _counters(side.ep)
    for effect, counter in counted.items():
        n = sum(
            1 for s in seen.steps for e in table.step(s.source, s.trigger).effects  # type: ignore[union-attr]
            if e == effect
        )
        if n:
            assert after[counter] - before[counter] == n, effect
    if table.step(state, trigger) is None:
        _guard_refuses(side.ep, table, state, trigger)


def _guard_refuses(ep: Any, table: StateTable, state: str, trigger: str) -> None:
    """The table guard of the endpoint refuses the pair if anything ever fed it."""
    stand_in = attrs.make_class("StandIn", ["room", "state", "peer", "lease"])(-1, state, None,
                                                                               "LEASED")
    with pytest.raises(LocalProtocolError):
        type(ep)._step(ep, stand_in, trigger, 0.0, [], None)


# --- kv_hold_lease: the lease rows inside PrefillEndpoint -------------------------------------


def _lease_fire(p: Prefill, trigger: str, seq: list[int]) -> Seen:
    if trigger == "Granted":  # the room comes into existence on P
        return p.fire("RequestAccepted")
    if trigger == "Released":  # any sender row with ReleaseLease; a local abort is one
        return p.fire("Aborted")
    if trigger == "Expired":
        return p.fire("LeaseExpired")
    seq[0] += 1
    heartbeat = ev.MessageReceived(D_ID, Heartbeat(seq[0], (ROOM,)))
    return _fire(p.seen, lambda: p.ep.handle(heartbeat, p.h.now))


def _lease_state(p: Prefill, reached: str) -> str:
    r = p.ep.rooms.get(ROOM)
    return r.lease if r is not None else reached


def _lease_pair(state: str, trigger: str) -> None:
    p, seq = Prefill(), [0]
    for step in _path(KV_HOLD_LEASE, state):
        assert _lease_fire(p, step, seq).error is None
    assert [s[2] for s in p.seen.lease_steps][-1:] == ([state] if state != "NONE" else [])
    live = ROOM in p.ep.rooms
    exp = _expect(KV_HOLD_LEASE, state, trigger, live, False)
    old_expiry = p.ep.lease_expiry(ROOM)
    p.h.now += 5.0
    seen = _lease_fire(p, trigger, seq)
    assert seen.error is None, seen.error
    for source, trig, target in seen.lease_steps:
        row = KV_HOLD_LEASE.step(source, trig)
        assert row is not None and row.target == target, (source, trig)
    now, cfg = p.h.now, p.ep.config
    row = KV_HOLD_LEASE.step(state, trigger)
    if exp.kind == "row":
        assert row is not None
        if trigger == "HeartbeatReceived":
            # The row's ExtendExpiry: the lease stays LEASED and expiry = max(old, now +
            # extension), never shorter.
            assert seen.lease_steps == [(state, trigger, row.target)]
            assert _lease_state(p, "?") == row.target
            assert old_expiry is not None
            assert p.ep.lease_expiry(ROOM) == max(old_expiry, now + cfg.extension)
            assert now + cfg.extension < old_expiry  # so that was "never shorter"
            longer_at = old_expiry - cfg.extension + 1.0  # now + extension passes the old expiry
            p.h.now = longer_at
            assert _lease_fire(p, trigger, seq).error is None
            assert p.ep.lease_expiry(ROOM) == longer_at + cfg.extension
            assert p.ep.next_deadline() == longer_at + cfg.extension
            p.h.now = old_expiry  # the old deadline passes: the lease holds
            assert p.ep.handle(ev.TimeAdvanced(), p.h.now) == [] and p.state == "BOOTSTRAPPING"
        else:
            assert seen.lease_steps[:1] == [(state, trigger, row.target)]
        if "SetExpiry" in row.effects:
            assert p.ep.lease_expiry(ROOM) == now + cfg.initial == p.ep.next_deadline()
        if row.target in KV_HOLD_LEASE.terminal:
            assert p.ep.lease_expiry(ROOM) is None and p.ep.next_deadline() is None
        if "ExpireRoom" in row.effects:  # the sender took LeaseExpired
            assert [s.trigger for s in seen.steps] == ["LeaseExpired"]
        else:
            assert "LeaseExpired" not in [s.trigger for s in seen.steps]
    elif exp.kind == "counted":  # a heartbeat for a room P holds no lease for
        assert not seen.lease_steps
        acks = [o.message for o in seen.out if isinstance(o, fx.SendMessage)]
        assert len(acks) == 1 and isinstance(acks[0], HeartbeatAck)
        if state == "NONE":
            assert acks[0].unknown_rooms == (ROOM,) and ROOM not in p.ep.rooms
        else:  # the room failed (abort, expiry): the ack tells D so
            assert acks[0].failed_rooms == (ROOM,)
    else:
        assert exp.kind == "unreachable", exp
        assert not any(s[:2] == (state, trigger) for s in seen.lease_steps), seen.lease_steps
    if row is None:  # the guard refuses the pair had the code ever fed it
        stand_in = attrs.make_class("StandIn", ["room", "lease"])(-1, state)
        with pytest.raises(LocalProtocolError):
            type(p.ep.leases).step(p.ep.leases, stand_in, trigger, p.h.now, [])


# --- instance_lease: BootstrapRegistry ----------------------------------------------------------

KEY = ("prefill", "p0", 0, 0, 0, 0)


class Registry:
    def __init__(self) -> None:
        self.reg = BootstrapRegistry()
        self.now = 1.0
        self.seen = Seen()
        step = self.reg._step

        def recorded(inst: Any, trigger: str, now: float, out: list[Any], e: Any) -> None:
            source, n = inst.state, len(out)
            step(inst, trigger, now, out, e)
            if inst.key == KEY:
                self.seen.steps.append(Step(source, trigger, inst.state, out[n:]))

        self.reg._step = recorded  # type: ignore[method-assign]

    def fire(self, trigger: str) -> Seen:
        def go() -> list[Any]:
            if trigger == "Expired":
                expiry = self.reg.expires_at(KEY)
                self.now = expiry if expiry is not None else self.now + 1e6
                return self.reg.handle(ev.TimeAdvanced(), self.now)
            event = {
                "Registered": ev.InstanceRegistered(KEY, {"id": "p0"}, "127.0.0.1:8998"),
                "HeartbeatReceived": ev.InstanceHeartbeat(KEY),
                "Deregistered": ev.InstanceDeregistered(KEY),
            }[trigger]
            return self.reg.handle(event, self.now)

        return _fire(self.seen, go)


def _instance_pair(state: str, trigger: str) -> None:
    r = Registry()
    for step in _path(INSTANCE_LEASE, state):
        assert r.fire(step).error is None
    table = INSTANCE_LEASE
    exp = _expect(table, state, trigger, r.reg.lookup(KEY) is not None, False)
    r.now += 1.0
    seen = r.fire(trigger)
    assert seen.error is None
    for s in seen.steps:
        row = table.step(s.source, s.trigger)
        assert row is not None and row.target == s.target, (s.source, s.trigger)
        kinds = [type(o).__name__ for o in s.effects]
        assert ("RegistrationRequired" in kinds) == ("AskToRegister" in row.effects)
        assert ("InstanceExpired" in kinds) == (s.trigger == "Expired")
        assert ("Acknowledged" in kinds) == (row.target == "ALIVE")
        if "RefreshTTL" in row.effects:
            assert r.reg.expires_at(KEY) == r.now + r.reg.config.ttl
        if "StoreRecord" in row.effects:
            assert r.reg.lookup(KEY) == {"id": "p0"}
            assert r.reg.resolve("127.0.0.1:8998") == [(KEY, {"id": "p0"})]
        if "DropRecord" in row.effects:
            assert r.reg.lookup(KEY) is None and r.reg.resolve("127.0.0.1:8998") == []
    # Terminal states are not kept: the key is NONE again.
    after = r.reg.state_of(KEY)
    if exp.kind == "row":
        row = table.step(state, trigger)
        assert row is not None
        first = seen.steps[0]
        assert (first.source, first.trigger, first.target) == (state, trigger, row.target)
        assert after == ("NONE" if row.target in table.terminal else row.target)
    elif exp.kind == "forgotten":
        row = table.step(table.initial, trigger)
        assert row is not None
        first = seen.steps[0]
        assert (first.source, first.trigger, first.target) == (table.initial, trigger,
                                                               row.target)
    else:
        assert exp.kind == "unreachable", exp
        assert not seen.took(state, trigger) and not seen.steps
    if table.step(state, trigger) is None:
        stand_in = attrs.make_class("StandIn", ["key", "state"])(("x",), state)
        with pytest.raises(LocalProtocolError):
            type(r.reg)._step(r.reg, stand_in, trigger, 0.0, [], None)


# --- room: RoomRouter ---------------------------------------------------------------------------

_ROOM_EFFECTS = {
    "PostBothLegs": ["DispatchRoom"],
    "PostDecodeAlone": ["DispatchLocal"],
    "RelayDecode": ["RelayDecode"],
    "AbortDecodeLeg": ["AbortLeg:decode"],
    "AbortPrefillLeg": ["AbortLeg:prefill"],
    "AbortBothLegs": ["AbortLeg:prefill", "AbortLeg:decode"],
    "ReplyError": ["ReplyError"],
    "ReopenRoom": ["ReopenRoom"],
    "RedirectDecodeLeg": ["RedirectDecode"],
    "PostHandoffLeg": ["DispatchLocal"],
}
# trigger -> (leg, ok, refused, retryable)
_LEG_EVENTS = {
    "PrefillResponded": ("prefill", True, False, False),
    "PrefillFailed": ("prefill", False, False, False),
    "PrefillFailedRecoverable": ("prefill", False, False, False),  # a router whose D recompute
    "PrefillRetryable": ("prefill", False, True, True),
    "DecodeResponded": ("decode", True, False, False),
    "DecodeFailed": ("decode", False, False, False),  # mid-relay: no migrations left
    "DecodeRefused": ("decode", False, True, True),  # another D can take the room
    "DecodeRetryable": ("decode", False, False, True),  # a 5xx before any byte
    "DecodeBroke": ("decode", False, False, False),  # mid-relay, a migratable request
    "HandoffFailed": ("decode", False, False, True),  # the hand-off leg, before any byte
}
_DISPATCH_PROMPTS = {"Dispatched": Prompt("a long prompt " * 20, 60),
                     "DispatchedLocal": Prompt("hi", 1)}
_ROUTER_SEED = 3
PROXY_ROOM = random.Random(_ROUTER_SEED).randrange(MAX_ROOM)  # the router's first draw


def _effect_name(o: Any) -> str:
    return f"AbortLeg:{o.leg}" if isinstance(o, fx.AbortLeg) else type(o).__name__


class Router:
    def __init__(self) -> None:
        # Conditional disaggregation on: a short prompt goes to D alone (DispatchedLocal).
        # Two D: a refused decode leg can move to the other in the same room (DecodeRefused).
        self.router = RoomRouter(["http://p0"], ["http://d0", "http://d1"],
                                 random.Random(_ROUTER_SEED),
                                 routing=RoutingConfig(local_prefill_tokens=8))
        self.now = 0.0
        self.seen = Seen()
        step = self.router._step

        def recorded(r: Any, trigger: str, out: list[Any], reason: str) -> None:
            source, n = r.state, len(out)
            step(r, trigger, out, reason)
            if r.room == PROXY_ROOM:
                self.seen.steps.append(Step(source, trigger, r.state, out[n:]))

        self.router._step = recorded  # type: ignore[method-assign]

    def fire(self, trigger: str) -> Seen:
        room = PROXY_ROOM

        # A failed prefill leg is recoverable for a router whose decode workers recompute; a
        # decode leg breaking off mid-relay fails the room once no migration is left.
        self.router.config = RouterConfig(
            decode_recomputes=trigger == "PrefillFailedRecoverable",
            migration_limit=0 if trigger == "DecodeFailed" else 3)

        def go() -> list[Any]:
            if trigger in _DISPATCH_PROMPTS:
                prompt = _DISPATCH_PROMPTS[trigger]
                return self.router.handle(
                    ev.RoomRequested("req", prompt, migratable=True), self.now)
            if trigger == "DispatchedHandoff":
                return self.router.handle(
                    ev.RoomRequested("req", Prompt("hi", 1), migratable=True, handoff=True),
                    self.now)
            if trigger == "DecodeHandedOff":
                return self.router.handle(
                    ev.LegResponded(room, "decode", False, "handed off", handoff=True), self.now)
            if trigger == "TimedOut":
                self.now += 1e6
                return self.router.handle(ev.TimeAdvanced(), self.now)
            if trigger in _LEG_EVENTS:
                leg, ok, refused, retryable = _LEG_EVENTS[trigger]
                event: Any = ev.LegResponded(room, leg, ok, "" if ok else "boom", refused,
                                             retryable)
            else:
                event = {"ClientDisconnected": ev.ClientDisconnected(room),
                         "RelayFinished": ev.RelayFinished(room)}[trigger]
            return self.router.handle(event, self.now)

        return _fire(self.seen, go)


def _room_pair_router(state: str, trigger: str) -> None:
    r = Router()
    for step in _path(ROOM_TABLE, state):
        assert r.fire(step).error is None
    table = ROOM_TABLE
    live = r.router.poll(PROXY_ROOM) is not None
    assert r.router.poll(PROXY_ROOM) == (state if live else None)
    exp = _expect(table, state, trigger, live, False)
    before, state_before = _counters(r.router), r.router.poll(PROXY_ROOM)
    seen = r.fire(trigger)
    if exp.kind == "unreachable" and trigger in ("DecodeBroke", "DecodeRetryable",
                                                 "DecodeRefused", "HandoffFailed",
                                                 "DecodeHandedOff"):
        # The leg event these triggers come from takes another row here: never this one.
        assert not seen.took(state, trigger), seen.steps
        return
    for s in seen.steps:
        row = table.step(s.source, s.trigger)
        assert row is not None and row.target == s.target, (s.source, s.trigger)
        assert [_effect_name(o) for o in s.effects] == [
            k for e in row.effects for k in _ROOM_EFFECTS[e]
        ]
    after_state = r.router.poll(PROXY_ROOM)
    _check_pair_outcome(table, state, trigger, exp, seen, before, _counters(r.router),
                        after_state, state_before)
    if exp.kind == "row":
        row = table.step(state, trigger)
        assert row is not None
        assert after_state == (None if row.target in table.terminal else row.target)
        if row.target in table.terminal:
            assert r.router.outcomes[row.target] == 1
    if table.step(state, trigger) is None:
        stand_in = attrs.make_class("StandIn", ["room", "state", "prefill", "decode", "reason",
                                                "request_id"])(-1, state, "p", "d", "", "x")
        with pytest.raises(LocalProtocolError):
            type(r.router)._step(r.router, stand_in, trigger, [], "")


# --- worker_breaker: WorkerBreakers -------------------------------------------------------------

_BREAKER_EFFECTS = {"CountFault": [], "ResetFaults": [], "StartCooldown": [],
                    "ReportChange": ["BreakerChanged"]}
WORKER = "http://w"


class Breakers:
    def __init__(self) -> None:
        self.b = WorkerBreakers(threshold=3, cooldown=1.0)
        self.b.keep([WORKER])
        self.now = 0.0
        self.seen = Seen()
        step = self.b._step

        def recorded(br: Any, trigger: str, out: list[Any]) -> None:
            source, n = br.state, len(out)
            step(br, trigger, out)
            if br.worker == WORKER:
                self.seen.steps.append(Step(source, trigger, br.state, out[n:]))

        self.b._step = recorded  # type: ignore[method-assign]

    def fire(self, trigger: str) -> Seen:
        def go() -> list[Any]:
            out: list[Any] = []
            if trigger in ("LegSucceeded", "LegFaulted", "Tripped"):
                # A fault trips the breaker or not by the threshold: set so it does exactly
                # when the trigger is Tripped.
                self.b.threshold = 1 if trigger == "Tripped" else 100
                self.b.outcome(WORKER, trigger == "LegSucceeded", trigger != "LegSucceeded",
                               self.now, out)
            elif trigger == "CooledDown":
                self.now += 1e6
                self.b.advance(self.now, out)
            elif trigger == "ProbeDispatched":
                self.b.dispatched(WORKER)
            else:
                self.b.keep([])
            return out

        return _fire(self.seen, go)


def _breaker_pair(state: str, trigger: str) -> None:
    r = Breakers()
    for step in _path(WORKER_BREAKER, state):
        assert r.fire(step).error is None
    table = WORKER_BREAKER
    live = WORKER in r.b.states()
    assert r.b.states()[WORKER] == state if live else state in table.terminal
    exp = _expect(table, state, trigger, live, False)
    seen = r.fire(trigger)
    for s in seen.steps:
        row = table.step(s.source, s.trigger)
        assert row is not None and row.target == s.target, (s.source, s.trigger)
        assert [type(o).__name__ for o in s.effects] == [
            k for e in row.effects for k in _BREAKER_EFFECTS[e]]
    after = r.b.states().get(WORKER)
    if exp.kind == "unreachable":
        assert not seen.took(state, trigger), seen.steps
        assert after == (state if live else None)
        return
    assert exp.kind == "row", exp
    row = table.step(state, trigger)
    assert row is not None and seen.steps and seen.steps[0].source == state
    assert after == (None if row.target in table.terminal else row.target)


# --- proxy_session: ProxySession; proxy_sequence: SequenceSession --------------------------------

_SESSION_EVENTS: dict[str, Callable[[], ev.SessionEvent]] = {
    "HeadersSent": ev.HeadersSent, "ChunkRelayed": ev.ChunkRelayed,
    "DoneRelayed": ev.DoneRelayed, "AnswerRelayed": ev.AnswerRelayed,
    "ErrorAnswered": ev.ErrorAnswered, "ClientLeft": ev.ClientLeft,
}
_SESSION_EFFECTS = {"ReportRelayFinished": "ReportRelayFinished",
                    "ReportDisconnect": "ReportDisconnect", "AbortSequences": "AbortSequences",
                    "ReportSequenceLeft": "ReportSequenceLeft"}
_ST = PROXY_SESSION.T
_SEQUENCE_ENDS = (_ST.SequenceEnded, _ST.LastSequenceEnded)  # both made by ev.SequenceEnded
SPLIT_INTO = (0, 2, 5)  # a split answer's unfinished sequences, by index


class Session:
    """A ProxySession or a SequenceSession driven by trigger names. A split answer's sequences
    still running are kept here (the session's own set is private): ``ev.SequenceEnded`` is the
    trigger SequenceEnded while another runs, LastSequenceEnded for the last."""

    def __init__(self, s: ProxySession | SequenceSession) -> None:
        self.s = s
        self.running: list[int] = []

    def event(self, trigger: str) -> tuple[ev.SessionEvent, str]:
        """The event that makes ``trigger``, and the trigger it makes."""
        if trigger == _ST.AnswerSplit:
            return ev.AnswerSplit(SPLIT_INTO), trigger
        if trigger in _SEQUENCE_ENDS:
            took = _ST.SequenceEnded if len(self.running) > 1 else _ST.LastSequenceEnded
            return ev.SequenceEnded(self.running[0] if self.running else 0), took
        return _SESSION_EVENTS[trigger](), trigger

    def fire(self, trigger: str) -> Seen:
        seen = Seen()
        source = self.s.state
        event, took = self.event(trigger)

        def go() -> list[Any]:
            out = self.s.handle(event, 0.0)
            seen.steps.append(Step(source, took, self.s.state, list(out)))
            if isinstance(event, ev.AnswerSplit):
                self.running = list(event.sequences)
            elif isinstance(event, ev.SequenceEnded):
                self.running.remove(event.index)
            return out

        return _fire(seen, go)

    def reach(self, table: StateTable, state: str, trigger: str) -> None:
        """Into ``state`` along the table's rows; for a sequence's end, through SPLIT where
        that leads there, so that the sequences it ends run (the shortest path to GONE does
        not split the answer)."""
        path = _path(table, state)
        if trigger in _SEQUENCE_ENDS:
            try:
                split = PROXY_SESSION.S.SPLIT
                path = _path(table, split) + _path(table, state, start=split)
            except KeyError:
                pass  # not reachable from SPLIT: no sequence can end there
        for step in path:
            if step == _ST.LastSequenceEnded:
                self.end_all_but_one()
            assert self.fire(step).error is None, (state, step)
        assert self.s.state == state
        if trigger == _ST.LastSequenceEnded:
            self.end_all_but_one()

    def end_all_but_one(self) -> None:
        while len(self.running) > 1:
            assert self.fire(_ST.SequenceEnded).error is None


def _session_pair(table: StateTable, make: Callable[[], ProxySession | SequenceSession],
                  state: str, trigger: str) -> None:
    h = Session(make())
    h.reach(table, state, trigger)
    exp = _expect(table, state, trigger, True, False)
    seen = h.fire(trigger)
    for st in seen.steps:
        row = table.step(st.source, st.trigger)
        assert row is not None and row.target == st.target, (st.source, st.trigger)
        assert [type(o).__name__ for o in st.effects] == [_SESSION_EFFECTS[e]
                                                         for e in row.effects]
    _check_pair_outcome(table, state, trigger, exp, seen, {}, {}, h.s.state, state)


_HANDOFF_T = KV_HANDOFF.T

# --- kv_handoff: HandoffLedger -------------------------------------------------------------------

_HANDOFF_EFFECTS = {"ArmLease": [], "ReleaseOffer": ["ReleaseOffer"],
                    "StartHandoffPull": ["StartHandoffPull"], "EnterDecode": ["EnterDecode"],
                    "FailHandoff": ["FailHandoff"], "FinishAborted": ["FinishAborted"],
                    "FreeHeldPages": ["FreeHeldPages"], "ArmPageWait": [],
                    "FinishUnplaced": ["FinishUnplaced"]}
HANDOFF_KEY = 7
_HANDOFF_TIMERS = {_HANDOFF_T.LeaseExpired, _HANDOFF_T.PageWaitEnded}  # fired by time alone


class Handoffs:
    def __init__(self) -> None:
        self.ledger = HandoffLedger()
        self.now = 0.0
        self.seen = Seen()
        step = self.ledger._step

        def recorded(h: Any, trigger: str, out: list[Any], reason: str) -> None:
            source, n = h.state, len(out)
            step(h, trigger, out, reason)
            if h.key == HANDOFF_KEY:
                self.seen.steps.append(Step(source, trigger, h.state, out[n:]))

        self.ledger._step = recorded  # type: ignore[method-assign]

    def fire(self, trigger: str) -> Seen:
        def go() -> list[Any]:
            if trigger in ("LeaseExpired", "PageWaitEnded"):
                self.now += 1e6
                return self.ledger.handle(ev.TimeAdvanced(), self.now)
            event: Any = {
                "Offered": ev.HandoffOffered(HANDOFF_KEY, 1.0),
                "Pulled": ev.HandoffPulled(HANDOFF_KEY),
                "Claimed": ev.HandoffClaimed(HANDOFF_KEY),
                "Queued": ev.HandoffQueued(HANDOFF_KEY, 1.0),
                "PagesReserved": ev.HandoffPagesReserved(HANDOFF_KEY),
                "PullSucceeded": ev.PullSucceeded(HANDOFF_KEY),
                "PullFailed": ev.PullFailed(HANDOFF_KEY, "boom"),
                "Aborted": ev.Aborted(HANDOFF_KEY, "gone"),
            }[trigger]
            return self.ledger.handle(event, self.now)

        return _fire(self.seen, go)


def _handoff_pair(state: str, trigger: str) -> None:
    h = Handoffs()
    for step in _path(KV_HANDOFF, state):
        assert h.fire(step).error is None
    table = KV_HANDOFF
    live = h.ledger.state_of(HANDOFF_KEY) is not None
    assert h.ledger.state_of(HANDOFF_KEY) == (state if live else None)
    assert live == (state not in table.terminal and state != table.initial)
    late = h.ledger.late
    seen = h.fire(trigger)
    if ("kv_handoff", state, trigger) in UNREACHABLE:
        assert not seen.took(state, trigger) and seen.error is None
        if trigger in _HANDOFF_TIMERS:  # time ran out for the timer this state does run
            assert {s_.trigger for s_ in seen.steps} <= _HANDOFF_TIMERS - {trigger}
            return
        assert not seen.out
        assert h.ledger.state_of(HANDOFF_KEY) == (state if live else None)
        return
    row = table.step(state, trigger) if live or state == table.initial else None
    if row is None and trigger in (_HANDOFF_T.Offered, _HANDOFF_T.Claimed, _HANDOFF_T.Queued):
        if live:  # uuids and pull rooms are drawn fresh: a repeat is our own bug
            assert isinstance(seen.error, LocalProtocolError)
        else:  # a finished key drawn again is a new hand-off
            assert seen.steps and seen.steps[0].source == table.initial
        return
    if row is None:  # a report its state does not expect, or for no live hand-off
        assert seen.error is None and not seen.steps and not seen.out
        assert h.ledger.late == late + 1
        return
    assert seen.error is None and seen.steps and seen.steps[0].source == state
    for s_ in seen.steps:
        r = table.step(s_.source, s_.trigger)
        assert r is not None and r.target == s_.target
        assert [type(o).__name__ for o in s_.effects] == [
            k for e in r.effects for k in _HANDOFF_EFFECTS[e]]
    after = h.ledger.state_of(HANDOFF_KEY)
    assert after == (None if row.target in table.terminal else row.target)
    if row.target in table.terminal:
        assert h.ledger.outcomes[row.target] == 1


# --- role_switch: RoleSwitch ---------------------------------------------------------------------

_ROLE_EFFECTS = {"WithdrawRecord": ["WithdrawRecord"], "RefuseLegs": ["RefuseLegs"],
                 "ArmDrainDeadline": [], "FailInFlight": ["FailInFlight"],
                 "StopRole": ["StopRole"], "StartRole": ["StartRole"], "CommitRole": [],
                 "AcceptLegs": ["AcceptLegs"], "RestoreRole": ["StartRole"],
                 "RefuseSwitch": ["RefuseSwitch"], "ExitProcess": ["ExitProcess"]}


class Roles:
    """A RoleSwitch of a prefill worker that may become a decode one, every step recorded."""

    def __init__(self) -> None:
        self.rs = RoleSwitch("prefill", ("prefill", "decode"))
        self.now = 0.0
        self.seen = Seen()
        step = self.rs._step

        def recorded(trigger: str, out: list[Any]) -> None:
            source, n = self.rs.state, len(out)
            step(trigger, out)
            self.seen.steps.append(Step(source, trigger, self.rs.state, out[n:]))

        self.rs._step = recorded  # type: ignore[method-assign]

    def fire(self, trigger: str) -> Seen:
        def go() -> list[Any]:
            if trigger == "DrainTimedOut":
                self.now += 1e6  # past any drain deadline
                return self.rs.handle(ev.TimeAdvanced(), self.now)
            event: Any = {
                "SwitchRequested": ev.SwitchRequested("decode", 5.0),
                "Drained": ev.RoleDrained(),
                "RoleStarted": ev.RoleStarted(),
                "RoleStartFailed": ev.RoleStartFailed("boom"),
            }[trigger]
            return self.rs.handle(event, self.now)

        return _fire(self.seen, go)


def _role_pair(state: str, trigger: str) -> None:
    table = ROLE_SWITCH
    r = Roles()
    for step in _path(table, state):
        assert r.fire(step).error is None
    assert r.rs.state == state
    epoch = r.rs.epoch
    seen = r.fire(trigger)
    if ("role_switch", state, trigger) in UNREACHABLE:
        assert seen.error is None and not seen.steps and not seen.out
        assert r.rs.state == state
        return
    row = table.step(state, trigger)
    if row is None:  # the worker never feeds it (FAILED exits; a report out of turn): our bug
        assert isinstance(seen.error, LocalProtocolError) and not seen.steps
        assert r.rs.state == state
        return
    assert seen.error is None and seen.steps
    first = seen.steps[0]
    assert (first.source, first.trigger, first.target) == (state, trigger, row.target)
    assert [type(o).__name__ for o in first.effects] == [
        k for e in row.effects for k in _ROLE_EFFECTS[e]]
    assert r.rs.state == row.target
    # Only a completed switch (CommitRole) moves the epoch, by one.
    assert r.rs.epoch == epoch + ("CommitRole" in row.effects)
    if row.target == table.S.DRAINING and state != row.target:
        assert r.rs.next_deadline() == r.now + 5.0
    if row.target != table.S.DRAINING:
        assert r.rs.next_deadline() is None


# --- the pairs ----------------------------------------------------------------------------------

DRIVERS: dict[str, Callable[[str, str], None]] = {
    "kv_sender": lambda s, t: _room_pair("kv_sender", s, t),
    "kv_receiver": lambda s, t: _room_pair("kv_receiver", s, t),
    "kv_hold_lease": _lease_pair,
    "instance_lease": _instance_pair,
    "room": _room_pair_router,
    "kv_handoff": _handoff_pair,
    "worker_breaker": _breaker_pair,
    "proxy_session": lambda s, t: _session_pair(PROXY_SESSION, ProxySession, s, t),
    "proxy_sequence": lambda s, t: _session_pair(PROXY_SEQUENCE, SequenceSession, s, t),
    "role_switch": _role_pair,
}

ALL_PAIRS = [(t.name, s, trig) for t in ALL_TABLES.values() for s, trig in t.pairs()]


def _param(pair: tuple[str, str, str]) -> Any:
    if pair in KNOWN_BUGS:
        return pytest.param(*pair, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[pair]))
    return pytest.param(*pair)


@pytest.mark.parametrize(("table", "state", "trigger"), [_param(p) for p in ALL_PAIRS])
def test_pair(table: str, state: str, trigger: str) -> None:
    if (table, state, trigger) in KNOWN_BUGS:
        _known_bug(table, state, trigger)
        return
    DRIVERS[table](state, trigger)


def _known_bug(table: str, state: str, trigger: str) -> None:
    """What the code must do for a KNOWN_BUGS pair (a peer's fault): not raise, count a remote
    error, and leave no room live in a state it cannot leave."""
    side: Prefill | Decode = Prefill() if table == "kv_sender" else Decode()
    side.reach(state)
    before = side.ep.stats.remote_errors
    seen = side.fire(trigger)
    assert seen.error is None, f"a peer's fault raised {seen.error!r}"
    assert side.ep.stats.remote_errors == before + 1
    assert side.state != "NEW"


def test_every_table_has_a_driver_and_the_lists_are_exact() -> None:
    assert set(DRIVERS) == set(ALL_TABLES)
    pairs = set(ALL_PAIRS)
    assert set(UNREACHABLE) <= pairs, set(UNREACHABLE) - pairs
    assert set(KNOWN_BUGS) <= pairs and not set(KNOWN_BUGS) & set(UNREACHABLE)
    rows = {(t.name, r.source, r.trigger) for t in ALL_TABLES.values() for r in t.rows}
    assert set(UNREACHABLE) & rows == DEAD_ROWS
    assert len(ALL_PAIRS) == sum(len(t.states) * len(t.triggers) for t in ALL_TABLES.values())


@pytest.mark.parametrize("table", list(ALL_TABLES.values()), ids=lambda t: t.name)
def test_every_state_has_a_documented_meaning(table: StateTable) -> None:
    assert all(doc for doc in table.states.values())
    assert all(r.reason for r in table.rows)
