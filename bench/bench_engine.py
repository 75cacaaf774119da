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
- **host share**: of a fused decode step, the time the host spends building the step's one
  array (``upload_ms``, the name runs before run 10 used: they uploaded four arrays there) and
  dispatching it (``dispatch_ms``, the array's transfer in the call, as the runner's); the rest
  is the device and the read-back.
- **chain**: today's path (``model/forward.py``'s ~34 jitted calls, then the sampler) for the
  smaller shapes, the same rows.
- **kernel check**: the ragged paged attention kernel against the XLA reference on the backend.
- **variants** (``--variants``, e.g. ``kv_write=scatter``): the fused step built
  another way, timed on the same pool at the ``--variants-at`` decode points and at every
  prefill.

Each figure is the median of ``--repeats`` steps after two warm ones; the first call's seconds
are the compile. Prints JSON lines as it goes (a run cut short still says what it measured).
"""

from __future__ import annotations

import argparse
import json
import re
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
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.kv.pool import allocate_kv_pool
from pd_fsm.jax_engine.model import forward
from pd_fsm.jax_engine.model.config import SMOLLM2_135M, ModelConfig
from pd_fsm.jax_engine.model.dummy import dummy_params, param_bytes, shape_config
from pd_fsm.jax_engine.model.params import fuse_projections, stack_layers
from pd_fsm.jax_engine.sampling.grammar import allow_every_token
from pd_fsm.jax_engine.sampling.sampler import _greedy, greedy_arrays
from pd_fsm.jax_engine.step.program import StepOptions, pack, packed_step
from pd_fsm.schedulers.penalty_slots import PENALTY_SLOTS

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
    """The fused step over a lanes pool of ``pages`` pages, driven as the model runner drives
    it: the runner's program (``packed_step``, the "sample" sampler, every row greedy, the
    every-token bitmask kept on the device), its arrays built and uploaded as one per step, the
    sampled tokens read back. ``kv``: a pool to run on instead of a new one."""

    def __init__(self, config: ModelConfig, params: dict[str, Any], pages: int,
                 options: StepOptions, kv: list[jax.Array] | None = None) -> None:
        self.config, self.params, self.options = config, params, options
        pool = config.kv_pool_config(pages, PAGE)
        self.pool_config = attrs.evolve(pool, lanes=True, bf16_bits=False)
        self.kv = allocate_kv_pool(self.pool_config) if kv is None else kv
        self.carried = jnp.zeros(max(ROWS), jnp.int32)
        # The penalty counts the runner keeps (no row penalized here).
        self.counts = jnp.zeros((PENALTY_SLOTS, config.vocab_size), jnp.int32)
        self.allowed: dict[int, jax.Array] = {}
        # Per run: building the step's array, dispatching the program (the array's transfer in
        # it), waiting for the tokens.
        self.laps: list[tuple[float, float, float]] = []

    def upload(self, tokens: np.ndarray, carry: np.ndarray, q_lens: np.ndarray,
               kv_lens: np.ndarray, table: np.ndarray) -> np.ndarray:
        """The step's one host array, packed as the runner packs it (the dispatch transfers
        it, as the runner's call does)."""
        return pack(tokens, carry, q_lens, kv_lens, table, greedy_arrays(len(q_lens)))

    def dispatch(self, batch: np.ndarray, seqs: int, width: int) -> jax.Array:
        """Dispatch the step on ``batch`` without waiting; its sampled tokens, on the device."""
        allowed = self.allowed.get(seqs)
        if allowed is None:
            allowed = self.allowed[seqs] = upload(
                allow_every_token(seqs, self.config.vocab_size))
        (sampled, *_), self.carried, self.counts, self.kv = packed_step(
            self.params, self.kv, batch, self.carried, allowed, self.counts,
            options=self.options, sampler="sample", seqs=seqs, width=width)
        return sampled

    def run(self, tokens: np.ndarray, q_lens: np.ndarray, kv_lens: np.ndarray,
            table: np.ndarray) -> np.ndarray:
        start = time.perf_counter()
        batch = self.upload(tokens, np.full(len(tokens), -1, np.int32), q_lens, kv_lens, table)
        uploaded = time.perf_counter()
        sampled = self.dispatch(batch, len(q_lens), table.shape[1])
        dispatched = time.perf_counter()
        out = np.asarray(sampled)
        self.laps.append((uploaded - start, dispatched - uploaded,
                          time.perf_counter() - dispatched))
        return out

    def split(self) -> dict[str, float]:
        """The median run's upload, dispatch and wait, in ms (the two warm runs left out)."""
        return {f"{part}_ms": 1e3 * statistics.median(lap[i] for lap in self.laps[2:])
                for i, part in enumerate(("upload", "dispatch", "wait"))}

    def overlapped(self, tokens: np.ndarray, kv_lens: np.ndarray, table: np.ndarray,
                   steps: int) -> float:
        """Seconds a decode step takes when step N+1 is built, uploaded and dispatched before
        step N's tokens are read (each row fed the token step N sampled for it, still on the
        device), as the runner's overlapped loop runs: the host's work hides behind the
        device's."""
        rows, width = len(tokens), table.shape[1]
        q_lens = np.ones(rows, np.int32)
        carry = np.arange(rows, dtype=np.int32)
        previous = self.dispatch(self.upload(tokens, carry, q_lens, kv_lens, table), rows, width)
        np.asarray(previous)
        start = time.perf_counter()
        for _ in range(steps):
            current = self.dispatch(self.upload(tokens, carry, q_lens, kv_lens, table), rows,
                                    width)
            np.asarray(previous)
            previous = current
        np.asarray(previous)
        return (time.perf_counter() - start) / steps


def profile(label: str, run: Callable[[], Any], out_dir: Path | None, steps: int = 5) -> None:
    """Trace ``steps`` runs and emit the device's time per operation (the top ones), what the
    host spent in dispatch, and each step's span on the device."""
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run()
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                run()
        traces = list(Path(tmp).rglob("perfetto_trace.json.gz"))
        if not traces:
            emit(profile=label, error="no perfetto trace written")
            return
        raw = traces[0].read_bytes()
        if out_dir is not None:
            (out_dir / f"trace_{label}.json.gz").write_bytes(raw)
    doc = json.loads(gzip.decompress(raw))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    per: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            where = names.get(e["pid"], str(e["pid"]))
            per.setdefault((where, e["name"]), []).append(float(e["dur"]))
    device = {k: v for k, v in per.items() if "TPU" in k[0] or "/device" in k[0]}
    top = sorted(device.items(), key=lambda kv: -sum(kv[1]))[:30]
    # The same by kind ("fusion.12" and "fusion.40" are one kind): where a step's time goes.
    # The step's own span (jit_step...) encloses the rest: it is the step, not a kind.
    kinds: dict[str, list[float]] = {}
    for (_, name), durs in device.items():
        if not name.startswith("jit_"):
            kinds.setdefault(re.sub(r"\.\d+$", "", name), []).extend(durs)
    emit(profile=label, steps=steps, processes=sorted(set(names.values())),
         device_us_per_step=sum(sum(v) for v in device.values()) / steps,
         kinds_us_per_step={k: (len(v) // steps, round(sum(v) / steps, 1)) for k, v in
                            sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:20]},
         top_device=[(k[0][-12:], k[1][:80], len(v) // steps, round(sum(v) / steps, 1))
                     for k, v in top],
         host=[(k[1][:60], len(v) // steps, round(sum(v) / steps, 1)) for k, v in
               sorted(per.items(), key=lambda kv: -sum(kv[1])) if k not in device][:15])


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
    # Room for the largest decode batch and for the longest prefill (a prefill's table names
    # pages 1..n/PAGE: a pool smaller than that made the kernel's DMA read past it and the chip
    # halt, run 7), within the budget.
    pages = int(min(budget // page_bytes, max(1 + max(args.rows) * max(args.contexts) // PAGE,
                                              1 + -(-max(args.prefills) // PAGE))))
    emit(shape=name, params=param_bytes(params), pool_pages=pages, kv_bytes_per_token=
         kv_token_bytes(config, itemsize), layers=config.num_layers, heads=config.num_heads,
         kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    attention = "interpret" if jax.default_backend() == "cpu" and args.interpret else (
        "reference" if jax.default_backend() == "cpu" else "pallas")
    options = StepOptions(config, attention=attention)  # type: ignore[arg-type]
    fused = Fused(config, params, pages, options)
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
                fused.laps.clear()
                first, med = timed(lambda t=table, k=kv_lens, q=q_lens, x=tokens:
                                   fused.run(x, q, k, t), args.repeats)
                floor = (weights + rows * ctx * kv_token_bytes(config, itemsize)) / (
                    args.hbm_gbps * 1e9)
                overlap = fused.overlapped(tokens, kv_lens, table, max(args.repeats, 10))
                emit(shape=name, path="fused", step="decode", rows=rows, ctx=ctx,
                     ms=med * 1e3, first_s=first, floor_ms=floor * 1e3,
                     of_floor=floor / med, **fused.split(), overlapped_ms=overlap * 1e3,
                     overlapped_of_floor=floor / overlap)
                if (rows, ctx) in args.profile_at:
                    profile(f"{name}-decode-{rows}x{ctx}", lambda t=table, k=kv_lens, q=q_lens,
                            x=tokens: fused.run(x, q, k, t), args.trace_dir)
                for variant in args.variants if (rows, ctx) in args.variants_at else ():
                    bench_variant(name, params, fused, variant, rows, ctx, tokens, kv_lens,
                                  table, floor, args)
            except Exception as exc:
                emit(shape=name, path="fused", step="decode", rows=rows, ctx=ctx,
                     error=f"{type(exc).__name__}: {exc}"[:2000])

    bench_prefills(name, config, params, fused, pages, args, rng)

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


def variant_of(base: Fused, params: dict[str, Any], variant: str) -> Fused:
    """The base's step built another way, on the base's pool (hand the pool back with
    ``base.kv = run.kv``): ``unroll_dma`` (the kernel's page DMAs unrolled), ``fused_proj``
    (q/k/v and gate/up as one product each), ``stacked`` (the layers' weights stacked: ~11
    weight arguments a dispatch instead of ~300), ``block_pages=N``, ``kv_write=scatter``
    (the KV written one row per token rather than whole pages then tokens:
    kv/token_write.py)."""
    options, weights = base.options, params
    if variant == "unroll_dma":
        options = attrs.evolve(options, unroll_dma=True)
    elif variant == "fused_proj":
        weights = fuse_projections(params)
    elif variant == "stacked":
        weights = stack_layers(params)
    elif variant.startswith("block_pages="):
        options = attrs.evolve(options, block_pages=int(variant.split("=")[1]))
    elif variant.startswith("kv_write="):
        options = attrs.evolve(options, kv_write=variant.split("=")[1])
    else:
        raise ValueError(f"unknown variant {variant!r}")
    return Fused(base.config, weights, 0, options, kv=base.kv)


def bench_variant(name: str, params: dict[str, Any], base: Fused, variant: str, rows: int,
                  ctx: int, tokens: np.ndarray, kv_lens: np.ndarray, table: np.ndarray,
                  floor: float, args: argparse.Namespace) -> None:
    """The same decode step built another way (:func:`variant_of`)."""
    run = variant_of(base, params, variant)
    q_lens = np.ones(rows, np.int32)
    try:
        first, med = timed(lambda: run.run(tokens, q_lens, kv_lens, table), args.repeats)
        emit(shape=name, path="fused", variant=variant, step="decode", rows=rows, ctx=ctx,
             ms=med * 1e3, first_s=first, of_floor=floor / med, **run.split())
    except Exception as exc:
        emit(shape=name, path="fused", variant=variant, step="decode", rows=rows, ctx=ctx,
             error=f"{type(exc).__name__}: {exc}"[:2000])
    finally:
        base.kv = run.kv


def bench_prefills(name: str, config: ModelConfig, params: dict[str, Any], fused: Fused,
                   pages: int, args: argparse.Namespace, rng: np.random.Generator) -> None:
    """One prompt of each ``--prefills`` length from a page boundary, with the base step and
    then each ``--variants`` one (MFU beside each time)."""
    for n in args.prefills:
        if -(-n // PAGE) >= pages:
            emit(shape=name, path="fused", step="prefill", tokens=n,
                 error=f"{n} tokens need more than the pool's {pages} pages")
            continue
        table = np.zeros((1, -(-max(args.prefills) // PAGE)), np.int32)
        table[0, : -(-n // PAGE)] = np.arange(1, 1 + -(-n // PAGE))
        tokens = rng.integers(1, config.vocab_size, n).astype(np.int32)
        flops = prefill_flops(config, params, n)
        for variant in ["", *args.variants]:
            run = variant_of(fused, params, variant) if variant else fused
            label = {"variant": variant} if variant else {}
            try:
                def prefill(t: np.ndarray = table, x: np.ndarray = tokens, m: int = n,
                            r: Fused = run) -> Any:
                    return r.run(x, np.array([m], np.int32), np.array([m], np.int32), t)

                first, med = timed(prefill, args.repeats)
                emit(shape=name, path="fused", **label, step="prefill", tokens=n,
                     ms=med * 1e3, first_s=first, mfu=flops / med / (args.peak_tflops * 1e12),
                     tokens_per_s=n / med)
                if n in args.profile_prefill:
                    tag = "-" + variant.replace("=", "-") if variant else ""
                    profile(f"{name}-prefill-{n}{tag}", prefill, args.trace_dir)
            except Exception as exc:
                emit(shape=name, path="fused", **label, step="prefill", tokens=n,
                     error=f"{type(exc).__name__}: {exc}"[:2000])
            finally:
                fused.kv = run.kv


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


def _cache_counts() -> dict[str, int]:
    from pd_fsm.jax_engine.compilation import cache

    return cache.counts()


def bench_scheduler(name: str, args: argparse.Namespace) -> None:
    """``Scheduler.step`` end to end: a closed loop of ``--loop-requests`` requests of
    ``--loop-in`` random tokens in and ``--loop-out`` out (greedy, EOS ignored), all admitted at
    once. The loop runs twice with the same lengths; the second is timed (the first compiles
    each shape it meets). Floor: its decode steps' reads and its prefills' FLOPs at the chip's
    rates, on the schedule it ran."""
    from pd_fsm.jax_engine.sampling.params import SamplingParams
    from pd_fsm.schedulers.args import SchedulerArgs
    from pd_fsm.schedulers.scheduler import Scheduler
    from pd_fsm.schedulers.warm_up import warm_up

    n, t_in, t_out = args.loop_requests, args.loop_in, args.loop_out
    context = args.loop_context or t_in + t_out + PAGE
    dtype = "float32" if args.cpu_f32 else "bfloat16"
    sched = Scheduler(SchedulerArgs(
        model=name, load_format="dummy", dtype=dtype,
        num_pages=args.loop_num_pages or 1 + n * -(-context // PAGE), page_size=PAGE,
        max_running=args.loop_max_running or n, max_batched_tokens=args.loop_batched or t_in,
        context_length=context))
    # What a server's start compiles (in parallel), so the loop's first pass meets no compile;
    # into the workers' compilation cache, so a server of the same settings started after this
    # loads them instead of compiling them again (a worker's start on the chip took 140 s).
    if args.compilation_cache:
        from pd_fsm.jax_engine.compilation import cache

        cache.enable(cache.default_dir())
    warm = warm_up(sched)
    emit(shape=name, path="scheduler warm-up", shapes=len(warm.shapes), compiled=warm.executables,
         seconds=warm.seconds, cache=_cache_counts() if args.compilation_cache else None)
    rng = np.random.default_rng(2)
    config = sched.config
    itemsize = jnp.dtype(dtype).itemsize

    def loop(tag: str) -> tuple[float, int, int]:
        for i in range(n):
            ids = rng.integers(1, config.vocab_size, t_in).tolist()
            sched.add_request(sched.make_request(f"{tag}{i}", ids, SamplingParams(
                max_new_tokens=t_out, ignore_eos=True, temperature=0.0)))
        start = time.perf_counter()
        steps = tokens = 0
        while sched.has_work():
            tokens += sum(len(o.new_token_ids) for o in sched.step())
            steps += 1
        return time.perf_counter() - start, steps, tokens

    try:
        first, _, _ = loop("warm")
        seconds, steps, tokens = loop("run")
        weights = decode_weight_bytes(sched.runner.params, config)
        # Decode steps read the weights once each and every running row's context; a row's
        # context grows from t_in to t_in + t_out.
        kv = n * sum(t_in + k for k in range(t_out)) * kv_token_bytes(config, itemsize)
        floor = ((weights * t_out + kv) / (args.hbm_gbps * 1e9)
                 + n * prefill_flops(config, sched.runner.params, t_in)
                 / (args.peak_tflops * 1e12))
        emit(shape=name, path="scheduler", requests=n, tokens_in=t_in, tokens_out=t_out,
             seconds=seconds, first_pass_s=first, steps=steps, output_tokens=tokens,
             output_tokens_per_s=tokens / seconds, floor_s=floor, of_floor=floor / seconds,
             forward_shapes=len(sched.forward_shapes))
    except Exception:
        emit(shape=name, path="scheduler", error=traceback.format_exc()[-3000:])


GREEDY_PROMPTS = (
    "Write a short story about a robot who learns to paint, in three paragraphs.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
)


def greedy_tokens(tokens: int) -> dict[str, list[int]]:
    """SmolLM2's greedy answers (f32 weights and KV, matmuls at full precision, EOS ignored)
    to the chat prompts, through the scheduler on this backend."""
    from pd_fsm.jax_engine.sampling.params import SamplingParams
    from pd_fsm.schedulers.args import SchedulerArgs
    from pd_fsm.schedulers.scheduler import Scheduler
    from pd_fsm.text.chat_template import ChatMessage

    with jax.default_matmul_precision("highest"):
        sched = Scheduler(SchedulerArgs(model="smollm2", dtype="float32", num_pages=256,
                                        max_running=8, context_length=512))
        tok = sched.tokenizer
        for i, prompt in enumerate(GREEDY_PROMPTS):
            ids = tok.encode(tok.apply_chat_template([ChatMessage("user", prompt)]))
            sched.add_request(sched.make_request(str(i), ids, SamplingParams(
                max_new_tokens=tokens, ignore_eos=True, temperature=0.0)))
        out: dict[str, list[int]] = {str(i): [] for i in range(len(GREEDY_PROMPTS))}
        for o in sched.run_until_idle():
            out[o.rid].extend(o.new_token_ids)
    return out


def greedy_check(args: argparse.Namespace) -> None:
    """The greedy answers here against a CPU's (a child process with ``JAX_PLATFORMS=cpu``):
    equal, or where they first differ."""
    import os
    import subprocess

    mine = greedy_tokens(args.greedy_tokens)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, __file__, "--greedy-child", str(args.greedy_tokens)], env=env,
        capture_output=True, text=True, timeout=900, check=True)
    cpu = json.loads(child.stdout.strip().splitlines()[-1])
    for rid, ids in mine.items():
        other = cpu[rid]
        first = next((i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b),
                     None)
        emit(check="greedy", prompt=GREEDY_PROMPTS[int(rid)], backend=jax.default_backend(),
             tokens=len(ids), equal=ids == other, first_difference=first,
             here=ids[:8], cpu=other[:8])


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
    parser.add_argument("--variants", default="",
                        help="comma list: unroll_dma, fused_proj, stacked, block_pages=N, "
                        "kv_write=scatter (each prefill runs them too)")
    parser.add_argument("--variants-at", default="1x512,64x512",
                        help="ROWSxCTX,... decode points the variants run at")
    parser.add_argument("--profile-at", default="", help="ROWSxCTX,... decode steps to trace")
    parser.add_argument("--profile-prefill", default="", help="prompt lengths to trace")
    parser.add_argument("--trace-dir", type=Path, help="keep the raw traces here")
    parser.add_argument("--scheduler", default="", help="shapes to run the closed loop on")
    parser.add_argument("--loop-context", type=int, default=0,
                        help="the loop's context length (0: in + out + a page)")
    parser.add_argument("--loop-num-pages", type=int, default=0,
                        help="the loop's pool pages (0: its requests' worth)")
    parser.add_argument("--loop-max-running", type=int, default=0,
                        help="the loop's admitted requests (0: --loop-requests)")
    parser.add_argument("--loop-batched", type=int, default=0,
                        help="the loop's prefill budget (0: --loop-in)")
    parser.add_argument("--no-compilation-cache", dest="compilation_cache", action="store_false",
                        help="the closed loop compiles without the workers' cache")
    parser.add_argument("--loop-requests", type=int, default=64)
    parser.add_argument("--loop-in", type=int, default=1024)
    parser.add_argument("--loop-out", type=int, default=256)
    parser.add_argument("--greedy-check", action="store_true",
                        help="SmolLM2's greedy answers here against a CPU child's")
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--greedy-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.greedy_child:
        print(json.dumps(greedy_tokens(args.greedy_child)), flush=True)
        return
    if args.quick:
        args.shapes, args.chain_shapes = "smollm2", "smollm2"
        args.rows, args.contexts, args.prefills, args.repeats = "1,8", "64", "32", 2
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.chain_shapes = [s for s in args.chain_shapes.split(",") if s]
    args.rows = [int(r) for r in args.rows.split(",")]
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.prefills = [int(p) for p in args.prefills.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]

    def pairs(text: str) -> set[tuple[int, int]]:
        return {(int(a), int(b)) for a, b in (p.split("x") for p in text.split(",") if p)}

    args.variants_at, args.profile_at = pairs(args.variants_at), pairs(args.profile_at)
    args.profile_prefill = {int(p) for p in args.profile_prefill.split(",") if p}
    emit(backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
         jax=jax.__version__)
    try:
        if args.kernel_check:
            kernel_check(args)
        if args.greedy_check:
            greedy_check(args)
        for name in args.shapes:
            try:
                bench_shape(name, args)
            except Exception as exc:
                emit(shape=name, error=traceback.format_exc()[-3000:], kind=type(exc).__name__)
        for name in (s for s in args.scheduler.split(",") if s):
            bench_scheduler(name, args)
    finally:
        if args.json:
            args.json.write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
