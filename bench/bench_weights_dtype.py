"""`--dtype bfloat16` (the weights, and the activations computed from them) against float32,
SmolLM2 on this machine's XLA:CPU, in one run: prefill of a 64-token prompt and decode ms/token at
batch 1 through the scheduler (warm; medians of 2). Asserts nothing.

    .venv/bin/python bench/bench_weights_dtype.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_fsm.jax_engine.model import load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs


def main() -> None:
    ids = list(range(100, 164))
    print("| --dtype | prefill 64 tokens ms | decode ms/token (batch 1) |\n|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        model = load_model("smollm2", dtype)
        sched = Scheduler(SchedulerArgs(model="smollm2", dtype=dtype, num_pages=64, page_size=16,
                                        max_running=1, max_batched_tokens=256), model=model)

        def run(tag: str, n: int, s: Scheduler = sched) -> tuple[float, float]:
            req = Req(tag, ids, SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))
            t0 = time.perf_counter()
            s.add_request(req)
            while not req.output_ids:
                s.step()
            t1 = time.perf_counter()
            while len(req.output_ids) < n:
                s.step()
            t2 = time.perf_counter()
            s.run_until_idle()
            return t1 - t0, (t2 - t1) / (n - 1)

        run("warm", 3)
        pre, step = zip(*[run(f"r{i}", 4) for i in range(2)], strict=True)
        print(f"| {dtype} | {1e3 * statistics.median(pre):.0f} | "
              f"{1e3 * statistics.median(step):.0f} |", flush=True)


if __name__ == "__main__":
    main()
