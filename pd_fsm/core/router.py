"""RoomRouter: the proxy's rooms (table room). RFC-2 §5.7.

Rooms are drawn uniform in [0, 2^63) from an injected RNG (never a live one twice); P and D are
chosen by the routing policies (``routing.RoutePlanner``: round-robin by default), or D alone
when conditional disaggregation says D should prefill the room itself, or a colocated worker
(role ``null``) that serves the whole request: such a room is a D-alone room (table
rows ``DispatchedLocal``, ``LOCAL``, ``LOCAL_RELAYING``) whose one leg is addressed as "null". A
room keeps its workers to its end (a retried leg lands where its pages are).

A request may outlive its room: a leg refused before any byte of its answer ends the
room RETRIED, a stream whose decode worker broke off ends it MIGRATED, and one a draining decode
worker handed off (its KV registered for another D to pull) ends it HANDED_OFF, each with a
``ReopenRoom`` effect that hands the proxy what the request used up (``routing.Attempts``); the
proxy feeds it back in the request's next ``RoomRequested``, which avoids the workers that failed
it while others are up. Whether a failure retries or migrates is decided here, from the limits in
``RouterConfig``. A decode leg refused before D took the room (down, draining, another role) is
first posted again within the room to another D (``RedirectDecode``): a PD room's, while P holds
the KV (``retry_limit`` times at most), and a hand-off room's, while the draining D registers it
(each D once; only when no D is left does it fall back to a re-prefill migration).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import assert_never

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.breakers import WorkerBreakers
from pd_fsm.core.config import RouterConfig
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.messages import MAX_ROOM
from pd_fsm.core.routing import Attempts, Route, RoutePlanner, RoutingConfig
from pd_fsm.core.tables import ROOM
from pd_fsm.core.timers import DeadlineHeap

# The table's names as attributes (tables.Names): never spelled as strings here.
_T = ROOM.T
_S = ROOM.S
ROUTED_PATHS = ("pd", "decode_alone", "colocated", "handoff")  # RoomRouter.routed's keys
SHED_RETRY_AFTER_S = 1.0  # a shed request's Retry-After: about one request's time to drain
# A leg's response as a room trigger: (is it P's leg, did it succeed).
_LEG_TRIGGERS = {
    (True, True): _T.PrefillResponded,
    (True, False): _T.PrefillFailed,
    (False, True): _T.DecodeResponded,
    (False, False): _T.DecodeFailed,
}


def _least_loaded(workers: list[str], live: Counter[str]) -> str | None:
    """The worker of ``workers`` with the fewest live rooms; None if there is none."""
    return min(workers, key=lambda w: live[w], default=None)


def _pools(e: ev.RoomRequested, all_prefill: list[str], all_decode: list[str],
           all_colocated: list[str], alone: bool) -> tuple[list[str], list[str], list[str]]:
    """The P, D and colocated workers a room may go to: around the workers that failed its
    request. With a P and a D left, or else a colocated worker, those; else, with ``alone``
    (``local_prefill_without_prefill``), a D left prefills the room alone; with neither, as
    before colocated workers existed: a role left with none keeps all of its workers, and the
    colocated workers all stay candidates. A hand-off room goes to a D only (it pulls KV a
    colocated worker cannot)."""
    avoid = set(e.attempts.avoid)
    prefill = [p for p in all_prefill if p not in avoid]
    decode = [d for d in all_decode if d not in avoid]
    if e.handoff:
        return prefill or all_prefill, decode or all_decode, []
    colocated = [c for c in all_colocated if c not in avoid]
    if (prefill and decode) or colocated:  # without P or D: a colocated worker's
        return prefill, decode, colocated
    if alone and decode:
        # Not back to the worker that refused: a colocated worker starting its switch to P
        # beside a standby D refused every retry of two requests until the proxy's next role
        # probe, where the standby could have taken them.
        return [], decode, []
    return prefill or all_prefill, decode or all_decode, all_colocated


@attrs.define(slots=True)
class _Room:
    room: int
    request_id: str
    prefill: str  # "" for a room D prefills alone
    decode: str
    deadline: float
    attempts: Attempts = attrs.field(factory=Attempts)
    migratable: bool = False
    state: str = ROOM.initial
    reason: str = ""
    route: str = ""  # why D prefills it alone (a local room)
    role: str = "decode"  # the role its answering leg is addressed as ("null": colocated)
    backoff: float = 0.0  # the delay of the retry this room ends with (RETRIED)
    failed: str = ""  # the worker whose failure retries or migrates the request
    redirects: int = 0  # decode legs re-posted to another D in this room (DecodeRefused)
    refused: tuple[str, ...] = ()  # the Ds that refused this room's decode leg (redirected)


def _handoff_taker(r: _Room, decode: list[str], breakers: WorkerBreakers, live: Counter[str]
                   ) -> str | None:
    """The D a hand-off room's refused leg goes to next, or None. A D that never took the leg
    (down, draining, in another role) is no reason to re-prefill: the draining D still registers
    the KV (until it is told to release it, or its lease ends), so another D pulls it: the least
    loaded of those the room has not tried, first those the request does not avoid (routable
    ones, then ones whose breaker is open), then those it does (as a re-prefill would go to them
    once no other D is left), never the draining D."""
    used = r.attempts
    left = [d for d in decode if d not in (r.decode, *r.refused, used.handed_off_by)]
    fresh = [d for d in left if d not in used.avoid]
    return _least_loaded(breakers.routable(fresh) or left, live)


def _redirect_taker(r: _Room, decode: list[str], breakers: WorkerBreakers, live: Counter[str]
                    ) -> str | None:
    """The D a PD room's refused decode leg goes to next (P holds the KV), or None: the least
    loaded D other than the room's and those that refused it already, first of those the request
    did not fail on (routable ones), else of those it did (routable ones first), as ``_pools``
    keeps a role's workers when none is left: a D that failed the request earlier may serve now
    (one that restarted, or a taker whose hand-off pull failed because its draining D crashed),
    and passing it over would fail a request that a live D could serve. The D that
    handed the request's stream off (draining, so lightly loaded) comes last of all."""
    left = [d for d in decode if d not in (r.decode, *r.refused)]
    fresh = [d for d in breakers.routable(decode) if d in left and d not in r.attempts.avoid]
    avoided = [d for d in left if d != r.attempts.handed_off_by] or left
    return _least_loaded(fresh or breakers.routable(avoided), live)


def _roles(prefill: Sequence[str], decode: Sequence[str], colocated: Sequence[str]
           ) -> dict[str, str]:
    """Each listed worker's role, by the list it is in."""
    return {**dict.fromkeys(colocated, "null"), **dict.fromkeys(decode, "decode"),
            **dict.fromkeys(prefill, "prefill")}


class RoomRouter:
    table = ROOM

    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        rng: random.Random,
        config: RouterConfig | None = None,
        routing: RoutingConfig | None = None,
        colocated: list[str] | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        self._rng = rng
        self.planner = RoutePlanner(routing or RoutingConfig(), rng)
        self._prefill: list[str] = []
        self._decode: list[str] = []
        self._colocated: list[str] = []  # workers in role "null": whole requests
        self._live: Counter[str] = Counter()  # live rooms per worker (the planner's load)
        self.breakers = WorkerBreakers(self.config.breaker_threshold,
                                       self.config.breaker_cooldown)
        self.set_workers(prefill, decode, colocated or [])
        self.rooms: dict[int, _Room] = {}
        self._timers: DeadlineHeap[int] = DeadlineHeap()
        self.outcomes: dict[str, int] = {s: 0 for s in ROOM.terminal}
        self.dropped = 0  # responses for rooms already over, or that the table does not expect
        self.shed: Counter[str] = Counter()  # requests answered 429, by the role that was full
        # Rooms drawn, by the path their request takes: "pd" (a P and a D), "decode_alone"
        # (conditional disaggregation), "colocated", "handoff" (a D pulls a handed-off stream).
        self.routed: Counter[str] = Counter(dict.fromkeys(ROUTED_PATHS, 0))
        self._fx = bind_effects(self, self.table)

    def set_workers(self, prefill: list[str], decode: list[str],
                    colocated: list[str] | None = None) -> None:
        """Replace the worker lists (static flags, probed roles or the bootstrap server's
        /list); ``colocated``: the workers in role "null" (none when not given)."""
        was = _roles(self._prefill, self._decode, self._colocated)
        self._prefill = list(prefill)
        self._decode = list(decode)
        self._colocated = list(colocated or [])
        self.planner.keep(self._prefill, self._decode)
        # A worker that changed role starts its breaker afresh: the legs it refused while it
        # drained for the switch were the old role's (503 "switching its role"), and a D that
        # refused three of them before a probe saw it drain was skipped as P for the cool-down
        # (seen in CI: every leg of the test's next six went to the other P).
        now = _roles(self._prefill, self._decode, self._colocated)
        self.breakers.keep([w for w in now if was.get(w, now[w]) == now[w]])
        self.breakers.keep(list(now))

    # -- entry point --------------------------------------------------------------------------

    def handle(self, event: ev.RouterEvent, now: float) -> list[fx.RouterEffect]:
        out: list[fx.RouterEffect] = []
        self.breakers.advance(now, out)
        for room in self._timers.pop_due(now):
            self._step(self.rooms[room], _T.TimedOut, out, "room deadline passed")
        match event:
            case ev.RoomRequested():
                self._dispatch(event, now, out)
            case ev.LegResponded():
                self._leg_responded(event, now, out)
            case ev.ClientDisconnected():
                # e.g. the client left after its room had already failed: dropped
                self._fire(event.room, _T.ClientDisconnected, out, "client disconnected")
            case ev.RelayFinished():
                self._fire(event.room, _T.RelayFinished, out, "")
            case ev.TimeAdvanced():
                pass  # the deadlines above are all it brings
            case _:
                assert_never(event)
        return out

    def next_deadline(self) -> float | None:
        due = [d for d in (self._timers.next_deadline(), self.breakers.next_deadline())
               if d is not None]
        return min(due, default=None)

    def poll(self, room: int) -> str | None:
        r = self.rooms.get(room)
        return None if r is None else r.state

    # -- internals ----------------------------------------------------------------------------

    def _leg_responded(self, e: ev.LegResponded, now: float,
                       out: list[fx.RouterEffect]) -> None:
        r = self.rooms.get(e.room)
        trigger = _LEG_TRIGGERS[e.leg == "prefill", e.ok]
        if r is not None and not e.handoff:  # a draining D handing its stream off does right
            # A refusal, a lost connection, or D breaking off mid-relay is the worker's fault;
            # other failures (a 4xx, D failing because P did) are not.
            worker = r.prefill if e.leg == "prefill" else r.decode
            broke = e.leg == "decode" and r.state in (_S.RELAYING, _S.LOCAL_RELAYING)
            self.breakers.outcome(worker, e.ok, not e.ok and (e.refused or e.lost or broke),
                                  now, out)
        if r is not None and not e.ok:
            trigger = self._failure_trigger(r, e, now, trigger)
        if trigger == _T.PrefillFailed and self.config.decode_recomputes:
            trigger = _T.PrefillFailedRecoverable
        self._fire(e.room, trigger, out, e.reason)

    def _fire(self, room: int, trigger: str, out: list[fx.RouterEffect], reason: str) -> None:
        """``trigger`` for a room from outside (a leg, the client): dropped, and counted, when
        the room is over or its state has no row for it."""
        r = self.rooms.get(room)
        if r is None or self.table.step(r.state, trigger) is None:
            self.dropped += 1
        else:
            self._step(r, trigger, out, reason)

    def _failure_trigger(self, r: _Room, e: ev.LegResponded, now: float, trigger: str) -> str:
        """A failed leg's trigger: a retry or a migration while the request has one left."""
        cfg, used = self.config, r.attempts
        worker = r.prefill if e.leg == "prefill" else r.decode
        if e.leg == "decode" and r.state == _S.HANDOFF:
            other = (_handoff_taker(r, self._decode, self.breakers, self._live) if e.refused
                     else None)
            if other is not None:
                r.failed = other  # the D its leg goes to next (RedirectDecodeLeg)
                return _T.DecodeRefused
            # The KV could not be had from the draining D: a migration (a re-prefill) is left.
            if used.migrations < cfg.migration_limit:
                r.failed = worker
                return _T.HandoffFailed
            return trigger
        if e.handoff and e.leg == "decode" and r.state in (_S.RELAYING, _S.LOCAL_RELAYING):
            if r.migratable:
                r.failed = worker  # draining: routed around
                return _T.DecodeHandedOff
            return trigger
        if e.leg == "decode" and r.state in (_S.RELAYING, _S.LOCAL_RELAYING):
            if r.migratable and used.migrations < cfg.migration_limit:
                r.failed = worker
                return _T.DecodeBroke
            return trigger
        if e.leg == "decode" and e.refused and r.state in (_S.DISPATCHED, _S.PREFILL_DONE):
            other = _redirect_taker(r, self._decode, self.breakers, self._live)
            if other is not None and r.redirects < cfg.retry_limit:
                r.failed = other  # the D its leg goes to next (RedirectDecodeLeg)
                return _T.DecodeRefused
        if not (e.refused or e.retryable or e.lost) or used.retries >= cfg.retry_limit:
            return trigger
        if e.leg == "prefill" and cfg.decode_recomputes:
            return trigger  # D prefills it itself: cheaper than a new room
        step = min(cfg.retry_backoff_max, cfg.retry_backoff * 2 ** used.retries)
        backoff = step * (0.5 + self._rng.random() / 2)  # jitter: retries do not march in step
        if now + backoff >= r.deadline:
            return trigger  # no time left for another room
        r.backoff, r.failed = backoff, worker
        return _T.PrefillRetryable if e.leg == "prefill" else _T.DecodeRetryable

    def _dispatch(self, e: ev.RoomRequested, now: float, out: list[fx.RouterEffect]) -> None:
        alone = self.planner.config.local_prefill_without_prefill  # D prefills with no P
        prefill, decode, colocated = _pools(e, self._prefill, self._decode, self._colocated,
                                            alone)
        # A room needs a P, but a hand-off room (D pulls the KV) or D prefilling alone.
        no_prefill = not prefill and not e.handoff and not alone
        if not colocated and (no_prefill or not decode):
            out.append(fx.NoWorkers(e.request_id, "prefill" if no_prefill else "decode"))
            return
        prefill, decode = self.breakers.routable(prefill), self.breakers.routable(decode)
        colocated = self.breakers.routable(colocated)
        # A hand-off room needs a D only: P's queues (or having no P at all) never shed it.
        full = self.planner.overloaded([] if e.handoff else prefill, decode, self._live,
                                       colocated)
        if full is not None:
            self.shed[full] += 1
            out.append(fx.ShedRequest(e.request_id, full, SHED_RETRY_AFTER_S))
            return
        room = self._rng.randrange(MAX_ROOM)
        while room in self.rooms:
            room = self._rng.randrange(MAX_ROOM)
        if e.handoff:  # D alone: the least loaded (the draining D is avoided)
            least = _least_loaded(decode, self._live)
            assert least is not None  # NoWorkers above; routable keeps all when none is
            route = Route(None, least, "handoff", "handoff")
        else:
            route = self.planner.plan(prefill, decode, e.prompt, self._live, colocated)
        self.routed["handoff" if e.handoff else "pd" if route.prefill
                    else "colocated" if route.role == "null" else "decode_alone"] += 1
        for worker in (route.prefill, route.decode):
            if worker:
                self.breakers.dispatched(worker)
        deadline = now + self.config.room_timeout
        if e.attempts.deadline is not None:
            deadline = min(deadline, e.attempts.deadline)
        r = _Room(room, e.request_id, route.prefill or "", route.decode, deadline, e.attempts,
                  e.migratable, route=route.prefill_reason, role=route.role)
        self.rooms[room] = r
        self._live.update(w for w in (r.prefill, r.decode) if w)
        self._timers.set(room, deadline)
        first = (_T.DispatchedHandoff if e.handoff else _T.Dispatched if route.prefill
                 else _T.DispatchedLocal)
        self._step(r, first, out, "")

    def _step(self, r: _Room, trigger: str, out: list[fx.RouterEffect], reason: str) -> None:
        tr = self.table.step(r.state, trigger)
        if tr is None:
            raise LocalProtocolError(f"room: {r.state} has no row for {trigger}")
        r.state = tr.target
        r.reason = reason or r.reason
        for name in tr.effects:
            self._fx[name](r, out)
        if tr.target in self.table.terminal:
            del self.rooms[r.room]
            self._live.subtract(w for w in (r.prefill, r.decode) if w)
            self._timers.cancel(r.room)
            self.outcomes[tr.target] += 1

    # -- effects (names from the table) --------------------------------------------------------

    def _fx_PostBothLegs(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.DispatchRoom(r.room, r.request_id, r.prefill, r.decode))

    def _fx_PostDecodeAlone(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.DispatchLocal(r.room, r.request_id, r.decode, r.route, r.role))

    def _fx_PostHandoffLeg(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.DispatchLocal(r.room, r.request_id, r.decode, r.route))

    def _fx_RelayDecode(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.RelayDecode(r.room))

    def _fx_AbortDecodeLeg(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.AbortLeg(r.room, "decode", r.decode))

    def _fx_AbortPrefillLeg(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.AbortLeg(r.room, "prefill", r.prefill))

    def _fx_AbortBothLegs(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        self._fx_AbortPrefillLeg(r, out)
        self._fx_AbortDecodeLeg(r, out)

    def _fx_ReplyError(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        out.append(fx.ReplyError(r.room, r.reason))

    def _fx_RedirectDecodeLeg(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        self._live.subtract([r.decode])
        r.refused += (r.decode,)
        r.decode, r.redirects = r.failed, r.redirects + 1
        self._live.update([r.decode])
        out.append(fx.RedirectDecode(r.room, r.prefill, r.decode))

    def _fx_ReopenRoom(self, r: _Room, out: list[fx.RouterEffect]) -> None:
        used = r.attempts
        if r.state == _S.HANDED_OFF:
            cause, delay = "handoff", 0.0
            attempts = attrs.evolve(used, handoffs=used.handoffs + 1, deadline=None,
                                    handed_off_by=r.failed)
        elif r.state == _S.MIGRATED:
            cause, delay = "migration", 0.0
            # A migrated stream starts a fresh deadline: it may have run long by now.
            attempts = attrs.evolve(used, migrations=used.migrations + 1, deadline=None)
        else:
            cause, delay = "retry", r.backoff
            attempts = attrs.evolve(used, retries=used.retries + 1, deadline=r.deadline)
        # A hand-off room's Ds that refused it are no better a bet for the re-prefill.
        refused = r.refused if r.route == "handoff" else ()
        attempts = attrs.evolve(attempts, avoid=(*used.avoid, *refused, r.failed))
        out.append(fx.ReopenRoom(r.room, r.request_id, cause, delay, attempts))
