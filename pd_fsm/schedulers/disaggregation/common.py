"""What the prefill and decode mixins share: the core endpoint, the clock, the transfer engine,
and the outbox of effects that only the I/O layer can carry out.

Threading: a PD scheduler is driven by one thread at a time (the worker serialises ``step`` and
``deliver`` calls), so its core endpoint needs no lock. The core never reads a clock: the mixin
reads ``self.clock`` (``time.monotonic`` unless injected) and passes ``now`` in.

Phases: each room carries stamps (``self.clock`` times) of the boundaries it passed; ``_lap``
turns two stamps into a ``(phase key, seconds)`` sample, queued for the worker to take with
``take_phase_samples`` after the step (pd_fsm/io_trio/worker/phases.py names every phase).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import drive
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec
from pd_fsm.jax_engine.kv.room import warm_room_copies
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.model_runner import MAIN_KV
from pd_fsm.schedulers.request import FinishReason, Req
from pd_fsm.schedulers.scheduler import Scheduler

# Phase samples kept until the worker takes them (a scheduler driven without a worker drops the
# oldest).
PHASE_SAMPLES_MAX = 4096


class DuplicateRoomError(ValueError):
    """A request reused a ``bootstrap_room`` that is live here (the first one is unaffected)."""


class DisaggregationCommon(Scheduler, ABC):
    args: DisaggregationArgs  # P's and D's constructors take these (Scheduler stores them)
    clock: Callable[[], float]
    engine: KVTransferEngine
    kv_args: KVArgs
    core: Any

    def _init_common(self, engine: KVTransferEngine, clock: Callable[[], float] | None) -> None:
        self.clock = clock or time.monotonic
        self.engine = engine
        self.kv_args = KVArgs([PoolTransferSpec.from_config(MAIN_KV, self.pool_config)],
                              kv_shards=self.args.tp_size)
        self.outbox: list[fx.IOEffect] = []
        self.room_of: dict[str, int] = {}  # rid -> bootstrap_room
        self.req_of: dict[int, Req] = {}  # bootstrap_room -> request, while the room holds it
        # rid -> (HTTP status, reason) of requests the PD protocol failed (read by the worker)
        self.failures: dict[str, tuple[int, str]] = {}
        # Events an effect produced for the core itself (e.g. a failed registration); fed back
        # after the current batch of effects, never re-entrantly.
        self._deferred: deque[Any] = deque()
        self._touched: set[int] = set()  # rooms an effect of the current event was about
        # bootstrap_room -> boundary name -> self.clock() time, while the room is live here.
        self._stamps: dict[int, dict[str, float]] = {}
        self._phase_samples: deque[tuple[str, float]] = deque(maxlen=PHASE_SAMPLES_MAX)

    @property
    def layout_hash(self) -> str:
        return self.kv_args.layout_hash

    # Which side of a room's KV copy this role runs: P gathers, D scatters.
    KV_COPY: str

    def warm_kv_copies(self) -> int:
        """Compile this role's KV copy for every page bucket a prompt can need (see
        ``room_kv.warm_room_copies``); returns how many executables that compiled."""
        longest = min(self.pool_config.pages_for(self.context_length),
                      self.page_budget.allocator.total)
        return warm_room_copies(self.kv_holder, self.kv_args, longest, self.KV_COPY)

    # -- the I/O layer's side ---------------------------------------------------------------------

    def deliver(self, event: Any, now: float | None = None) -> None:
        """Feed an event from the I/O layer (a side-channel message, a lookup answer, a local
        abort, or just the passing of time) into the core and carry out what it says.

        ``now`` is when the event happened on ``self.clock`` (default: now). A message that
        arrived while a forward step ran should be delivered with its arrival time, so that a
        heartbeat received in time extends a lease before the lease's expiry is judged."""
        self._drive(event, self.clock() if now is None else now)

    def step_started(self) -> list[fx.BusyEffect]:
        """Tell the core a step starts (``ev.StepStarted``): what the I/O side must do until
        :meth:`step_ended` to keep peers from taking this busy worker for a dead one. Other
        effects of the event (a lease come due) are carried out as usual."""
        busy: list[fx.BusyEffect] = []

        def dispatch(e: fx.PrefillEffect | fx.DecodeEffect) -> Iterable[Any]:
            if isinstance(e, fx.BusyEffect):
                busy.append(e)
                return ()
            return self._dispatch(e)

        self._drive(ev.StepStarted(), self.clock(), dispatch=dispatch)
        return busy

    def step_ended(self) -> None:
        self.deliver(ev.StepEnded())

    def take_outbox(self) -> list[fx.IOEffect]:
        """Effects only the I/O layer can carry out (SendMessage, ResolvePeer), in order."""
        out, self.outbox = self.outbox, []
        return out

    def next_deadline(self) -> float | None:
        """When (on ``self.clock``) the core next needs ``deliver(TimeAdvanced())``."""
        deadline: float | None = self.core.next_deadline()
        return deadline

    def _drive(
        self,
        event: Any,
        now: float,
        *,
        handle: Callable[[Any, float], list[Any]] | None = None,
        dispatch: Callable[[Any], Iterable[Any]] | None = None,
    ) -> None:
        """Feed ``event`` through the one driver step (``pd_fsm.core.drive``): effects carried
        out in order, the events they yield fed back at ``now``."""
        drive(handle or self.core.handle, event, now, dispatch or self._dispatch,
              after_effects=self._after_batch)

    def _dispatch(self, e: fx.PrefillEffect | fx.DecodeEffect) -> Iterable[Any]:
        """One effect: the I/O layer's go to the outbox, the rest are carried out here; the
        events that yields at once (deferred by the effect's code) come back."""
        if isinstance(e, fx.IOEffect):  # side-channel sends, bootstrap lookups
            self.outbox.append(e)
            return ()
        self._carry_out(e)
        room = getattr(e, "room", None)  # ForgetTransfer is about a peer
        if room is not None:
            self._touched.add(room)
        return self._take_deferred()

    def _after_batch(self) -> Iterable[Any]:
        """After one event's effects: forget rooms that are over on our side, run the role's
        hook (D: the page queue), and return the events that produced."""
        for room in self._touched:
            if self.core.state_of(room) is None:
                self.req_of.pop(room, None)
                self._stamps.pop(room, None)
        self._touched.clear()
        self._after_effects()
        return self._take_deferred()

    def _take_deferred(self) -> list[Any]:
        out = list(self._deferred)
        self._deferred.clear()
        return out

    @abstractmethod
    def _carry_out(self, effect: Any) -> None:  # Any: each role takes its own effect union
        """Carry out one scheduler-side effect of the core (pages, transfer, requests)."""

    def _after_effects(self) -> None:
        """Hook run after each batch of effects (D: try the page queue)."""

    def _admit_pd(self, req: Req, event: Any, accepted: float | None = None) -> None:
        """Register ``req`` and open its room in the core, or raise and keep nothing.
        ``accepted``: when the worker took the leg (``self.clock`` time; default now)."""
        self._register(req)  # ValueError for a request that can never be served
        now = self.clock()

        def admit(e: Any, at: float) -> list[Any]:
            effects: list[Any] = self.core.handle(e, at)  # Any: core is either role's endpoint
            if e is not event:
                return effects
            rejected = [x for x in effects if isinstance(x, fx.RejectRequest)]
            if rejected:  # nothing carried out: the live room of that number is unaffected
                del self.reqs[req.rid]
                raise DuplicateRoomError(rejected[0].reason)
            self.room_of[req.rid] = event.room
            self.req_of[event.room] = req
            self._stamps[event.room] = {"accepted": now if accepted is None
                                        else min(accepted, now)}
            return effects

        self._drive(event, now, handle=admit)

    def abort(self, rid: str, message: str = "aborted") -> bool:
        """A local abort: while the room is live the core decides what to release and whom to
        tell; afterwards (decoding on D) it is an ordinary abort."""
        room = self.room_of.get(rid)
        if room is not None and self.core.state_of(room) is not None:
            self.deliver(ev.Aborted(room, message))
            return True
        return super().abort(rid, message)

    def pd_stats(self) -> dict[str, Any]:
        """KVPoll state counts and the endpoint's counters, for /metrics."""
        states = {f"state_{s}": n for s, n in self.core.state_counts.items() if n}
        return {**states, **self.core.stats.as_dict(), "rooms_live": len(self.core.rooms)}

    # -- shared helpers ---------------------------------------------------------------------------

    def _fail_request(self, req: Req, status: int, reason: str) -> None:
        """Tell the caller the request failed; pages are not touched here (the core releases
        them with their own effect, possibly later)."""
        self.failures[req.rid] = (status, reason)
        self.room_of.pop(req.rid, None)
        self._finish(req, FinishReason("abort", message=reason))

    def pop_failure(self, rid: str) -> tuple[int, str] | None:
        return self.failures.pop(rid, None)

    # -- phases -----------------------------------------------------------------------------------

    def take_phase_samples(self) -> list[tuple[str, float]]:
        """``(phase key, value)`` samples since the last call (the worker observes them)."""
        out = list(self._phase_samples)
        self._phase_samples.clear()
        return out

    def _phase_sample(self, phase: str, value: float) -> None:
        self._phase_samples.append((phase, value))

    def _lap(self, room: int, phase: str, since: str, mark: str) -> None:
        """Stamp ``room`` with ``mark`` now and record ``phase`` = now - its ``since`` stamp;
        once per room (a room already stamped ``mark`` is left as it is)."""
        stamps = self._stamps.get(room)
        if stamps is None or mark in stamps:
            return
        now = stamps[mark] = self.clock()
        start = stamps.get(since)
        if start is not None:
            self._phase_sample(phase, max(0.0, now - start))

    def prompt_pages(self, req: Req) -> int:
        """Pages holding the prompt's KV: what crosses from P to D."""
        return self.pool_config.pages_for(len(req.input_ids))
