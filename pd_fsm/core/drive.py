"""The one driver step every embedder runs a core endpoint through.

An embedder feeds an event to an endpoint, carries out the effects it returns in order, and feeds
back the events that carrying them out yields at once (pages free right now: ``BlocksAllocated``;
a registration that failed: ``PrefillFailed``) — first in, first out, and never re-entrantly, so
an effect never runs in the middle of another event's effects. That loop is :func:`drive`. The
PD schedulers of the workers (``schedulers/disaggregation/common.py``), the trio
``EndpointDriver`` (the bootstrap server, tests, benches; ``io_trio/driver.py``) and the
simulator's workers (``pd_fsm/sim``) all run it; what differs between them is only what happens
between two calls (a trio task waiting on a channel, a worker thread between forward steps, a
virtual clock) and how each effect is carried out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from pd_fsm.core.errors import LocalProtocolError

Ev = TypeVar("Ev")
Fx = TypeVar("Fx")
Ev_contra = TypeVar("Ev_contra", contravariant=True)


class Endpoint(Protocol[Ev_contra, Fx]):
    """What an embedder needs of a core owner: ``handle`` from its closed event union to a list
    of its closed effect union, and when it next needs ``TimeAdvanced``. ``PrefillEndpoint`` is
    an ``Endpoint[ev.PrefillEvent, fx.PrefillEffect]``, ``DecodeEndpoint`` an
    ``Endpoint[ev.DecodeEvent, fx.DecodeEffect]``, ``RoomRouter`` an
    ``Endpoint[ev.RouterEvent, fx.RouterEffect]``, ``ProxySession`` and ``SequenceSession``
    each an ``Endpoint[ev.SessionEvent, fx.SessionEffect]`` and ``BootstrapRegistry[R]`` an
    ``Endpoint[ev.RegistryEvent[R], RegistryEffect[R]]`` (checked in tests/unit/test_core_types.py).
    """

    def handle(self, event: Ev_contra, now: float) -> list[Fx]: ...

    def next_deadline(self) -> float | None: ...


def drive(
    handle: Callable[[Ev, float], list[Fx]],
    event: Ev,
    now: float,
    carry_out: Callable[[Fx], Iterable[Ev]],
    *,
    after_effects: Callable[[], Iterable[Ev]] | None = None,
    on_local_error: Callable[[Ev, LocalProtocolError], None] | None = None,
) -> int:
    """Feed ``event`` (at ``now``) to ``handle`` and carry out every effect in order; the events
    ``carry_out`` returns, and then those ``after_effects`` returns once an event's effects are
    all carried out, are fed next at the same ``now``, in order. Returns how many effects ran.

    ``on_local_error``: a ``LocalProtocolError`` (the embedder fed an event the tables forbid)
    is passed to it and the loop goes on with the next queued event; without it, it propagates.
    """
    queue: deque[Ev] = deque((event,))
    ran = 0
    while queue:
        current = queue.popleft()
        try:
            effects = handle(current, now)
        except LocalProtocolError as exc:
            if on_local_error is None:
                raise
            on_local_error(current, exc)
            continue
        for effect in effects:
            ran += 1
            queue.extend(carry_out(effect))
        if after_effects is not None:
            queue.extend(after_effects())
    return ran
