"""Why batch-1 decode is slower than llama.cpp here (issue 13 §6): the memory bandwidth XLA:CPU
reaches on matrix-vector products, the operation batch-1 decode is made of.

Batch-1 decode reads every weight once per token (SmolLM2-135M in F32: 538 MB), so its speed is
the bandwidth its matrix-vector products reach. Measured in one run, weights never reused within
a pass (more bytes than the caches hold), min over the repeats:

    chain, one program       GEMVs that depend on each other, one jitted program (decode's shape)
    independent, one program the same GEMVs without dependencies (XLA may run two at once)
    chain, split columns     each weight stored as two column halves, two dots per step
    chain, one call each     one jitted call per GEMV (dispatch cost included)
    SmolLM2 decode forward   our forward, batch 1, bytes of weights read per token / step time

llama.cpp's figure for comparison comes from bench/RESULTS_llamacpp.md (538 MB / its ms/token).

    .venv/bin/python bench/bench_gemv.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

HIDDEN = 576  # SmolLM2-135M


def _gbps(fn: Callable[[], Any], nbytes: int, repeats: int) -> float:
    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def gemv_rows(repeats: int) -> list[tuple[str, float]]:
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(rng.normal(size=(HIDDEN, HIDDEN)), jnp.float32) for _ in range(250)]
    nbytes = sum(w.nbytes for w in weights)  # 332 MB
    x = jnp.ones((1, HIDDEN), jnp.float32)

    def chain(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    def independent(x: jax.Array, ws: list[jax.Array]) -> jax.Array:
        return sum((x @ w).sum() for w in ws)  # type: ignore[return-value]

    half = HIDDEN // 2
    halves = [(w[:, :half], w[:, half:]) for w in weights]
    halves = [(jnp.asarray(a), jnp.asarray(b)) for a, b in halves]

    def chain_split(x: jax.Array, hs: list[tuple[jax.Array, jax.Array]]) -> jax.Array:
        for a, b in hs:
            x = jnp.tanh(jnp.concatenate([x @ a, x @ b], axis=1))
        return x

    one = jax.jit(lambda x, w: jnp.tanh(x @ w))

    def calls() -> jax.Array:
        y = x
        for w in weights:
            y = one(y, w)
        return y

    chain_j, indep_j, split_j = jax.jit(chain), jax.jit(independent), jax.jit(chain_split)
    return [
        ("chain, one program", _gbps(lambda: chain_j(x, weights), nbytes, repeats)),
        ("independent, one program", _gbps(lambda: indep_j(x, weights), nbytes, repeats)),
        ("chain, split columns", _gbps(lambda: split_j(x, halves), nbytes, repeats)),
        ("chain, one call each", _gbps(calls, nbytes, repeats)),
    ]


def decode_row(repeats: int) -> tuple[str, float, float]:
    from pd_fsm.jax_engine.kv.pool import allocate_kv_pool
    from pd_fsm.jax_engine.model import forward
    from pd_fsm.jax_engine.model.registry import load_model

    model = load_model("smollm2", "float32", 0)
    config, params = model.config, model.params
    kv = allocate_kv_pool(config.kv_pool_config(64, 16))
    tokens = jnp.ones((1,), jnp.int32)
    positions, lengths = jnp.array([60], jnp.int32), jnp.array([61], jnp.int32)
    table = jnp.arange(1, 33, dtype=jnp.int32)[None, :]  # a 512-token context, as the llama bench
    weights = sum(a.nbytes for a in jax.tree.leaves(params))

    def step() -> jax.Array:
        nonlocal kv
        logits, kv = forward.decode(params, kv, tokens, positions, table, lengths, config=config)
        return logits

    gbps = _gbps(step, weights, repeats)
    return "SmolLM2 decode forward, batch 1", gbps, weights / gbps / 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {os.cpu_count()} CPUs, "
          f"min of {args.repeats} repeats")
    print(f"{'':34}{'GB/s':>8}")
    for label, gbps in gemv_rows(args.repeats):
        print(f"{label:<34}{gbps:>8.2f}")
    label, gbps, ms = decode_row(args.repeats)
    print(f"{label:<34}{gbps:>8.2f}   ({ms:.1f} ms per token)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
