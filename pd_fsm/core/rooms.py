"""What P's and D's endpoints share: rooms stepped through a compiled table.

A subclass supplies the table and one ``_fx_<Effect>`` method per effect name in it, its own or
one of its parts' (``effect_parts``: the objects it is split into by concern), bound when it is
built (``_bind_effects``), so a table effect without code fails at start-up, not mid-request.
Finished rooms leave the live dict at once (bytes per live room stay small) and are remembered,
bounded, in ``_finished`` so late messages are told apart from unknown ones and ``poll()`` still
answers.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import ClassVar, Generic, Protocol, TypeVar

import attrs

from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.stats import EndpointStats
from pd_fsm.core.tables import StateTable
from pd_fsm.core.timers import DeadlineHeap


class _HasRoomState(Protocol):
    room: int
    state: str


R = TypeVar("R", bound=_HasRoomState)
E = TypeVar("E")  # the endpoint's effect union


@attrs.frozen(slots=True)
class Cause:
    """What a step's effects are told: the trigger, the reason a client or peer is given, and
    the HTTP status a failure maps to (500 unless the trigger's own)."""

    trigger: str
    reason: str = ""
    status: int = 500


class RoomMachines(Generic[R, E]):
    table: StateTable
    # The classes of the parts that run some of the table's effects (one handler per effect,
    # among the endpoint and its parts); ``pd-fsm spec check`` reads them here.
    effect_parts: ClassVar[tuple[type, ...]] = ()

    def __init__(self, finished_capacity: int) -> None:
        self.rooms: dict[int, R] = {}
        self.stats = EndpointStats()
        self.state_counts: Counter[str] = Counter()
        self._finished: OrderedDict[int, KVPoll] = OrderedDict()
        self._finished_capacity = finished_capacity
        self._room_timers: DeadlineHeap[int] = DeadlineHeap()
        self._fx: dict[str, Callable[[R, float, list[E], Cause], None]] = {}
        self._terminal = self.table.terminal
        self._transitions = self.table.transitions

    def _bind_effects(self, *parts: object) -> None:
        """One handler per effect of our table, ours or one of ``parts``' (those of
        ``effect_parts``, built by the subclass once the rooms exist), and no handler without
        one (TypeError)."""
        kinds = self.effect_parts
        if len(parts) != len(kinds) or not all(map(isinstance, parts, kinds)):
            raise TypeError(f"{type(self).__name__}: parts {parts} are not {kinds}")
        self._fx = bind_effects(self, self.table, parts=parts)

    # -- queries ------------------------------------------------------------------------------

    def poll(self, room: int) -> KVPoll | None:
        r = self.rooms.get(room)
        if r is not None:
            return self.table.poll_of[r.state]
        return self._finished.get(room)

    def state_of(self, room: int) -> str | None:
        r = self.rooms.get(room)
        return None if r is None else r.state

    # -- stepping -----------------------------------------------------------------------------

    def _step(self, r: R, trigger: str, now: float, out: list[E], cause: Cause) -> None:
        """Apply ``trigger``; the caller has already turned a missing remote row into
        ProtocolViolated, so a missing row here is a local bug."""
        tr = self._transitions.get((r.state, trigger))
        if tr is None:
            raise LocalProtocolError(
                f"{self.table.name}: room {r.room} in {r.state} has no row for {trigger}"
            )
        counts = self.state_counts
        counts[r.state] -= 1
        r.state = tr.target
        counts[r.state] += 1
        fx = self._fx
        for name in tr.effects:
            fx[name](r, now, out, cause)
        if tr.target in self._terminal:
            self._retire(r)

    def _has_row(self, r: R, trigger: str) -> bool:
        return (r.state, trigger) in self._transitions

    def _admit(self, r: R) -> None:
        self.rooms[r.room] = r
        self._finished.pop(r.room, None)
        self.state_counts[r.state] += 1

    def _retire(self, r: R) -> None:
        del self.rooms[r.room]
        self._room_timers.cancel(r.room)
        self.state_counts[r.state] -= 1
        poll = self.table.poll_of[r.state]
        if poll is KVPoll.Success:
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
        finished = self._finished
        finished[r.room] = poll
        if len(finished) > self._finished_capacity:
            finished.popitem(last=False)

    # -- a peer's messages -----------------------------------------------------------------------

    peer_role: str  # who sends this endpoint's remote triggers ("D" to P's endpoint, "P" to D's)

    def _cause(self, trigger: str, reason: str, status: int = 0) -> Cause:
        """``trigger``'s cause, with ``status`` or else the HTTP status the table gives it."""
        return Cause(trigger, reason, status or self.table.status(trigger))

    def _apply(self, r: R, trigger: str, now: float, out: list[E], reason: str) -> None:
        """Step ``r`` (subclasses that keep per-state deadlines override this)."""
        self._step(r, trigger, now, out, self._cause(trigger, reason))

    def _remote(self, r: R, trigger: str, now: float, out: list[E], reason: str) -> None:
        """A trigger caused by the peer: a missing row is the peer's fault, not ours."""
        if self._has_row(r, trigger):
            self._apply(r, trigger, now, out, reason)
        else:
            self._violated(
                r, now, out, f"{self.peer_role} sent {trigger} while the room was {r.state}"
            )

    def _violated(self, r: R, now: float, out: list[E], reason: str) -> None:
        self.stats.remote_errors += 1
        self._apply(r, self.table.T.ProtocolViolated, now, out, f"protocol error: {reason}")

    def _fx_CountDuplicate(self, r: R, now: float, out: list[E], cause: Cause) -> None:
        self.stats.duplicates += 1

    def next_deadline(self) -> float | None:
        return self._room_timers.next_deadline()
