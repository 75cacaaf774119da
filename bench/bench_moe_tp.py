"""A tiny mixture-of-experts model (the Qwen3-MoE reference checkpoint,
``tests/fixtures/hf/qwen3_moe``: 4 experts, 2 per token, 4 kv-heads) at tp 1, 2 and 4 on forced
CPU devices (each expert cut along its intermediate dimension), against the dense Qwen3
reference checkpoint (the same attention widths; one dense MLP of 128 where the MoE has 4
experts of 48 in its first layer) in the same run: prefill tokens/s and decode ms/step at batch
4. Asserts nothing. The dense one's 2 kv-heads allow tp 1 and 2.

    .venv/bin/python bench/bench_moe_tp.py [--repeats 5]
"""

from __future__ import annotations

import os
import sys

# Before JAX starts (the pd_fsm imports below): it fixes its device count then.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pd_fsm.jax_engine.sampling.params import SamplingParams  # noqa: E402
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hf"


def _sched(model: str, tp: int) -> Scheduler:
    return Scheduler(SchedulerArgs(model=str(FIXTURES / model), num_pages=256, page_size=16,
                                   max_running=4, max_batched_tokens=256, tp_size=tp))


def _prefill_s(sched: Scheduler, tag: str) -> float:
    req = Req(tag, list(range(3, 203)), SamplingParams(temperature=0.0, max_new_tokens=1))
    t0 = time.perf_counter()
    sched.add_request(req)
    sched.run_until_idle()
    return time.perf_counter() - t0


def _step_s(sched: Scheduler, tag: str, steps: int = 20) -> float:
    sampling = SamplingParams(temperature=0.0, max_new_tokens=steps + 4, ignore_eos=True)
    reqs = [Req(f"{tag}-{i}", list(range(5, 37)), sampling) for i in range(4)]
    for req in reqs:
        sched.add_request(req)
    while sched.waiting or sched.prefilling or any(not r.output_ids for r in reqs):
        sched.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    elapsed = (time.perf_counter() - t0) / steps
    sched.run_until_idle()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    configs = [("qwen3_moe", 1), ("qwen3_moe", 2), ("qwen3_moe", 4), ("qwen3", 1), ("qwen3", 2)]
    scheds = {c: _sched(*c) for c in configs}
    for c, s in scheds.items():  # warm: compile every shape used below
        _prefill_s(s, f"w{c}")
        _step_s(s, f"w{c}", 2)
    pre: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    step: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    for r in range(args.repeats):
        for c in configs if r % 2 == 0 else configs[::-1]:
            pre[c].append(_prefill_s(scheds[c], f"p{r}{c}"))
            step[c].append(_step_s(scheds[c], f"s{r}{c}"))
    print(f"# tiny MoE vs the dense Qwen3 fixture at tp 1, 2, 4 (forced CPU devices), "
          f"{args.repeats} repetitions alternated, medians\n")
    print("| model | tp | prefill tokens/s (200 tokens) | decode ms/step (batch 4) |")
    print("|---|---|---|---|")
    for c in configs:
        p, s = statistics.median(pre[c]), statistics.median(step[c])
        print(f"| {c[0]} | {c[1]} | {200 / p:.0f} | {s * 1e3:.2f} |")


if __name__ == "__main__":
    main()
