"""The endpoint driver: one trio task per core endpoint, feeding it events and carrying out effects.

The core decides; this loop only moves things: events from the HTTP and ZMQ adapters come in
through a bounded memory channel, ``handle(event, now)`` runs with ``now = trio.current_time()``,
and each effect goes where it belongs — :class:`~pd_fsm.core.effects.SendMessage` to the side
channel, :class:`~pd_fsm.core.effects.ResolvePeer` to the resolver (answered later with
``PeerResolved`` / ``PeerResolutionFailed``), everything else to the :class:`EffectSink` (the
scheduler). Between events the task sleeps until ``next_deadline()``, woken early by new events.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol, assert_never

import attrs
import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import Endpoint as Endpoint  # what the driver needs of a core owner
from pd_fsm.core.drive import drive
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.messages import Message

log = logging.getLogger("pd_fsm.io_trio.driver")

Resolution = ev.PeerResolved | ev.PeerResolutionFailed
Resolver = Callable[[str], Awaitable[Resolution]]


class SideChannel(Protocol):
    """The side channel as a driver sees it: a non-blocking send that may drop (and count), and
    closing what is kept for a peer the core forgot."""

    def send(self, peer: str, message: Message) -> bool: ...

    def close_peer(self, peer: str) -> bool: ...


IOEffect = fx.IOEffect


def carry_out_io(effect: IOEffect, side: SideChannel | None,
                 start_resolve: Callable[[str], None]) -> bool:
    """The one place a core's I/O effects are carried out, by the worker's loop and by
    :class:`EndpointDriver`: False for a message the side channel dropped. A lookup needs no
    side channel; a message or a forgotten peer without one is the embedder's bug."""
    match effect:
        case fx.ResolvePeer():
            start_resolve(effect.bootstrap_addr)
            return True
        case fx.SendMessage():
            return _needs_side(side, effect).send(effect.peer, effect.message)
        case fx.ForgetPeer():
            _needs_side(side, effect).close_peer(effect.peer)
            return True
        case _:
            assert_never(effect)


def _needs_side(side: SideChannel | None, effect: IOEffect) -> SideChannel:
    if side is None:
        raise RuntimeError(f"{type(effect).__name__} but no side channel")
    return side


async def resolve_within(resolver: Resolver, bootstrap_addr: str, timeout: float,
                         name: str) -> Resolution:
    """``resolver``'s answer, or a failure naming why: it took over ``timeout`` (set it inside
    the core's own resolve deadline, so this clearer answer arrives first) or it raised (a
    resolver bug or a transport error fails the rooms waiting on it, never the caller)."""
    with trio.move_on_after(timeout):
        try:
            return await resolver(bootstrap_addr)
        except Exception as exc:
            log.warning("%s: resolving %s failed: %r", name, bootstrap_addr, exc)
            return ev.PeerResolutionFailed(bootstrap_addr, f"{type(exc).__name__}: {exc}")
    return ev.PeerResolutionFailed(bootstrap_addr,
                                   f"bootstrap lookup took over {timeout:g} s")


class EffectSink(Protocol):
    """The scheduler-facing half of the effects (RegisterKV, ReleaseKV, AllocateBlocks,
    StartPull, CompleteTransfer, CompleteRequest, FailRequest, RejectRequest, CancelAllocation,
    ReleaseBlocks, and the registry's bookkeeping effects).

    ``apply`` runs on the driver's task and must not block. It returns the events that are known
    at once (e.g. ``BlocksAllocated`` when pages are free right now); the driver feeds them to the
    endpoint before the next event. Outcomes known later (a pull finishing in a worker thread) go
    back through :meth:`EndpointDriver.submit` or :meth:`EndpointDriver.submit_nowait`.
    """

    def apply(self, effect: Any, now: float) -> Iterable[Any]: ...


@attrs.define
class DriverStats:
    events: int = 0
    effects: int = 0
    messages_sent: int = 0
    messages_dropped: int = 0  # the side channel refused (queue full, peer unroutable)
    local_errors: int = 0  # LocalProtocolError: a bug in whoever fed the event
    submit_dropped: int = 0  # submit_nowait found the inbox full
    resolutions: int = 0


class _Call:
    """An event whose caller waits for the effects it produced (the registry's HTTP writes)."""

    __slots__ = ("done", "error", "event", "result")

    def __init__(self, event: Any) -> None:
        self.event = event
        self.result: list[Any] = []
        self.error: BaseException | None = None
        self.done = trio.Event()


class EndpointDriver:
    """Runs one endpoint. Start with ``await nursery.start(driver.run)``."""

    def __init__(
        self,
        # Any endpoint: the driver feeds each its own TimeAdvanced, MessageReceived and lookup
        # answers, which no event type variable can say is in the endpoint's union.
        endpoint: Endpoint[Any, Any],
        sink: EffectSink,
        *,
        side_channel: SideChannel | None = None,
        resolver: Resolver | None = None,
        resolve_timeout: float = 10.0,
        inbox_size: int = 4096,
        batch: int = 256,
        name: str = "endpoint",
    ) -> None:
        self.endpoint = endpoint
        self.sink = sink
        self.side_channel = side_channel
        self.resolver = resolver
        self.resolve_timeout = resolve_timeout
        self.name = name
        self.stats = DriverStats()
        self._batch = batch
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[Any](inbox_size)
        self._nursery: trio.Nursery | None = None

    # -- feeding ------------------------------------------------------------------------------

    async def submit(self, event: Any) -> None:
        """Queue ``event``; waits while the inbox is full (backpressure on the producer)."""
        await self._inbox_send.send(event)

    def submit_nowait(self, event: Any) -> bool:
        """Queue ``event`` from synchronous code; False (counted) when the inbox is full."""
        try:
            self._inbox_send.send_nowait(event)
        except trio.WouldBlock:
            self.stats.submit_dropped += 1
            return False
        return True

    async def deliver(self, peer: str, message: Message) -> None:
        """The side channel's callback for a decoded message."""
        await self._inbox_send.send(ev.MessageReceived(peer, message))

    async def call(self, event: Any, timeout: float = 5.0) -> list[Any]:
        """Feed ``event`` and return the effects it produced (raises what ``handle`` raised)."""
        item = _Call(event)
        with trio.fail_after(timeout):
            await self._inbox_send.send(item)
            await item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    # -- the loop -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await self._loop()
            finally:
                self._nursery = None

    async def _loop(self) -> None:
        recv = self._inbox_recv
        while True:
            deadline = self.endpoint.next_deadline()
            item: Any = None
            with trio.move_on_at(math.inf if deadline is None else deadline):
                item = await recv.receive()
            if item is None:
                self._feed(ev.TimeAdvanced(), trio.current_time())
                continue
            self._feed(item, trio.current_time())
            # Drain what is already queued before sleeping again, but bounded, so a flood of
            # messages cannot keep timers (checked at the top of the loop) from firing.
            for _ in range(self._batch):
                try:
                    item = recv.receive_nowait()
                except trio.WouldBlock:
                    break
                self._feed(item, trio.current_time())

    def _feed(self, item: Any, now: float) -> None:
        call = item if isinstance(item, _Call) else None

        def handle(event: Any, at: float) -> list[Any]:
            self.stats.events += 1
            return self.endpoint.handle(event, at)

        def carry_out(effect: Any) -> Iterable[Any]:
            self.stats.effects += 1
            if call is not None:
                call.result.append(effect)
            return self._execute(effect, now)

        def local_error(event: Any, exc: LocalProtocolError) -> None:
            # Our own side fed something the tables forbid: a bug to fix, but one room's bug
            # must not stop every other room, so it is logged loudly and the loop goes on.
            self.stats.local_errors += 1
            log.error("%s: %s (event %r)", self.name, exc, event)
            if call is not None and event is call.event:
                call.error = exc

        drive(handle, call.event if call else item, now, carry_out, on_local_error=local_error)
        if call is not None:
            call.done.set()

    def _execute(self, effect: object, now: float) -> Iterable[Any]:
        # An open dispatch (any endpoint's effects): the I/O ones here, the rest to the sink.
        match effect:
            case fx.ResolvePeer() if self.resolver is None or self._nursery is None:
                return (ev.PeerResolutionFailed(effect.bootstrap_addr, "no bootstrap resolver"),)
            case fx.SendMessage():
                if carry_out_io(effect, self.side_channel, self._start_resolve):
                    self.stats.messages_sent += 1
                else:
                    self.stats.messages_dropped += 1
            case fx.ResolvePeer() | fx.ForgetPeer():
                carry_out_io(effect, self.side_channel, self._start_resolve)
            case _:
                return self.sink.apply(effect, now)
        return ()

    def _start_resolve(self, bootstrap_addr: str) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._resolve, bootstrap_addr)

    async def _resolve(self, bootstrap_addr: str) -> None:
        assert self.resolver is not None
        self.stats.resolutions += 1
        await self.submit(await resolve_within(self.resolver, bootstrap_addr,
                                               self.resolve_timeout, self.name))


class NullSink:
    """A sink for endpoints whose effects need no scheduler (the bootstrap registry)."""

    def apply(self, effect: Any, now: float) -> Iterable[Any]:
        return ()
