"""The proxy's RELAYING state (room table) against recording P/D stand-ins: the room stays live
until the last byte of D's answer is out, so a client leaving mid-stream, or the room's deadline
passing mid-stream, still aborts both legs; a complete answer leaves no abort behind."""

from __future__ import annotations

import random
from typing import Any

import httpx
import trio

from pd_fsm.io_trio.proxy.server import PrefillTarget, ProxyServer, serve_proxy
from tests.integration.pd_standins import StandIn, serve_standin
from tests.integration.serve_support import sse_events

GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True}


async def _one_pair(nursery: trio.Nursery, **proxy_kw: Any) -> tuple[str, ProxyServer, StandIn,
                                                                       StandIn]:
    p_url, p = await serve_standin(nursery, "prefill")
    d_url, d = await serve_standin(nursery, "decode")
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d_url], rng=random.Random(1),
                  **proxy_kw)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    return url, proxy, p, d


async def _wait(predicate: Any, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_client_leaving_mid_stream_aborts_both_legs(nursery: trio.Nursery) -> None:
    url, proxy, p, d = await _one_pair(nursery)
    d.script.chunk_gate = trio.Event()  # D sends one chunk, then stalls (never released)
    async with (httpx.AsyncClient(base_url=url, timeout=10) as http,
                http.stream("POST", "/generate", json={**GEN, "rid": "leaver"}) as r):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # the first chunk is here: headers are out, the room is RELAYING
        assert [proxy.router.poll(room) for room in proxy.router.rooms] == ["RELAYING"]
    # Leaving the block closed the connection mid-stream.
    await _wait(lambda: "leaver" in p.aborts and "leaver" in d.aborts)
    assert proxy.router.outcomes["CANCELLED"] == 1 and proxy.router.outcomes["COMPLETED"] == 0
    assert not proxy.router.rooms
    assert proxy.aborts_sent == {"prefill": 1, "decode": 1}


async def test_complete_stream_is_completed_without_aborts(nursery: trio.Nursery) -> None:
    url, proxy, p, d = await _one_pair(nursery)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.post("/generate", json={**GEN, "rid": "stayer"})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[0]["served_by"] == "decode"
        r = await http.post("/generate", json={**GEN, "rid": "plain", "stream": False})
        assert r.status_code == 200 and r.json()["served_by"] == "decode"
    # The connection's end after a complete answer is not a client leaving.
    await _wait(lambda: proxy.router.outcomes["COMPLETED"] == 2)
    await trio.sleep(0.2)
    assert proxy.router.outcomes["CANCELLED"] == 0 and not proxy.router.rooms
    assert proxy.aborts_sent == {"prefill": 0, "decode": 0} and not p.aborts and not d.aborts


async def test_deadline_mid_stream_aborts_both_legs_and_says_so(nursery: trio.Nursery) -> None:
    url, proxy, p, d = await _one_pair(nursery, room_timeout=1.0)
    d.script.chunk_gate = trio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.post("/generate", json={**GEN, "rid": "slow"})
    assert r.status_code == 200  # the headers went out before the deadline
    events = sse_events(r.text)
    assert events[0]["served_by"] == "decode"
    assert events[-2]["error"]["code"] == 504 and events[-1] == "[DONE]"
    await _wait(lambda: "slow" in p.aborts and "slow" in d.aborts)
    assert proxy.router.outcomes["FAILED"] == 1 and not proxy.router.rooms
