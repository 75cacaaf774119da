"""Several streamed answers relayed as one stream: a batch's prompts, each in a room of its own
(``batch.py``), or an n > 1 answer's sequences, each continued in a request of its own after a
migration (``room.RoomResponse``).

Each part is an ASGI app (a room's response) whose events go to the client as they come, each
marked with the part's ``index`` (OpenAI's choices', sglang's top-level one). Its ``[DONE]`` and
its usage chunk are held back: the caller ends the whole stream with one of each. A part that
answers an error status instead of a stream sends its error as one event with its index.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio
from starlette.types import ASGIApp, Message, Receive, Scope

from pd_fsm.io_trio.proxy.logprob_merge import split_events
from pd_fsm.io_trio.worker.responses import indexed
from pd_fsm.io_trio.worker.sse import event


class Part:
    """What one part sent, as events of the merged stream (``feed``, ``end``)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.status = 0  # its http.response.start's, if it sent one
        # dict[str, Any]: a JSON object, as worker.responses (indexed, summed_usage) types it.
        self.usage: dict[str, Any] | None = None  # its usage chunk (OpenAI include_usage)
        self._error = b""  # an error status's body
        self._pending = b""

    def feed(self, message: Message) -> list[bytes]:
        """One ASGI message of the part: the events (SSE bytes) it has for the client now."""
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return []
        if message["type"] != "http.response.body":
            return []
        body: bytes = message.get("body", b"")
        if self.status not in (0, 200):
            self._error += body  # a failed room's body: its error, kept whole
            return []
        events, self._pending = split_events(self._pending + body)
        out = []
        for raw in events:
            payload = _payload(raw)
            if payload is None:
                continue  # [DONE]: one for the whole stream, at the end
            if payload.get("choices") == [] and isinstance(payload.get("usage"), dict):
                self.usage = payload  # one usage chunk for the whole stream
                continue
            out.append(event(indexed(payload, self.index)))
        return out

    def end(self) -> list[bytes]:
        """Once the part is over: its error as an event, if it answered an error status."""
        if self.status in (0, 200):
            return []
        try:
            body = json.loads(self._error)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {"error": {"message": self._error.decode("utf-8", "replace")[:2000],
                              "code": self.status}}
        return [event({**body, "index": self.index})]


async def merge_streams(parts: Sequence[tuple[int, ASGIApp]], scope: Scope, receive: Receive,
                        send: Callable[[bytes], Awaitable[None]]) -> list[Part]:
    """Run every part with ``receive`` (how each learns the client left) and ``send`` their
    events as they come (see the module's docstring). Returns once all are over: what each
    sent (its usage chunk)."""
    out_parts = [Part(index) for index, _ in parts]
    send_ch, recv_ch = trio.open_memory_channel[bytes](64)

    async def run(app: ASGIApp, part: Part, out: trio.MemorySendChannel[bytes]) -> None:
        async def forward(message: Message) -> None:
            for chunk in part.feed(message):
                await out.send(chunk)

        async with out:
            await app(scope, receive, forward)
            for chunk in part.end():
                await out.send(chunk)

    async with trio.open_nursery() as nursery:
        async with send_ch:
            for (_, app), part in zip(parts, out_parts, strict=True):
                nursery.start_soon(run, app, part, send_ch.clone())
        async with recv_ch:
            async for chunk in recv_ch:
                await send(chunk)
    return out_parts


def _payload(raw: bytes) -> dict[str, Any] | None:  # Any: as worker.responses.indexed takes it
    data = raw.strip().removeprefix(b"data: ")
    if data == b"[DONE]":
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None
