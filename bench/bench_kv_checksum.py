"""What ``--disaggregation-kv-checksum`` costs (issue 31 §3): the checksum of a room's KV on P (of
the array it registers) and on D (of the array it pulled), against the pull of the same bytes,
at 1, 4, 16 and 64 MiB, in one run. The issue's goal: both checksums within 5 % of the pull at
16 MiB. Prints a table; asserts nothing.

    .venv/bin/python bench/bench_kv_checksum.py [--reps 9] [--sizes 1 4 16 64]

A P and a D process (spawned; host heap on huge pages, as ``pd-fsm serve`` starts a worker), each
with a ``JaxTransferKVEngine``. For each size and repetition: P makes a fresh float32 array (a
gather's output stands in: just written, so as warm in the caches as one), times its checksum
(``pd_fsm.jax_engine.kv.checksum``, the code P runs) and registers it; D times the pull (request
to every byte ready) and then the checksum of what it pulled (the code D's pull thread runs).
D also times XLA:CPU's jitted form of the same checksum (what an accelerator would run; on bytes
the numpy form has just read, so a lower bound), to show why the CPU path is numpy; and a plain
sum of the words of a second pull of the same array (P registers it twice, as it does for the
re-pull), as cold in the caches as the first, to show what the per-row weights (which catch
misplaced chunks) cost on top. Medians; the ratios are of medians measured side by side.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
ROW = 4096  # float32 words per row of the benchmark's arrays (their shape does not matter)
SECOND = 1 << 40  # uuid offset of the second registration of each array


def _shape(mib: int) -> tuple[int, int]:
    return (mib * MIB // 4 // ROW, ROW)


def _p_main(pipe: Connection) -> None:
    import jax
    import jax.numpy as jnp

    from pd_fsm.jax_engine.kv.checksum import kv_checksum
    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    fresh = jax.jit(lambda key, shape: jax.random.uniform(key, shape, jnp.float32),
                    static_argnums=1)

    def register(uuid: int, mib: int) -> tuple[float, int]:
        array = fresh(jax.random.key(uuid), _shape(mib))
        array.block_until_ready()  # the gather is done: only the checksum is timed
        t = time.perf_counter()
        checksum = kv_checksum(array)
        took = time.perf_counter() - t
        engine.register(uuid, [array], lease_s=600)
        engine.register(uuid + SECOND, [array], lease_s=600)
        return took, checksum

    _serve(pipe, engine.address, register)
    engine.close()


def _d_main(pipe: Connection, p_addr: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pd_fsm.jax_engine.kv.checksum import kv_checksum
    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def pull(uuid: int, mib: int) -> tuple[float, float, float, float, int]:
        spec = jax.ShapeDtypeStruct(_shape(mib), jnp.float32, sharding=sharding)
        t = time.perf_counter()
        pending = engine.start_pull(p_addr, uuid, [spec], deadline_s=120)
        pending.wait()
        pulled = time.perf_counter()
        (array,) = pending.arrays
        checksum = kv_checksum(array)
        verified = time.perf_counter()
        on_device = kv_checksum(array, on_device=True)
        xla = time.perf_counter() - verified
        assert on_device == checksum, "the two forms of the checksum disagree"
        again = engine.start_pull(p_addr, uuid + SECOND, [spec], deadline_s=120)
        again.wait()
        summed = time.perf_counter()
        np.add.reduce(np.asarray(again.arrays[0]).reshape(-1).view(np.uint32), dtype=np.uint32)
        plain = time.perf_counter() - summed
        return pulled - t, verified - pulled, xla, plain, checksum

    _serve(pipe, "ready", pull)
    engine.close()


def _serve(pipe: Connection, hello: str, answer: Callable[[int, int], object]) -> None:
    """A P or D process's loop: say ``hello``, then answer (uuid, MiB) requests until "quit"."""
    pipe.send(hello)
    while (msg := pipe.recv())[0] != "quit":
        _, uuid, mib = msg
        pipe.send(answer(uuid, mib))


def _spawn(target: object, *args: object) -> tuple[Connection, mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    return here, proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], metavar="MIB")
    ap.add_argument("--reps", type=int, default=9, help="per size, after one warm-up (9)")
    args = ap.parse_args()

    from pd_fsm.jax_engine.kv.host_memory import hugepage_env

    saved = dict(os.environ)
    os.environ.update(hugepage_env(os.environ) or {})  # as pd-fsm serve starts its workers
    try:
        p, p_proc = _spawn(_p_main)
        if not p.poll(180):
            raise SystemExit("P did not start")
        p_addr = p.recv()
        d, d_proc = _spawn(_d_main, p_addr)
        if not d.poll(180) or d.recv() != "ready":
            raise SystemExit("D did not start")
    finally:
        os.environ.clear()
        os.environ.update(saved)

    rows: dict[int, dict[str, list[float]]] = {m: {} for m in args.sizes}
    uuid = 0
    for rep in range(args.reps + 1):  # sizes interleaved, so that machine noise hits all alike
        for mib in args.sizes:
            uuid += 1
            p.send(("register", uuid, mib))
            p_s, p_sum = p.recv()
            d.send(("pull", uuid, mib))
            pull_s, d_s, xla_s, plain_s, d_sum = d.recv()
            if p_sum != d_sum:
                raise SystemExit(f"{mib} MiB: P's checksum {p_sum:#x}, D's {d_sum:#x}")
            if rep == 0:
                continue  # warm-up: connections, compiles, first touches of the heap
            for key, value in (("pull", pull_s), ("p", p_s), ("d", d_s), ("xla", xla_s),
                               ("plain", plain_s)):
                rows[mib].setdefault(key, []).append(value)
    for pipe, proc in ((p, p_proc), (d, d_proc)):
        pipe.send(("quit",))
        proc.join(10)

    import jax

    print(f"# bench_kv_checksum; jax {jax.__version__}, {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; medians of "
          f"{args.reps} after a warm-up")
    print()
    print("| size | pull ms (GB/s) | P checksum ms | D checksum ms | P + D, % of pull | "
          "XLA:CPU form ms (D) | plain word sum ms (D) |")
    print("|---|---|---|---|---|---|---|")
    for mib in args.sizes:
        med = {k: statistics.median(v) for k, v in rows[mib].items()}
        share = 100 * (med["p"] + med["d"]) / med["pull"]
        print(f"| {mib} MiB | {med['pull'] * 1e3:.2f} ({mib * MIB / med['pull'] / 1e9:.2f}) | "
              f"{med['p'] * 1e3:.3f} ({100 * med['p'] / med['pull']:.1f} %) | "
              f"{med['d'] * 1e3:.3f} ({100 * med['d'] / med['pull']:.1f} %) | {share:.1f} % | "
              f"{med['xla'] * 1e3:.2f} | {med['plain'] * 1e3:.3f} |")


if __name__ == "__main__":
    main()
