"""What the prefill and decode roles share: the link to their core endpoint (``PDLink``): the
clock, the outbox of effects only the I/O layer can carry out, the rooms' requests and failures,
and the one driver step every event goes through.

Threading: a PD scheduler is driven by one thread at a time (the worker serialises ``step`` and
``deliver`` calls), so its core endpoint needs no lock. The core never reads a clock: the link
reads ``clock`` (``time.monotonic`` unless injected) and passes ``now`` in.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

from pd_fsm.core import effects as fx
from pd_fsm.core.drive import drive
from pd_fsm.core.stats import EndpointStats
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec
from pd_fsm.jax_engine.kv.room import warm_room_copies
from pd_fsm.schedulers.disaggregation.phases import PhaseRecorder
from pd_fsm.schedulers.model_runner import MAIN_KV
from pd_fsm.schedulers.request import FinishReason, Req
from pd_fsm.schedulers.scheduler import Scheduler

Ev = TypeVar("Ev")  # the role's event union (ev.PrefillEvent, ev.DecodeEvent)
Fx = TypeVar("Fx")  # the role's effect union (fx.PrefillEffect, fx.DecodeEffect)
Ev_contra = TypeVar("Ev_contra", contravariant=True)


class DuplicateRoomError(ValueError):
    """A request reused a ``bootstrap_room`` that is live here (the first one is unaffected)."""


class PDCore(Protocol[Ev_contra, Fx]):
    """What a role needs of its core endpoint (``PrefillEndpoint``, ``DecodeEndpoint``)."""

    @property
    def rooms(self) -> Mapping[int, object]: ...  # read only: each endpoint's own room type

    @property
    def stats(self) -> EndpointStats: ...

    @property
    def state_counts(self) -> Counter[str]: ...

    def handle(self, event: Ev_contra, now: float) -> list[Fx]: ...

    def next_deadline(self) -> float | None: ...

    def state_of(self, room: int) -> str | None: ...


def kv_args_of(sched: Scheduler) -> KVArgs:
    """The layout of the scheduler's pool as the transfer sees it (its hash is the layout hash
    P and D compare)."""
    return KVArgs([PoolTransferSpec.from_config(MAIN_KV, sched.pool_config)],
                  kv_shards=sched.args.tp_size)


def warm_kv_copies(sched: Scheduler, kv_args: KVArgs, side: str) -> int:
    """Compile a role's side of a room's KV copy (``"gather"``: P, ``"scatter"``: D) for every
    page bucket a prompt can need (see ``kv.room.warm_room_copies``); how many compiled."""
    longest = min(sched.pool_config.pages_for(sched.context_length),
                  sched.page_budget.allocator.total)
    return warm_room_copies(sched.kv_holder, kv_args, longest, side)


class PDLink(Generic[Ev, Fx]):
    """A role's core endpoint and what feeding it takes.

    ``carry_out(effect)``: the role carries out one effect of the core (routing the I/O layer's
    to ``send``, a busy answer to ``busy``) and says which room it was about (None: none, or an
    effect that is not the role's work). ``after_effects()``: run after each event's effects
    (D: the page queue)."""

    def __init__(
        self,
        sched: Scheduler,
        core: PDCore[Ev, Fx],
        clock: Callable[[], float],
        carry_out: Callable[[Fx], int | None],
        after_effects: Callable[[], None] = lambda: None,
    ) -> None:
        self.sched = sched
        self.core = core
        self.clock = clock
        self.phases = PhaseRecorder(clock)
        self._carry_out = carry_out
        self._after_effects = after_effects
        self.outbox: list[fx.IOEffect] = []
        self.room_of: dict[str, int] = {}  # rid -> bootstrap_room
        self.req_of: dict[int, Req] = {}  # bootstrap_room -> request, while the room holds it
        # rid -> (HTTP status, reason) of requests the PD protocol failed (read by the worker)
        self.failures: dict[str, tuple[int, str]] = {}
        # Events an effect produced for the core itself (e.g. a failed registration); fed back
        # after the current batch of effects, never re-entrantly.
        self._deferred: deque[Ev] = deque()
        self._touched: set[int] = set()  # rooms an effect of the current event was about
        self._busy: list[fx.BusyEffect] | None = None  # collected while a step starts

    # -- the I/O layer's side ---------------------------------------------------------------------

    def deliver(self, event: Ev, now: float | None = None) -> None:
        """Feed an event (a side-channel message, a lookup answer, a local abort, or just the
        passing of time) into the core at ``now`` (default: now) and carry out what it says."""
        self.drive(event, self.clock() if now is None else now)

    def step_started(self, event: Ev) -> list[fx.BusyEffect]:
        """Feed ``event`` (the role's ``StepStarted``): the busy effects it says go back to the
        I/O side; its other effects (a lease come due) are carried out as usual."""
        self._busy = []
        try:
            self.drive(event, self.clock())
            return self._busy
        finally:
            self._busy = None

    def busy(self, effect: fx.BusyEffect) -> None:
        """The role's ``carry_out`` got a busy effect: it is for ``step_started``'s caller."""
        if self._busy is None:
            raise TypeError(f"{effect!r} outside a step start")
        self._busy.append(effect)

    def send(self, effect: fx.IOEffect) -> None:
        """The role's ``carry_out`` got an effect only the I/O layer can carry out."""
        self.outbox.append(effect)

    def take_outbox(self) -> list[fx.IOEffect]:
        """Effects only the I/O layer can carry out (SendMessage, ResolvePeer), in order."""
        out, self.outbox = self.outbox, []
        return out

    def next_deadline(self) -> float | None:
        """When (on ``clock``) the core next needs ``deliver(TimeAdvanced())``."""
        return self.core.next_deadline()

    def drive(
        self, event: Ev, now: float, handle: Callable[[Ev, float], list[Fx]] | None = None
    ) -> None:
        """Feed ``event`` through the one driver step (``pd_fsm.core.drive``): effects carried
        out in order, the events they yield fed back at ``now``."""
        drive(handle or self.core.handle, event, now, self._dispatch,
              after_effects=self._after_batch)

    def defer(self, event: Ev) -> None:
        """An event carrying out an effect produced, for the core: fed after this effect."""
        self._deferred.append(event)

    def _dispatch(self, effect: Fx) -> Iterable[Ev]:
        room = self._carry_out(effect)
        if room is not None:
            self._touched.add(room)
        return self._take_deferred()

    def _after_batch(self) -> Iterable[Ev]:
        """After one event's effects: forget rooms that are over on our side, run the role's
        hook (D: the page queue), and return the events that produced."""
        for room in self._touched:
            if self.core.state_of(room) is None:
                self.req_of.pop(room, None)
                self.phases.stamps.pop(room, None)
        self._touched.clear()
        self._after_effects()
        return self._take_deferred()

    def _take_deferred(self) -> list[Ev]:
        out = list(self._deferred)
        self._deferred.clear()
        return out

    # -- requests ---------------------------------------------------------------------------------

    def admit(self, req: Req, event: Ev, room: int, accepted: float | None = None) -> None:
        """Register ``req`` and open its ``room`` with ``event`` in the core, or raise and keep
        nothing. ``accepted``: when the worker took the leg (``clock`` time; default now)."""
        self.sched.register(req)  # ValueError for a request that can never be served
        now = self.clock()

        def admit(e: Ev, at: float) -> list[Fx]:
            effects = self.core.handle(e, at)
            if e is not event:
                return effects
            rejected = [x for x in effects if isinstance(x, fx.RejectRequest)]
            if rejected:  # nothing carried out: the live room of that number is unaffected
                del self.sched.reqs[req.rid]
                raise DuplicateRoomError(rejected[0].reason)
            self.room_of[req.rid] = room
            self.req_of[room] = req
            self.phases.stamps[room] = {"accepted": now if accepted is None
                                        else min(accepted, now)}
            return effects

        self.drive(event, now, handle=admit)

    def live_room(self, rid: str) -> int | None:
        """The room of ``rid`` while the core holds it."""
        room = self.room_of.get(rid)
        return room if room is not None and self.core.state_of(room) is not None else None

    def fail_request(self, req: Req, status: int, reason: str) -> None:
        """Tell the caller the request failed; pages are not touched here (the core releases
        them with their own effect, possibly later)."""
        self.failures[req.rid] = (status, reason)
        self.room_of.pop(req.rid, None)
        self.sched.finish(req, FinishReason("abort", message=reason))

    def pd_stats(self) -> dict[str, int]:
        """KVPoll state counts and the endpoint's counters, for /metrics."""
        core = self.core
        states = {f"state_{s}": n for s, n in core.state_counts.items() if n}
        return {**states, **core.stats.as_dict(), "rooms_live": len(core.rooms)}

    def prompt_pages(self, req: Req) -> int:
        """Pages holding the prompt's KV: what crosses from P to D."""
        return self.sched.pool_config.pages_for(len(req.input_ids))
