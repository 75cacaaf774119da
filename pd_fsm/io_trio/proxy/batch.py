"""A batch of prompts through PD: one room per prompt, one answer for the client.

A room carries one prompt (one KV hand-off, one P leg and one D leg), so the proxy opens a room
per prompt of the batch (``schemas.split_batch`` gives their bodies) and runs each room's own
response (:class:`~pd_fsm.io_trio.proxy.room.RoomResponse`, with its legs, deadlines and
aborts) into a capture instead of the client's socket:

* unstreamed: one answer in the prompts' order (sglang's list of results; OpenAI's ``choices``
  with their ``index``, usage summed). The first room that fails answers for the batch, and the
  others are abandoned (each sees its client leave: both its legs are aborted);
* streamed: every room's events as they come, each marked with its prompt's ``index``; one usage
  chunk (summed) and one ``[DONE]`` at the end; a room that fails sends its error as an event
  with its index, and the others go on.

A client that leaves abandons every room.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import trio
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from pd_fsm.io_trio.proxy.merged_stream import merge_streams
from pd_fsm.io_trio.proxy.room import RoomResponse
from pd_fsm.io_trio.worker.responses import batch_body, summed_usage
from pd_fsm.io_trio.worker.schemas import Kind
from pd_fsm.io_trio.worker.sse import DONE, SSE_HEADERS, event

_DISCONNECT: Message = {"type": "http.disconnect"}


class RoomOpener(Protocol):
    """What a batch needs of the proxy (``server.ProxyServer``, which builds the batch: naming it
    here would close an import circle; ``tests/unit/test_layering.py`` forbids one)."""

    def open_room(self, path: str, body: Mapping[str, object],
                  headers: dict[str, str]) -> RoomResponse | Response:
        """One prompt's room: its ASGI response, or the error to answer with (no worker)."""
        ...


class _Capture:
    """What one room's response sent: its status and body bytes."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")

    def json(self) -> Any:  # Any: a worker's JSON answer, as responses.batch_body takes it
        try:
            return json.loads(self.body)
        except ValueError:
            return {"error": {"message": self.body.decode("utf-8", "replace")[:2000],
                              "code": self.status}}


class BatchResponse:
    """The ASGI response of a batch of prompts (see the module's docstring)."""

    def __init__(self, proxy: RoomOpener, path: str, items: Sequence[Mapping[str, object]],
                 headers: dict[str, str], *, stream: bool) -> None:
        self.proxy = proxy
        self.path = path
        self.items = items
        self.headers = headers
        self.stream = stream
        self.abandon = trio.Event()  # the client left, or (unstreamed) one room failed
        self.client_gone = False

    async def _room_receive(self) -> Message:
        await self.abandon.wait()
        return _DISCONNECT

    async def _watch_client(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.client_gone = True
        self.abandon.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        opened = [self.proxy.open_room(self.path, item, self.headers) for item in self.items]
        rooms = [r for r in opened if isinstance(r, RoomResponse)]
        refused = [r for r in opened if not isinstance(r, RoomResponse)]
        if refused:  # no worker: the rooms opened already are abandoned at once
            self.abandon.set()
            async with trio.open_nursery() as nursery:
                for room in rooms:
                    nursery.start_soon(room, scope, self._room_receive, _Capture().send)
            await refused[0](scope, receive, send)
            return
        if self.stream:
            await self._streamed(scope, receive, send, rooms)
        else:
            await self._whole(scope, receive, send, rooms)

    async def _whole(self, scope: Scope, receive: Receive, send: Send,
                     rooms: list[RoomResponse]) -> None:
        captures = [_Capture() for _ in rooms]

        async def run(room: RoomResponse, capture: _Capture) -> None:
            await room(scope, self._room_receive, capture.send)
            if capture.status != 200:
                self.abandon.set()  # the batch fails: the other rooms are aborted

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_client, receive)
            async with trio.open_nursery() as room_tasks:
                for room, capture in zip(rooms, captures, strict=True):
                    room_tasks.start_soon(run, room, capture)
            nursery.cancel_scope.cancel()
        if self.client_gone:
            return  # every room saw it leave: both legs of each are aborted
        failed = next((c for c in captures if c.status != 200), None)
        if failed is not None:
            status, body = failed.status or 499, failed.json()
        else:
            kind: Kind = "generate" if self.path == "/generate" else "completion"
            status, body = 200, batch_body(kind, [c.json() for c in captures])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(body).encode(),
                    "more_body": False})

    async def _streamed(self, scope: Scope, receive: Receive, send: Send,
                        rooms: list[RoomResponse]) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})

        async def out(chunk: bytes) -> None:
            if not self.client_gone:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_client, receive)
            parts = await merge_streams(list(enumerate(rooms)), scope, self._room_receive, out)
            nursery.cancel_scope.cancel()
        if self.client_gone:
            return  # the client left: nothing more to send
        usages = [p.usage for p in parts if p.usage is not None]
        tail = b""
        if usages:  # one usage chunk for the batch, summed
            tail = event({**usages[-1], "usage": summed_usage([u["usage"] for u in usages])})
        await send({"type": "http.response.body", "body": tail + DONE, "more_body": False})
