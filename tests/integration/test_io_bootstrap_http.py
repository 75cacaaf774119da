"""The bootstrap server over real HTTP (hypercorn on 127.0.0.1): every bad input gets a 4xx JSON
body naming the problem, and the server keeps serving; the CLI starts and stops cleanly. With a
cluster secret, writes are signed (pd_fsm.core.request_auth): unsigned, bearer, forged, replayed
and stale writes are refused with 401 and counted."""

from __future__ import annotations

import base64
import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.core.keys import registry_key, side_channel_key
from pd_fsm.core.request_auth import sign_request
from pd_fsm.io_trio.bootstrap.client import BootstrapClient, BootstrapError, RegistrySigner
from pd_fsm.io_trio.bootstrap.records import to_json
from pd_fsm.io_trio.bootstrap.server import BootstrapServer, serve_bootstrap
from tests.support.io_doubles import sample_record

SECRET = b"s3cret-token"
GOOD = to_json(sample_record())
KEY = {k: GOOD[k] for k in ("role", "instance_id", "tp_rank", "cp_rank", "dp_rank", "pp_rank")}
SIGNED = RegistrySigner(SECRET)  # httpx auth: signs each write afresh


@pytest.fixture
async def url(nursery: trio.Nursery) -> str:
    server = BootstrapServer(secret=SECRET, max_body=4096)
    base: str = await nursery.start(serve_bootstrap, server, "127.0.0.1", 0)
    return base


async def _ok_still(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).status_code == 200
    assert (await http.put("/route", json=GOOD, auth=SIGNED)).status_code == 200


def _with(**patch: Any) -> dict[str, Any]:
    return {**GOOD, **patch}


def _without(field: str) -> dict[str, Any]:
    return {k: v for k, v in GOOD.items() if k != field}


BAD_BODIES: list[tuple[str, Any, int, str]] = [
    ("malformed JSON", b'{"role": "prefill",', 400, "malformed JSON"),
    ("not UTF-8", b"\xff\xfe{}", 400, "malformed JSON"),
    ("JSON array", b"[1, 2]", 422, "must be a JSON object"),
    ("missing field", _without("zmq_addr"), 422, "required field missing @ body.zmq_addr"),
    ("string rank", _with(tp_rank="0"), 422, "expected int @ body.tp_rank"),
    ("bool rank", _with(tp_rank=True), 422, "expected int @ body.tp_rank"),
    ("float size", _with(tp_size=1.0), 422, "expected int @ body.tp_size"),
    ("unknown field", _with(tp_rnak=0), 422, "extra fields found (tp_rnak)"),
    ("unknown role", _with(role="router"), 422, "unknown role 'router'"),
    ("negative rank", _with(dp_rank=-1), 422, "dp_rank must be >= 0"),
    ("rank >= size", _with(tp_rank=2, tp_size=2), 422, "tp_rank 2 must be < tp_size 2"),
    ("zero size", _with(pp_size=0), 422, "pp_size must be >= 1"),
    ("bad address", _with(zmq_addr="nohost"), 422, "is not host:port @ body.zmq_addr"),
    ("bad port", _with(transfer_addr="h:70000"), 422, "port outside 1..65535"),
    ("wildcard transfer", _with(transfer_addr="0.0.0.0:7001"), 422,
     "advertises the wildcard address 0.0.0.0, which no peer can dial @ body.transfer_addr"),
    ("wildcard bootstrap_host", _with(bootstrap_host="::"), 422,
     "advertises the wildcard address ::, which no peer can dial @ body.bootstrap_host"),
    ("mesh_meta list", _with(mesh_meta=[1]), 422, "body.mesh_meta"),
    ("zero page size", _with(page_size=0), 422, "page_size must be >= 1"),
    ("zero ttl", _with(heartbeat_ttl=0), 422, "heartbeat_ttl must be in"),
    ("huge ttl", _with(heartbeat_ttl=1e9), 422, "heartbeat_ttl must be in"),
    ("string ttl", _with(heartbeat_ttl="15"), 422, "expected float | None @ body.heartbeat_ttl"),
    ("bool ttl", _with(heartbeat_ttl=True), 422, "expected float | None @ body.heartbeat_ttl"),
    # Issue 34: what Python's json accepts and JSON does not, refused before it is stored.
    ("lone surrogate", json.dumps(_with(instance_id="p\ud800")).encode(), 400,
     "body.instance_id has a lone surrogate U+D800"),
    ("NaN ttl", json.dumps(_with(heartbeat_ttl=math.nan)).encode(), 400,
     "body.heartbeat_ttl is NaN"),
    ("overflowing ttl", json.dumps(_with(heartbeat_ttl=1.5)).replace("1.5", "1e400").encode(),
     400, "body.heartbeat_ttl is 1e400"),
    ("NaN in mesh_meta", json.dumps(_with(mesh_meta={"x": [math.inf]})).encode(), 400,
     "body.mesh_meta.x[0] is Infinity"),
    ("deep mesh_meta", json.dumps(_with(mesh_meta={"x": 0})).replace(
        '{"x": 0}', '{"x": ' + "[" * 1_500 + "]" * 1_500 + "}").encode(), 400,
     "deeper than 64 levels"),
    ("duplicate key", json.dumps(GOOD).replace('{"role"', '{"role": "decode", "role"').encode(),
     400, "body has the key 'role' more than once"),
]


@pytest.mark.parametrize(("what", "body", "status", "needle"), BAD_BODIES,
                         ids=[row[0] for row in BAD_BODIES])
async def test_put_route_rejects(url: str, what: str, body: Any, status: int, needle: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        if isinstance(body, bytes):
            r = await http.put("/route", content=body, auth=SIGNED)
        else:
            r = await http.put("/route", json=body, auth=SIGNED)
        assert r.status_code == status, r.text
        payload = r.json()
        assert needle in payload["error"] + " ".join(payload.get("problems", [])), payload
        await _ok_still(http)
        listed = await http.get("/list", params={"role": "prefill"})  # nothing poisoned
        assert listed.status_code == 200 and len(listed.json()["instances"]) == 1


async def test_loopback_registered_from_another_host_is_refused_by_field() -> None:
    """A worker on 10.77.0.9 advertising 127.0.0.1 would send every peer to itself: 422 naming
    each field, and the registry stays empty. (The real app over httpx's ASGI transport, which
    lets the test set the client's address; the namespaced test does the same over a link.)"""
    server = BootstrapServer(max_body=4096)
    transport = httpx.ASGITransport(app=server.app, client=("10.77.0.9", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as http:
        r = await http.put("/route", json=GOOD)
    assert r.status_code == 422, r.text
    detail = " ".join(r.json()["problems"])
    for field in ("transfer_addr", "zmq_addr"):
        assert f"advertises loopback 127.0.0.1 but registered from 10.77.0.9: peers on other " \
            f"hosts would dial themselves (start it with --advertise-host) @ body.{field}" in detail
    assert server.registry.instances(None) == []
    assert server.bad_requests == 1


async def test_put_route_takes_exactly_the_rfc_payload(url: str) -> None:
    """RFC-2 §5.3's PUT /route payload, nothing more: no layout_hash (ours, optional; the layout
    is then checked at the handshake) and no bootstrap_host/port (defaulting to zmq_addr's)."""
    rfc = {
        "role": "prefill", "instance_id": "rfc-p0",
        "tp_rank": 0, "tp_size": 1, "cp_rank": 0, "cp_size": 1,
        "dp_rank": 0, "dp_size": 1, "pp_rank": 0, "pp_size": 1,
        "transfer_addr": "10.0.0.5:7000", "zmq_addr": "10.0.0.5:7001",
        "scheduler_addr": "10.0.0.5:7002", "page_size": 16, "kv_dtype": "bfloat16",
        "mesh_meta": {"devices": 4},
    }
    async with httpx.AsyncClient(base_url=url) as http:
        for body in (rfc, {k: v for k, v in rfc.items()
                           if k not in ("scheduler_addr", "mesh_meta")}):
            r = await http.put("/route", json=body, auth=SIGNED)
            assert r.status_code == 200, r.text
        r = await http.get("/route", params={"host": "10.0.0.5", "port": 7001})
        assert r.status_code == 200, r.text
        (record,) = r.json()["instances"]
        assert record["instance_id"] == "rfc-p0" and record["layout_hash"] == ""


async def test_body_over_limit_is_413(url: str) -> None:
    # Unsigned: the size limit is checked while reading, before the signature (which covers the
    # whole body) can be.
    async with httpx.AsyncClient(base_url=url) as http:
        big = _with(mesh_meta={"pad": "x" * 8000})
        r = await http.put("/route", json=big)
        assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]

        async def chunks() -> Any:  # no Content-Length: the limit is counted while reading
            for _ in range(10):
                yield b" " * 1000

        r = await http.put("/route", content=chunks())
        assert r.status_code == 413
        await _ok_still(http)


async def test_a_client_that_sends_its_whole_body_first_reads_the_413(url: str) -> None:
    """Python's urllib writes the whole body before it reads the answer: with a 64 MB body,
    the server must read (and drop) it before answering, else the client meets a connection
    closed under its upload (a broken pipe) and never sees the 413."""

    def put() -> tuple[int, bytes]:
        request = urllib.request.Request(f"{url}/route", data=b" " * (64 << 20), method="PUT",
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    status, body = await trio.to_thread.run_sync(put)
    assert status == 413 and b"over 4096 bytes" in body, (status, body[:200])
    async with httpx.AsyncClient(base_url=url) as http:
        await _ok_still(http)


async def test_writes_need_a_signature(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"}):
            assert (await http.put("/route", json=GOOD, headers=headers)).status_code == 401
            assert (await http.post("/heartbeat", json=KEY, headers=headers)).status_code == 401
            r = await http.request("DELETE", "/route", json=KEY, headers=headers)
            assert r.status_code == 401 and "cluster secret" in r.json()["error"]
        # Reads are open (routers list instances without the secret).
        assert (await http.get("/list")).status_code == 200
        assert (await http.get("/health")).json()["bad_requests_total"] == 9
        await _ok_still(http)


async def test_the_old_bearer_secret_is_refused(url: str) -> None:
    """The old scheme sent the cluster secret itself on every heartbeat: refused outright, even
    next to a valid signature, so a client still doing it fails loudly instead of leaking it."""
    bearer = {"authorization": f"Bearer {SECRET.decode()}"}
    async with httpx.AsyncClient(base_url=url) as http:
        for auth in (None, SIGNED):
            r = await http.put("/route", json=GOOD, headers=bearer, auth=auth)
            assert r.status_code == 401, r.text
            assert "Authorization header (Bearer) refused" in r.json()["error"]
        assert (await http.get("/list")).json()["instances"] == []


def _signed(method: str, path: str, body: Any, *, key: bytes | None = None,
            sent_at: float | None = None) -> tuple[bytes, dict[str, str]]:
    """The body bytes and headers of one signed write, to send (and send again) by hand."""
    content = json.dumps(body).encode()
    headers = sign_request(
        registry_key(SECRET) if key is None else key, method, path, content,
        sent_at=time.time() if sent_at is None else sent_at, nonce=secrets.token_bytes(16),
    )
    return content, {"content-type": "application/json", **headers}


async def test_replayed_stale_altered_and_wrong_key_writes_are_refused(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        assert (await http.put("/route", json=GOOD, auth=SIGNED)).status_code == 200
        health0 = (await http.get("/health")).json()

        # A heartbeat recorded off the wire and sent again: the first counts, the copy does not.
        content, headers = _signed("POST", "/heartbeat", KEY)
        assert (await http.post("/heartbeat", content=content, headers=headers)).is_success
        r = await http.post("/heartbeat", content=content, headers=headers)
        assert r.status_code == 401 and "request replayed" in r.json()["error"], r.text

        # Signed two minutes ago: outside the 60 s window.
        content, headers = _signed("POST", "/heartbeat", KEY, sent_at=time.time() - 120)
        r = await http.post("/heartbeat", content=content, headers=headers)
        assert r.status_code == 401 and "outside the 60 s window" in r.json()["error"], r.text

        # A valid signature over another body: a forged registration in a signed envelope.
        content, headers = _signed("PUT", "/route", GOOD)
        forged = json.dumps(_with(zmq_addr="10.6.6.6:1")).encode()
        r = await http.put("/route", content=forged, headers=headers)
        assert r.status_code == 401 and "bad signature" in r.json()["error"], r.text
        # ... or another method or path under the same signature.
        content, headers = _signed("DELETE", "/route", KEY)
        r = await http.post("/heartbeat", content=content, headers=headers)
        assert r.status_code == 401 and "bad signature" in r.json()["error"]

        # Signed with the side-channel key of the same secret: not a registry key.
        content, headers = _signed("DELETE", "/route", KEY, key=side_channel_key(SECRET))
        r = await http.request("DELETE", "/route", content=content, headers=headers)
        assert r.status_code == 401 and "bad signature" in r.json()["error"]

        health = (await http.get("/health")).json()
        assert health["bad_requests_total"] == health0["bad_requests_total"] + 5
        [record] = (await http.get("/list")).json()["instances"]
        assert record == GOOD  # registered once, never deleted nor replaced
        await _ok_still(http)


async def test_a_write_signed_before_a_restart_is_refused_after_it(nursery: trio.Nursery) -> None:
    """A fresh server has no memory of accepted MACs; its floor (its start) refuses what was
    signed before it, though that is well inside the 60 s window."""
    content, headers = _signed("PUT", "/route", GOOD)
    await trio.sleep(0.01)  # past the signature's ms
    restarted = BootstrapServer(secret=SECRET)
    url = await nursery.start(serve_bootstrap, restarted, "127.0.0.1", 0)
    async with httpx.AsyncClient(base_url=url) as http:
        r = await http.put("/route", content=content, headers=headers)
        assert r.status_code == 401 and "before this process started" in r.json()["error"]
        assert (await http.put("/route", json=GOOD, auth=SIGNED)).status_code == 200


def _forms(secret: bytes) -> list[bytes]:
    encoded = (secret.hex().encode(), base64.b64encode(secret), base64.urlsafe_b64encode(secret))
    return [secret, *(e.rstrip(b"=") for e in encoded)]


async def test_nothing_the_client_sends_contains_the_secret_or_a_key() -> None:
    """Every byte BootstrapClient puts on the wire (request line, headers, body), over a whole
    life: register, heartbeats, lookups, deregistration; none holds the cluster secret or either
    derived key, in any common encoding. Its writes are signed, its reads are not."""
    wire: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        head = [f"{request.method} {request.url}".encode()]
        head += [name + b": " + value for name, value in request.headers.raw]
        wire.append(b"\r\n".join(head) + b"\r\n\r\n" + request.content)
        if request.method == "GET":
            return httpx.Response(200, json={"instances": [GOOD]})
        return httpx.Response(200, json={"ok": True, "ttl": 15.0})

    http = httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://b")
    client = BootstrapClient("http://b", sample_record(), secret=SECRET, heartbeat_interval=0.01,
                             http=http)
    async with http, trio.open_nursery() as nursery:
        nursery.start_soon(client.run)
        with trio.fail_after(10):
            while client.heartbeats < 3:
                await trio.sleep(0.01)
        await client.resolve("127.0.0.1", 7002)
        await client.list()
        nursery.cancel_scope.cancel()  # deregisters on the way out
    methods = [w.split(b" ", 1)[0] for w in wire]
    assert methods.count(b"PUT") == 1 and methods.count(b"POST") >= 3
    assert methods.count(b"GET") == 2 and methods[-1] == b"DELETE"
    forbidden = [f for s in (SECRET, registry_key(SECRET), side_channel_key(SECRET))
                 for f in _forms(s)]
    for sent in wire:
        assert not [f for f in forbidden if f in sent], sent
        assert b"authorization" not in sent.lower()
        assert (b"x-pd-fsm-mac: " in sent) == (not sent.startswith(b"GET "))


async def test_endpoints_and_lookups(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, auth=SIGNED) as http:
        decode = _with(role="decode", instance_id="d0", zmq_addr="127.0.0.1:9000")
        p1 = _with(instance_id="p0", tp_rank=1, tp_size=2, bootstrap_port=8998)
        p0 = _with(instance_id="p0", tp_rank=0, tp_size=2, bootstrap_port=8998)
        for body in (decode, p1, p0):
            r = await http.put("/route", json=body)
            assert r.status_code == 200 and r.json()["ttl"] == 15.0
        listed = (await http.get("/list", params={"role": "prefill"})).json()["instances"]
        assert [(r["instance_id"], r["tp_rank"]) for r in listed] == [("p0", 0), ("p0", 1)]
        assert len((await http.get("/list")).json()["instances"]) == 3
        assert (await http.get("/list", params={"role": "x"})).status_code == 422

        by_key = {"role": "prefill", "instance_id": "p0", "cp_rank": 0, "dp_rank": 0, "pp_rank": 0}
        r = await http.get("/route", params={**by_key, "tp_rank": 1})
        assert r.status_code == 200 and r.json()["tp_rank"] == 1
        assert (await http.get("/route", params={**by_key, "tp_rank": 5})).status_code == 404
        r = await http.get("/route", params={"role": "prefill", "instance_id": "p0"})
        assert r.status_code == 422 and "missing" in r.json()["problems"][0]

        where = {"host": "127.0.0.1", "port": 8998, "role": "prefill"}
        r = await http.get("/route", params=where)
        assert [i["tp_rank"] for i in r.json()["instances"]] == [0, 1]
        r = await http.get("/route", params={**where, "tp_rank": 1})
        assert [i["tp_rank"] for i in r.json()["instances"]] == [1]
        r = await http.get("/route", params={**where, "port": 7002})  # zmq port, not advertised
        assert r.status_code == 404 and "no live prefill" in r.json()["error"]
        r = await http.get("/route", params={**where, "port": "x", "tp_rank": "-1"})
        assert r.status_code == 422 and len(r.json()["problems"]) == 2
        r = await http.get("/route", params={"host": "127.0.0.1", "port": 9000, "role": "decode"})
        assert r.json()["instances"][0]["instance_id"] == "d0"

        # Heartbeat and deregistration, and their 404s.
        assert (await http.post("/heartbeat", json={**KEY, "tp_rank": 1})).status_code == 200
        assert (await http.request("DELETE", "/route", json={**KEY, "tp_rank": 1})).is_success
        r = await http.post("/heartbeat", json={**KEY, "tp_rank": 1})
        assert r.status_code == 404 and "PUT /route again" in r.json()["error"]
        r = await http.request("DELETE", "/route", json={**KEY, "tp_rank": 1})
        assert r.status_code == 404
        r = await http.post("/heartbeat", json={**KEY, "role": "both"})
        assert r.status_code == 422
        r = await http.post("/heartbeat", content=b"nope")
        assert r.status_code == 400
        assert (await http.get("/health")).json()["instances"] == 2


async def test_client_against_real_server(url: str) -> None:
    async with BootstrapClient(url, sample_record(), secret=SECRET) as client:
        await client.register()
        [found] = await client.resolve("127.0.0.1", 7002)
        assert found == sample_record()
        assert [r.instance_id for r in await client.list("prefill")] == ["p0"]
    async with BootstrapClient(url, sample_record(), secret=b"wrong") as bad:
        with pytest.raises(BootstrapError, match="401"):
            await bad.register()
    async with BootstrapClient("http://127.0.0.1:1", sample_record()) as nowhere:
        with pytest.raises(BootstrapError, match="ConnectError"):
            await nowhere.register()


def test_cli_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pd_fsm.cli", "bootstrap", "--port", "0", "--ttl", "3"]
    proc = subprocess.Popen(
        [*cmd, "--secret-file", str(secret_file)],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stderr is not None
        base = None
        for line in proc.stderr:
            assert line.startswith("pd-fsm bootstrap: "), line
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
            if m:
                base = m.group(1)
                break
        assert base is not None
        assert httpx.get(f"{base}/health", timeout=5).json()["status"] == "ok"
        assert httpx.put(f"{base}/route", json=GOOD, timeout=5).status_code == 401
        r = httpx.put(f"{base}/route", json=GOOD, auth=SIGNED, timeout=5)
        assert r.json()["ttl"] == 3.0
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=10) == 0
        assert "received SIGTERM" in rest and "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
