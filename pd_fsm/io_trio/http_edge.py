"""What every pd_fsm HTTP server does at its edge: read a body within its bound, parse it as strict
JSON (:mod:`pd_fsm.io_trio.strict_json`), and contain whatever a request's handler raises.

**One body reader.** :func:`read_body` and :func:`read_json` are the only ways a worker, the
proxy and the bootstrap server read a request: a body over the server's bound is a 413 (counted
while it arrives: chunked uploads declare no length), a client that leaves mid-body a 499, and
anything that is not strict JSON within :class:`JsonLimits` a 400 (413 for an oversized
container) naming the field — all as :class:`BodyError`, which each server turns into its own
error shape. An oversized body is read to its end and dropped before the 413 goes out, up to
``DISCARD_BYTES`` past the bound and for ``DISCARD_S`` at most: a client that writes its whole
body before it reads (Python's urllib) otherwise met a connection closed under its upload, a
broken pipe, and never saw the 413 (measured with a 64 MB body). Past either bound the answer
goes out at once and the connection closes. A body over ``THREAD_JSON_BYTES`` is
parsed in a thread, so one 8 MB request does not stall every other stream on the event loop.

**Containment.** :func:`edge_app` builds every server's Starlette app with :class:`Contained`
inside it, and ``serve_app`` wraps whatever it serves in one more: an exception that escapes a
request's handler ends that request with a JSON 500 naming the cause (or, once the response has
started, ends its body), is logged with its traceback once and counted
(:func:`request_failures`, ``request_failures_total`` in a server's stats) — and the process goes
on serving. Without it Starlette answered a plain-text 500 and hypercorn logged "Error in ASGI
Framework" for each such request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import trio
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.routing import BaseRoute

from pd_fsm.io_trio.api_key import ASGIApp, Message, Receive, Scope, Send
from pd_fsm.io_trio.strict_json import DEFAULT_LIMITS, JsonError, JsonLimits, JsonValue, loads

log = logging.getLogger("pd_fsm.io_trio.http_edge")

THREAD_JSON_BYTES = 256 * 1024  # parse bigger bodies off the event loop
# An oversized body is read on and dropped for at most this much more, this long, before its 413.
DISCARD_BYTES = 128 * 1024 * 1024
DISCARD_S = 10.0
_failures = 0  # requests whose handler raised (trio's thread only: no lock needed)


class BodyError(Exception):
    """A request body refused at the edge: answer ``status`` with ``message``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, at most ``limit`` bytes; :class:`BodyError` 413 past it (once the rest is
    read and dropped, within ``DISCARD_BYTES`` and ``DISCARD_S``), 499 when the client leaves
    while sending it."""
    too_big = BodyError(413, f"request body over {limit} bytes")
    declared = request.headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > limit
    if over and int(declared or 0) > limit + DISCARD_BYTES:
        raise too_big
    chunks: list[bytes] = []
    size = 0
    with trio.CancelScope() as discarding:
        if over:
            discarding.deadline = trio.current_time() + DISCARD_S
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit and not over:
                    over = True
                    discarding.deadline = trio.current_time() + DISCARD_S
                if not over:
                    chunks.append(chunk)
                elif size > limit + DISCARD_BYTES:
                    break
        except ClientDisconnect:
            if not over:  # normal under load: one line and a 499 outcome, never a traceback
                raise BodyError(499, f"client left after {size} bytes of its body") from None
    if over:
        raise too_big
    return b"".join(chunks)


async def parse_json(raw: bytes, limits: JsonLimits = DEFAULT_LIMITS) -> JsonValue:
    """``raw`` as strict JSON (in a thread when it is big), or :class:`BodyError`."""
    try:
        if len(raw) > THREAD_JSON_BYTES:
            return await trio.to_thread.run_sync(loads, raw, limits)
        return loads(raw, limits)
    except JsonError as exc:
        raise BodyError(exc.status, exc.message) from None


async def read_json(request: Request, limit: int, limits: JsonLimits = DEFAULT_LIMITS
                    ) -> JsonValue:
    """:func:`read_body` then :func:`parse_json`."""
    return await parse_json(await read_body(request, limit), limits)


def request_failures() -> int:
    """Requests of this process's HTTP servers whose handler raised (each answered 500)."""
    return _failures


def describe(exc: BaseException, limit: int = 500) -> str:
    """``Type: message`` of ``exc`` — of each exception inside a group (a trio nursery's), which
    is where the cause is — safe to put in a JSON answer, at most ``limit`` characters."""
    if isinstance(exc, BaseExceptionGroup):
        text = "; ".join(describe(e, limit) for e in exc.exceptions)
    else:
        text = f"{type(exc).__name__}: {exc}"
    # backslashreplace: the text must encode even if the exception quotes a lone surrogate.
    return text.encode("utf-8", "backslashreplace").decode()[:limit]


def _count_failure(scope: Scope, exc: BaseException) -> str:
    global _failures
    _failures += 1
    where = f"{scope.get('method', '?')} {scope.get('path', '?')}"
    log.error("contained a failure of %s (%d so far)", where, _failures, exc_info=exc)
    return f"internal error while handling {where}: {describe(exc)}"


class Contained:
    """ASGI middleware: a handler's exception ends its request with a JSON 500, not the process.

    Once the response has started the status cannot change: the body is ended instead (a client
    reading a stream sees it stop short; the server's own error events come before that)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False}

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            message = _count_failure(scope, exc)
            if state["ended"]:
                return
            try:
                if not state["started"]:
                    body = {"error": {"message": message, "type": "internal_server_error",
                                      "code": 500}}
                    await send({"type": "http.response.start", "status": 500,
                                "headers": [(b"content-type", b"application/json")]})
                    await send({"type": "http.response.body", "body": json.dumps(body).encode(),
                                "more_body": False})
                else:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # the connection is gone: nothing left to tell
                log.debug("could not answer the failed request", exc_info=True)


def contained(app: Any) -> ASGIApp:
    """``app`` wrapped in :class:`Contained` (once)."""
    return app if isinstance(app, Contained) else Contained(app)


Handler = Callable[[Request, Exception], Awaitable[Any]]


def edge_app(routes: Sequence[BaseRoute],
             exception_handlers: Mapping[Any, Handler] | None = None) -> Starlette:
    """A Starlette app whose handlers' exceptions are contained (inside Starlette's own error
    middleware, so no plain-text 500 and no re-raise reach the server)."""
    return Starlette(routes=list(routes), exception_handlers=dict(exception_handlers or {}),
                     middleware=[Middleware(Contained)])
