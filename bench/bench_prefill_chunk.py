"""What one prefill forward's size costs on this machine: `--max-batched-tokens` (the padded
tokens a forward may take; a longer prompt is prefilled in chunks of it) against the time to
prefill one prompt, in-process (the colocated scheduler, the prefix cache off), each budget's
first prompt unmeasured (it compiles), then the median of ``--repeats`` prompts of the same
length and other tokens. The baseline is the earlier default, 1,024, in the same run.

    .venv/bin/python bench/bench_prefill_chunk.py                       # SmolLM2, 788 and 2,000
    .venv/bin/python bench/bench_prefill_chunk.py --lengths 300 --budgets 1024 512 256 128

Prints a table; asserts nothing. Results: bench/RESULTS_prefill_chunk.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompt(n: int, vocab: int, salt: int) -> list[int]:
    """``n`` token ids, different for every ``salt`` (no prefix shared between repeats)."""
    return [(7 * i + 13 * salt) % (vocab - 1) + 1 for i in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", type=int, nargs="+", default=[788, 2000])
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 512, 256, 128])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax

    from pd_fsm.jax_engine.model import load_model
    from pd_fsm.jax_engine.sampling.params import SamplingParams
    from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs

    model = load_model(args.model)
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    print(f"# bench_prefill_chunk; {args.model}, jax {jax.__version__} {jax.default_backend()}, "
          f"{len(os.sched_getaffinity(0))} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"median of {args.repeats} after one unmeasured\n")
    print("| prompt tokens | --max-batched-tokens | forwards | prefill s (median) | vs 1,024 |")
    print("|---:|---:|---:|---:|---:|")
    salt = 0
    for n in args.lengths:
        base = None
        for budget in args.budgets:
            sched = Scheduler(SchedulerArgs(model=args.model, num_pages=(n // 16) + 8,
                                            page_size=16, max_running=1,
                                            max_batched_tokens=budget), model=model)
            times = []
            for rep in range(args.repeats + 1):
                salt += 1
                t = time.perf_counter()
                sched.add_request(Req(f"r{rep}", prompt(n, sched.config.vocab_size, salt), one))
                sched.run_until_idle()
                if rep:
                    times.append(time.perf_counter() - t)
            median = statistics.median(times)
            base = median if budget == 1024 else base
            vs = f"{base / median:.2f}x faster" if base else "n/a"
            print(f"| {n} | {budget} | {-(-n // budget)} | {median:.2f} | {vs} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
