"""`--kv-dtype bfloat16` against float32 KV, SmolLM2, in one run (issue 33 §2): bytes per room,
pull time P -> D (two schedulers and two real transfer servers in this process, as
``tests/support/pd_pair.py`` wires them), prefill time, decode step at batch 8, and greedy
agreement with the f32 run (how many tokens match before the first difference) on the llama.cpp
benchmark's prompt and seven short ones. The two dtypes alternate repetition by repetition (the
machine is shared). Asserts nothing.

    .venv/bin/python bench/bench_kv_dtype.py [--prompt-len 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import DisaggregationArgs
from pd_fsm.text.tokenizer import ChatMessage
from tests.support.pd_pair import BOOT, PDPair

DTYPES = ("float32", "bfloat16")
PAGE = 16
STORY = "Write a short story about a robot who learns to paint, in three paragraphs."
SHORT = ["The", "Paris is", "def fibonacci(n):", "The quick brown fox jumps over the lazy dog.",
         "Water boils at a temperature of", "In 1969, the first humans landed on",
         "The capital of France is"]


def _sched(model: LoadedModel, kv: str, pages: int = 512) -> Scheduler:
    return Scheduler(SchedulerArgs(model="smollm2", num_pages=pages, page_size=PAGE,
                                   max_running=8, max_batched_tokens=1024, kv_dtype=kv),
                     model=model)


def _ttft(sched: Scheduler, ids: list[int], rid: str) -> float:
    req = Req(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=1))
    t0 = time.perf_counter()
    sched.add_request(req)
    sched.run_until_idle()
    return time.perf_counter() - t0


def _decode_step(sched: Scheduler, ids: list[int], steps: int, tag: str) -> float:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=steps + 8, ignore_eos=True)
    reqs = [Req(f"{tag}-{i}", ids, sampling) for i in range(8)]
    for req in reqs:
        sched.add_request(req)
    while sched.waiting or sched.prefilling or any(not r.output_ids for r in reqs):
        sched.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    elapsed = time.perf_counter() - t0
    for req in reqs:
        sched.abort(req.rid)
    sched.drain_outputs()
    return elapsed / steps


def _greedy(sched: Scheduler, ids: list[int], n: int, rid: str) -> list[int]:
    req = Req(rid, ids, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
    sched.add_request(req)
    sched.run_until_idle()
    return list(req.output_ids)


def _agree(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _pd_args(mode: str, kv: str) -> DisaggregationArgs:
    return DisaggregationArgs(model="smollm2", num_pages=256, page_size=PAGE, max_running=8,
                              max_batched_tokens=1024, disaggregation_mode=mode,
                              instance_id=f"{mode}-0", kv_dtype=kv, lease_initial=600.0,
                              lease_extension=600.0)


def _pulls(model: LoadedModel, kv: str, ids: list[int], rooms: int) -> tuple[float, int]:
    """Median seconds of one room's pull (submit -> KV ready, D's own measure) and its bytes."""
    pair = PDPair(model, _pd_args("prefill", kv), _pd_args("decode", kv))
    sampling = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    try:
        times: list[float] = []
        for room in range(rooms + 1):
            before = dict(pair.d.role.transfer_stats)
            pair.d.role.add_pd_request(Req(f"d{room}", ids, sampling), BOOT, room)
            pair.p.role.add_pd_request(Req(f"d{room}", ids, sampling), room)
            pair.run(lambda b=before: pair.d.role.transfer_stats["pulls_ok"] > b["pulls_ok"]
                     and pair.books_balanced())
            if room:  # the first compiles this page bucket's transfer
                times.append(pair.d.role.transfer_stats["seconds"] - before["seconds"])
                nbytes = pair.d.role.transfer_stats["bytes"] - before["bytes"]
        return statistics.median(times), nbytes
    finally:
        pair.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    args = ap.parse_args()
    model = load_model("smollm2")
    tok = model.tokenizer
    rng = np.random.default_rng(0)
    long_ids = rng.integers(100, model.config.vocab_size, size=args.prompt_len).tolist()
    scheds = {kv: _sched(model, kv) for kv in DTYPES}
    for kv, s in scheds.items():  # warm: compile the shapes used below
        _ttft(s, long_ids, f"warm-{kv}")
        _decode_step(s, long_ids[:64], 2, f"warm-{kv}")

    ttft: dict[str, list[float]] = {kv: [] for kv in DTYPES}
    step: dict[str, list[float]] = {kv: [] for kv in DTYPES}
    for r in range(args.repeats):
        for kv in DTYPES if r % 2 == 0 else DTYPES[::-1]:
            ttft[kv].append(_ttft(scheds[kv], long_ids, f"t{r}-{kv}"))
            step[kv].append(_decode_step(scheds[kv], long_ids[:64], args.decode_steps,
                                         f"s{r}-{kv}"))
    pulls = {kv: _pulls(model, kv, long_ids, args.repeats) for kv in DTYPES}

    print(f"# KV dtype: SmolLM2, {args.prompt_len}-token prompt, page size {PAGE}, "
          f"{args.repeats} repetitions alternated, medians\n")
    print("| measure | float32 KV | bfloat16 KV | bf16 / f32 |\n|---|---|---|---|")
    rows = [
        ("bytes per room (pulled)", pulls["float32"][1], pulls["bfloat16"][1], "{:,.0f}"),
        ("pull ms (submit -> KV ready)", 1e3 * pulls["float32"][0], 1e3 * pulls["bfloat16"][0],
         "{:.1f}"),
        (f"prefill ms ({args.prompt_len} tokens, to first token)",
         1e3 * statistics.median(ttft["float32"]), 1e3 * statistics.median(ttft["bfloat16"]),
         "{:.1f}"),
        ("decode ms/step, batch 8", 1e3 * statistics.median(step["float32"]),
         1e3 * statistics.median(step["bfloat16"]), "{:.1f}"),
    ]
    for name, a, b, fmt in rows:
        print(f"| {name} | {fmt.format(a)} | {fmt.format(b)} | {b / a:.2f}x |")

    prompts = {"story (llama.cpp bench, chat)": tok.encode(
        tok.apply_chat_template([ChatMessage("user", STORY)]))}
    prompts |= {repr(t): tok.encode(t) for t in SHORT}
    print(f"\n## Greedy agreement with the f32 KV run ({args.greedy_tokens} tokens each)\n")
    print("| prompt | tokens equal before the first difference |\n|---|---|")
    for i, (name, ids) in enumerate(prompts.items()):
        outs = [_greedy(scheds[kv], ids, args.greedy_tokens, f"g{i}-{kv}") for kv in DTYPES]
        same = _agree(*outs)
        print(f"| {name} | {same if same < args.greedy_tokens else 'all'} of "
              f"{args.greedy_tokens} |")


if __name__ == "__main__":
    main()
