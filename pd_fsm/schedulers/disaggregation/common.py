"""What the prefill and decode mixins share: the core endpoint, the clock, the transfer engine,
and the outbox of effects that only the I/O layer can carry out.

Threading: a PD scheduler is driven by one thread at a time (the worker serialises ``step`` and
``deliver`` calls), so its core endpoint needs no lock. The core never reads a clock: the mixin
reads ``self.clock`` (``time.monotonic`` unless injected) and passes ``now`` in.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import Any

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.jax_engine.pool_spec import KVArgs, PoolTransferSpec
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.schedulers.request import FinishReason, Req
from pd_fsm.schedulers.scheduler import MAIN_KV, Scheduler

# Effects the I/O layer carries out (side-channel sends, bootstrap lookups).
IO_EFFECTS = (fx.SendMessage, fx.ResolvePeer, fx.ForgetPeer)


class DuplicateRoomError(ValueError):
    """A request reused a ``bootstrap_room`` that is live here (the first one is unaffected)."""


class DisaggregationCommon(Scheduler, ABC):
    clock: Callable[[], float]
    engine: KVTransferEngine
    kv_args: KVArgs
    core: Any

    def _init_common(self, engine: KVTransferEngine, clock: Callable[[], float] | None) -> None:
        self.clock = clock or time.monotonic
        self.engine = engine
        self.kv_args = KVArgs([PoolTransferSpec.from_config(MAIN_KV, self.pool_config)])
        self.outbox: list[Any] = []
        self.room_of: dict[str, int] = {}  # rid -> bootstrap_room
        self.req_of: dict[int, Req] = {}  # bootstrap_room -> request, while the room holds it
        # rid -> (HTTP status, reason) of requests the PD protocol failed (read by the worker)
        self.failures: dict[str, tuple[int, str]] = {}
        # Events an effect produced for the core itself (e.g. a failed registration); fed back
        # after the current batch of effects, never re-entrantly.
        self._deferred: deque[Any] = deque()

    @property
    def layout_hash(self) -> str:
        return self.kv_args.layout_hash

    # -- the I/O layer's side ---------------------------------------------------------------------

    def deliver(self, event: Any, now: float | None = None) -> None:
        """Feed an event from the I/O layer (a side-channel message, a lookup answer, a local
        abort, or just the passing of time) into the core and carry out what it says.

        ``now`` is when the event happened on ``self.clock`` (default: now). A message that
        arrived while a forward step ran should be delivered with its arrival time, so that a
        heartbeat received in time extends a lease before the lease's expiry is judged."""
        self._run(self.core.handle(event, self.clock() if now is None else now))

    def take_outbox(self) -> list[Any]:
        """Effects only the I/O layer can carry out (SendMessage, ResolvePeer), in order."""
        out, self.outbox = self.outbox, []
        return out

    def next_deadline(self) -> float | None:
        """When (on ``self.clock``) the core next needs ``deliver(TimeAdvanced())``."""
        deadline: float | None = self.core.next_deadline()
        return deadline

    def _run(self, effects: list[Any], now: float | None = None) -> None:
        """Carry out ``effects``, then feed back deferred events (at ``now``, default: now)."""
        while True:
            rooms: set[int] = set()
            for e in effects:
                if isinstance(e, IO_EFFECTS):
                    self.outbox.append(e)
                else:
                    self._carry_out(e)
                    room = getattr(e, "room", None)  # ForgetTransfer is about a peer
                    if room is not None:
                        rooms.add(room)
            for room in rooms:
                if self.core.state_of(room) is None:  # the room is over on our side
                    self.req_of.pop(room, None)
            self._after_effects()
            if not self._deferred:
                return
            effects = self.core.handle(self._deferred.popleft(),
                                       self.clock() if now is None else now)

    @abstractmethod
    def _carry_out(self, effect: Any) -> None:
        """Carry out one scheduler-side effect of the core (pages, transfer, requests)."""

    def _after_effects(self) -> None:
        """Hook run after each batch of effects (D: try the page queue)."""

    def _admit_pd(self, req: Req, event: Any) -> None:
        """Register ``req`` and open its room in the core, or raise and keep nothing."""
        self._register(req)  # ValueError for a request that can never be served
        effects = self.core.handle(event, self.clock())
        rejected = [e for e in effects if isinstance(e, fx.RejectRequest)]
        if rejected:
            del self.reqs[req.rid]
            raise DuplicateRoomError(rejected[0].reason)
        self.room_of[req.rid] = event.room
        self.req_of[event.room] = req
        self._run(effects)

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

    def prompt_pages(self, req: Req) -> int:
        """Pages holding the prompt's KV: what crosses from P to D."""
        return self.pool_config.pages_for(len(req.input_ids))
