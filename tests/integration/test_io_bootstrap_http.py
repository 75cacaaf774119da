"""The bootstrap server over real HTTP (hypercorn on 127.0.0.1): every bad input gets a 4xx JSON
body naming the problem, and the server keeps serving; the CLI starts and stops cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.io_trio.bootstrap_client import BootstrapClient, BootstrapError
from pd_fsm.io_trio.bootstrap_server import BootstrapServer, serve_bootstrap
from pd_fsm.io_trio.records import to_json
from pd_fsm.io_trio.testing import sample_record

SECRET = b"s3cret-token"
GOOD = to_json(sample_record())
KEY = {k: GOOD[k] for k in ("role", "instance_id", "tp_rank", "cp_rank", "dp_rank", "pp_rank")}
AUTH = {"authorization": f"Bearer {SECRET.decode()}"}


@pytest.fixture
async def url(nursery: trio.Nursery) -> str:
    server = BootstrapServer(secret=SECRET, max_body=4096)
    base: str = await nursery.start(serve_bootstrap, server, "127.0.0.1", 0)
    return base


async def _ok_still(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).status_code == 200
    assert (await http.put("/route", json=GOOD, headers=AUTH)).status_code == 200


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
    ("mesh_meta list", _with(mesh_meta=[1]), 422, "body.mesh_meta"),
    ("zero page size", _with(page_size=0), 422, "page_size must be >= 1"),
]


@pytest.mark.parametrize(("what", "body", "status", "needle"), BAD_BODIES, ids=lambda x: x)
async def test_put_route_rejects(url: str, what: str, body: Any, status: int, needle: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        if isinstance(body, bytes):
            r = await http.put("/route", content=body, headers=AUTH)
        else:
            r = await http.put("/route", json=body, headers=AUTH)
        assert r.status_code == status, r.text
        payload = r.json()
        assert needle in payload["error"] + " ".join(payload.get("problems", [])), payload
        await _ok_still(http)


async def test_body_over_limit_is_413(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        big = _with(mesh_meta={"pad": "x" * 8000})
        r = await http.put("/route", json=big, headers=AUTH)
        assert r.status_code == 413 and "over 4096 bytes" in r.json()["error"]

        async def chunks() -> Any:  # no Content-Length: the limit is counted while reading
            for _ in range(10):
                yield b" " * 1000

        r = await http.put("/route", content=chunks(), headers=AUTH)
        assert r.status_code == 413
        await _ok_still(http)


async def test_writes_need_the_secret(url: str) -> None:
    async with httpx.AsyncClient(base_url=url) as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"}):
            assert (await http.put("/route", json=GOOD, headers=headers)).status_code == 401
            assert (await http.post("/heartbeat", json=KEY, headers=headers)).status_code == 401
            r = await http.request("DELETE", "/route", json=KEY, headers=headers)
            assert r.status_code == 401 and "secret" in r.json()["error"]
        # Reads are open (routers list instances without the secret).
        assert (await http.get("/list")).status_code == 200
        await _ok_still(http)


async def test_endpoints_and_lookups(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, headers=AUTH) as http:
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
        r = httpx.put(f"{base}/route", json=GOOD, headers=AUTH, timeout=5)
        assert r.json()["ttl"] == 3.0
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(timeout=10) == 0
        assert "received SIGTERM" in rest and "stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
