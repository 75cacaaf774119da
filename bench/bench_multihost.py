"""Across hosts: KV transfer over a veth link against a raw socket on the same link; TTFT with TLS
and CURVE against plain; `pd-fsm cluster --ray` launch time against the local runner. Prints
tables; asserts nothing. Needs root (network namespaces, ``tests/integration/netns_support.py``).

    .venv/bin/python bench/bench_multihost.py                    # all three parts
    .venv/bin/python bench/bench_multihost.py --part transfer --sizes 16,64,256 --reps 5
    .venv/bin/python bench/bench_multihost.py --part ttft --requests 40
    .venv/bin/python bench/bench_multihost.py --part launch --reps 2

* ``transfer``: a P process in namespace A (10.77.0.1) and a D process in B (10.77.0.2), each
  with a ``JaxTransferKVEngine`` bound to its side of the link and the worker's huge-page heap;
  D pulls an array P registered, and reads the same number of bytes from a raw TCP socket P
  serves on the same link. Interleaved repetition by repetition; medians.
* ``ttft``: two tiny-model 1P1D clusters on the same two hosts, one plain and one with TLS on
  every HTTP hop, CURVE on the side channel and a cluster secret; a client in B sends the same
  streamed requests to each proxy in turn and times the first token. Medians and p90.
* ``launch``: from the command to its "ready" line: `pd-fsm cluster --model tiny` on this host,
  and `pd-fsm cluster --ray` placing P on A and D on B of a running two-node Ray cluster (the time
  `ray start` took is printed apart).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import plots  # bench/, beside this script (the first entry of sys.path)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
PY = sys.executable


# ------------------------------------------------------------------------- peers (in namespaces)


def _peer_p(host: str, sizes: list[int]) -> None:
    """P: a transfer engine and a raw TCP server on ``host``; registers on request."""
    import jax
    import jax.numpy as jnp

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine(host, reaper_interval_s=None)
    payload = os.urandom(max(sizes) * MIB)
    raw = socket.create_server((host, 0))

    def serve_raw() -> None:
        while True:
            conn, _ = raw.accept()
            with conn:
                while len(head := conn.recv(8)) == 8:
                    conn.sendall(memoryview(payload)[: int.from_bytes(head, "big")])

    threading.Thread(target=serve_raw, daemon=True).start()
    arrays = {m: jax.jit(lambda n=m * MIB // 4: jnp.arange(n, dtype=jnp.float32))()
              for m in sizes}
    jax.block_until_ready(list(arrays.values()))
    print(json.dumps({"engine": engine.address, "raw": raw.getsockname()[1]}), flush=True)
    for line in sys.stdin:
        uuid, mib = json.loads(line)
        engine.register(uuid, [arrays[mib]], lease_s=600)
        print("ok", flush=True)


def _peer_d(host: str, p_host: str, engine_addr: str, raw_port: int) -> None:
    """D: pulls (or reads the raw socket) when told; answers seconds to every byte ready."""
    import jax
    import jax.numpy as jnp

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine(host, reaper_interval_s=None)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    raw = socket.create_connection((p_host, raw_port))
    buf = bytearray()
    print("ready", flush=True)
    for line in sys.stdin:
        which, uuid, mib = json.loads(line)
        t = time.perf_counter()
        if which == "engine":
            spec = jax.ShapeDtypeStruct((mib * MIB // 4,), jnp.float32, sharding=sharding)
            engine.start_pull(engine_addr, uuid, [spec], deadline_s=300).wait()
        else:
            n = mib * MIB
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            raw.sendall(n.to_bytes(8, "big"))
            got = 0
            while got < n:
                got += raw.recv_into(view[got:])
        print(json.dumps(time.perf_counter() - t), flush=True)


def _spawn(hosts: Any, ns: str, argv: list[str], env: dict[str, str] | None = None
           ) -> subprocess.Popen[str]:
    return subprocess.Popen(hosts.exec(ns, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})})


def _ask(proc: subprocess.Popen[str], line: Any) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(line) + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def part_transfer(hosts: Any, sizes: list[int], reps: int) -> None:
    heap = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # as `pd-fsm serve` runs (host_heap)
    me = str(Path(__file__).resolve())
    p = _spawn(hosts, hosts.a, [PY, me, "--peer", "p", "--host", hosts.ip_a,
                                "--sizes", ",".join(map(str, sizes))], heap)
    assert p.stdout is not None
    addrs = json.loads(p.stdout.readline())
    d = _spawn(hosts, hosts.b, [PY, me, "--peer", "d", "--host", hosts.ip_b, "--p-host",
                                hosts.ip_a, "--engine", addrs["engine"], "--raw-port",
                                str(addrs["raw"])], heap)
    assert d.stdout is not None and d.stdout.readline().strip() == "ready"
    try:
        print(f"\nKV transfer across the veth link, {hosts.ip_a} -> {hosts.ip_b} "
              f"(median of {reps}, first pull of each size discarded)")
        print(f"{'MiB':>6} {'engine s':>10} {'engine GB/s':>12} {'raw s':>10} {'raw GB/s':>10} "
              f"{'engine/raw':>11}")
        rates: dict[str, list[float]] = {"engine": [], "raw socket": []}
        for mib in sizes:
            times: dict[str, list[float]] = {"engine": [], "raw": []}
            for rep in range(reps + 1):
                uuid = secrets.randbits(63)
                assert _ask(p, [uuid, mib]) == "ok"
                t_engine = float(_ask(d, ["engine", uuid, mib]))
                t_raw = float(_ask(d, ["raw", 0, mib]))
                if rep:  # the first connects and warms both paths
                    times["engine"].append(t_engine)
                    times["raw"].append(t_raw)
            e, r = statistics.median(times["engine"]), statistics.median(times["raw"])
            gb = mib * MIB / 1e9
            print(f"{mib:>6} {e:>10.4f} {gb / e:>12.2f} {r:>10.4f} {gb / r:>10.2f} "
                  f"{e / r:>10.2f}x", flush=True)
            rates["engine"].append(gb / e)
            rates["raw socket"].append(gb / r)
        plots.rate_vs_size("multihost_transfer", "KV pull across a veth link vs a raw socket",
                           sizes, rates, reference="raw socket")
    finally:
        for proc in (p, d):
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------- ttft

_TTFT_CLIENT = r"""
import json, ssl, sys, time
import httpx
urls, ca, n, max_tokens = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
clients = {name: httpx.Client(timeout=60, verify=ssl.create_default_context(cafile=ca)
                              if url.startswith("https") else True)
           for name, url in urls.items()}
out = {name: [] for name in urls}
for i in range(n):
    for name, url in (urls.items() if i % 2 == 0 else reversed(list(urls.items()))):
        body = {"text": f"Request {i}: tell me about the sea.", "stream": True,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}
        t = time.perf_counter()
        first = None
        with clients[name].stream("POST", url + "/generate", json=body) as r:
            assert r.status_code == 200, r.read()
            for chunk in r.iter_text():
                if first is None and chunk.strip():
                    first = time.perf_counter() - t
        out[name].append(first)
print(json.dumps(out))
"""


def _start_cluster(hosts: Any, work: Path, name: str, ports: dict[str, int],
                   secure: dict[str, Any] | None) -> list[subprocess.Popen[bytes]]:
    from tests.integration.failure_support import TINY

    a, b = hosts.ip_a, hosts.ip_b
    tls_p: list[str] = []
    boot_tls: list[str] = []
    scheme = "http"
    extra: dict[str, list[str]] = {"p0": [], "d0": []}
    if secure is not None:
        tls = secure["tls"]
        scheme, tls_p = "https", tls.argv()
        boot_tls = ["--ssl-certfile", str(tls.certfile), "--ssl-keyfile", str(tls.keyfile),
                    "--secret-file", str(secure["secret"])]
        for role in extra:
            extra[role] = ["--cluster-secret-file", str(secure["secret"]),
                           "--side-channel-curve-key", str(secure["keys"] / f"{role}.key_secret"),
                           "--side-channel-curve-peers", str(secure["keys"] / "trusted")]
    pd = ["--disaggregation-bootstrap-host", a, "--disaggregation-bootstrap-port",
          str(ports["boot"]), "--log-level", "WARNING"]
    cli = [PY, "-m", "pd_fsm.cli"]
    specs = [
        (hosts.a, [*cli, "bootstrap", "--host", a, "--port", str(ports["boot"]),
                   "--log-level", "WARNING", *boot_tls]),
        (hosts.a, [*cli, "serve", *TINY, "--disaggregation-mode", "prefill", "--host", a,
                   "--port", str(ports["p"]), *pd, *tls_p, *extra["p0"]]),
        (hosts.b, [*cli, "serve", *TINY, "--disaggregation-mode", "decode", "--host", b,
                   "--port", str(ports["d"]), *pd, *tls_p, *extra["d0"]]),
        (hosts.b, [*cli, "proxy", "--host", b, "--port", str(ports["proxy"]), "--bootstrap-url",
                   f"{scheme}://{a}:{ports['boot']}", "--refresh-interval", "1",
                   "--log-level", "WARNING", *tls_p]),
    ]
    procs = []
    for ns, argv in specs:
        log = (work / f"{name}-{len(procs)}.log").open("wb")
        procs.append(subprocess.Popen(hosts.exec(ns, argv), stdout=log, stderr=subprocess.STDOUT,
                                      env={**os.environ, "PD_FSM_WARMUP": "full"}))
    return procs


def part_ttft(hosts: Any, work: Path, requests: int, max_tokens: int) -> None:
    import zmq.auth

    from pd_fsm.io_trio.tls import throwaway_ca
    from tests.integration.netns_support import NsClient

    tls = throwaway_ca(work / "tls", [hosts.ip_a, hosts.ip_b])
    keys = work / "curve"
    (keys / "trusted").mkdir(parents=True)
    for role in ("p0", "d0"):
        zmq.auth.create_certificates(keys, role)
        (keys / "trusted" / f"{role}.key").write_bytes((keys / f"{role}.key").read_bytes())
    (work / "secret").write_text(secrets.token_hex(16))
    secure = {"tls": tls, "keys": keys, "secret": work / "secret"}
    plain_ports = {"boot": 8998, "p": 30000, "d": 30001, "proxy": 8000}
    secure_ports = {"boot": 9998, "p": 40000, "d": 40001, "proxy": 9000}
    procs = (_start_cluster(hosts, work, "plain", plain_ports, None)
             + _start_cluster(hosts, work, "secure", secure_ports, secure))
    client = NsClient(hosts, hosts.b)
    urls = {"plain": f"http://{hosts.ip_b}:{plain_ports['proxy']}",
            "TLS+CURVE+secret": f"https://{hosts.ip_b}:{secure_ports['proxy']}"}
    try:
        client.wait_ok([f"{urls['plain']}/health"], timeout=600)
        client.wait_ok([f"{urls['TLS+CURVE+secret']}/health"], timeout=600, ca=tls.ca_file)
        # A few rounds first: connections, first compiles of the request path.
        run = [PY, "-c", _TTFT_CLIENT, json.dumps(urls), str(tls.ca_file)]
        warm = subprocess.run(hosts.exec(hosts.b, [*run, "4", str(max_tokens)]),
                              capture_output=True, text=True, timeout=600)
        if warm.returncode != 0:
            raise RuntimeError(f"TTFT client failed: {warm.stderr[-2000:]}")
        done = subprocess.run(hosts.exec(hosts.b, [*run, str(requests), str(max_tokens)]),
                              check=True, capture_output=True, text=True, timeout=1200)
        ttft = json.loads(done.stdout)
        print(f"\nTTFT through the proxy, 1P1D tiny model, P on {hosts.ip_a}, D + proxy + client "
              f"on {hosts.ip_b}, {requests} streamed requests each, alternating")
        print(f"{'cluster':<18} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}")
        for name, xs in ttft.items():
            xs = sorted(xs)
            print(f"{name:<18} {1e3 * statistics.median(xs):>8.1f} "
                  f"{1e3 * xs[int(0.9 * (len(xs) - 1))]:>8.1f} {1e3 * statistics.fmean(xs):>8.1f}")
        base, sec = (statistics.median(v) for v in ttft.values())
        print(f"overhead of TLS+CURVE+secret at p50: {1e3 * (sec - base):+.1f} ms "
              f"({sec / base:.2f}x)")
    finally:
        client.close()
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


# ----------------------------------------------------------------------------------- launch


def _time_to_ready(argv: list[str], timeout: float = 600) -> float:
    t = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if line.startswith("pd-fsm cluster: ready"):
                return time.monotonic() - t
            if time.monotonic() - t > timeout:
                break
        raise RuntimeError(f"no ready line from {argv[:6]}")
    finally:
        proc.send_signal(2)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def part_launch(hosts: Any, reps: int) -> None:
    ray = str(Path(PY).with_name("ray"))
    common = ["--num-cpus", "1", "--object-store-memory", "100000000", "--disable-usage-stats"]
    temps = [f"/tmp/ray-bench-{side}" for side in "ab"]
    t = time.monotonic()
    subprocess.run(hosts.exec(hosts.a, [ray, "start", "--head", "--node-ip-address", hosts.ip_a,
                                        "--port", "6379", "--include-dashboard=false",
                                        "--temp-dir", temps[0], *common]),
                   check=True, capture_output=True, timeout=120)
    head = time.monotonic() - t
    t = time.monotonic()
    subprocess.run(hosts.exec(hosts.b, [ray, "start", "--address", f"{hosts.ip_a}:6379",
                                        "--node-ip-address", hosts.ip_b, "--temp-dir", temps[1],
                                        "--resources", '{"hostB": 1}', *common]),
                   check=True, capture_output=True, timeout=120)
    worker = time.monotonic() - t
    cluster = [PY, "-m", "pd_fsm.cli", "cluster", "--model", "tiny"]
    results: dict[str, list[float]] = {"local runner (one host)": [],
                                       "--ray (P on A, D on B)": []}
    try:
        for _ in range(reps):
            results["local runner (one host)"].append(_time_to_ready(cluster))
            results["--ray (P on A, D on B)"].append(_time_to_ready(hosts.exec(hosts.a, [
                *cluster, "--ray", f"{hosts.ip_a}:6379", "--prefill-nodes", hosts.ip_a,
                "--decode-nodes", "resource:hostB"])))
    finally:
        for tmp in temps:
            subprocess.run(["rm", "-rf", tmp], check=False)
    print(f"\nLaunch to ready, tiny model, 1P1D + proxy ({reps} runs each, executables cached); "
          f"`ray start --head` took {head:.1f} s, `ray start --address` {worker:.1f} s")
    print(f"{'launcher':<26} {'median s':>9} {'runs':>20}")
    for name, xs in results.items():
        print(f"{name:<26} {statistics.median(xs):>9.1f} "
              f"{' '.join(f'{x:.1f}' for x in xs):>20}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("transfer", "ttft", "launch", "all"), default="all")
    ap.add_argument("--sizes", default="16,64,256", help="MiB per pull (transfer)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions (transfer, launch)")
    ap.add_argument("--requests", type=int, default=40, help="per cluster (ttft)")
    ap.add_argument("--max-tokens", type=int, default=4, help="(ttft)")
    ap.add_argument("--peer", choices=("p", "d"), help=argparse.SUPPRESS)
    ap.add_argument("--host", help=argparse.SUPPRESS)
    ap.add_argument("--p-host", help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--raw-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.peer == "p":
        return _peer_p(args.host, sizes)
    if args.peer == "d":
        return _peer_d(args.host, args.p_host, args.engine, args.raw_port)
    import tempfile

    from tests.integration.netns_support import Hosts, namespaces_unavailable

    why = namespaces_unavailable()
    if why is not None:
        raise SystemExit(f"needs network namespaces: {why}")
    for part in (["transfer", "ttft", "launch"] if args.part == "all" else [args.part]):
        hosts = Hosts.make()
        try:
            with tempfile.TemporaryDirectory() as work:
                if part == "transfer":
                    part_transfer(hosts, sizes, args.reps)
                elif part == "ttft":
                    part_ttft(hosts, Path(work), args.requests, args.max_tokens)
                else:
                    part_launch(hosts, min(args.reps, 3))
        finally:
            hosts.remove()
    return None


if __name__ == "__main__":
    main()
