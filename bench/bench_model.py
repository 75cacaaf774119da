"""SmolLM2-135M forward speed on this machine: prefill tokens/s and decode ms/step (warm).

Prints numbers; asserts nothing. Run: ``.venv/bin/python bench/bench_model.py``
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.model import decode, load_model, new_kv_pool, prefill, table_width


def _median_s(fn: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = load_model("smollm2")
    cfg = model.config
    print(f"model: smollm2 {cfg.num_layers} layers, hidden {cfg.hidden_size}, dtype {cfg.dtype}; "
          f"loaded in {time.perf_counter() - t0:.2f}s; backend {jax.default_backend()}, "
          f"{jax.device_count()} device(s)")

    n_pages_seq = -(-(args.prompt_len + args.decode_steps + 1) // args.page_size)
    max_b = max(args.batches)
    pool = cfg.kv_pool_config(1 + max_b * n_pages_seq, args.page_size)
    kv = new_kv_pool(pool)
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, cfg.vocab_size, size=(max_b, args.prompt_len)).astype(np.int32)
    page_rows = np.arange(1, 1 + max_b * n_pages_seq, dtype=np.int32).reshape(max_b, n_pages_seq)

    state = {"kv": kv}

    def run_prefill(row: int) -> jax.Array:
        logits, state["kv"] = prefill(
            model.params,
            state["kv"],
            jnp.asarray(prompts[row]),
            args.prompt_len,
            jnp.asarray(page_rows[row]),
            config=cfg,
        )
        return logits.block_until_ready()

    t0 = time.perf_counter()
    run_prefill(0)
    compile_s = time.perf_counter() - t0
    for row in range(max_b):  # fill every sequence's pages for the decode runs below
        run_prefill(row)
    prefill_s = _median_s(lambda: run_prefill(0), args.repeats)
    print(f"prefill: {args.prompt_len} tokens in {prefill_s * 1e3:.1f} ms -> "
          f"{args.prompt_len / prefill_s:.0f} tokens/s (first call incl. compile {compile_s:.1f}s)")

    for b in args.batches:
        tokens = jnp.asarray(rng.integers(100, cfg.vocab_size, size=b).astype(np.int32))
        # Whole context chunks wide, as the scheduler's tables are (its width covers the longest
        # sequence it admits; attention reads only up to each row's position either way).
        width = table_width(n_pages_seq, args.page_size)
        table = jnp.asarray(np.pad(page_rows[:b], ((0, 0), (0, width - n_pages_seq))))

        def step(pos: int, b: int = b, toks: jax.Array = tokens, tab: jax.Array = table) -> None:
            positions = jnp.full((b,), pos, jnp.int32)
            logits, state["kv"] = decode(
                model.params, state["kv"], toks, positions, tab, positions + 1, config=cfg
            )
            logits.block_until_ready()

        t0 = time.perf_counter()
        step(args.prompt_len)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(args.decode_steps):
            step(args.prompt_len + 1 + i)
        per_step = (time.perf_counter() - t0) / args.decode_steps
        print(f"decode batch {b}: {per_step * 1e3:.1f} ms/step, {per_step * 1e3 / b:.2f} ms/token, "
              f"{b / per_step:.0f} tokens/s (context {args.prompt_len}, page table "
              f"{n_pages_seq} pages padded to {width}; first call incl. compile {compile_s:.1f}s)")


if __name__ == "__main__":
    main()
