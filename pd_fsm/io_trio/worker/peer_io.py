"""A PD worker's I/O around its scheduler: ``PeerIO``.

What the PD loop (pd_backends.py) and its adapter (pd_adapter.py) share with the world outside the
scheduler: the side channel (its role opens it), the inbox of what arrived on it and of lookup
answers, the registry client, and what the core said to answer while a tick keeps the scheduler
busy (``AckWhileBusy``, ``RepeatWhileBusy``). Touched from the trio loop, except where a method
says it runs on the tick's thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.messages import Message
from pd_fsm.io_trio.bootstrap.client import BootstrapClient, BootstrapResolver
from pd_fsm.io_trio.bootstrap.records import InstanceRecord, rank_query
from pd_fsm.io_trio.driver import carry_out_io, resolve_within
from pd_fsm.io_trio.side_channel.channel import DecodeSideChannel, PrefillSideChannel
from pd_fsm.io_trio.worker.spmd.frames import InboxEvent

log = logging.getLogger("pd_fsm.io_trio.worker.pd")

INBOX_SIZE = 4096  # side-channel messages and lookup answers waiting for the loop

Arrived = tuple[float, InboxEvent]  # time.monotonic() of the arrival, and what arrived


class PeerIO:
    def __init__(self, wake: Callable[[], None]) -> None:
        """``wake``: wakes the loop (a message arrived, a pull finished)."""
        self._wake = wake
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[Arrived](INBOX_SIZE)
        self._token: trio.lowlevel.TrioToken | None = None
        self.side: PrefillSideChannel | DecodeSideChannel | None = None  # the role's, once open
        self.bootstrap: BootstrapClient | None = None
        self.inbox_dropped = 0
        # trio time the running scheduler tick began (None between ticks): a first forward of a
        # new shape compiles for many seconds, and liveness must not wait for it.
        self.busy_since: float | None = None
        # What the core said to do while the running tick keeps it busy (ev.StepStarted):
        # published by the tick's thread at its start, emptied at its end; the loop's tasks
        # read the reference (a tuple of frozen effects) and carry it out.
        self.while_busy: tuple[fx.BusyEffect, ...] = ()
        self.busy_liveness_total = 0

    def started(self) -> None:
        """On the trio loop, before any thread may call ``wake_from_thread``."""
        self._token = trio.lowlevel.current_trio_token()

    def running_side(self) -> PrefillSideChannel | DecodeSideChannel:
        assert self.side is not None
        return self.side

    def send(self, peer: str, message: Message) -> bool:
        """Send on the side channel (non-blocking; False when dropped)."""
        return self.running_side().send(peer, message)

    async def deliver_message(self, peer: str, message: Message) -> None:
        """The side channel's callback: stamp the arrival time, queue, wake the loop; while a
        tick runs, answer at once what the core's ``AckWhileBusy`` answers."""
        for effect in self.while_busy:
            reply = effect.answer(message) if isinstance(effect, fx.AckWhileBusy) else None
            if reply is not None:
                self.busy_liveness_total += 1
                self.send(peer, reply)
        self.put(ev.MessageReceived(peer, message))

    def put(self, event: InboxEvent) -> None:
        try:
            self._inbox_send.send_nowait((time.monotonic(), event))
        except trio.WouldBlock:
            self.inbox_dropped += 1  # bounded: a flood is dropped and counted, never queued
        self._wake()

    def take_inbox(self) -> list[Arrived]:
        inbox: list[Arrived] = []
        while True:
            try:
                inbox.append(self._inbox_recv.receive_nowait())
            except trio.WouldBlock:
                return inbox

    def on_loop(self, fn: Callable[[], None]) -> None:
        """From another thread (the tick's, a pull's): run ``fn`` on the trio loop now."""
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):  # the worker is shutting down
                trio.from_thread.run_sync(fn, trio_token=self._token)

    def wake_from_thread(self, _: object = None) -> None:
        self.on_loop(self._wake)

    def carry_out(self, effects: list[fx.IOEffect],
                  start_resolve: Callable[[str], None]) -> None:
        for effect in effects:
            carry_out_io(effect, self.running_side(), start_resolve)

    def send_from_thread(self, effects: list[fx.IOEffect],
                         start_resolve: Callable[[str], None]) -> None:
        """From the tick's thread, before its step: out on the loop now (run_tick)."""
        self.on_loop(lambda: self.carry_out(effects, start_resolve))

    async def keepalive(self, interval: float) -> None:
        """Carry out the core's ``RepeatWhileBusy`` while a tick outlasts its interval (a first
        forward of a new shape compiles for seconds): P's acks keep D from losing it."""
        while True:
            await trio.sleep(interval)
            since = self.busy_since
            for effect in self.while_busy:
                if not isinstance(effect, fx.RepeatWhileBusy) or since is None:
                    continue
                if trio.current_time() - since < effect.interval:
                    continue
                for send in effect.heartbeats:
                    self.send(send.peer, send.message)
                self.busy_liveness_total += 1

    async def resolve(self, bootstrap_addr: str, check: Callable[[InstanceRecord], str | None],
                      timeout: float, name: str) -> None:
        """Look P up in the registry (``check``: why not use the one found) and queue the
        answer; ``timeout`` inside the core's own resolve deadline, so this clearer answer
        arrives first."""
        assert self.bootstrap is not None
        resolver = BootstrapResolver(self.bootstrap, rank_query(), check=check)
        self.put(await resolve_within(resolver, bootstrap_addr, timeout, name))
