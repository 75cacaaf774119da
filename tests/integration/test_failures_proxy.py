"""The proxy when D dies mid-stream, made exact: a raw-socket D that streams SSE events over a
chunked body and then drops the connection without the body's end, as a SIGKILLed worker does.

Found by the soak (test_failures_soak.py): D killed right after its ``data: [DONE]`` event but
before the chunked terminator made the proxy append an error chunk and a second ``[DONE]``
after the client's complete stream (invalid SSE: events after ``[DONE]``).
"""

from __future__ import annotations

import functools
import json
import random
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.io_trio.proxy.server import PrefillTarget, Proxy, serve_proxy
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
    proxy = Proxy([PrefillTarget.from_url(p_url, 8998)], [d_url], rng=random.Random(1))
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
    proxy = Proxy([PrefillTarget.from_url(p_url, 8998)], [d0_url, d1_url], rng=random.Random(1))
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


async def test_requests_over_every_workers_queue_bound_get_429_at_once(
    nursery: trio.Nursery,
) -> None:
    from pd_fsm.core.routing import RoutingConfig

    p_url, _ = await serve_standin(nursery, "prefill")
    d_url, d = await serve_standin(nursery, "decode")
    held = trio.Event()
    d.script.wait_for = held  # D holds its first answer: one request in flight
    proxy = Proxy([PrefillTarget.from_url(p_url, 8998)], [d_url], rng=random.Random(1),
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
