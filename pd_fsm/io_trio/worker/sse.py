"""Server-sent events and client-disconnect detection at the ASGI level.

Starlette's StreamingResponse notices a vanished client only when a write fails; a generation
can run for a long time between writes (and a non-streaming one writes nothing until the end),
so every long wait here runs next to a task that reads ``http.disconnect`` and cancels it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any, TypeVar

import trio

if TYPE_CHECKING:
    from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]  # as starlette types an ASGI receive
Send = Callable[[dict[str, Any]], Awaitable[None]]
T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


# Live hand-off: a draining decode worker ends a stream the proxy let it hand off
# (accept_handoff) with this event, which is no ``data:``-only event, so that a client that
# somehow gets one does not take it for output. The proxy reads it and never relays it.
HANDOFF_EVENT = b"event: pd_fsm.handoff\n"


def handoff_event(ticket: HandoffTicket) -> bytes:
    return HANDOFF_EVENT + event(ticket.to_json())


def handoff_ticket(raw: bytes) -> dict[str, Any] | None:
    """The ticket of a hand-off event (one SSE event's bytes), else None."""
    return _named(raw, HANDOFF_EVENT)


def _named(raw: bytes, name: bytes) -> dict[str, Any] | None:
    """The JSON object of one SSE event's bytes that start with the event line ``name``, else
    None (another event, or no object after it)."""
    if not raw.startswith(name + b"data: "):
        return None
    try:
        body = json.loads(raw[len(name) + len(b"data: "):])
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


# A stream the worker gave up to another (``POST /move_streams``, a stream the proxy let it move:
# accept_move) ends with this event instead of [DONE]: the proxy prefills the prompt and the
# tokens so far on another worker and goes on there. Not ``data:``-only, for the same reason.
MOVED_EVENT = b"event: pd_fsm.moved\n"


def moved_event(reason: str) -> bytes:
    return MOVED_EVENT + event({"reason": reason})


def moved_reason(raw: bytes) -> str | None:
    """The reason of a move event (one SSE event's bytes), else None."""
    if not raw.startswith(MOVED_EVENT):
        return None
    reason = (_named(raw, MOVED_EVENT) or {}).get("reason")
    return reason if isinstance(reason, str) else "moved"


async def _watch(receive: Receive, scope: trio.CancelScope, gone: list[bool]) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            gone.append(True)
            scope.cancel()
            return


async def until_disconnect(
    receive: Receive, fn: Callable[[], Awaitable[T]]
) -> tuple[bool, T | None]:
    """Run ``fn()`` unless the client disconnects first: ``(True, result)`` or ``(False, None)``.

    Call only after the request body is consumed: ``receive`` then yields nothing but the
    disconnect. ``fn`` must not raise (return errors as values): nurseries wrap exceptions.
    """
    gone: list[bool] = []
    result: list[T] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch, receive, nursery.cancel_scope, gone)
        result.append(await fn())
        nursery.cancel_scope.cancel()
    if gone or not result:
        return False, None
    return True, result[0]


class SSEResponse:
    """An ASGI response that sends ``events`` as SSE; a client that goes away cancels the
    iteration (which closes ``events``, aborting the request behind it). ``background`` starts
    the tasks that feed ``events`` (a batch's requests), in the response's own nursery: they are
    cancelled with it."""

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_disconnect: Callable[[], None] | None = None,
        background: Callable[[trio.Nursery], None] | None = None,
    ) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.background = background

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        gone: list[bool] = []
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_watch, receive, nursery.cancel_scope, gone)
                if self.background is not None:
                    self.background(nursery)
                await self._pump(send)
                nursery.cancel_scope.cancel()
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
        if gone and self.on_disconnect is not None:
            self.on_disconnect()
        if not gone:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _pump(self, send: Send) -> None:
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
