"""SmolLM2-135M greedy decode: our JAX engine against llama.cpp, same F32 weights, same machine.

Our engine dequantises the shipped Q4_1 GGUF to float32. For llama.cpp to compute on the same
numbers, an F32 GGUF is written once from that file (every quantised tensor dequantised with the
``gguf`` package, the F32 ones copied, all metadata kept, ``general.file_type`` ALL_F32) and cached
next to our converted weights. llama.cpp on the original Q4_1 file is a second reference line.

llama.cpp runs through llama-cpp-python in its own interpreter (``--llama-python``), a long-lived
child process that keeps both models loaded; it is never part of the project's environment. Each
round times, in turn: ours at batch 1 (scheduler), llama.cpp F32, ours at batch 1 (forward only),
llama.cpp Q4_1, ours at batch 8 — all with the same prompt token ids, greedy, after one warm-up of
each (compiles and first-touch excluded). Both engines use both cores (llama.cpp ``--threads``,
XLA's CPU thread pool by default).

"decode ms/token" is the wall time of a decode step that feeds one token per sequence and picks
the next greedily: for ours, a ``Scheduler.step()`` with every sequence running (forward, sampling,
detokenising) and, as a split, the bare ``decode`` forward plus a device argmax; for llama.cpp,
``Llama.eval([token])`` plus an argmax over the logits. The prompt's prefill is excluded.

Prints numbers; asserts nothing. Run:
``.venv/bin/python bench/bench_llamacpp.py --llama-python /work/llamacpp-venv/bin/python``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.io_trio.bench_client import common_prefix
from pd_fsm.jax_engine.model import LoadedModel, decode, load_model, new_kv_pool, prefill
from pd_fsm.jax_engine.model.gguf_loader import find_smollm2_gguf
from pd_fsm.jax_engine.model.weight_cache import source_key
from pd_fsm.jax_engine.paths import cache_dir
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Scheduler, SchedulerArgs
from pd_fsm.text.tokenizer import ChatMessage

PROMPT = "Write a short story about a robot who learns to paint, in three paragraphs."

# The llama.cpp side: one JSON request per stdin line, one JSON reply per stdout line.
_LLAMA_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp

n_ctx, threads = int(sys.argv[1]), int(sys.argv[2])
models = {}

def load(path):
    if path not in models:
        models[path] = llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
            n_threads_batch=threads, verbose=False,
        )
    return models[path]

def next_token(llm):
    # The last evaluated token's logits, straight from the context (llama-cpp-python keeps
    # Llama.scores only with logits_all); greedy = argmax, as in ours.
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))))

print(json.dumps({"ready": True, "version": llama_cpp.__version__,
                  "system_info": llama_cpp.llama_print_system_info().decode()}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t0 = time.perf_counter()
    llm = load(req["model"])
    load_s = time.perf_counter() - t0
    llm.reset()  # n_tokens = 0; the next eval drops the cached K/V beyond it
    t0 = time.perf_counter()
    llm.eval(req["prompt"])
    tok = next_token(llm)
    prompt_s = time.perf_counter() - t0
    out = [tok]
    t0 = time.perf_counter()
    for _ in range(req["steps"]):
        llm.eval([tok])
        tok = next_token(llm)
        out.append(tok)
    decode_s = time.perf_counter() - t0
    print(json.dumps({"tokens": out, "prompt_s": prompt_s, "decode_s": decode_s,
                      "load_s": load_s}), flush=True)
"""


# ----------------------------------------------------------------------------- F32 GGUF


def f32_gguf(source: Path) -> tuple[Path, bool]:
    """The F32 copy of ``source`` in the weight cache (written once); (path, written now)."""
    target = cache_dir() / f"smollm2-f32-{source_key(source)}.gguf"
    if target.exists():
        return target, False
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        alignment = reader.fields.get("general.alignment")
        if alignment is not None:
            writer.add_custom_alignment(int(alignment.contents()))
        for field in reader.fields.values():
            # GGUF.* are the reader's virtual fields; the writer adds the architecture itself.
            if field.name.startswith("GGUF.") or field.name in (
                "general.architecture",
                "general.alignment",
            ):
                continue
            vtype = field.types[0]
            sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            if field.name == "general.file_type":
                value = int(gguf.LlamaFileType.ALL_F32)
            writer.add_key_value(field.name, value, vtype, sub_type=sub_type)
        for t in reader.tensors:
            # t.shape is GGUF's ne order (innermost first); numpy's is the reverse, and the writer
            # reverses a numpy shape back into ne order.
            shape = tuple(int(n) for n in reversed(t.shape))
            w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            writer.add_tensor(t.name, np.ascontiguousarray(w))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target, True


# ----------------------------------------------------------------------------- ours


def ours_decode(
    sched: Scheduler, prompt_ids: list[int], batch: int, steps: int
) -> tuple[float, list[int]]:
    """Seconds per decode step over ``steps`` steps with ``batch`` sequences all running, and the
    first sequence's greedy tokens (the prompt's token, then one per step)."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
    reqs = [sched.make_request(f"r{i}", prompt_ids, sampling) for i in range(batch)]
    for req in reqs:
        sched.add_request(req)
    while sched.waiting or sched.prefilling or any(not r.output_ids for r in reqs):
        sched.step()  # prefill (that step may also run a first decode)
    assert len(sched.running) == batch, "every sequence must be decoding together"
    starts = [len(r.output_ids) for r in reqs]
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    elapsed = time.perf_counter() - t0
    assert all(len(r.output_ids) == s + steps for r, s in zip(reqs, starts, strict=True))
    tokens = list(reqs[0].output_ids[: 1 + steps])
    for req in reqs:
        sched.abort(req.rid)
    sched.drain_outputs()
    assert sched.stats().free_pages == sched.stats().total_pages
    return elapsed / steps, tokens


class ForwardOnly:
    """Our model without the scheduler: ``decode`` plus a device argmax per step, batch 1, the
    same page-table width as the scheduler's (what the scheduler adds is the difference)."""

    def __init__(self, model: LoadedModel, table_width: int, n_ctx: int, page_size: int) -> None:
        self.model, self.cfg = model, model.config
        n_pages = -(-n_ctx // page_size)
        self.kv = new_kv_pool(self.cfg.kv_pool_config(1 + n_pages, page_size))
        self.pages = np.arange(1, 1 + n_pages, dtype=np.int32)
        self.table = jnp.asarray(np.pad(self.pages, (0, table_width - n_pages))[None])

    def run(self, prompt_ids: list[int], steps: int) -> tuple[float, list[int]]:
        params, cfg = self.model.params, self.cfg
        logits, self.kv = prefill(
            params, self.kv, jnp.asarray(prompt_ids, jnp.int32), len(prompt_ids),
            jnp.asarray(self.pages), config=cfg,
        )
        tok = int(jnp.argmax(logits))
        out, pos = [tok], len(prompt_ids)
        t0 = time.perf_counter()
        for _ in range(steps):
            positions = jnp.asarray([pos], jnp.int32)
            logits, self.kv = decode(
                params, self.kv, jnp.asarray([tok], jnp.int32), positions, self.table,
                positions + 1, config=cfg,
            )
            tok = int(jnp.argmax(logits[0]))
            out.append(tok)
            pos += 1
        return (time.perf_counter() - t0) / steps, out


# ----------------------------------------------------------------------------- llama.cpp


class LlamaChild:
    def __init__(self, python: str, n_ctx: int, threads: int) -> None:
        self.proc = subprocess.Popen(
            [python, "-c", _LLAMA_CHILD, str(n_ctx), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.hello = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp child exited (rc {self.proc.wait()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def run(self, model: Path, prompt_ids: list[int], steps: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        req = {"model": str(model), "prompt": prompt_ids, "steps": steps}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ----------------------------------------------------------------------------- report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--llama-python", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    ap.add_argument("--batch", type=int, default=8, help="our second batch size")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    ap.add_argument("--n-ctx", type=int, default=512, help="context of both engines")
    args = ap.parse_args()

    source = find_smollm2_gguf()
    t0 = time.perf_counter()
    f32_path, written = f32_gguf(source)
    print(f"source: {source.name}; F32 copy: {f32_path} "
          f"({'written' if written else 'cached'} in {time.perf_counter() - t0:.1f}s, "
          f"{f32_path.stat().st_size / 2**20:.0f} MiB)")

    model = load_model("smollm2")
    tok = model.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template([ChatMessage("user", PROMPT)]))
    steps = args.tokens
    if len(prompt_ids) + steps + 16 > args.n_ctx:
        raise SystemExit(f"prompt {len(prompt_ids)} + {steps} tokens do not fit n_ctx {args.n_ctx}")
    page_size = 16
    pages_per_seq = -(-args.n_ctx // page_size)
    sched = Scheduler(
        SchedulerArgs(
            model="smollm2",
            num_pages=1 + args.batch * pages_per_seq,
            page_size=page_size,
            max_running=args.batch,
            context_length=args.n_ctx,
        ),
        model=model,
    )

    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"jax {jax.__version__} backend {jax.default_backend()}; "
          f"prompt {len(prompt_ids)} tokens, {steps} decode steps timed per run, "
          f"{args.repeats} rounds")

    child = LlamaChild(args.llama_python, args.n_ctx, args.threads)
    print(f"llama-cpp-python {child.hello['version']}, {args.threads} threads; "
          f"{child.hello['system_info'].strip()}")
    q4_path = source
    fwd = ForwardOnly(model, sched.table_width, args.n_ctx, page_size)

    # Warm-up: compiles (ours), model load and first touch (llama.cpp); not timed.
    t0 = time.perf_counter()
    _, ours_tokens = ours_decode(sched, prompt_ids, 1, steps)
    _, ours_batch_tokens = ours_decode(sched, prompt_ids, args.batch, steps)
    _, fwd_tokens = fwd.run(prompt_ids, steps)
    print(f"warm-up ours: {time.perf_counter() - t0:.1f}s")
    warm_f32 = child.run(f32_path, prompt_ids, steps)
    warm_q4 = child.run(q4_path, prompt_ids, steps)
    print(f"warm-up llama.cpp: load F32 {warm_f32['load_s']:.1f}s, Q4_1 {warm_q4['load_s']:.1f}s")

    keys = ("ours b1", "ours fwd", "llama F32", "llama Q4_1", "ours bN")
    times: dict[str, list[float]] = {k: [] for k in keys}
    seqs: dict[str, list[int]] = {
        "ours b1": ours_tokens,
        "ours bN": ours_batch_tokens,
        "ours fwd": fwd_tokens,
        "llama F32": warm_f32["tokens"],
        "llama Q4_1": warm_q4["tokens"],
    }
    for r in range(args.repeats):
        per, toks = ours_decode(sched, prompt_ids, 1, steps)
        times["ours b1"].append(per)
        assert toks == seqs["ours b1"], "our greedy output changed between runs"
        res = child.run(f32_path, prompt_ids, steps)
        times["llama F32"].append(res["decode_s"] / steps)
        per_f, _ = fwd.run(prompt_ids, steps)
        times["ours fwd"].append(per_f)
        res_q = child.run(q4_path, prompt_ids, steps)
        times["llama Q4_1"].append(res_q["decode_s"] / steps)
        per_b, _ = ours_decode(sched, prompt_ids, args.batch, steps)
        times["ours bN"].append(per_b)
        print(f"round {r + 1}: ours b1 {per * 1e3:.2f} ms/token (forward only "
              f"{per_f * 1e3:.2f}), llama.cpp F32 "
              f"{res['decode_s'] / steps * 1e3:.2f}, Q4_1 {res_q['decode_s'] / steps * 1e3:.2f}; "
              f"ours b{args.batch} {per_b * 1e3:.2f} ms/step; load average "
              f"{os.getloadavg()[0]:.2f}")
    child.close()

    b = args.batch
    ref_med, ref_min = statistics.median(times["llama F32"]), min(times["llama F32"])
    print()
    print("| engine | decode ms/token, min | median | tokens/s (median) | ms/token ÷ llama.cpp "
          "F32, median (min) |")
    print("|---|---|---|---|---|")
    rows = [
        ("ours (JAX), F32, batch 1", "ours b1", 1),
        ("ours (JAX), F32, batch 1, forward + argmax only", "ours fwd", 1),
        ("llama.cpp, F32, batch 1", "llama F32", 1),
        ("llama.cpp, Q4_1, batch 1", "llama Q4_1", 1),
        (f"ours (JAX), F32, batch {b}", "ours bN", b),
    ]
    for label, key, rows_per_step in rows:
        lo, med = min(times[key]), statistics.median(times[key])
        # Per token at batch N: one step yields N tokens.
        ms_lo, ms_med = lo * 1e3 / rows_per_step, med * 1e3 / rows_per_step
        r_med, r_min = med / rows_per_step / ref_med, lo / rows_per_step / ref_min
        ratio = f"{r_med:.2f}x ({r_min:.2f}x)"
        print(f"| {label} | {ms_lo:.2f} | {ms_med:.2f} | {rows_per_step / med:.1f} | {ratio} |")
    print(f"(batch {b}: {min(times['ours bN']) * 1e3:.1f} / "
          f"{statistics.median(times['ours bN']) * 1e3:.1f} ms per step, min / median)")

    print()
    print("greedy agreement (tokens after the prompt, the first from prefill):")
    n = 1 + steps
    for key in ("llama F32", "llama Q4_1", "ours bN", "ours fwd"):
        same = common_prefix(seqs["ours b1"], seqs[key])
        print(f"  ours b1 vs {key}: first {same} of {n} tokens identical")
    same = common_prefix(seqs["llama F32"], seqs["llama Q4_1"])
    print(f"  llama F32 vs llama Q4_1: first {same} of {n} tokens identical")
    for key in ("ours b1", "llama F32", "llama Q4_1"):
        text = tok.decode(seqs[key][:32], skip_special_tokens=False)
        print(f"  {key}, first 32 tokens: {text!r}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
