"""Which shape of KV part P should stream to D while it prefills (issue 31 §1): a finished
prefill chunk's pages across all layers ("chunk parts", what `--disaggregation-stream-tokens`
does), or a group of layers across all tokens ("layer-group parts", never built).

What it measures, in-process on this machine's CPU, one prompt at a time, each shape's first
run unmeasured (or compiled ahead), then the median of ``--repeats`` runs, the shapes taken in
turn within each repeat so that the machine's load falls on all of them alike:

* ``one forward`` (the baseline): the engine's public ``prefill`` over the whole prompt in one
  forward (``T`` = the context; 512 and 2,048 are powers of two, so no padding), KV written.
* ``chunks of N`` (N = ``--chunk``, 256): the engine's ``prefill`` per chunk, at its
  ``start_pos``, over the prompt's page table; each chunk timed to ``block_until_ready``. A part
  = one chunk's pages of every layer, N x bytes/token.
* ``layers/G``: the whole prompt in one forward, split into groups of G layers: a jitted
  function per group runs its layers over all ``T`` tokens (compiled ahead of time, so no
  compile is timed), each group timed to ``block_until_ready`` (what P would wait for before it
  registers the group's KV). A part = G/L of the whole KV. The split forward is written here
  (the engine's per-layer function is private), a fresh prompt's causal attention in f32, and
  checked before any timing: its K/V entries of every layer and its last token's logits equal
  the engine's ``prefill`` of the same prompt (``allclose``, atol/rtol 1e-3: f32 summed in
  another order), so what is timed is the real computation. ``layers/L`` (one group) is the
  same code unsplit: the split's overhead is ``layers/G`` against it.

Then, for each shape, context and link rate (``--links``, GB/s; default 0.125 = 1 Gbit/s and
1.25 = 10 Gbit/s), a pipeline model: part i's transfer starts when part i is computed and the
link is free (D pulls the parts one at a time, in order), at the link's rate; compute ends when
the last part (and the head) is computed; exposed = end of the last transfer - end of compute;
TTFT = compute end + exposed; hidden = 1 - exposed / the whole transfer. No part overhead (a
pull's round trip, a registration) is modelled: it would count against the shape with more
parts.

    .venv/bin/python bench/bench_part_shape.py                         # SmolLM2, 512 and 2,048
    .venv/bin/python bench/bench_part_shape.py --model tiny --contexts 8192 --groups 1 2

Prints markdown tables; asserts only the equality above. Results: bench/RESULTS_part_shape.md.

Measured here (2026-12-03, 2 CPUs, load average 1.6-2.5, the quietest of four runs): at 2,048
tokens 8 chunks of 256 took 6.6 s against 13.4 s for one forward (22.9 s in the engine's code),
so the modelled TTFT over 1 Gbit/s was 6.7 s in chunk parts against 13.4 s for the best
layer-group parts (layers/6), though layer groups hide more of the transfer (1-3 layers per
part: 91-100 %, chunks 88 %); at 512 tokens a tie within noise. Chunk parts kept.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pd_fsm.jax_engine.model import (  # noqa: E402
    KV,
    ModelConfig,
    Params,
    compile_forward,
    load_model,
    new_kv_pool,
    prefill,
)
from pd_fsm.jax_engine.model.forward import kv_encode, rms_norm, rope  # noqa: E402

PAGE = 16
Shape = tuple[list[float], list[float], float]  # part compute seconds, part bytes, tail seconds


def prompt(n: int, vocab: int, salt: int) -> np.ndarray:
    """``n`` token ids, different for every ``salt``."""
    return np.array([(7 * i + 13 * salt) % (vocab - 1) + 1 for i in range(n)], np.int32)


# ---- the split forward: a group of layers over a fresh prompt's T tokens ---------------------


def _one_layer(x: jax.Array, layer: Params, positions: jax.Array, dtype: Any,
               config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The engine's decoder layer for start_pos 0 (no cached context): plain causal softmax."""
    t = x.shape[0]
    nh, nkv, d, g = config.num_heads, config.num_kv_heads, config.head_dim, config.group_size
    h = rms_norm(x, layer["attn_norm"], config.rms_eps)
    q = (h @ layer["wq"]).reshape(1, t, nh, d)
    k = (h @ layer["wk"]).reshape(1, t, nkv, d)
    v = (h @ layer["wv"]).reshape(1, t, nkv, d)
    q = rope(q, positions, config)[0]
    k = kv_encode(rope(k, positions, config), dtype)[0]
    v = kv_encode(v, dtype)[0]
    entry = jnp.stack([k, v], axis=2).reshape(t, 2 * nkv, d)
    qf = q.reshape(t, nkv, g, d).astype(jnp.float32) * d**-0.5
    s = jnp.einsum("tkgd,skd->kgts", qf, k.astype(jnp.float32))
    causal = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
    p = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(jnp.float32).min), axis=-1)
    attn = jnp.einsum("kgts,skd->tkgd", p, v.astype(jnp.float32)).reshape(t, nh * d)
    x = x + attn.astype(x.dtype) @ layer["wo"]
    h = rms_norm(x, layer["mlp_norm"], config.rms_eps)
    return x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"], entry


def _group(x: jax.Array, layers: list[Params], positions: jax.Array, *, dtype: Any,
           config: ModelConfig) -> tuple[jax.Array, list[jax.Array]]:
    entries = []
    for layer in layers:
        x, entry = _one_layer(x, layer, positions, dtype, config)
        entries.append(entry)
    return x, entries


def _head(x: jax.Array, final_norm: jax.Array, head: jax.Array, *, config: ModelConfig,
          tied: bool) -> jax.Array:
    h = rms_norm(x[-1:], final_norm, config.rms_eps)
    return (h @ (head.T if tied else head))[0].astype(jnp.float32)


class SplitForward:
    """The whole prompt's forward in groups of ``size`` layers, each group compiled ahead."""

    def __init__(self, params: Params, config: ModelConfig, t: int, size: int,
                 dtype: Any) -> None:
        self.params, self.config, self.size = params, config, size
        self.positions = jnp.arange(t, dtype=jnp.int32)[None, :]
        x = jax.ShapeDtypeStruct((t, config.hidden_size), jnp.dtype(config.dtype))
        layers = params["layers"]
        self.bounds = [(i, min(i + size, len(layers))) for i in range(0, len(layers), size)]
        group = jax.jit(functools.partial(_group, dtype=dtype, config=config))
        self.groups: dict[int, Any] = {}
        for lo, hi in self.bounds:
            if hi - lo not in self.groups:
                self.groups[hi - lo] = group.lower(x, layers[lo:hi], self.positions).compile()
        self.tied = config.tie_embeddings
        self.head_w = params["embed"] if self.tied else params["lm_head"]
        self.head = jax.jit(functools.partial(_head, config=config, tied=self.tied)).lower(
            x, params["final_norm"], self.head_w).compile()
        self.embed = jax.jit(lambda e, tok: e[tok]).lower(
            params["embed"], jax.ShapeDtypeStruct((t,), jnp.int32)).compile()

    def run(self, tokens: jax.Array) -> tuple[list[float], float, jax.Array, list[jax.Array]]:
        """Per group seconds (the embedding in the first), the head's seconds, logits, entries."""
        times: list[float] = []
        entries: list[jax.Array] = []
        t0 = time.perf_counter()
        x = self.embed(self.params["embed"], tokens)
        for lo, hi in self.bounds:
            x, group_entries = self.groups[hi - lo](x, self.params["layers"][lo:hi],
                                                    self.positions)
            jax.block_until_ready(group_entries)
            entries += group_entries
            t1 = time.perf_counter()
            times.append(t1 - t0)
            t0 = t1
        logits = self.head(x, self.params["final_norm"], self.head_w).block_until_ready()
        return times, time.perf_counter() - t0, logits, entries


# ---- the engine's own forward: whole, or in chunks ---------------------------------------------


class Engine:
    """The engine's public ``prefill`` over one prompt's pages in a pool of its own."""

    def __init__(self, params: Params, config: ModelConfig, t: int, chunk: int) -> None:
        self.params, self.config, self.t = params, config, t
        self.pool_cfg = config.kv_pool_config(t // PAGE + 2, PAGE)
        self.kv: KV = new_kv_pool(self.pool_cfg)
        self.page_ids = jnp.arange(1, t // PAGE + 1, dtype=jnp.int32)
        for n in {t, chunk}:
            compile_forward(params, self.kv, 1, n, len(self.page_ids), config=config)

    def forward(self, tokens: jax.Array, start: int, n: int) -> jax.Array:
        logits, self.kv = prefill(self.params, self.kv, tokens[start:start + n], n,
                                  self.page_ids, start, config=self.config)
        return jax.block_until_ready(logits)

    def entries(self, layer: int) -> np.ndarray:
        pages = np.asarray(self.kv[layer])[np.asarray(self.page_ids)]
        return pages.reshape(self.t, *pages.shape[2:])


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def check_equal(engine: Engine, split: SplitForward, tokens: jax.Array) -> float:
    """The split forward computes what the engine computes: K/V of every layer, logits (f32
    summed in another order: 1e-3; the largest difference is returned and printed)."""
    logits = np.asarray(engine.forward(tokens, 0, engine.t))
    _, _, split_logits, entries = split.run(tokens)
    np.testing.assert_allclose(np.asarray(split_logits), logits, rtol=1e-3, atol=1e-3)
    worst = float(np.max(np.abs(np.asarray(split_logits) - logits)))
    for layer, entry in enumerate(entries):
        np.testing.assert_allclose(np.asarray(entry), engine.entries(layer), rtol=1e-3,
                                   atol=1e-3, err_msg=f"layer {layer}")
        worst = max(worst, float(np.max(np.abs(np.asarray(entry) - engine.entries(layer)))))
    return worst


# ---- the pipeline model -------------------------------------------------------------------------


def pipeline(parts: list[float], sizes: list[float], tail: float, rate: float
             ) -> tuple[float, float, float]:
    """(compute end, exposed transfer, hidden fraction) for parts of ``parts`` seconds each and
    ``sizes`` bytes each over a link of ``rate`` bytes/s, pulled one at a time in order."""
    ready = link_free = 0.0
    for seconds, size in zip(parts, sizes, strict=True):
        ready += seconds
        link_free = max(ready, link_free) + size / rate
    end = ready + tail
    exposed = max(0.0, link_free - end)
    return end, exposed, 1.0 - exposed / (sum(sizes) / rate)


def median_parts(runs: list[list[float]]) -> list[float]:
    return [statistics.median(col) for col in zip(*runs, strict=True)]


def measure(args: argparse.Namespace, t: int, out: dict[str, Shape]) -> None:
    model = load_model(args.model)
    config, params = model.config, model.params
    layers = config.num_layers
    per_token = layers * 2 * config.num_kv_heads * config.head_dim \
        * jnp.dtype(config.dtype).itemsize
    if any(k in params["layers"][0] for k in ("bq", "q_norm", "router")):
        raise SystemExit("the split forward here is Llama's only (no biases, q/k norms, experts)")
    t_build = time.perf_counter()
    engine = Engine(params, config, t, args.chunk)
    dtype = jnp.dtype(engine.pool_cfg.storage_dtype)
    splits = {g: SplitForward(params, config, t, g, dtype) for g in [*args.groups, layers]}
    print(f"# context {t}: compiled in {time.perf_counter() - t_build:.1f} s; "
          f"KV {per_token} bytes/token, {t * per_token / 1e6:.1f} MB", flush=True)
    worst = max(check_equal(engine, splits[layers],
                            jnp.asarray(prompt(t, config.vocab_size, 0))),
                check_equal(engine, splits[min(args.groups)],
                            jnp.asarray(prompt(t, config.vocab_size, 1))))
    print(f"# context {t}: split forward == engine prefill (K/V of {layers} layers, logits; "
          f"largest difference {worst:.1e})", flush=True)
    whole: list[float] = []
    chunks: list[list[float]] = []
    groups: dict[int, list[list[float]]] = {g: [] for g in splits}
    heads: dict[int, list[float]] = {g: [] for g in splits}
    for rep in range(args.repeats):
        tokens = jnp.asarray(prompt(t, config.vocab_size, 10 + rep))
        whole.append(timed(lambda tokens=tokens: engine.forward(tokens, 0, t)))
        chunks.append([timed(lambda s=s, tokens=tokens: engine.forward(tokens, s, args.chunk))
                       for s in range(0, t, args.chunk)])
        for g, split in splits.items():
            part_s, head_s, _, _ = split.run(tokens)
            groups[g].append(part_s)
            heads[g].append(head_s)
        print(f"# context {t}: repeat {rep + 1} done, load {os.getloadavg()[0]:.1f}", flush=True)
    total = t * per_token
    out["one forward (engine)"] = ([statistics.median(whole)], [float(total)], 0.0)
    chunk_s = median_parts(chunks)
    out[f"chunks of {args.chunk} (engine)"] = (
        chunk_s, [float(args.chunk * per_token)] * len(chunk_s), 0.0)
    for g in splits:
        part_s = median_parts(groups[g])
        label = "one forward (split code, unsplit)" if g == layers else f"layers/{g}"
        out[label] = (part_s, [float(total * (hi - lo) / layers)
                               for lo, hi in splits[g].bounds], statistics.median(heads[g]))


def report(t: int, shapes: dict[str, Shape], links: list[float]) -> None:
    base = shapes["one forward (engine)"][0][0]
    split_base = sum(shapes["one forward (split code, unsplit)"][0])
    print(f"\n### context {t} tokens\n")
    print("| shape | parts | part MB | compute s (parts: min / max s) | vs one forward "
          "| split overhead | " + " | ".join(
              f"{r * 8:g} Gbit/s: exposed ms / hidden / TTFT s" for r in links) + " |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(links))
    for label, (parts, sizes, tail) in shapes.items():
        compute = sum(parts) + tail
        overhead = (f"{compute / split_base - 1:+.1%}" if label.startswith("layers/")
                    else "")
        cells = []
        for rate in links:
            shape = (parts, sizes, tail) if len(parts) > 1 else ([compute], sizes, 0.0)
            end, exposed, hidden = pipeline(*shape, rate * 1e9)
            cells.append(f"{exposed * 1e3:.0f} / {max(hidden, 0.0):.0%} / {end + exposed:.2f}")
        print(f"| {label} | {len(parts)} | {sizes[0] / 1e6:.1f} | {compute:.2f} "
              f"({min(parts):.2f} / {max(parts):.2f}) | {base / compute:.2f}x "
              f"| {overhead} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 3, 6, 10, 15])
    ap.add_argument("--links", type=float, nargs="+", default=[0.125, 1.25],
                    help="link rates in GB/s (0.125 = 1 Gbit/s)")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    print(f"# bench_part_shape; {args.model}, jax {jax.__version__} {jax.default_backend()}, "
          f"{len(os.sched_getaffinity(0))} CPUs, load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; median of {args.repeats}",
          flush=True)
    results: dict[int, dict[str, Shape]] = {}
    for t in args.contexts:
        results[t] = {}
        measure(args, t, results[t])
        report(t, results[t], args.links)
    print(f"\n# done; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
