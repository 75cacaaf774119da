"""One client request through PD: its rooms, their legs, and the one answer the client gets.

A request (:class:`ClientRequest`) lives in one room at a time (:class:`Room`, table room in the
core's ``RoomRouter``); a retry or a migration opens the next. Two things are state here, and
neither is a flag of its own:

* how the current room ended is the room table's effect for it, kept as one value
  (``Room.outcome``: ``RelayDecode``, a :class:`Reply` for ``ReplyError``, or ``ReopenRoom``);
  a redirected decode leg is a new ``Room.d_scope`` (``RedirectDecode``);
* what the client has of its answer spans the rooms: the core's ``ProxySession`` (table
  proxy_session), fed what was sent through the core's ``drive`` (:meth:`RoomResponse.tell`);
  an n > 1 stream that broke goes on as its sequences (its session SPLIT), each a request of its
  own whose client side is a ``SequenceSession`` (table proxy_sequence).

:class:`RoomResponse` is the ASGI response; it needs of the proxy only :class:`RoomHost`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, assert_never

import attrs
import httpx
import trio
from starlette import types as asgi
from starlette.types import ASGIApp, Message, Scope

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import drive
from pd_fsm.core.role_switch import ROLE_HEADER
from pd_fsm.core.session import ProxySession, SequenceSession
from pd_fsm.io_trio.phases import PhaseHistograms
from pd_fsm.io_trio.proxy.answers import (
    Failure,
    Refusal,
    error_body,
    json_or_text,
    reason,
    send_json,
    send_stream_error,
)
from pd_fsm.io_trio.proxy.logprob_merge import SseRewriter, merge
from pd_fsm.io_trio.proxy.merged_stream import merge_streams
from pd_fsm.io_trio.proxy.migration import Progress
from pd_fsm.io_trio.worker.sse import Receive, Send, event

log = logging.getLogger("pd_fsm.io_trio.proxy.server")  # one logger for the proxy
SSE_DONE = b"data: [DONE]\n\n"  # the last event of an sglang / OpenAI stream
# A worker that did not take the leg: draining (503 + Retry-After), or in another role than the
# leg's X-PD-Role since a role switch (409). Nothing of the room is there: it goes elsewhere.
STALE_ROLE = 409
REFUSED = (503, STALE_ROLE)
# A leg that never reached its worker: the connection refused, or not made within the connect
# timeout (a host that answers nothing). Nothing of the room is there either.
NOT_CONNECTED = (httpx.ConnectError, httpx.ConnectTimeout)


@attrs.define(eq=False)
class ClientRequest:
    """What a client request keeps across its rooms."""

    request_id: str
    path: str
    client_body: Mapping[str, object]  # the JSON object the client sent
    headers: dict[str, str]
    # What the client asked for: fixed by its body, not states of the request.
    stream: bool
    return_logprob: bool
    migratable: bool  # a new room can continue its answer exactly (migration.migratable)
    # P's answer has positions D's lacks (logprob_merge). Cleared for good once a room is D's
    # alone (D computes them itself), later rooms included.
    prompt_logprobs: bool = False
    progress: Progress | None = None  # what the client has of a migratable answer
    # What the client has of it: the answer's (table proxy_session), or, for one sequence of a
    # split answer (``sequence``), that sequence's (table proxy_sequence).
    client: ProxySession | SequenceSession = attrs.field(factory=ProxySession)

    def sequence(self, index: int, body: Mapping[str, object], progress: Progress
                 ) -> ClientRequest:
        """Sequence ``index`` of this n > 1 request as a request of its own (``body`` and
        ``progress`` from ``Progress.sequences``): it goes on under the client's headers, so
        its errors go in-band, and the client's request, not it, is counted."""
        return ClientRequest(f"{self.request_id}.n{index}", self.path, body, self.headers,
                             self.stream, self.return_logprob, migratable=True,
                             progress=progress, client=SequenceSession())


@attrs.frozen
class Reply:
    """``ReplyError``: the room failed; the status and JSON body the client gets."""

    status: int
    body: object  # a JSON value


# How the router ended a room for the client: relay D's answer, answer an error, or go on in a
# new room (the room table's RelayDecode, ReplyError and ReopenRoom effects).
Outcome = fx.RelayDecode | Reply | fx.ReopenRoom


@attrs.define(eq=False)
class Room:
    """One room of a request: its workers, its legs' body, and how the router ended it."""

    request: ClientRequest
    room: int = -1
    prefill: str = ""  # "" when D prefills the room alone (DispatchLocal)
    decode: str = ""  # the worker whose answer the client gets: a D, or a colocated worker
    decode_role: str = "decode"  # that leg's X-PD-Role: "null" for a colocated worker
    rid: str = ""
    body: dict[str, object] = attrs.field(factory=dict)  # the legs' JSON body
    outcome: Outcome | None = None  # set once, with ``decided``
    decided: trio.Event = attrs.field(factory=trio.Event)
    relay_done: trio.Event = attrs.field(factory=trio.Event)
    p_done: trio.Event = attrs.field(factory=trio.Event)
    p_body: object = None  # P's answer, a JSON value (read by logprob_merge)
    d_posted: float = 0.0  # trio time D's leg was posted
    p_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # D's leg; RedirectDecode arms a new one, and the leg is posted again in it.
    d_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # A hand-off room: the ticket its D pulls from, and the draining D that
    # offers it (told to release it once pulled, or once the pull failed).
    ticket: dict[str, object] | None = None
    handoff_from: str = ""

    @property
    def relaying(self) -> bool:
        """The router relays D's answer (RelayDecode)."""
        return isinstance(self.outcome, fx.RelayDecode)

    @property
    def reopen(self) -> fx.ReopenRoom | None:
        """The room ended RETRIED, MIGRATED or HANDED_OFF: the request goes on in a new room."""
        return self.outcome if isinstance(self.outcome, fx.ReopenRoom) else None

    def decide(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.decided.set()


class RoomHost(Protocol):
    """What a room needs of the proxy (``server.ProxyServer``, which builds it: naming it here would
    close an import circle)."""

    phases: PhaseHistograms
    room_timeout: float

    @property
    def client(self) -> httpx.AsyncClient: ...

    def feed(self, event: ev.RouterEvent, failure: Failure | None = None) -> None:
        """Hand ``event`` to the router and carry out its effects; ``failure`` is the answer if
        it fails its own room."""
        ...

    def count(self, path: str, status: str) -> None:
        """One client request answered ``status`` (or "disconnected")."""
        ...

    def contain(self, where: str, s: Room, exc: Exception) -> Failure:
        """An exception in one room's work: counted, logged, the room failed in the router."""
        ...

    def start_soon(self, fn: Callable[[Room], Awaitable[None]], s: Room) -> None:
        """Run ``fn(s)`` in the proxy's own nursery (P's leg: nobody waits for its drain)."""
        ...

    async def reopen(self, s: Room) -> Room | Refusal | list[tuple[int, Room | Refusal]]:
        """The request's next room after ``s`` ended RETRIED or MIGRATED, or why none; or, an
        n > 1 answer's (``Progress.apart``), each unfinished sequence's room by its index."""
        ...

    def room_over(self, s: Room) -> None:
        """``s`` is over here: the proxy forgets it."""
        ...

    def leg_refused(self, url: str, status: int) -> None:
        """A leg to ``url`` got 409 (the worker is in another role now) or 503
        (draining, perhaps for a role switch)."""
        ...


class RoomResponse:
    """The ASGI response of one request: its rooms' legs, the client's disconnect, one answer."""

    def __init__(self, host: RoomHost, room: Room) -> None:
        self.host = host
        self.s = room
        self.left = trio.Event()  # the client left (its sequences' rooms learn it from this)
        # The response's own tasks, cancelled when the client leaves (unless the answer is
        # split: then each sequence's request aborts its own room, and the merge ends).
        self._tasks: trio.CancelScope | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = self.host
        try:
            async with trio.open_nursery() as nursery:
                self._tasks = nursery.cancel_scope
                nursery.start_soon(self._watch_client, receive)
                while await self._room(send):  # a retry or a migration: the next room
                    nxt = await host.reopen(self.s)
                    if isinstance(nxt, Refusal):
                        await self._answer_error(send, nxt.status, nxt.body())
                        break
                    if isinstance(nxt, list):
                        await self._sequences(scope, send, nxt)
                        break
                    self.s = nxt
                nursery.cancel_scope.cancel()
        except Exception as exc:
            # The room ends with this request: failed in the router (P's leg aborted); the
            # server's edge (http_edge.Contained) answers the client and keeps serving.
            host.contain("room", self.s, exc)
            raise
        finally:
            host.room_over(self.s)

    def tell(self, s: Room, event: ev.SessionEvent) -> None:
        """What went to the client (table proxy_session), and what the row says to report."""

        def carry_out(effect: fx.SessionEffect) -> tuple[()]:
            match effect:
                case fx.ReportRelayFinished():
                    self.host.feed(ev.RelayFinished(s.room))
                case fx.ReportDisconnect():
                    self.host.count(s.request.path, "disconnected")
                    self._abort(s)
                case fx.AbortSequences():
                    self.host.count(s.request.path, "disconnected")
                    self.left.set()  # each sequence's request: ClientLeft, its room aborted
                case fx.ReportSequenceLeft():
                    self._abort(s)
                case _:
                    assert_never(effect)
            return ()

        drive(s.request.client.handle, event, trio.current_time(), carry_out)

    def _abort(self, s: Room) -> None:
        """The client left: the router aborts ``s``'s legs, and this response's tasks end."""
        self.host.feed(ev.ClientDisconnected(s.room))
        if self._tasks is not None:
            self._tasks.cancel()

    async def _room(self, send: Send) -> bool:
        """Run the current room to its end: True when the request goes on in a new room."""
        s = self.s
        async with trio.open_nursery() as legs:
            if s.prefill:
                self.host.start_soon(self._prefill_leg, s)
            legs.start_soon(self._decode_leg, s, send)
            await s.decided.wait()
            if isinstance(s.outcome, Reply):
                await self._answer_error(send, s.outcome.status, s.outcome.body)
            elif s.reopen is None:
                await s.relay_done.wait()  # a migration may end the relay (ReopenRoom)
            legs.cancel_scope.cancel()
        self.host.room_over(s)
        return s.reopen is not None

    async def _answer_error(self, send: Send, status: int, body: object) -> None:
        """The request's error: a JSON answer, or an error chunk in a stream already begun (a
        room after a migration)."""
        s = self.s
        in_band = s.request.client.headers_sent
        # The answer is whole: the disconnect the server reports after it is its end, not a
        # client leaving.
        self.tell(s, ev.ErrorAnswered())
        if in_band:
            await send_stream_error(send, reason(body, status), status)
            return
        self.host.count(s.request.path, str(status))
        await send_json(send, status, body)

    async def _watch_client(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # What it means (the end of a whole answer, or a client leaving a room, or a
                # split answer's sequences) is the session's row.
                self.tell(self.s, ev.ClientLeft())
                return

    async def _sequences(self, scope: Scope, send: Send,
                         parts: list[tuple[int, Room | Refusal]]) -> None:
        """After a migration, an n > 1 answer's unfinished sequences, each in a request of its
        own (``Progress.sequences`` says why): their streams relayed as one under the client's
        headers (``merged_stream``), then one usage chunk and one ``[DONE]``. The answer's
        session waits in SPLIT for each sequence's end (finished, or failed with its error)."""
        q = self.s.request
        assert q.progress is not None
        self.tell(self.s, ev.AnswerSplit(tuple(index for index, _ in parts)))

        async def left() -> Message:
            await self.left.wait()
            return {"type": "http.disconnect"}

        async def out(chunk: bytes) -> None:
            if not q.client.gone:
                self.tell(self.s, ev.ChunkRelayed())
                await send({"type": "http.response.body", "body": chunk, "more_body": True})

        def ended(index: int, app: ASGIApp) -> ASGIApp:
            async def sequence(scope: Scope, receive: asgi.Receive, send: asgi.Send) -> None:
                await app(scope, receive, send)
                self.tell(self.s, ev.SequenceEnded(index))

            return sequence

        apps: list[tuple[int, ASGIApp]] = [
            (index, ended(index, RoomResponse(self.host, r) if isinstance(r, Room)
                          else _refused(r)))
            for index, r in parts]
        merged = await merge_streams(apps, scope, left, out)
        if q.client.gone:
            return  # every sequence's room saw it leave: its legs are aborted
        usages = [part.usage for part in merged if part.usage is not None]
        tail = event(q.progress.usage_chunk(usages[-1])) if usages else b""
        self.tell(self.s, ev.AnswerRelayed())  # SPLIT_ENDED: the table demands every end
        await send({"type": "http.response.body", "body": tail + SSE_DONE, "more_body": False})

    # ------------------------------------------------------------------ P's leg

    async def _prefill_leg(self, s: Room) -> None:
        """P's leg, in the proxy's own nursery: nothing it raises may reach that nursery (it
        would end the proxy), so an unexpected exception fails this room alone."""
        try:
            await self._post_prefill(s)
        except Exception as exc:
            self.host.contain("prefill_leg", s, exc)
            s.p_done.set()

    async def _post_prefill(self, s: Room) -> None:
        q = s.request
        status, body, refused, lost = 0, None, False, False
        try:
            with s.p_scope:
                posted = trio.current_time()
                s.p_scope.deadline = posted + self.host.room_timeout
                # A leg whose body the relay needs is asked for one JSON answer.
                leg = {**s.body, "stream": False} if q.prompt_logprobs else s.body
                async with self.host.client.stream(
                        "POST", s.prefill + q.path, json=leg,
                        headers={**q.headers, ROLE_HEADER: "prefill"}) as resp:
                    raw = await resp.aread()  # drains an SSE leg too
                    status = resp.status_code
                    ok = 200 <= status < 300
                    body = None if ok and leg.get("stream") is True else json_or_text(raw)
                    if status in REFUSED:
                        self.host.leg_refused(s.prefill, status)
                    if ok:
                        self.host.phases.observe("proxy_prefill_leg",
                                                 trio.current_time() - posted)
        except httpx.HTTPError as exc:
            refused = isinstance(exc, NOT_CONNECTED)  # else lost: P may have started
            lost = not refused
            status, body = 502, error_body(502, f"prefill worker {s.prefill}: {exc!r}",
                                           "prefill_unreachable")
        finally:
            s.p_body = body
            s.p_done.set()
        if status == 0:
            return  # aborted by the router (AbortLeg): nothing to report
        if 200 <= status < 300:
            self.host.feed(ev.LegResponded(s.room, "prefill", True))
        else:
            failure = (status, body if body is not None else error_body(status, "prefill failed"))
            self.host.feed(ev.LegResponded(s.room, "prefill", False, reason(body, status),
                                           refused or status in REFUSED, status >= 500, lost),
                           failure)

    # ------------------------------------------------------------------ D's leg

    async def _decode_leg(self, s: Room, send: Send) -> None:
        """D's leg; posted again to another D while the router redirects it (RedirectDecode:
        the D refused it before taking the room, and a new scope is armed for the next post)."""
        try:
            while True:
                posted_in = s.d_scope
                await self._post_decode(s, send)
                if s.d_scope is posted_in:
                    return
        finally:
            s.relay_done.set()

    async def _post_decode(self, s: Room, send: Send) -> None:
        q = s.request
        try:
            with s.d_scope:
                s.d_posted = trio.current_time()
                async with self.host.client.stream(
                        "POST", s.decode + q.path, json=s.body,
                        headers={**q.headers, ROLE_HEADER: s.decode_role}) as resp:
                    if not 200 <= resp.status_code < 300:
                        body = json_or_text(await resp.aread())
                        if resp.status_code in REFUSED:
                            self.host.leg_refused(s.decode, resp.status_code)
                        if s.ticket is not None:  # why a hand-off falls back to a re-prefill
                            log.info("room %d: hand-off leg refused by %s (%d): %s", s.room,
                                     s.decode, resp.status_code, reason(body, resp.status_code))
                        self.host.feed(
                            ev.LegResponded(s.room, "decode", False,
                                            reason(body, resp.status_code),
                                            resp.status_code in REFUSED,
                                            resp.status_code >= 500),
                            (resp.status_code, body),
                        )
                        return
                    self.host.feed(ev.LegResponded(s.room, "decode", True))
                    if not s.relaying:
                        return  # the room already failed; the client got that error
                    await self._relay(s, resp, send)
                    self.host.phases.observe("proxy_decode_leg", trio.current_time() - s.d_posted)
            if s.relaying and s.d_scope.cancelled_caught and not q.client.gone:
                # The router ended the room mid-relay (its deadline): say so to the client.
                await self._relay_error(s, send, 504, "room deadline passed during the relay")
        except httpx.HTTPError as exc:
            await self._decode_broke(s, send, exc)

    async def _decode_broke(self, s: Room, send: Send, exc: httpx.HTTPError) -> None:
        """D's leg failed on the wire: before the router decided, while relaying, or after."""
        q = s.request
        if not s.decided.is_set():
            failure = (502, error_body(502, f"decode worker {s.decode}: {exc!r}",
                                       "decode_unreachable"))
            # Unreachable: D never took the room. Lost: it may have (a new room, then).
            refused = isinstance(exc, NOT_CONNECTED)
            self.host.feed(ev.LegResponded(s.room, "decode", False, repr(exc), refused, True,
                                           lost=not refused), failure)
        elif s.relaying and not q.client.answered and (q.client.stream_whole or (
                q.progress is not None and q.progress.finished and q.stream)):
            # D broke off after its last event (killed before the chunked body's end): the
            # client has the whole stream, and an error chunk after [DONE] would corrupt it; or
            # after its finish event, before [DONE].
            await self._end_whole(s, send)
        elif s.relaying:
            # D broke off mid-relay: the request migrates to a new room (ReopenRoom), or the
            # room fails (P's leg is aborted) and the client is told, in-band when the headers
            # are already out.
            self.host.feed(ev.LegResponded(s.room, "decode", False, repr(exc), lost=True))
            if s.reopen is None:
                await self._relay_error(s, send, 502, f"decode worker broke off: {exc!r}")

    async def _end_whole(self, s: Room, send: Send) -> None:
        """D broke off (or failed in-band) with nothing left to generate: the client's stream
        is ended as D would have ended it (no [DONE] twice, no error event after it)."""
        end = b"" if s.request.client.stream_whole else SSE_DONE
        self.tell(s, ev.AnswerRelayed())
        await send({"type": "http.response.body", "body": end, "more_body": False})

    async def _relay_error(self, s: Room, send: Send, status: int, message: str) -> None:
        if s.request.client.gone:
            return  # D broke off as the client left: nobody reads it, the legs are cancelled
        if s.request.client.headers_sent:
            await send_stream_error(send, message, status)
        else:
            self.host.count(s.request.path, str(status))
            await send_json(send, status, error_body(status, message))

    # ------------------------------------------------------------------ the relay

    async def _relay(self, s: Room, resp: httpx.Response, send: Send) -> None:
        q = s.request
        headers = [(b"content-type", resp.headers.get("content-type", "application/json")
                    .encode())]
        if not q.client.headers_sent:  # a migrated request was counted by its first room
            self.host.count(q.path, str(resp.status_code))
        if q.stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
            headers.append((b"cache-control", b"no-cache"))
            await self._relay_stream(s, resp, send, headers)
            return
        raw = await resp.aread()
        self._first_byte(s)  # a plain answer is read whole: its first byte is its last
        if s.prefill and (q.return_logprob or q.prompt_logprobs):
            raw = await self._merge_logprobs(s, raw)
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": headers})
        self.tell(s, ev.AnswerRelayed())
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    async def _relay_stream(self, s: Room, resp: httpx.Response, send: Send,
                            headers: list[tuple[bytes, bytes]]) -> None:
        q = s.request
        if not q.client.headers_sent:  # a migrated request's stream goes on under its headers
            await send({"type": "http.response.start", "status": resp.status_code,
                        "headers": headers})
            self.tell(s, ev.HeadersSent())
        tail = b""
        first = True
        rewriter = None
        if q.prompt_logprobs:
            p_body = await self._prefill_body(s)
            rewriter = SseRewriter(lambda event: merge(q.path, p_body, event),
                                   once=q.path != "/generate")
        elif q.progress is not None:
            rewriter = SseRewriter(q.progress.observe, once=False,
                                   drop=q.progress.withhold)
        async for chunk in resp.aiter_raw():
            if first and chunk:
                first = False
                self._first_byte(s)
            if rewriter is not None:
                chunk = rewriter.feed(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            tail = (tail + chunk)[-len(SSE_DONE):]
            self.tell(s, ev.DoneRelayed() if tail == SSE_DONE else ev.ChunkRelayed())
        rest = rewriter.flush() if rewriter is not None else b""
        if q.progress is not None and q.progress.failed is not None:
            # D failed the stream in-band (a 5xx event, not relayed): as if it broke off, the
            # request migrates to a new room, or the client gets D's error.
            status, message = q.progress.failed
            q.progress.failed = None
            if q.progress.finished:  # after every finish event: as if it broke off there
                await self._end_whole(s, send)
                return
            self.host.feed(ev.LegResponded(s.room, "decode", False, message, lost=True))
            if s.reopen is None:
                await self._relay_error(s, send, status, f"decode worker {s.decode}: {message}")
            return
        if q.progress is not None and (q.progress.ticket is not None or q.progress.moved):
            # D is draining and handed the stream off (or gave it up: a move): it goes on in
            # the next room, under the headers already sent (or, if the router will not, ends
            # in an error chunk).
            moved = q.progress.moved
            self.host.feed(ev.LegResponded(s.room, "decode", False, moved or "handed off",
                                           handoff=True))
            if s.reopen is None:
                q.progress.ticket = q.progress.moved = None
                await self._relay_error(s, send, 502, f"decode worker {s.decode} "
                                        + ("gave the stream up" if moved else
                                           "drained mid-stream"))
            return
        self.tell(s, ev.AnswerRelayed())
        await send({"type": "http.response.body", "body": rest, "more_body": False})

    def _first_byte(self, s: Room) -> None:
        self.host.phases.observe("proxy_decode_first_byte", trio.current_time() - s.d_posted)

    async def _prefill_body(self, s: Room) -> object:
        """P's answer, once its leg is over (None if it never came within the room's time)."""
        with trio.move_on_at(s.p_scope.deadline):
            await s.p_done.wait()
        return s.p_body

    async def _merge_logprobs(self, s: Room, raw: bytes) -> bytes:
        """D's body with P's prompt log-probs put in (``logprob_merge``)."""
        p_body = await self._prefill_body(s)
        try:
            d_body = json.loads(raw)
        except ValueError:
            return raw
        return json.dumps(d_body).encode() if merge(s.request.path, p_body, d_body) else raw


def _refused(refusal: Refusal) -> ASGIApp:
    """A sequence's room that could not be opened (no worker): its error in-band, as its one
    event."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_stream_error(send, refusal.reason, refusal.status)

    return app
