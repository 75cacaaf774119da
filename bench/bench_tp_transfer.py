"""KV transfer between tensor-parallel instances: pull throughput for P tp -> D tp pairs against
tp 1 -> 1, for the same total bytes, in one run. Prints a table; asserts nothing.

    .venv/bin/python bench/bench_tp_transfer.py              # 16 and 64 MiB rooms, 7 rounds
    .venv/bin/python bench/bench_tp_transfer.py --quick      # 4 MiB, 3 rounds

One process per P tp size (1, 2, 4) and per D tp size (1, 2), each with the devices its tp needs
(``XLA_FLAGS=--xla_force_host_platform_device_count``) and a ``JaxTransferKVEngine`` as a worker
has one. Per round and pair, P gathers a room from its sharded pool and registers it as it does
when serving (one array per kv-head shard); D pulls the shards onto its devices and regroups
them (``tensor_parallel``), and reports the time from the pull request to the regrouped array
ready, and to the shards ready (the transfer alone). Pairs are interleaved round by round so that
machine noise hits them alike; medians are reported.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plots  # bench/, beside this script

MIB = 1 << 20
# A page of every layer: 8 layers x 16 tokens x 4 kv-heads (K and V) x 64 dims x f32 = 256 KiB.
LAYERS, PAGE_SIZE, KV_HEADS, HEAD_DIM = 8, 16, 4, 64
PAGE_BYTES = LAYERS * PAGE_SIZE * 2 * KV_HEADS * HEAD_DIM * 4
PAIRS = [(1, 1), (2, 2), (2, 1), (1, 2), (4, 2)]


def _child(role: str, tp: int, pages: int, conn: Connection) -> None:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(tp, 1)}"
    import jax
    import numpy as np

    from pd_fsm.jax_engine.kv import tiered
    from pd_fsm.jax_engine.kv.pool import KVPoolConfig, allocate_kv_pool
    from pd_fsm.jax_engine.parallel.tensor_parallel import (
        packed_sharding,
        pool_sharding,
        regroup,
        shard_structs,
        split_shards,
    )
    from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine

    cfg = KVPoolConfig(num_layers=LAYERS, num_pages=pages + 1, page_size=PAGE_SIZE,
                       num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    engine = JaxTransferKVEngine(reaper_interval_s=None)
    pool = allocate_kv_pool(cfg, pool_sharding(tp))
    if role == "p":
        rng = np.random.default_rng(tp)
        pool = [jax.device_put(rng.standard_normal(cfg.layer_shape).astype(np.float32),
                               pool_sharding(tp)) for _ in range(LAYERS)]
    target = packed_sharding(pool[0].sharding)
    conn.send(engine.address)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        if msg[0] == "register":
            _, uuid, n = msg
            packed = tiered.gather(pool, list(range(1, n + 1)))
            arrays = split_shards(packed, tp)
            jax.block_until_ready(arrays)
            engine.register(uuid, arrays, lease_s=120)
            conn.send(("shape", packed.shape))
        elif msg[0] == "pull":
            _, addr, uuid, shape, p_shards = msg
            structs = shard_structs(shape, np.dtype("float32"), p_shards, target)
            start = time.perf_counter()
            pending = engine.start_pull(addr, uuid, structs, 60)
            pending.wait()
            pulled = time.perf_counter()
            jax.block_until_ready(regroup(pending.arrays, target))
            conn.send((pulled - start, time.perf_counter() - start))
        elif msg[0] == "release":
            engine.release(msg[1], "bench")
            conn.send("ok")
    engine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    args = ap.parse_args(argv)
    sizes_mib = [4] if args.quick else [16, 64]
    rounds = args.rounds or (3 if args.quick else 7)
    pages = max(sizes_mib) * MIB // PAGE_BYTES
    ctx = mp.get_context("spawn")
    procs: dict[tuple[str, int], tuple[Any, Connection]] = {}
    for role, tp in [("p", 1), ("p", 2), ("p", 4), ("d", 1), ("d", 2)]:
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=_child, args=(role, tp, pages, theirs), daemon=True)
        proc.start()
        procs[(role, tp)] = (proc, mine)
    addrs = {key: conn.recv() for key, (_, conn) in procs.items()}
    times: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
    uuid = 1000
    for r in range(rounds + 1):  # round 0 warms every pair up (compiles, connections)
        for mib in sizes_mib:
            n = mib * MIB // PAGE_BYTES
            for p, d in PAIRS[r % len(PAIRS):] + PAIRS[: r % len(PAIRS)]:
                uuid += 1
                p_conn, d_conn = procs[("p", p)][1], procs[("d", d)][1]
                p_conn.send(("register", uuid, n))
                _, shape = p_conn.recv()
                d_conn.send(("pull", addrs[("p", p)], uuid, shape, p))
                got = d_conn.recv()
                p_conn.send(("release", uuid))
                p_conn.recv()
                if r:
                    times.setdefault((mib, p, d), []).append(got)
    # D first: a D that outlives its peers' transfer servers by a moment may abort at exit
    # ("terminate called after throwing"), its connections torn down under it.
    for role in ("d", "p"):
        for (r, _), (proc, conn) in procs.items():
            if r == role:
                conn.send(None)
                proc.join(30)
    print(f"# KV pull between tp sizes: {rounds} rounds, medians; page = {PAGE_BYTES >> 10} KiB "
          f"({LAYERS} layers, {KV_HEADS} kv-heads x {HEAD_DIM} f32, page size {PAGE_SIZE})")
    print("| room | P tp -> D tp | shards pulled | pull ms | GB/s | + regroup ms | GB/s "
          "| vs 1 -> 1 |")
    print("|---|---|---|---|---|---|---|---|")
    curves: dict[str, list[float]] = {f"{p} -> {d}": [] for p, d in PAIRS}
    for mib in sizes_mib:
        base = statistics.median(t for _, t in times[(mib, 1, 1)])
        for p, d in PAIRS:
            pulls = [a for a, _ in times[(mib, p, d)]]
            totals = [b for _, b in times[(mib, p, d)]]
            pull, total = statistics.median(pulls), statistics.median(totals)
            gb = mib * MIB / 1e9
            print(f"| {mib} MiB | {p} -> {d} | {p} | {pull * 1e3:.1f} | {gb / pull:.2f} "
                  f"| {total * 1e3:.1f} | {gb / total:.2f} | {base / total:.2f}x |")
            curves[f"{p} -> {d}"].append(gb / total)
    plots.rate_vs_size("tp_transfer", "KV pull + regroup between tp sizes (P tp -> D tp)",
                       sizes_mib, curves, reference="1 -> 1")


if __name__ == "__main__":
    main()
