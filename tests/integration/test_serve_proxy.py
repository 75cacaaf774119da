"""The PD proxy against recording P/D stand-ins on 127.0.0.1: what it injects, where it sends,
what the client gets back, and how the other leg is cleaned up when one fails or the client
leaves."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.core.messages import MAX_ROOM
from pd_fsm.io_trio.bootstrap.records import to_json
from pd_fsm.io_trio.bootstrap.server import BootstrapServer, serve_bootstrap
from pd_fsm.io_trio.http_edge import contained
from pd_fsm.io_trio.ports import free_ports
from pd_fsm.io_trio.proxy.server import PrefillTarget, ProxyServer, serve_proxy
from tests.integration.pd_standins import StandIn, serve_standin
from tests.integration.serve_support import sse_events
from tests.support.io_doubles import sample_record

GEN = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture
async def cluster(nursery: trio.Nursery) -> dict[str, Any]:
    p0_url, p0 = await serve_standin(nursery, "prefill")
    p1_url, p1 = await serve_standin(nursery, "prefill")
    d0_url, d0 = await serve_standin(nursery, "decode")
    d1_url, d1 = await serve_standin(nursery, "decode")
    proxy = ProxyServer(
        [PrefillTarget.from_url(p0_url, 8998), PrefillTarget.from_url(p1_url, None)],
        [d0_url, d1_url],
        rng=random.Random(7),
    )
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    return {"url": url, "proxy": proxy, "p": [p0, p1], "d": [d0, d1],
            "p_urls": [p0_url, p1_url], "d_urls": [d0_url, d1_url]}


def _by_rid(standins: list[StandIn]) -> dict[str, tuple[int, dict[str, Any]]]:
    return {r.body["rid"]: (i, r.body) for i, s in enumerate(standins)
            for r in s.generations()}


async def test_injection_and_round_robin_on_both_legs(cluster: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        for i in range(8):
            r = await http.post("/generate", json={**GEN, "rid": f"r{i}"},
                                headers={"x-request-id": f"x{i}"})
            assert r.status_code == 200 and r.json()["served_by"] == "decode"
        r = await http.post("/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
    ps, ds = _by_rid(cluster["p"]), _by_rid(cluster["d"])
    assert set(ps) == set(ds) and len(ps) == 9
    for i in range(8):
        p_index, p_body = ps[f"r{i}"]
        d_index, d_body = ds[f"r{i}"]
        assert p_body == d_body  # the same body to both legs
        room = p_body["bootstrap_room"]
        assert isinstance(room, int) and 0 <= room < MAX_ROOM
        assert p_body["bootstrap_host"] == "127.0.0.1"
        assert p_body["bootstrap_port"] == (8998 if p_index == 0 else None)
        assert p_index == i % 2  # round robin
        assert d_index == i % 2  # round robin too (a room keeps its D to its end)
        assert p_body["text"] == "hi" and p_body["sampling_params"] == GEN["sampling_params"]
    rooms = [b["bootstrap_room"] for _, b in ps.values()]
    assert len(set(rooms)) == len(rooms)
    # The proxy names the legs when the client did not.
    chat_rid = next(rid for rid in ps if not rid.startswith("r"))
    assert chat_rid.startswith("pdfsm-")
    headers = cluster["p"][0].generations()[0].headers
    assert headers["x-request-id"] == "x0"
    assert cluster["proxy"].router.outcomes["COMPLETED"] == 9


async def test_legs_are_posted_concurrently(cluster: dict[str, Any]) -> None:
    # Each P answers only once its D has the request: a sequential proxy would time out here.
    for p in cluster["p"]:
        p.script.wait_for = trio.Event()
    d_arrived = trio.Event()
    for d in cluster["d"]:
        d.arrived = d_arrived
    for p in cluster["p"]:
        p.script.wait_for = d_arrived
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        r = await http.post("/generate", json={**GEN, "return_logprob": True})
        assert r.status_code == 200


async def test_decode_status_and_body_relayed(cluster: dict[str, Any]) -> None:
    for d in cluster["d"]:
        d.script.status = 503
        d.script.error = "decode is full"
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        r = await http.post("/generate", json={**GEN, "rid": "dfail"})
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "decode is full"
        # D failed: P's leg of the room is aborted.
        with trio.fail_after(5):
            while not any("dfail" in p.aborts for p in cluster["p"]):
                await trio.sleep(0.01)
    assert cluster["proxy"].router.outcomes["FAILED"] == 1


async def test_sse_relayed_as_it_arrives(cluster: dict[str, Any]) -> None:
    gate = trio.Event()
    for d in cluster["d"]:
        d.script.chunks = 4
        d.script.chunk_gate = gate  # D sends the rest only after the client saw chunk 1
    seen: list[Any] = []
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        with trio.fail_after(5):
            async with http.stream("POST", "/generate", json={**GEN, "stream": True}) as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                body = ""
                async for text in r.aiter_text():
                    body += text
                    seen = sse_events(body) if body.endswith("\n\n") else seen
                    if seen and not gate.is_set():
                        gate.set()
    assert [e["index"] for e in seen[:-1]] == [0, 1, 2, 3] and seen[-1] == "[DONE]"
    assert all(e["served_by"] == "decode" for e in seen[:-1])
    # P was asked to stream too, and its leg was drained.
    p_bodies = [r.body for p in cluster["p"] for r in p.generations()]
    assert p_bodies and all(b["stream"] is True for b in p_bodies)


async def test_logprobs_merged(cluster: dict[str, Any]) -> None:
    p_lps = [[None, 1, None], [-0.5, 2, None]]
    for p in cluster["p"]:
        p.script.input_logprobs = p_lps
        p.script.delay = 0.2  # D answers first: the proxy must wait for P
    for d in cluster["d"]:
        d.script.input_logprobs = [[-0.7, 3, None]]
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        r = await http.post("/generate", json={**GEN, "return_logprob": True})
    meta = r.json()["meta_info"]
    assert meta["input_token_logprobs"] == [*p_lps, [-0.7, 3, None]]
    assert meta["output_token_logprobs"] == [[-0.1, 7, None], [-0.2, 8, None]]


async def test_prefill_error_fails_room_and_aborts_decode(cluster: dict[str, Any]) -> None:
    for p in cluster["p"]:
        p.script.status = 500
        p.script.error = "prefill exploded"
    for d in cluster["d"]:
        d.script.hold = True  # D waits for KV that will never come
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        with trio.fail_after(5):
            r = await http.post("/generate", json={**GEN, "rid": "pfail"})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == "prefill exploded"
        with trio.fail_after(5):
            while not any("pfail" in d.aborts for d in cluster["d"]):
                await trio.sleep(0.01)
        # The same for a streaming request: the error comes as a status, not a 200 stream.
        r = await http.post("/generate", json={**GEN, "rid": "pfail2", "stream": True})
        assert r.status_code == 500
    assert cluster["proxy"].router.outcomes["FAILED"] == 2


async def test_client_disconnect_aborts_both_legs(cluster: dict[str, Any]) -> None:
    for s in (*cluster["p"], *cluster["d"]):
        s.script.hold = True
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        with trio.move_on_after(0.5):
            await http.post("/generate", json={**GEN, "rid": "leaver"})
            pytest.fail("both legs hold: the request cannot finish")
    with trio.fail_after(5):
        while not (any("leaver" in p.aborts for p in cluster["p"])
                   and any("leaver" in d.aborts for d in cluster["d"])):
            await trio.sleep(0.01)
    proxy = cluster["proxy"]
    assert proxy.router.outcomes["CANCELLED"] == 1 and not proxy.router.rooms


async def test_health_models_metrics_and_bad_input(cluster: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        assert (await http.get("/health")).json() == {
            "status": "ok", "prefill": {"healthy": 2, "configured": 2},
            "decode": {"healthy": 2, "configured": 2},
            "colocated": {"healthy": 0, "configured": 0},
        }
        models = (await http.get("/v1/models")).json()
        assert models["data"][0]["id"] == "standin"
        r = await http.post("/generate", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
        r = await http.post("/generate", json=[1])
        assert r.status_code == 400
        await http.post("/generate", json=GEN)
        metrics = (await http.get("/metrics")).text
        assert 'pd_fsm_proxy_rooms_total{key="COMPLETED"} 1.0' in metrics
        assert "pd_fsm_proxy_http_requests_total" in metrics
        # Counted before D's answer goes out (the legs' histograms may lag the client).
        assert "pd_fsm_proxy_decode_first_byte_seconds_count 1.0" in metrics
        assert "pd_fsm_proxy_prefill_leg_seconds_bucket" in metrics
        assert (await http.get("/workers")).json() == {
            "prefill": cluster["p_urls"], "decode": cluster["d_urls"], "colocated": [],
            "breakers": {u: "CLOSED" for u in sorted([*cluster["p_urls"], *cluster["d_urls"]])},
            "roles": {}}  # the stand-ins report no switchable role
    # Nothing reached the workers for the bad bodies.
    assert sum(len(p.generations()) for p in cluster["p"]) == 1


# Issue 34's rows: each killed the proxy process (httpx could not re-encode the body for the legs,
# and that error escaped the proxy's nursery) or answered 500.
HOSTILE = [
    (b'{"text":"hi","sampling_params":{"max_new_tokens":2,"temperature":NaN}}',
     "body.sampling_params.temperature is NaN"),
    (b'{"text":"hi","rid":NaN,"sampling_params":{"max_new_tokens":2}}', "body.rid is NaN"),
    (b'{"text":"hi","sampling_params":{"max_new_tokens":1e400}}',
     "body.sampling_params.max_new_tokens is 1e400"),
    (b'{"text":"\\ud800\\udfff\\ud800","sampling_params":{"max_new_tokens":2}}',
     "body.text has a lone surrogate U+D800"),
    (b'{"text":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "deeper than 64 levels"),
    (b'{"text":"hi","text":"ho"}', "body has the key 'text' more than once"),
]


async def test_hostile_json_is_refused_by_name_and_reaches_no_worker(
        cluster: dict[str, Any]) -> None:
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        for raw, words in HOSTILE:
            for path in ("/generate", "/v1/completions"):
                r = await http.post(path, content=raw)
                assert r.status_code == 400, (raw[:80], r.text)
                assert words in r.json()["error"]["message"], r.text
        r = await http.post("/generate", json=GEN)
        assert r.status_code == 200 and r.json()["served_by"] == "decode"
    assert sum(len(p.generations()) for p in cluster["p"]) == 1


async def test_an_exception_in_a_room_fails_that_room_not_the_proxy(
        cluster: dict[str, Any]) -> None:
    """Past the edge (a body the strict parse would refuse, handed to the room directly), both
    legs fail to encode it: the prefill leg in the proxy's own nursery, the decode leg in the
    request's. Each is contained: the room fails (counted), the client gets a JSON 500 naming the
    cause, and the proxy goes on serving."""
    proxy: ProxyServer = cluster["proxy"]
    response = proxy.open_room("/generate", {**GEN, "temperature": math.nan},
                               {"content-type": "application/json"})
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(dict(message))

    with trio.fail_after(10):
        await contained(response)({"type": "http", "method": "POST", "path": "/generate"},
                                  receive, send)
    assert sent[0]["status"] == 500
    message = json.loads(sent[1]["body"])["error"]["message"]
    assert "Out of range float values are not JSON compliant" in message, message
    with trio.fail_after(5):
        while proxy.contained["prefill_leg"] == 0:  # P's leg runs on in the proxy's nursery
            await trio.sleep(0.01)
    assert proxy.contained["room"] == 1 and not proxy.router.rooms
    assert proxy.router.outcomes["FAILED"] == 1
    async with httpx.AsyncClient(base_url=cluster["url"], timeout=10) as http:
        r = await http.post("/generate", json=GEN)
        assert r.status_code == 200
        metrics = (await http.get("/metrics")).text
    assert 'pd_fsm_proxy_contained_failures_total{key="prefill_leg"} 1.0' in metrics
    assert 'pd_fsm_proxy_contained_failures_total{key="room"} 1.0' in metrics


async def test_no_workers_is_503(nursery: trio.Nursery) -> None:
    proxy = ProxyServer([], [])
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        assert (await http.get("/health")).status_code == 503
        r = await http.post("/generate", json=GEN)
        assert r.status_code == 503 and "no prefill workers" in r.json()["error"]["message"]


async def test_health_is_503_naming_the_side_with_no_reachable_worker(
    nursery: trio.Nursery,
) -> None:
    """Configured is not reachable: a proxy whose every decode worker is down says so."""
    p_url, _ = await serve_standin(nursery, "prefill")
    (dead,) = free_ports(1)  # nothing listens there
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 7100)], [f"http://127.0.0.1:{dead}"])
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.get("/health")
        assert r.status_code == 503, r.text
        assert r.json()["missing"] == ["decode"]
        assert r.json()["prefill"] == {"healthy": 1, "configured": 1}
        assert "decode" in r.json()["status"]


async def test_discovery_from_bootstrap_server(nursery: trio.Nursery) -> None:
    boot_url: str = await nursery.start(serve_bootstrap, BootstrapServer(), "127.0.0.1", 0)
    p_url, p = await serve_standin(nursery, "prefill")
    d_url, d = await serve_standin(nursery, "decode")
    async with httpx.AsyncClient(base_url=boot_url, timeout=10) as http:
        for rec in (
            sample_record(instance_id="p0", scheduler_addr=p_url, zmq_addr="127.0.0.1:7100"),
            sample_record(role="decode", instance_id="d0", scheduler_addr=d_url,
                          zmq_addr="127.0.0.1:7200"),
        ):
            assert (await http.put("/route", json=to_json(rec))).status_code == 200
    proxy = ProxyServer([], [], bootstrap_url=boot_url, refresh_interval=0.2)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        r = await http.post("/generate", json=GEN)
        assert r.status_code == 200, r.text
    body = p.generations()[0].body
    assert (body["bootstrap_host"], body["bootstrap_port"]) == ("127.0.0.1", 7100)
    assert d.generations()[0].body["bootstrap_room"] == body["bootstrap_room"]
    assert Counter(proxy.stats()["rooms_total"])["COMPLETED"] == 1


async def test_discovery_with_static_colocated_workers(nursery: trio.Nursery) -> None:
    """The registry lists no null worker: with --bootstrap-url the --colocated ones are routed
    whole requests, except one the registry lists under another role (a switched worker)."""
    boot_url: str = await nursery.start(serve_bootstrap, BootstrapServer(), "127.0.0.1", 0)
    p_url, p = await serve_standin(nursery, "prefill")
    c_url, c = await serve_standin(nursery, "null")
    w_url, w = await serve_standin(nursery, "decode")  # given as colocated, registered as D
    async with httpx.AsyncClient(base_url=boot_url, timeout=10) as http:
        rec = sample_record(instance_id="p0", scheduler_addr=p_url, zmq_addr="127.0.0.1:7100")
        assert (await http.put("/route", json=to_json(rec))).status_code == 200
    proxy = ProxyServer([], [], bootstrap_url=boot_url, refresh_interval=0.1,
                  colocated=[c_url, w_url])
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(2):  # no D registered: each goes whole to a colocated worker, in turn
            r = await http.post(f"{url}/generate", json=GEN)
            assert r.status_code == 200, r.text
        assert [g.headers["x-pd-role"] for g in (*c.generations(), *w.generations())] == [
            "null", "null"]
        rec = sample_record(role="decode", instance_id="w0", scheduler_addr=w_url,
                            zmq_addr="127.0.0.1:7200")
        assert (await http.put(f"{boot_url}/route", json=to_json(rec))).status_code == 200
        with trio.fail_after(10):
            while (await http.get(f"{url}/workers")).json()["decode"] != [w_url]:
                await trio.sleep(0.05)
        workers = (await http.get(f"{url}/workers")).json()
    assert (workers["prefill"], workers["colocated"]) == ([p_url], [c_url])
    assert not p.generations()
    assert proxy.stats()["rooms_routed_total"]["colocated"] == 2
