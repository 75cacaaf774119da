"""The proxy when D dies mid-stream, made exact: a raw-socket D that streams SSE events over a
chunked body and then drops the connection without the body's end, as a SIGKILLed worker does.

Found by the soak (test_failures_soak.py): D killed right after its ``data: [DONE]`` event but
before the chunked terminator made the proxy append an error chunk and a second ``[DONE]``
after the client's complete stream (invalid SSE: events after ``[DONE]``).

An n = 2 stream that such a D breaks off goes on as its two sequences, each a request of its own
(tables proxy_session's SPLIT and proxy_sequence): to the end, or with the client leaving
mid-split (one disconnect counted, each sequence's room cancelled).
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.io_trio.proxy.server import PrefillTarget, ProxyServer, serve_proxy
from tests.integration.pd_standins import serve_standin
from tests.integration.serve_support import sse_events

EVENTS = [{"text": "a", "output_ids": [1]}, {"text": "ab", "output_ids": [1, 2],
                                               "meta_info": {"finish_reason": {"type": "length"}}}]


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _read_request(stream: trio.SocketStream) -> bytes:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return buf
        buf += data
    head, _, body = buf.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += await stream.receive_some(65536)
    return head.split(b"\r\n")[0]


async def _dying_decode(nursery: trio.Nursery, with_done: bool) -> str:
    """A D that streams EVENTS (and ``[DONE]`` if ``with_done``), then drops the connection
    without the chunked body's terminator; ``/abort_request`` gets a plain 200."""

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request_line = await _read_request(stream)
            if b"/abort_request" in request_line:
                body = b'{"aborted": []}'
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                                      b"connection: close\r\ncontent-length: "
                                      + str(len(body)).encode() + b"\r\n\r\n" + body)
                return
            out = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                   b"transfer-encoding: chunked\r\n\r\n")
            for e in EVENTS:
                out += _chunk(b"data: " + json.dumps(e).encode() + b"\n\n")
            if with_done:
                out += _chunk(b"data: [DONE]\n\n")
            await stream.send_all(out)
            await trio.sleep(0.05)
            # Leaving without b"0\r\n\r\n": what the proxy sees from a SIGKILLed worker.

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0,
                                                      host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("with_done", [True, False], ids=["after-done", "before-done"])
async def test_decode_dying_mid_stream(nursery: trio.Nursery, with_done: bool) -> None:
    """After ``[DONE]``, or after its finish event and before ``[DONE]``: the client's stream is
    exactly D's, complete, with no error chunk (nothing was left to generate; the proxy ends
    the stream as D would have)."""
    p_url, _ = await serve_standin(nursery, "prefill")
    d_url = await _dying_decode(nursery, with_done)
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d_url], rng=random.Random(1))
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    body: dict[str, Any] = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 2}}
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{url}/generate", json=body)
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events == [*EVENTS, "[DONE]"]
    with trio.fail_after(5):
        while proxy.stats()["rooms_live"]:
            await trio.sleep(0.01)


async def test_a_decode_worker_answering_503_is_retried_on_another(nursery: trio.Nursery) -> None:
    """A 503 (a draining worker) means D never took the room: its leg goes to the other D in
    the same room, which claims the KV P holds for it; P prefills each request once, and the
    client gets the other D's answer."""
    p_url, p = await serve_standin(nursery, "prefill")
    d0_url, d0 = await serve_standin(nursery, "decode")
    d1_url, d1 = await serve_standin(nursery, "decode")
    d0.script.status = 503
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d0_url, d1_url],
                        rng=random.Random(1))
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(4):  # round robin: some go to d0 first
            r = await http.post(f"{url}/generate", json={"text": "hi"})
            assert r.status_code == 200, r.text
    assert d0.generations() and len(d1.generations()) == 4
    rooms = {g.body["bootstrap_room"] for g in d1.generations()}
    assert rooms == {g.body["bootstrap_room"] for g in p.generations()}  # the same rooms
    assert len(p.generations()) == 4 and not p.aborts  # no prefill redone, none aborted
    stats = proxy.stats()
    assert stats["rooms_reopened_total"]["redirect"] == len(d0.generations())
    assert stats["rooms_total"]["COMPLETED"] == 4 and not stats["rooms_total"]["RETRIED"]


class _ConnectTimesOut(httpx.AsyncBaseTransport):
    """The proxy's transport, but a connection to ``dead`` is never made: a host that answers
    nothing ends in the connect timeout (``httpx.ConnectTimeout``), not a refusal."""

    def __init__(self, dead: str) -> None:
        self.dead, self.inner = dead, httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(self.dead):
            raise httpx.ConnectTimeout("connect timed out", request=request)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_decode_worker_that_cannot_be_connected_to_in_time_is_redirected(
        nursery: trio.Nursery) -> None:
    """A decode leg whose connection times out never reached D, as a refused one: it goes to
    the other D in the same room (P's KV claimed there, no prefill redone, no new room). A
    hand-off room's leg takes the same path (its ticket goes along)."""
    p_url, p = await serve_standin(nursery, "prefill")
    d1_url, d1 = await serve_standin(nursery, "decode")
    dead = "http://127.0.0.1:9"  # never dialled: the transport times it out
    client = httpx.AsyncClient(transport=_ConnectTimesOut(dead), timeout=10)
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [dead, d1_url], rng=random.Random(1),
                  client=client)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(2):  # round robin: one goes to the dead one first
            r = await http.post(f"{url}/generate", json={"text": "hi"})
            assert r.status_code == 200, r.text
    stats = proxy.stats()
    await client.aclose()
    assert len(d1.generations()) == 2 and len(p.generations()) == 2 and not p.aborts
    assert stats["rooms_reopened_total"]["redirect"] == 1
    assert stats["rooms_total"]["COMPLETED"] == 2 and not stats["rooms_total"]["RETRIED"]


async def test_requests_over_every_workers_queue_bound_get_429_at_once(
    nursery: trio.Nursery,
) -> None:
    from pd_fsm.core.routing import RoutingConfig

    p_url, _ = await serve_standin(nursery, "prefill")
    d_url, d = await serve_standin(nursery, "decode")
    held = trio.Event()
    d.script.wait_for = held  # D holds its first answer: one request in flight
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d_url], rng=random.Random(1),
                  routing=RoutingConfig(max_queue=1))
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        async with trio.open_nursery() as inner:
            inner.start_soon(functools.partial(http.post, f"{url}/generate", json={"text": "a"}))
            with trio.fail_after(5):
                await d.arrived.wait()
            r = await http.post(f"{url}/generate", json={"text": "b"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "every decode worker is at its queue bound" in r.json()["error"]["message"]
            held.set()
        assert proxy.stats()["shed_total"] == {"decode": 1}
        r = await http.post(f"{url}/generate", json={"text": "c"})  # room again: served
        assert r.status_code == 200
    assert len(d.generations()) == 2  # the shed request never reached a worker


def _event(e: dict[str, Any]) -> bytes:
    return _chunk(b"data: " + json.dumps(e).encode() + b"\n\n")


async def _splitting_decode(nursery: trio.Nursery, finish: bool) -> tuple[list[str], list[int]]:
    """Two D addresses of one raw-socket D. Its first stream (the n = 2 request) sends an event
    of each sequence and drops the connection as a SIGKILLed worker does; each later one (a
    sequence going on alone, n = 1) sends one event and then, with ``finish``, its finish event
    and the body's end, else holds the connection open. Returns the addresses and a list with
    one entry per ``/abort_request`` it got."""
    streams: list[int] = []
    aborts: list[int] = []

    async def handle(stream: trio.SocketStream) -> None:
        async with stream:
            request_line = await _read_request(stream)
            if b"/generate" not in request_line:  # an abort, or the proxy's role probe
                aborted = b"/abort_request" in request_line
                aborts.extend([1] if aborted else [])
                body = b'{"aborted": []}' if aborted else b'{}'
                status = b"200 OK" if aborted else b"404 Not Found"
                await stream.send_all(b"HTTP/1.1 " + status + b"\r\ncontent-type: "
                                      b"application/json\r\nconnection: close\r\n"
                                      b"content-length: " + str(len(body)).encode()
                                      + b"\r\n\r\n" + body)
                return
            streams.append(1)
            out = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                   b"transfer-encoding: chunked\r\n\r\n")
            if len(streams) == 1:
                for i in (0, 1):
                    out += _event({"text": "a", "output_ids": [1], "index": i})
                await stream.send_all(out)
                await trio.sleep(0.05)
                return  # no chunked terminator: the break
            out += _event({"text": "ab", "output_ids": [1, 2]})
            if finish:
                out += _event({"text": "abc", "output_ids": [1, 2, 3],
                               "meta_info": {"finish_reason": {"type": "length"}}})
                out += _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
            await stream.send_all(out)
            if not finish:
                await trio.sleep_forever()  # until the proxy aborts it (or the test ends)

    urls = []
    for _ in range(2):
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0,
                                                          host="127.0.0.1"))
        urls.append(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
    return urls, aborts


def _requests(proxy: ProxyServer, status: str) -> float:
    value = proxy.registry.get_sample_value("pd_fsm_proxy_http_requests_total",
                                            {"path": "/generate", "status": status})
    return value or 0.0


@pytest.mark.parametrize("leave", [False, True], ids=["to-the-end", "client-leaves"])
async def test_an_n_2_stream_split_by_a_break(nursery: trio.Nursery, leave: bool) -> None:
    """D breaks off an n = 2 stream: each sequence goes on in a request of its own (the answer's
    session SPLIT, each sequence's a proxy_sequence). To the end: the client gets each
    sequence's events under its index and one [DONE] once both ended, each sequence's room
    COMPLETED. A client that leaves mid-split is counted once as disconnected, and each
    sequence's room is cancelled with its D leg aborted."""
    p_url, _ = await serve_standin(nursery, "prefill")
    d_urls, d_aborts = await _splitting_decode(nursery, finish=not leave)
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], d_urls, rng=random.Random(1))
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    body = {"text": "hi", "stream": True, "sampling_params": {"n": 2, "max_new_tokens": 3}}
    events: list[Any] = []
    async with (httpx.AsyncClient(timeout=10) as http,
                http.stream("POST", f"{url}/generate", json=body) as r):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
            if leave and len(events) == 4:  # both sequences' first events after the break
                break
    with trio.fail_after(5):  # the rooms end, and the aborts posted (leave) arrive
        while proxy.stats()["rooms_live"] or len(d_aborts) < 2 * leave:
            await trio.sleep(0.01)
    outcomes = proxy.stats()["rooms_total"]
    assert isinstance(outcomes, dict)
    assert sorted(e["index"] for e in events[:4]) == [0, 0, 1, 1]
    assert outcomes["MIGRATED"] == 1
    if leave:
        assert outcomes["CANCELLED"] == 2 and len(d_aborts) == 2
        # P: the broken room's leg (MIGRATED) and each sequence room's; D: each sequence's.
        assert proxy.stats()["aborts_sent_total"] == {"prefill": 3, "decode": 2}
        assert _requests(proxy, "disconnected") == 1
    else:
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1 and len(events) == 7
        assert {e["index"] for e in events[4:6]} == {0, 1}
        assert all(e["meta_info"]["finish_reason"] == {"type": "length"} for e in events[4:6])
        assert outcomes["COMPLETED"] == 2 and not d_aborts
        assert _requests(proxy, "disconnected") == 0
    assert _requests(proxy, "200") == 1
