"""HandoffLedger: the live KV hand-offs of one decode worker (table kv_handoff).

Both sides of a hand-off live here, each under its own key. The draining D offers a running
sequence's KV under its registration's uuid (``HandoffOffered``) until the proxy says the taking D
answered (``HandoffPulled``) or the offer's lease ends, and releases the registration exactly once
either way. The taking D pulls under its pull's room number (``HandoffClaimed``, negative: never a
PD room's) until the pull reports; a request aborted meanwhile keeps its pages until then, so no
page is freed under a pull that could still write it. A taking D with no free pages queues the
claim (``HandoffQueued``) until pages are reserved for it (``HandoffPagesReserved``) or its wait
ends (half the offer's lease: the rest is the pull's), since a failed hand-off costs a
re-prefill. Sans-IO like every owner in the core: it is fed events with ``now`` and answers with
effects for the scheduler to carry out.
"""

from __future__ import annotations

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import KV_HANDOFF
from pd_fsm.core.timers import DeadlineHeap

_T = KV_HANDOFF.T
_PULL_REPORTS = {ev.PullSucceeded: _T.PullSucceeded, ev.PullFailed: _T.PullFailed}


@attrs.define(slots=True)
class _Handoff:
    key: int  # the offer's uuid, or the pull's room
    state: str = KV_HANDOFF.initial
    reason: str = ""  # why it failed, was released or aborted
    expires_at: float = 0.0  # an offer's lease end, or a queued claim's end of wait


class HandoffLedger:
    table = KV_HANDOFF

    def __init__(self) -> None:
        self.handoffs: dict[int, _Handoff] = {}  # live ones only
        self._timers: DeadlineHeap[int] = DeadlineHeap()
        self.outcomes: dict[str, int] = {s: 0 for s in KV_HANDOFF.terminal}
        # Reports for no live hand-off, or one its state does not expect (a second release of
        # an offer, a release after its expiry): counted, nothing done.
        self.late = 0
        self._fx = bind_effects(self, self.table)

    def handle(self, event: ev.HandoffEvent, now: float) -> list[fx.HandoffEffect]:
        out: list[fx.HandoffEffect] = []
        for key in self._timers.pop_due(now):
            h = self.handoffs[key]
            if h.state == KV_HANDOFF.S.WAITING_FOR_PAGES:
                self._step(h, _T.PageWaitEnded, out, "no free KV pages for the hand-off in time")
            else:
                self._step(h, _T.LeaseExpired, out, "hand-off lease expired")
        match event:
            case ev.HandoffOffered():
                self._new(_Handoff(event.uuid, expires_at=now + event.lease_s), _T.Offered, out)
            case ev.HandoffClaimed():
                self._new(_Handoff(event.room), _T.Claimed, out)
            case ev.HandoffQueued():
                self._new(_Handoff(event.room, expires_at=now + event.wait_s), _T.Queued, out)
            case ev.HandoffPagesReserved():
                self._report(event.room, _T.PagesReserved, out, "")
            case ev.HandoffPulled():
                self._report(event.uuid, _T.Pulled, out, "pulled by another decode worker")
            case ev.PullSucceeded() | ev.PullFailed():
                reason = event.reason if isinstance(event, ev.PullFailed) else ""
                self._report(event.room, _PULL_REPORTS[type(event)], out, reason)
            case ev.Aborted():
                self._report(event.room, _T.Aborted, out, event.reason)
            case ev.TimeAdvanced():
                pass
        return out

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    def state_of(self, key: int) -> str | None:
        h = self.handoffs.get(key)
        return None if h is None else h.state

    def __len__(self) -> int:
        return len(self.handoffs)

    # -- internals ----------------------------------------------------------------------------

    def _new(self, h: _Handoff, trigger: str, out: list[fx.HandoffEffect]) -> None:
        if h.key in self.handoffs:  # a uuid or pull room is drawn fresh: a repeat is our bug
            raise LocalProtocolError(f"kv_handoff: {h.key} is already live")
        self.handoffs[h.key] = h
        self._step(h, trigger, out, "")

    def _report(self, key: int, trigger: str, out: list[fx.HandoffEffect], reason: str) -> None:
        h = self.handoffs.get(key)
        if h is None or self.table.step(h.state, trigger) is None:
            self.late += 1
            return
        self._step(h, trigger, out, reason)

    def _step(self, h: _Handoff, trigger: str, out: list[fx.HandoffEffect], reason: str) -> None:
        tr = self.table.step(h.state, trigger)
        if tr is None:
            raise LocalProtocolError(f"kv_handoff: {h.state} has no row for {trigger}")
        h.state, h.reason = tr.target, reason or h.reason
        for name in tr.effects:
            self._fx[name](h, out)
        if tr.target in self.table.terminal:
            del self.handoffs[h.key]
            self._timers.cancel(h.key)
            self.outcomes[tr.target] += 1

    # -- effects (names from the table) --------------------------------------------------------

    def _fx_ArmLease(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        self._timers.set(h.key, h.expires_at)

    def _fx_ReleaseOffer(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        out.append(fx.ReleaseOffer(h.key, h.reason))

    # An offer's lease and a queued claim's wait are the same timer: the hand-off's expires_at.
    _fx_ArmPageWait = _fx_ArmLease

    def _fx_StartHandoffPull(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        self._timers.cancel(h.key)  # a queued claim's wait is over (none runs for a claim)
        out.append(fx.StartHandoffPull(h.key))

    def _fx_EnterDecode(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        out.append(fx.EnterDecode(h.key))

    def _fx_FailHandoff(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        out.append(fx.FailHandoff(h.key, h.reason))

    def _fx_FinishAborted(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        out.append(fx.FinishAborted(h.key, h.reason))

    def _fx_FreeHeldPages(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        out.append(fx.FreeHeldPages(h.key))

    def _fx_FinishUnplaced(self, h: _Handoff, out: list[fx.HandoffEffect]) -> None:
        out.append(fx.FinishUnplaced(h.key, h.reason))
