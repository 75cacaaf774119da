"""The engine against the chip's floor: today's chain of jitted calls and the fused step
(``pd_fsm/jax_engine/step``) side by side in one process, each as a fraction of what the chip's
memory or compute allows.

    python bench/bench_engine.py --json OUT.json                       # on the TPU machine
    JAX_PLATFORMS=cpu python bench/bench_engine.py --quick --json x.json   # a smoke run here

Per model shape (random weights at the published shape, ``--load-format dummy``; bf16 weights and
KV on an accelerator):

- **decode**: whole steps (forward, sampling, the tokens back on the host) at 1 / 8 / 64 / 256
  rows x 512 and 2,048 tokens of context. Floor: the weights and the KV a step reads, over the
  chip's HBM bandwidth (``--hbm-gbps``, 819 for a v5e). Rows may share pages (a pool for 256 x
  2,048 tokens of a 4B model does not fit the chip): each row still reads its own from HBM.
- **prefill** of one prompt of 128 / 1,024 / 4,096 tokens. Floor: the model's FLOPs over the
  chip's peak (``--peak-tflops``, 197 for a v5e bf16), i.e. the fraction is MFU.
- **mixed**: 64 decode rows at 512 tokens and a 512-token prefill chunk in one step.
- **host share**: of a fused decode step, the time the host spends building and uploading the
  step's arrays and dispatching it (the rest is the device and the read-back).
- **chain**: today's path (``model/forward.py``'s ~34 jitted calls, then the sampler) for the
  smaller shapes, the same rows.
- **kernel check**: the ragged paged attention kernel against the XLA reference on the backend.

Each figure is the median of ``--repeats`` steps after two warm ones; the first call's seconds
are the compile. Prints JSON lines as it goes (a run cut short still says what it measured).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_fsm.jax_engine.attention.ragged_paged import (
    decode_block_q,
    ragged_paged_attention,
)
from pd_fsm.jax_engine.attention.reference import ragged_attention_reference
from pd_fsm.jax_engine.kv.pool import allocate_kv_pool
from pd_fsm.jax_engine.model import forward
from pd_fsm.jax_engine.model.config import SMOLLM2_135M, ModelConfig
from pd_fsm.jax_engine.model.dummy import dummy_params, param_bytes, shape_config
from pd_fsm.jax_engine.sampling.sampler import _greedy
from pd_fsm.jax_engine.step.program import StepOptions, step

PAGE = 16
SHAPES = ("smollm2", "qwen3-0.6b", "qwen3-1.7b", "llama-3.2-1b", "qwen3-4b", "llama-3.2-3b")
CHAIN_SHAPES = ("smollm2", "qwen3-0.6b")
ROWS = (1, 8, 64, 256)
CONTEXTS = (512, 2048)
PREFILLS = (128, 1024, 4096)
RESULTS: list[dict[str, Any]] = []


def emit(**record: Any) -> None:
    RESULTS.append(record)
    print(json.dumps(record), flush=True)


def model_config(name: str, dtype: str) -> ModelConfig:
    config = SMOLLM2_135M if name == "smollm2" else shape_config(name)[0]
    return attrs.evolve(config, dtype=dtype)


def kv_token_bytes(config: ModelConfig, itemsize: int) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * itemsize


def decode_weight_bytes(params: dict[str, Any], config: ModelConfig) -> int:
    """What a decode step reads of the weights: all of them but the embedding rows it gathers
    (a tied embedding is read whole as the head)."""
    total = param_bytes(params)
    if not config.tie_embeddings:
        total -= params["embed"].size * params["embed"].dtype.itemsize
    return total


def prefill_flops(config: ModelConfig, params: dict[str, Any], tokens: int) -> float:
    layer = sum(a.size for a in jax.tree_util.tree_leaves(params["layers"]))
    attn = 4 * config.num_heads * config.head_dim * tokens * (tokens + 1) / 2 * config.num_layers
    return 2.0 * tokens * layer + attn + 2.0 * config.hidden_size * config.vocab_size


def timed(run: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(compile + first run seconds, median seconds of ``repeats`` runs after two warm ones)."""
    start = time.perf_counter()
    run()
    first = time.perf_counter() - start
    run()
    laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        laps.append(time.perf_counter() - start)
    return first, statistics.median(laps)


class Fused:
    """The fused step over a lanes pool of ``pages`` pages, driven as a server would: numpy
    arrays built and uploaded per step, the sampled tokens read back."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], pages: int,
                 attention: str) -> None:
        self.config, self.params = config, params
        pool = config.kv_pool_config(pages, PAGE)
        self.pool_config = attrs.evolve(pool, lanes=True, bf16_bits=False)
        self.kv = allocate_kv_pool(self.pool_config)
        self.options = StepOptions(config, attention=attention)  # type: ignore[arg-type]
        self.host_seconds: list[float] = []

    def run(self, tokens: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
            table: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        args = (jnp.asarray(tokens), jnp.asarray(q_lens), jnp.asarray(kv_lens),
                jnp.asarray(table))
        (sampled, _), self.kv = step(self.params, self.kv, *args, {}, options=self.options,
                                     sampler="greedy")
        self.host_seconds.append(time.perf_counter() - start)
        return np.asarray(sampled)


def page_table(rows: int, ctx: int, pages: int, rng: np.random.Generator) -> np.ndarray:
    """Each row's pages for ``ctx`` tokens, drawn from the pool's (rows share pages when the
    pool is smaller than their sum)."""
    per_row = -(-ctx // PAGE)
    draw = rng.permutation(np.arange(1, pages))
    need = rows * per_row
    ids = np.resize(draw, need) if need > draw.size else draw[:need]
    return ids.reshape(rows, per_row).astype(np.int32)


def bench_shape(name: str, args: argparse.Namespace) -> None:
    dtype = "float32" if args.cpu_f32 else "bfloat16"
    config = model_config(name, dtype)
    params = dummy_params(config, dtype, seed=0)
    jax.block_until_ready(params)
    itemsize = jnp.dtype(dtype).itemsize
    weights = decode_weight_bytes(params, config)
    page_bytes = kv_token_bytes(config, itemsize) * PAGE
    budget = min(args.pool_gb * 1e9, max(args.hbm_gb * 1e9 - param_bytes(params) - 2e9, 1e8))
    pages = int(min(budget // page_bytes, 1 + max(args.rows) * max(args.contexts) // PAGE,
                    1 + max(args.prefills) // PAGE + 64))
    emit(shape=name, params=param_bytes(params), pool_pages=pages, kv_bytes_per_token=
         kv_token_bytes(config, itemsize), layers=config.num_layers, heads=config.num_heads,
         kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    attention = "interpret" if jax.default_backend() == "cpu" and args.interpret else (
        "reference" if jax.default_backend() == "cpu" else "pallas")
    fused = Fused(config, params, pages, attention)
    rng = np.random.default_rng(0)
    width = -(-max(args.contexts) // PAGE)

    for rows in args.rows:
        for ctx in args.contexts:
            table = np.zeros((rows, width), np.int32)
            table[:, : -(-ctx // PAGE)] = page_table(rows, ctx, pages, rng)
            tokens = rng.integers(1, config.vocab_size, rows).astype(np.int32)
            q_lens = np.ones(rows, np.int32)
            kv_lens = np.full(rows, ctx, np.int32)
            try:
                fused.host_seconds.clear()
                first, med = timed(lambda t=table, k=kv_lens, q=q_lens, x=tokens:
                                   fused.run(x, q, k, t), args.repeats)
                host = statistics.median(fused.host_seconds[2:])
                floor = (weights + rows * ctx * kv_token_bytes(config, itemsize)) / (
                    args.hbm_gbps * 1e9)
                emit(shape=name, path="fused", step="decode", rows=rows, ctx=ctx,
                     ms=med * 1e3, first_s=first, floor_ms=floor * 1e3,
                     of_floor=floor / med, host_ms=host * 1e3)
            except Exception as exc:
                emit(shape=name, path="fused", step="decode", rows=rows, ctx=ctx,
                     error=f"{type(exc).__name__}: {exc}"[:2000])

    for n in args.prefills:
        table = np.zeros((1, -(-max(args.prefills) // PAGE)), np.int32)
        table[0, : -(-n // PAGE)] = np.arange(1, 1 + -(-n // PAGE))
        tokens = rng.integers(1, config.vocab_size, n).astype(np.int32)
        try:
            first, med = timed(lambda t=table, x=tokens, m=n: fused.run(
                x, np.array([m], np.int32), np.array([m], np.int32), t), args.repeats)
            flops = prefill_flops(config, params, n)
            emit(shape=name, path="fused", step="prefill", tokens=n, ms=med * 1e3,
                 first_s=first, mfu=flops / med / (args.peak_tflops * 1e12),
                 tokens_per_s=n / med)
        except Exception as exc:
            emit(shape=name, path="fused", step="prefill", tokens=n,
                 error=f"{type(exc).__name__}: {exc}"[:2000])

    if args.mixed:
        rows, ctx, chunk = 64, max(args.contexts), 512
        table = np.zeros((rows + 1, max(width, chunk // PAGE)), np.int32)
        table[:rows, : -(-ctx // PAGE)] = page_table(rows, ctx, pages, rng)
        table[rows, : chunk // PAGE] = np.arange(1, 1 + chunk // PAGE)
        q_lens = np.array([1] * rows + [chunk], np.int32)
        kv_lens = np.array([ctx] * rows + [chunk], np.int32)
        tokens = rng.integers(1, config.vocab_size, rows + chunk).astype(np.int32)
        try:
            first, med = timed(lambda: fused.run(tokens, q_lens, kv_lens, table), args.repeats)
            emit(shape=name, path="fused", step="mixed", rows=rows, ctx=ctx, chunk=chunk,
                 ms=med * 1e3, first_s=first)
        except Exception as exc:
            emit(shape=name, path="fused", step="mixed", error=f"{type(exc).__name__}: {exc}"[
                :2000])
    fused.kv = []  # the pool's HBM back before the chain's

    if name in args.chain_shapes:
        bench_chain(name, config, params, weights, args, rng)


def bench_chain(name: str, config: ModelConfig, params: dict[str, Any], weights: int,
                args: argparse.Namespace, rng: np.random.Generator) -> None:
    """Today's step: the chain of jitted calls over the heads pool (bf16 kept as its bits),
    then the sampler, the tokens read back."""
    itemsize = jnp.dtype(config.dtype).itemsize
    ctx = 512
    rows_list = [r for r in args.rows if r <= 64]
    pages = 1 + max(rows_list) * ctx // PAGE
    kv = allocate_kv_pool(config.kv_pool_config(pages, PAGE))
    state = {"kv": kv}
    for rows in rows_list:
        table = jnp.asarray(page_table(rows, ctx, pages, rng))
        tokens = jnp.asarray(rng.integers(1, config.vocab_size, rows).astype(np.int32))
        positions = jnp.full((rows,), ctx - 1, jnp.int32)
        lengths = positions + 1
        bitmask = jnp.full((rows, -(-config.vocab_size // 32)), -1, jnp.int32)

        def run(table: jax.Array = table, tokens: jax.Array = tokens, positions: jax.Array =
                positions, lengths: jax.Array = lengths, bitmask: jax.Array = bitmask
                ) -> np.ndarray:
            logits, state["kv"] = forward.decode(params, state["kv"], tokens, positions, table,
                                                 lengths, config=config)
            return np.asarray(_greedy(logits, bitmask)[0])

        try:
            first, med = timed(run, args.repeats)
            floor = (weights + rows * ctx * kv_token_bytes(config, itemsize)) / (
                args.hbm_gbps * 1e9)
            emit(shape=name, path="chain", step="decode", rows=rows, ctx=ctx, ms=med * 1e3,
                 first_s=first, floor_ms=floor * 1e3, of_floor=floor / med)
        except Exception as exc:
            emit(shape=name, path="chain", step="decode", rows=rows, error=str(exc)[:2000])


def kernel_check(args: argparse.Namespace) -> None:
    """The kernel against the XLA reference on this backend: decode rows, a prefill, a chunk
    after cached context, for head_dim 128 and 64 and 1, 2 and 3 query heads per kv-head."""
    interpret = jax.default_backend() == "cpu"
    cases = [(16, 8, 128, "bfloat16"), (9, 3, 64, "bfloat16"), (32, 8, 64, "bfloat16"),
             (8, 8, 128, "float32")]
    rng = np.random.default_rng(1)
    for nh, nkv, d, dtype in cases:
        pages = 64
        pool = jnp.asarray(rng.standard_normal((pages, PAGE, 2 * nkv * d)), dtype)
        q_lens = np.array([1, 1, 37, 5], np.int32)
        kv_lens = np.array([1, 300, 37, 200], np.int32)
        table = np.zeros((4, 32), np.int32)
        perm = rng.permutation(np.arange(1, pages))
        used = 0
        for s, n in enumerate(-(-kv_lens // PAGE)):
            table[s, :n] = perm[used:used + n]
            used += n
        q = jnp.asarray(rng.standard_normal((48, nh, d)), dtype)
        group = nh // nkv
        for block_q in sorted({decode_block_q(group, dtype), 128}):
            try:
                got = ragged_paged_attention(q, pool, jnp.asarray(q_lens), jnp.asarray(kv_lens),
                                             jnp.asarray(table), block_q=block_q, block_pages=4,
                                             interpret=interpret)
                with jax.default_matmul_precision("highest"):
                    ref = ragged_attention_reference(q, pool, jnp.asarray(q_lens),
                                                     jnp.asarray(kv_lens), jnp.asarray(table))
                n = int(q_lens.sum())
                err = float(jnp.max(jnp.abs(got[:n].astype(jnp.float32)
                                            - ref[:n].astype(jnp.float32))))
                emit(check="kernel", heads=nh, kv_heads=nkv, head_dim=d, dtype=dtype,
                     block_q=block_q, max_abs_err=err)
            except Exception as exc:
                emit(check="kernel", heads=nh, kv_heads=nkv, head_dim=d, dtype=dtype,
                     block_q=block_q, error=f"{type(exc).__name__}: {exc}"[:3000])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every record here as well")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--chain-shapes", default=",".join(CHAIN_SHAPES))
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    parser.add_argument("--prefills", default=",".join(map(str, PREFILLS)))
    parser.add_argument("--no-mixed", dest="mixed", action="store_false")
    parser.add_argument("--no-kernel-check", dest="kernel_check", action="store_false")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--hbm-gbps", type=float, default=819.0)
    parser.add_argument("--peak-tflops", type=float, default=197.0)
    parser.add_argument("--hbm-gb", type=float, default=15.7)
    parser.add_argument("--pool-gb", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run on a CPU: SmolLM2 only, small rows and prompts")
    parser.add_argument("--interpret", action="store_true",
                        help="on a CPU, the kernel in interpret mode (slow) instead of XLA")
    parser.add_argument("--cpu-f32", action="store_true", help="f32 weights and KV")
    args = parser.parse_args()
    if args.quick:
        args.shapes, args.chain_shapes = "smollm2", "smollm2"
        args.rows, args.contexts, args.prefills, args.repeats = "1,8", "64", "32", 2
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.chain_shapes = [s for s in args.chain_shapes.split(",") if s]
    args.rows = [int(r) for r in args.rows.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.prefills = [int(p) for p in args.prefills.split(",")]
    emit(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
         jax=jax.__version__)
    try:
        if args.kernel_check:
            kernel_check(args)
        for name in args.shapes:
            try:
                bench_shape(name, args)
            except Exception as exc:
                emit(shape=name, error=traceback.format_exc()[-3000:], kind=type(exc).__name__)
    finally:
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
