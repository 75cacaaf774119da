"""I/O layer benchmark: bootstrap server and side channel. Prints figures; asserts nothing.

    .venv/bin/python bench/bench_io.py [--instances 1000] [--seconds 3]

Bootstrap: the server runs as `pd-fsm bootstrap` in its own process; this process is the httpx
client. Heartbeats/s with 1,000 registered instances (1, 4 and 32 connections), then GET /route
latency (by key, and by host:port as D resolves P) against GET /health as the same-run baseline.

Side channel: a P (PrefillEndpoint behind its driver and ROUTER) answers batched heartbeats of
64 rooms from a D DEALER; messages/s counts HB + HB_ACK. Baseline: raw pyzmq DEALER->ROUTER echo
of the same bytes with a blocking thread on the P side (no codec, no core, no trio).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import trio
import zmq

from pd_fsm.core import events as ev
from pd_fsm.core.codec import encode
from pd_fsm.core.messages import Heartbeat, HeartbeatAck, Message, RecvInit
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.io_trio.bootstrap.records import to_json
from pd_fsm.io_trio.driver import NullSink
from pd_fsm.io_trio.side_channel.channel import DecodeSideChannel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test doubles live under tests/

from tests.support.io_doubles import sample_record  # noqa: E402
from tests.support.services import serve_prefill  # noqa: E402

# -- bootstrap ----------------------------------------------------------------------------------


def start_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "pd_fsm.cli", "bootstrap", "--port", "0", "--ttl", "60"]
    proc = subprocess.Popen(cmd, stderr=log.open("wb"), cwd=ROOT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        m = re.search(r"listening on (http://[\d.]+:\d+)", log.read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"bootstrap server did not start:\n{log.read_text()}")


def key_of(i: int) -> dict[str, Any]:
    return {
        "role": "prefill",
        "instance_id": f"p{i // 8}",
        "tp_rank": i % 8,
        "cp_rank": 0,
        "dp_rank": 0,
        "pp_rank": 0,
    }


def record_of(i: int) -> dict[str, Any]:
    port = 20000 + i // 8
    rec = sample_record(
        instance_id=f"p{i // 8}",
        tp_rank=i % 8,
        tp_size=8,
        zmq_addr=f"127.0.0.1:{port}",
        transfer_addr=f"127.0.0.1:{port + 10000}",
    )
    return to_json(rec)


async def fan_out(n: int, workers: int, job: Any) -> None:
    it = iter(range(n))

    async def worker() -> None:
        for i in it:
            await job(i)

    async with trio.open_nursery() as nursery:
        for _ in range(workers):
            nursery.start_soon(worker)


async def latencies(http: httpx.AsyncClient, make: Any, n: int) -> list[float]:
    out = []
    for i in range(n):
        t = time.perf_counter()
        r = await make(http, i)
        out.append(time.perf_counter() - t)
        assert r.status_code == 200, r.text
    return out


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] * 1e3


async def heartbeat_rate(url: str, instances: int, seconds: float, connections: int) -> float:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as http:
        done = 0
        stop_at = time.perf_counter() + seconds

        async def heartbeats(i: int) -> None:
            nonlocal done
            while time.perf_counter() < stop_at:
                r = await http.post("/heartbeat", json=key_of(i % instances))
                assert r.status_code == 200, r.text
                done += 1
                i += connections

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for c in range(connections):
                nursery.start_soon(heartbeats, c)
        return done / (time.perf_counter() - t0)


async def bench_bootstrap(url: str, instances: int, seconds: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10) as http:

        async def register(i: int) -> None:
            r = await http.put("/route", json=record_of(i))
            assert r.status_code == 200, r.text

        await fan_out(instances, 32, register)
        listed = (await http.get("/list")).json()["instances"]
        assert len(listed) == instances

        hb_rates: dict[int, float] = {}
        for connections in (1, 4, 32):
            hb_rates[connections] = await heartbeat_rate(url, instances, seconds, connections)

        n = 2000

        async def health(h: httpx.AsyncClient, i: int) -> httpx.Response:
            return await h.get("/health")

        async def by_key(h: httpx.AsyncClient, i: int) -> httpx.Response:
            return await h.get("/route", params=key_of(i * 7919 % instances))

        async def by_addr(h: httpx.AsyncClient, i: int) -> httpx.Response:
            port = 20000 + (i * 7919 % instances) // 8
            return await h.get("/route", params={"host": "127.0.0.1", "port": port, "tp_rank": 3})

        base = await latencies(http, health, n)
        key = await latencies(http, by_key, n)
        addr = await latencies(http, by_addr, n)
    return {
        **{f"heartbeats_per_s_{c}": r for c, r in hb_rates.items()},
        "health_p50_ms": pct(base, 50),
        "health_p99_ms": pct(base, 99),
        "route_key_p50_ms": pct(key, 50),
        "route_key_p99_ms": pct(key, 99),
        "route_addr_p50_ms": pct(addr, 50),
        "route_addr_p99_ms": pct(addr, 99),
    }


async def bench_app_in_process(n: int = 3000) -> float:
    """Microseconds per heartbeat through the app alone (httpx ASGITransport, no sockets)."""
    from pd_fsm.io_trio.bootstrap.server import BootstrapServer

    server = BootstrapServer()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        transport = httpx.ASGITransport(app=server.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as http:
            await http.put("/route", json=record_of(0))
            t0 = time.perf_counter()
            for _ in range(n):
                await http.post("/heartbeat", json=key_of(0))
            per = (time.perf_counter() - t0) / n * 1e6
        nursery.cancel_scope.cancel()
    return per


# -- side channel -------------------------------------------------------------------------------

ROOMS = tuple(range(1, 65))
WINDOW = 64  # heartbeats in flight


async def bench_side_channel(seconds: float) -> float:
    """HB + HB_ACK per second through the real P stack (ROUTER, codec, driver, core)."""
    endpoint = PrefillEndpoint("L", random.Random(0))
    acks = 0
    got = trio.Event()

    async def on_ack(peer: str, message: Message) -> None:
        nonlocal acks, got
        assert isinstance(message, HeartbeatAck)
        acks += 1
        got.set()

    async with trio.open_nursery() as nursery:
        p = await nursery.start(serve_prefill, endpoint, NullSink())
        d = DecodeSideChannel("decode-bench", on_ack)
        await nursery.start(d.run)
        for room in ROOMS:  # the rooms exist on P, so each HB extends 64 real leases
            d.send(p.address, RecvInit(room, "decode-bench", 1, "L"))
            await p.driver.submit(ev.PrefillRequestAccepted(room))
        seq = 0
        sent = 0
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        while time.perf_counter() < stop_at:
            while sent - acks < WINDOW:
                seq += 1
                if d.send(p.address, Heartbeat(seq, ROOMS)):
                    sent += 1
            got = trio.Event()
            with trio.fail_after(10):
                await got.wait()
        with trio.fail_after(10):
            while acks < sent:
                got = trio.Event()
                await got.wait()
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    return 2 * acks / elapsed


def bench_raw_zmq(seconds: float) -> float:
    """Baseline: the same frames, raw pyzmq, blocking echo thread on the P side."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    hb = encode(Heartbeat(1, ROOMS))
    ack = encode(HeartbeatAck(1, 1))
    stop = threading.Event()

    def echo() -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        while not stop.is_set():
            if poller.poll(50):
                while True:
                    try:
                        ident, _ = router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    router.send_multipart([ident, ack])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"raw")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    sent = received = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        while sent - received < WINDOW:
            dealer.send(hb)
            sent += 1
        dealer.recv()
        received += 1
    while received < sent:
        dealer.recv()
        received += 1
    elapsed = time.perf_counter() - t0
    stop.set()
    thread.join()
    ctx.destroy(linger=0)
    return 2 * received / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--instances", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared)")

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(Path(tmp) / "bootstrap.log")
        try:
            b = trio.run(bench_bootstrap, url, args.instances, args.seconds)
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"bootstrap server, {args.instances} registered instances, client in another process:")
    for c in (1, 4, 32):
        print(f"  heartbeats/s ({c:2d} connection(s))      {b[f'heartbeats_per_s_{c}']:10.0f}")
    for name, label in (
        ("health", "GET /health (baseline)"),
        ("route_key", "GET /route by key"),
        ("route_addr", "GET /route by host:port"),
    ):
        p50, p99 = b[f"{name}_p50_ms"], b[f"{name}_p99_ms"]
        print(f"  {label:34s} p50 {p50:6.3f} ms   p99 {p99:6.3f} ms")
    ratio = b["route_key_p50_ms"] / b["health_p50_ms"]
    print(f"  GET /route p50 / GET /health p50   {ratio:10.2f}")
    app_us = trio.run(bench_app_in_process)
    print(f"  one heartbeat in-process (app + httpx client, no socket) {app_us:6.0f} us")

    ours = trio.run(bench_side_channel, args.seconds)
    raw = bench_raw_zmq(args.seconds)
    print("side channel, 64-room heartbeat batches, 64 in flight, HB + HB_ACK counted:")
    print(f"  pd_fsm (ROUTER/DEALER on trio, codec, driver, core)  {ours:10.0f} msg/s")
    print(f"  raw pyzmq echo, same bytes (baseline)                {raw:10.0f} msg/s")
    print(f"  ratio pd_fsm / raw                                   {ours / raw:10.2f}")


if __name__ == "__main__":
    main()
