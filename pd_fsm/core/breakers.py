"""WorkerBreakers: the proxy's circuit breaker per worker (table worker_breaker).

The RoomRouter owns one and feeds it every leg's outcome: a worker fault (a leg refused before
any byte, or broken off mid-relay) counts against the worker, a 2xx resets the count, and the
``breaker_threshold``-th consecutive fault opens the breaker: routing skips the worker for
``breaker_cooldown`` seconds, then sends it one probe request, whose answer closes or reopens
it. Routing never refuses for breakers alone: when every worker of a role is open, all are
tried (an error from a worker says more than one from the proxy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import WORKER_BREAKER
from pd_fsm.core.timers import DeadlineHeap

_T = WORKER_BREAKER.T
_S = WORKER_BREAKER.S
_ROUTABLE = frozenset({_S.CLOSED, _S.HALF_OPEN})


@attrs.define(slots=True)
class _Breaker:
    worker: str
    state: str = WORKER_BREAKER.initial
    faults: int = 0  # consecutive worker faults (CLOSED)


class WorkerBreakers:
    table = WORKER_BREAKER

    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold  # 0: never opens
        self.cooldown = cooldown
        self._breakers: dict[str, _Breaker] = {}
        self._timers: DeadlineHeap[str] = DeadlineHeap()
        self.changes: Counter[str] = Counter()  # "CLOSED->OPEN": transitions, for /metrics
        self._now = 0.0
        self._fx = bind_effects(self, self.table)

    # -- inputs ---------------------------------------------------------------------------------

    def keep(self, workers: Sequence[str]) -> None:
        """The proxy's lists changed: a worker no longer in them is forgotten."""
        for gone in [w for w in self._breakers if w not in workers]:
            self._step(self._breakers[gone], _T.WorkerRemoved, [])
        for w in workers:
            self._breakers.setdefault(w, _Breaker(w))

    def outcome(self, worker: str, ok: bool, fault: bool, now: float,
                out: list[fx.RouterEffect]) -> None:
        """A leg to ``worker`` answered 2xx (``ok``), or failed by the worker's ``fault``; a
        failure that is not the worker's (a client's 4xx) changes nothing."""
        b = self._breakers.get(worker)
        if b is None or not (ok or fault):
            return  # not listed (any more): its late legs say nothing
        self._now = now
        if ok:
            trigger = _T.LegSucceeded
        elif self.threshold and b.faults + 1 >= self.threshold:
            trigger = _T.Tripped
        else:
            trigger = _T.LegFaulted
        self._step(b, trigger, out)

    def dispatched(self, worker: str) -> None:
        """A room was routed to ``worker``: while HALF_OPEN, that room is the probe."""
        b = self._breakers.get(worker)
        if b is not None and b.state == _S.HALF_OPEN:
            self._step(b, _T.ProbeDispatched, [])

    def advance(self, now: float, out: list[fx.RouterEffect]) -> None:
        """Cool-downs that are over."""
        self._now = now
        for worker in self._timers.pop_due(now):
            self._step(self._breakers[worker], _T.CooledDown, out)

    # -- what routing asks ----------------------------------------------------------------------

    def routable(self, workers: list[str]) -> list[str]:
        """``workers`` whose breaker lets requests through (all of them if none does)."""
        ok = [w for w in workers if self.state(w) in _ROUTABLE]
        return ok or workers

    def state(self, worker: str) -> str:
        b = self._breakers.get(worker)
        return b.state if b is not None else _S.CLOSED

    def states(self) -> dict[str, str]:
        return {w: b.state for w, b in sorted(self._breakers.items())}

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    # -- internals ------------------------------------------------------------------------------

    def _step(self, b: _Breaker, trigger: str, out: list[fx.RouterEffect]) -> None:
        tr = self.table.step(b.state, trigger)
        if tr is None:
            raise LocalProtocolError(f"worker_breaker: {b.state} has no row for {trigger}")
        old, b.state = b.state, tr.target
        for name in tr.effects:
            self._fx[name](b, old, out)
        if tr.target in self.table.terminal:
            del self._breakers[b.worker]
            self._timers.cancel(b.worker)

    # -- effects (names from the table) ---------------------------------------------------------

    def _fx_CountFault(self, b: _Breaker, old: str, out: list[fx.RouterEffect]) -> None:
        b.faults += 1

    def _fx_ResetFaults(self, b: _Breaker, old: str, out: list[fx.RouterEffect]) -> None:
        b.faults = 0

    def _fx_StartCooldown(self, b: _Breaker, old: str, out: list[fx.RouterEffect]) -> None:
        b.faults = 0
        self._timers.set(b.worker, self._now + self.cooldown)

    def _fx_ReportChange(self, b: _Breaker, old: str, out: list[fx.RouterEffect]) -> None:
        self.changes[f"{old}->{b.state}"] += 1
        out.append(fx.BreakerChanged(b.worker, old, b.state))
