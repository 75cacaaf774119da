"""Test doubles for the I/O layer (as ``trio.testing`` is for trio).

:class:`RecordingSink` stands in for the *scheduler* behind an :class:`EffectSink`: it records
every effect with the time it was carried out, reserves pages at once and reports every pull as
succeeded (or failed, when told to). The protocol, the sockets and the clock stay real.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.messages import Message
from pd_fsm.io_trio.bootstrap.records import InstanceRecord, parse_record


class Inbox:
    """What a side channel delivered: (peer, message) in arrival order."""

    def __init__(self) -> None:
        self.got: list[tuple[str, Message]] = []

    async def deliver(self, peer: str, message: Message) -> None:
        self.got.append((peer, message))


async def until(probe: Callable[[], Any], timeout: float = 5.0) -> None:
    """Wait until ``probe()`` is true, at most ``timeout`` seconds (then TooSlowError)."""
    with trio.fail_after(timeout):
        while not probe():
            await trio.sleep(0.005)


class RecordingSink:
    def __init__(self, *, allocate: bool = True, pull_error: str | None = None) -> None:
        self.allocate = allocate
        self.pull_error = pull_error
        self.effects: list[tuple[float, Any]] = []
        self._changed = trio.Event()

    def apply(self, effect: Any, now: float) -> Iterable[Any]:
        self.effects.append((now, effect))
        self._changed.set()
        self._changed = trio.Event()
        if isinstance(effect, fx.AllocateBlocks) and self.allocate:
            return (ev.BlocksAllocated(effect.room),)
        if isinstance(effect, fx.StartPull):
            if self.pull_error is not None:
                return (ev.PullFailed(effect.room, self.pull_error),)
            return (ev.PullSucceeded(effect.room),)
        return ()

    def of_type(self, kind: type, room: int | None = None) -> list[tuple[float, Any]]:
        return [
            (t, e)
            for t, e in self.effects
            if isinstance(e, kind) and (room is None or getattr(e, "room", None) == room)
        ]

    async def wait_for(
        self, kind: type, room: int | None = None, timeout: float = 10.0
    ) -> tuple[float, Any]:
        """The first (time, effect) of ``kind`` (for ``room``), waiting up to ``timeout``."""
        return await self.wait_until(
            lambda: next(iter(self.of_type(kind, room)), None), timeout=timeout
        )

    async def wait_until(self, probe: Callable[[], Any], timeout: float = 10.0) -> Any:
        with trio.fail_after(timeout):
            while True:
                found = probe()
                if found is not None:
                    return found
                await self._changed.wait()


def sample_record(**overrides: Any) -> InstanceRecord:
    """A valid prefill registration at rank (0, 0, 0, 0); override any field."""
    fields: dict[str, Any] = {
        "role": "prefill",
        "instance_id": "p0",
        "tp_rank": 0,
        "tp_size": 1,
        "cp_rank": 0,
        "cp_size": 1,
        "dp_rank": 0,
        "dp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "transfer_addr": "127.0.0.1:7001",
        "zmq_addr": "127.0.0.1:7002",
        "page_size": 16,
        "kv_dtype": "bfloat16",
        "layout_hash": "layout-1",
    }
    fields.update(overrides)
    return parse_record(fields)
