"""The host's time to launch a fused decode step: ``ModelRunner.decode_launch`` as the
overlapped loop calls it (the rows' arrays built, the step dispatched on the device, not read),
with the accelerator's choices (the fused step; attention by the XLA reference) on whatever
device JAX has.

A small model (the tiny config at head_dim 64), because the host's work does not depend on the
model's size: per row, the page table, the tokens carried from the step in flight, the
sampling arrays; per step, one host array and the executable's call. Half the rows sample,
half are greedy. Each launch is timed after the previous step finished, so that a CPU's device
work does not share the cores with it. Prints the median and the fastest of ``--launches``
launches (after ten warm ones) at each row count, in milliseconds.

    python bench/bench_launch_host.py [--rows 1,64] [--launches 60]

Compare two commits by running it at each (`farm-bench` pairs them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import attrs
import jax

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.model import TINY, LoadedModel
from pd_fsm.jax_engine.model.params import random_params
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Scheduler, SchedulerArgs
from pd_fsm.schedulers.plan import plan_decode
from pd_fsm.schedulers.warm_up import warm_up
from pd_fsm.text.tokenizer import CharTokenizer

PROMPT = 64


def launches(sched: Scheduler, rows: int, count: int) -> list[float]:
    """Seconds of each of ``count`` launches of a decode step of ``rows`` running requests."""
    for i in range(rows):
        sp = SamplingParams(max_new_tokens=count + 40, temperature=0.0 if i % 2 else 0.7,
                            seed=i, ignore_eos=True)
        sched.add_request(sched.make_request(f"r{rows}-{i}", [1 + (i + j) % 200
                                                              for j in range(PROMPT)], sp))
    while len(sched.running) < rows:
        sched.step()
    runner, batch = sched.runner, plan_decode(sched.running)
    assert batch is not None
    previous = runner.decode_launch(batch, None)
    laps = []
    for _ in range(count):
        jax.block_until_ready(previous.out)
        start = time.perf_counter()
        launched = runner.decode_launch(batch, previous)
        laps.append(time.perf_counter() - start)
        runner.collect(previous)
        previous = launched
    runner.collect(previous)
    for req in list(sched.running):
        sched.abort(req.rid)
    sched.run_until_idle()
    return laps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64")
    parser.add_argument("--launches", type=int, default=60)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    config = attrs.evolve(TINY, head_dim=64, num_heads=4, num_kv_heads=2)
    model = LoadedModel("tiny", config, random_params(config, 0),
                        CharTokenizer(256, eos_token_id=0))
    sched_args = SchedulerArgs(model="tiny", num_pages=max(rows) * 80 + 8, page_size=16,
                               max_running=max(rows), max_batched_tokens=1024,
                               context_length=1200)
    with backend.using(backend.accelerator_on_cpu("reference")):
        sched = Scheduler(sched_args, model=model)
        warm_up(sched)
        for n in rows:
            laps = launches(sched, n, args.launches + 10)[10:]
            print(json.dumps({"rows": n,
                              "launch_ms_median": round(1e3 * statistics.median(laps), 3),
                              "launch_ms_min": round(1e3 * min(laps), 3),
                              "backend": jax.default_backend()}), flush=True)


if __name__ == "__main__":
    main()
