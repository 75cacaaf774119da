"""A connection whose protocol handler fails is closed and counted; the server keeps serving.

Reproduces what ended a prefill worker in a CI run (the sglang-router opens HTTP/2
prior-knowledge connections to every worker): hypercorn 0.18's HTTP/2 protocol raises
``KeyError`` on a DATA frame for a stream whose response it has already sent and dropped, and
that escaped ``serve_listeners`` and took the whole server down. Real hypercorn on trio, a real
HTTP/2 client (``h2``) over TCP, then an ordinary HTTP/1.1 request to the same server."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import httpx
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pd_fsm.io_trio.http_server import connection_failures, serve_app


async def _ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")  # answers without reading the body


async def _late_body(port: int, delay: float) -> None:
    """POST /ok with its body still to come; once answered, wait ``delay`` and send the body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":path", "/ok"), (":scheme", "http"),
                              (":authority", "pd-fsm")])
        await stream.send_all(conn.data_to_send())
        answered = False
        with trio.fail_after(10):
            while not answered:
                data = await stream.receive_some(65536)
                assert data, "the server closed the connection before answering"
                answered = any(isinstance(e, h2.events.StreamEnded) and e.stream_id == 1
                               for e in conn.receive_data(data))
                await stream.send_all(conn.data_to_send())
        # Hypercorn drops the stream once the app's task is over, which can come a little after
        # the answer's last frame: the DATA must arrive after that to meet the missing stream.
        await trio.sleep(delay)
        conn.send_data(1, b"late", end_stream=True)
        await stream.send_all(conn.data_to_send())
        with trio.move_on_after(2):
            while await stream.receive_some(65536):
                pass  # the server closes a connection whose handler failed


async def test_a_late_http2_body_closes_its_connection_not_the_server() -> None:
    app = Starlette(routes=[Route("/ok", _ok, methods=["GET", "POST"])])
    async with trio.open_nursery() as nursery:
        url: str = (await nursery.start(serve_app, app, "127.0.0.1", 0))[0]
        port = int(url.rsplit(":", 1)[1])
        before = connection_failures()
        for attempt in range(10):  # the stream's drop is a race under load: wait longer each try
            await _late_body(port, 0.05 * (attempt + 1))
            if connection_failures() > before:
                break
        assert connection_failures() == before + 1
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.get(f"{url}/ok")
        assert (r.status_code, r.text) == (200, "ok")
        nursery.cancel_scope.cancel()
