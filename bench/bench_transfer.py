"""Data-plane benchmark: gather/scatter vs numpy copies, and P->D transfer throughput of our engine
vs ``jax.experimental.transfer`` with its defaults vs a raw loopback socket. Prints a table;
asserts nothing.

    .venv/bin/python bench/bench_transfer.py            # 1, 16, 64, 256 MiB
    .venv/bin/python bench/bench_transfer.py --quick    # small sizes, few repetitions

Transfers run between pairs of processes (multiprocessing, spawn), each set up the way it is used:

* ``engine``: a P and a D process configured as ``pd-fsm serve`` configures a worker (host heap
  policy ``hugepages``: started with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
  pd_fsm.jax_engine.kv.host_memory), each with a ``JaxTransferKVEngine``. The same two processes
  also host a transfer server with the library's default settings, so that ``default, huge pages``
  shows what the heap policy alone gives the library.
* ``library default``: a P and a D process left as a user of the library gets them (glibc's default
  heap, ``start_transfer_server`` with default settings), plus a raw TCP server/client pair.

The coordinator (this process) times nothing itself: for each size and repetition it asks each P to
register, then the matching D to pull and report the time from request to every byte ready on D.
Methods are interleaved repetition by repetition so that machine noise hits them alike; the median
is reported.
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plots  # bench/, beside this script

MIB = 1 << 20


# --------------------------------------------------------------------------- P and D processes


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


def _check_heap(hugepages: bool) -> None:
    from pd_fsm.jax_engine.kv.host_memory import hugepages_in_force

    if hugepages_in_force() != hugepages:
        raise SystemExit(f"process heap is not as configured (huge pages wanted: {hugepages})")


def _p_main(pipe: Connection, hugepages: bool, sizes_mib: list[int]) -> None:
    """P: registers a prepared array of the asked size with the asked server."""
    _check_heap(hugepages)
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    servers: dict[str, Any] = {
        "default": transfer.start_transfer_server(
            jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
        )
    }
    addresses = {"default": servers["default"].address()}
    if hugepages:  # the engine pair
        engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
        addresses["engine"] = engine.address
    else:  # the library-default pair also serves the raw socket
        raw = socket.create_server(("127.0.0.1", 0))
        threading.Thread(
            target=_raw_server, args=(raw, os.urandom(max(sizes_mib) * MIB)), daemon=True
        ).start()
        addresses["raw"] = str(raw.getsockname()[1])
    arrays = {
        m: jax.jit(lambda n=m * MIB // 4: jnp.arange(n, dtype=jnp.float32))() for m in sizes_mib
    }
    jax.block_until_ready(list(arrays.values()))
    pipe.send(addresses)
    while True:
        msg = pipe.recv()
        if msg[0] == "quit":
            return
        _, which, uuid, mib = msg
        if which == "engine":
            engine.register(uuid, [arrays[mib]], lease_s=600)
        else:
            servers[which].await_pull(uuid, [arrays[mib]])
        pipe.send("ok")


def _d_main(pipe: Connection, hugepages: bool, addresses: dict[str, str]) -> None:
    """D: pulls (or reads the raw socket) when told and reports seconds to every byte ready."""
    _check_heap(hugepages)
    import jax
    import jax.numpy as jnp
    from jax.experimental import transfer

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    default = transfer.start_transfer_server(
        jax.devices()[0].client, "127.0.0.1:0", ["127.0.0.1:0"]
    )
    default_conn = default.connect(addresses["default"])
    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None) if hugepages else None
    raw: socket.socket | None = None
    if "raw" in addresses:
        raw = socket.create_connection(("127.0.0.1", int(addresses["raw"])))
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()

    def spec(mib: int) -> Any:
        return jax.ShapeDtypeStruct((mib * MIB // 4,), jnp.float32, sharding=sharding)

    pipe.send("ready")
    while True:
        msg = pipe.recv()
        if msg[0] == "quit":
            return
        _, which, uuid, mib = msg
        t = time.perf_counter()
        if which == "engine":
            assert engine is not None
            engine.start_pull(addresses["engine"], uuid, [spec(mib)], deadline_s=120).wait()
        elif which == "default":
            (x,) = default_conn.pull(uuid, [spec(mib)])
            x.block_until_ready()
        else:
            assert raw is not None
            n = mib * MIB
            if len(buf) < n:
                buf = bytearray(n)
            view = memoryview(buf)[:n]
            raw.sendall(struct.pack("!Q", n))
            got = 0
            while got < n:
                got += raw.recv_into(view[got:])
        pipe.send(time.perf_counter() - t)


class _Pair:
    """A P and a D process, both with or without huge pages for the host heap."""

    def __init__(self, hugepages: bool, sizes_mib: list[int]) -> None:
        from pd_fsm.jax_engine.kv.host_memory import hugepage_env

        # Spawned children start from this environment; glibc reads GLIBC_TUNABLES at start-up.
        saved = dict(os.environ)
        os.environ.pop("GLIBC_TUNABLES", None)
        if hugepages:
            os.environ.update(hugepage_env(os.environ) or {})
        try:
            self._start(hugepages, sizes_mib)
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def _start(self, hugepages: bool, sizes_mib: list[int]) -> None:
        ctx = mp.get_context("spawn")
        self.p, p_end = ctx.Pipe()
        self.d, d_end = ctx.Pipe()
        self.procs = [ctx.Process(target=_p_main, args=(p_end, hugepages, sizes_mib),
                                  daemon=True)]
        self.procs[0].start()
        if not self.p.poll(180):
            raise SystemExit("P process did not start")
        addresses = self.p.recv()
        self.procs.append(ctx.Process(target=_d_main, args=(d_end, hugepages, addresses),
                                      daemon=True))
        self.procs[1].start()
        if not self.d.poll(180) or self.d.recv() != "ready":
            raise SystemExit("D process did not start")
        self._uuid = 1

    def run(self, which: str, mib: int) -> float:
        self._uuid += 1
        if which != "raw":
            self.p.send(("register", which, self._uuid, mib))
            if not self.p.poll(60) or self.p.recv() != "ok":
                raise SystemExit("P did not register")
        self.d.send(("pull", which, self._uuid, mib))
        if not self.d.poll(180):
            raise SystemExit(f"D did not finish a {which} pull of {mib} MiB")
        return float(self.d.recv())

    def close(self) -> None:
        for pipe in (self.p, self.d):
            pipe.send(("quit",))
        for proc in self.procs:
            proc.join(10)


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

    from pd_fsm.jax_engine.kv.gather_scatter import insert_kv_chunks, select_from_kv_caches

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
    sizes = [1, 4, 16] if quick else [1, 16, 64, 256]

    def reps(mib: int) -> int:
        # Small pulls take a millisecond and scatter widely on a shared machine: take more.
        return 3 if quick else (25 if mib < 64 else 9)

    tuned, plain = _Pair(True, sizes), _Pair(False, sizes)
    # (column, pair, what that pair's processes run)
    methods = [
        ("engine", tuned, "engine"),
        ("library default", plain, "default"),
        ("default, huge pages", tuned, "default"),
        ("raw socket", plain, "raw"),
    ]
    results: dict[tuple[str, int], float] = {}
    try:
        for mib in sizes:
            for _, pair, which in methods:
                pair.run(which, mib)  # warm up: compile, connect
            times: dict[str, list[float]] = {name: [] for name, _, _ in methods}
            for _ in range(reps(mib)):
                for name, pair, which in methods:
                    times[name].append(pair.run(which, mib))
            for name in times:
                results[(name, mib)] = statistics.median(times[name])
    finally:
        tuned.close()
        plain.close()

    counts = ", ".join(f"{reps(m)} at {m} MiB" for m in sizes)
    print(f"\n## P -> D transfer, two processes on 127.0.0.1 (GB/s, medians of {counts})\n")
    print("| size | engine | library default | default, huge pages | raw socket "
          "| engine / default | engine / default, huge pages | engine / raw |")
    print("|---|---|---|---|---|---|---|---|")
    for mib in sizes:
        g = {name: mib * MIB / results[(name, mib)] / 1e9 for name, _, _ in methods}
        print(f"| {mib} MiB | {g['engine']:.2f} | {g['library default']:.2f} | "
              f"{g['default, huge pages']:.2f} | {g['raw socket']:.2f} | "
              f"{g['engine'] / g['library default']:.2f}x | "
              f"{g['engine'] / g['default, huge pages']:.2f}x | "
              f"{g['engine'] / g['raw socket']:.2f}x |")
    plots.rate_vs_size(
        "transfer_rate_vs_size", "P → D KV transfer, two processes on 127.0.0.1",
        sizes, {name: [mib * MIB / results[(name, mib)] / 1e9 for mib in sizes]
                for name, _, _ in methods}, reference="raw socket")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument(
        "--host-heap", choices=("hugepages", "default"), default="hugepages",
        help="heap policy of this process for the gather/scatter part (workers use hugepages)",
    )
    args = parser.parse_args()
    if args.host_heap == "hugepages":
        from pd_fsm.jax_engine.kv.host_memory import reexec_with_hugepages

        reexec_with_hugepages()
    import jax

    print(f"# bench_transfer ({'quick' if args.quick else 'full'}); jax {jax.__version__}, "
          f"{jax.default_backend()}, {os.cpu_count()} CPUs; gather/scatter with host heap "
          f"{args.host_heap}")
    bench_gather_scatter(args.quick)
    bench_transfer(args.quick)


if __name__ == "__main__":
    main()
