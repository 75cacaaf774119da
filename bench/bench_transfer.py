"""Data-plane benchmark: gather/scatter vs numpy copies, and P->D transfer throughput of our engine
vs ``jax.experimental.transfer`` with its defaults vs a raw loopback socket. Prints a table;
asserts nothing.

    .venv/bin/python bench/bench_transfer.py            # 1, 16, 64, 256 MiB
    .venv/bin/python bench/bench_transfer.py --quick    # small sizes, few repetitions

P is a second process (multiprocessing, spawn) hosting three servers: a ``JaxTransferKVEngine``, a
transfer server started with the library's default settings, and a raw TCP server. D (this
process) times, for each size, request -> every byte ready on D, interleaving the three methods
repetition by repetition so that machine noise hits them alike; the median is reported.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import struct
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20


# --------------------------------------------------------------------------- P process


def _raw_server(sock: socket.socket, payload: bytes) -> None:
    while True:
        conn, _ = sock.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while True:
                head = conn.recv(8)
                if len(head) < 8:
                    break
                (n,) = struct.unpack("!Q", head)
                conn.sendall(memoryview(payload)[:n])


def _p_main(pipe: Connection, sizes_mib: list[int]) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    default = transfer.start_transfer_server(
        jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
    )
    raw = socket.create_server(("127.0.0.1", 0))
    threading.Thread(
        target=_raw_server, args=(raw, os.urandom(max(sizes_mib) * MIB)), daemon=True
    ).start()
    arrays = {
        m: jax.jit(lambda n=m * MIB // 4: jnp.arange(n, dtype=jnp.float32))() for m in sizes_mib
    }
    jax.block_until_ready(list(arrays.values()))
    pipe.send((engine.address, default.address(), raw.getsockname()[1]))
    while True:
        msg = pipe.recv()
        if msg[0] == "quit":
            return
        _, which, uuid, mib = msg
        if which == "engine":
            engine.register(uuid, [arrays[mib]], lease_s=600)
        else:
            default.await_pull(uuid, [arrays[mib]])
        pipe.send("ok")


# --------------------------------------------------------------------------- measurements


def _median_s(fn: Callable[[], None], reps: int) -> float:
    fn()  # warm up: compile, connect
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_gather_scatter(quick: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pd_fsm.jax_engine.gather_scatter import insert_kv_chunks, select_from_kv_caches

    layers, num_pages, page = (4, 256, (16, 8, 128)) if quick else (8, 1024, (16, 8, 128))
    n = 48 if quick else 200
    rng = np.random.default_rng(0)
    pool_np = [rng.standard_normal((num_pages, *page)).astype(np.float32) for _ in range(layers)]
    pool = [jnp.asarray(a) for a in pool_np]

    def fragmented() -> list[int]:
        # runs of 1..8 consecutive pages at random places: what a LIFO allocator leaves behind
        out: list[int] = []
        free = set(range(1, num_pages))
        while len(out) < n:
            start = int(rng.integers(1, num_pages))
            for p in range(start, min(start + int(rng.integers(1, 9)), num_pages)):
                if p in free and len(out) < n:
                    free.discard(p)
                    out.append(p)
        return out

    src_pages, dst_pages = fragmented(), fragmented()
    nbytes = n * layers * int(np.prod(page)) * 4
    packed = select_from_kv_caches(pool, src_pages)
    state = {"pool": pool}

    def gather() -> None:
        select_from_kv_caches(state["pool"], src_pages).block_until_ready()

    def scatter() -> None:
        state["pool"] = insert_kv_chunks(state["pool"], packed, dst_pages)
        jax.block_until_ready(state["pool"])

    out = np.empty((layers, n, *page), np.float32)

    def np_take() -> None:
        for layer in range(layers):
            np.take(pool_np[layer], src_pages, axis=0, out=out[layer])

    def np_take_fresh() -> None:
        # what the gather has to do: its output is new memory (held until D pulls it)
        fresh = np.empty((layers, n, *page), np.float32)
        for layer in range(layers):
            np.take(pool_np[layer], src_pages, axis=0, out=fresh[layer])

    flat_src = np.concatenate([a[:n].ravel() for a in pool_np])
    flat_dst = np.empty_like(flat_src)

    def np_memcpy() -> None:
        np.copyto(flat_dst, flat_src)

    reps = 5 if quick else 10
    rows = [(name, _median_s(fn, reps)) for name, fn in
            [("gather (jit, runs)", gather), ("scatter XLA (jit, runs, donated)", scatter),
             ("numpy take (same pages, preallocated out)", np_take),
             ("numpy take (same pages, fresh out)", np_take_fresh),
             ("numpy memcpy (contiguous)", np_memcpy)]]
    memcpy_gbs = nbytes / rows[-1][1] / 1e9
    print(f"\n## gather / scatter: {layers} layers x {n} fragmented pages of "
          f"{int(np.prod(page)) * 4 // 1024} KiB = {nbytes / MIB:.0f} MiB\n")
    print("| op | ms | GB/s | vs numpy memcpy |\n|---|---|---|---|")
    for name, s in rows:
        gbs = nbytes / s / 1e9
        print(f"| {name} | {s * 1e3:.2f} | {gbs:.2f} | {gbs / memcpy_gbs:.2f}x |")


def bench_transfer(quick: bool) -> None:
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    sizes = [1, 4, 16] if quick else [1, 16, 64, 256]
    reps = 3 if quick else 7
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_p_main, args=(theirs, sizes), daemon=True)
    proc.start()
    if not ours.poll(120):
        raise SystemExit("P process did not start")
    engine_addr, default_addr, raw_port = ours.recv()

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    default = transfer.start_transfer_server(
        jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
    )
    default_conn = default.connect(default_addr)
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    uuid = [1]

    def register(which: str, mib: int) -> int:
        uuid[0] += 1
        ours.send(("register", which, uuid[0], mib))
        if not ours.poll(60) or ours.recv() != "ok":
            raise SystemExit("P did not register")
        return uuid[0]

    def spec(mib: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((mib * MIB // 4,), jnp.float32, sharding=sharding)

    def run_engine(mib: int) -> float:
        u = register("engine", mib)
        t = time.perf_counter()
        engine.start_pull(engine_addr, u, [spec(mib)], deadline_s=120).wait()
        return time.perf_counter() - t

    def run_default(mib: int) -> float:
        u = register("default", mib)
        t = time.perf_counter()
        (x,) = default_conn.pull(u, [spec(mib)])
        x.block_until_ready()
        return time.perf_counter() - t

    buf = bytearray(max(sizes) * MIB)

    def run_raw(mib: int) -> float:
        n = mib * MIB
        view = memoryview(buf)[:n]
        t = time.perf_counter()
        raw.sendall(struct.pack("!Q", n))
        got = 0
        while got < n:
            got += raw.recv_into(view[got:])
        return time.perf_counter() - t

    methods = {"engine": run_engine, "library default": run_default, "raw socket": run_raw}
    results: dict[tuple[str, int], float] = {}
    for mib in sizes:
        for fn in methods.values():
            fn(mib)  # warm up
        times: dict[str, list[float]] = {k: [] for k in methods}
        for _ in range(reps):
            for name, fn in methods.items():
                times[name].append(fn(mib))
        for name in methods:
            results[(name, mib)] = statistics.median(times[name])
    ours.send(("quit",))
    proc.join(10)

    print(f"\n## P -> D transfer, two processes on 127.0.0.1 (median of {reps}, GB/s)\n")
    print("| size | engine (4 MiB transfer_size) | library default | raw socket "
          "| engine / default | engine / raw |\n|---|---|---|---|---|---|")
    for mib in sizes:
        g = {k: mib * MIB / results[(k, mib)] / 1e9 for k in methods}
        print(f"| {mib} MiB | {g['engine']:.2f} | {g['library default']:.2f} | "
              f"{g['raw socket']:.2f} | {g['engine'] / g['library default']:.2f}x | "
              f"{g['engine'] / g['raw socket']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    args = parser.parse_args()
    import jax

    print(f"# bench_transfer ({'quick' if args.quick else 'full'}); jax {jax.__version__}, "
          f"{jax.default_backend()}, {os.cpu_count()} CPUs")
    bench_gather_scatter(args.quick)
    bench_transfer(args.quick)


if __name__ == "__main__":
    main()
