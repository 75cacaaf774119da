"""Validate the performance model (issue 30 §4): predict what bench_placement.py or
bench_adaptive.py measured.

Reads a ``pd-fsm profile`` file and a ``bench_placement.py --json`` record; rebuilds that run's
workload (the same prompts, tokenized by the model's tokenizer, and the same Poisson arrival
schedule as ``bench_client.run_load``); runs ``pd_fsm.sim.perf`` for every placement and rate
the bench measured; prints predicted against measured goodput (and TTFT, ITL p50), with the
error. The goal the issue sets: predicted goodput within ±20 % of the measured.

A ``bench_adaptive.py --json`` record carries its schedule (each request's arrival, phase,
prompt and answer tokens, exact under SmolLM2's tokenizer) and its static placements' fields:
every static placement is simulated over that schedule and compared phase by phase and over
the whole run (goodput as that bench counts it: a phase's requests that met both targets over
the phase's seconds).

    .venv/bin/pd-fsm profile --cpus 0 --out bench/profile_smollm2.json
    .venv/bin/pd-fsm profile --cpus 0-1 --merge bench/profile_smollm2.json
    .venv/bin/python bench/bench_placement.py --json /tmp/placement.json
    .venv/bin/python bench/bench_perf_model.py --profile bench/profile_smollm2.json \\
        --measured /tmp/placement.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_fsm.io_trio.bench_client import make_prompts
from pd_fsm.jax_engine.model.registry import load_model
from pd_fsm.sim.perf import Placement, Request, outcome, poisson, simulate
from pd_fsm.sim.perf_cli import load_profile
from pd_fsm.sim.perf_profile import Profile


def percent(err: float) -> str:
    """A relative error as printed; none where the measured goodput was 0."""
    return f"{err * 100:+.0f} %" if math.isfinite(err) else "- (measured 0)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--measured", type=Path, required=True)
    p.add_argument("--max-batched-tokens", type=int, default=0, metavar="N",
                   help="the workers' prefill budget where it is not the profile's (256: "
                        "the CPU default since RESULTS_placement.md run 3)")
    args = p.parse_args()
    profile = load_profile(args.profile, args.max_batched_tokens)
    record = json.loads(args.measured.read_text())
    if "schedule" in record:
        return adaptive(profile, record)
    s = record["settings"]
    tokenizer = load_model(s["model"]).tokenizer
    tokens: dict[int, list[int]] = {}

    def lengths(seed: int) -> list[int]:
        """The prompt lengths of the set made with ``seed`` (a record before fresh prompts at
        each rate has none per run: the one set of ``settings.seed``)."""
        if seed not in tokens:
            prompts = make_prompts(s["dataset"], s["num_prompts"], seed)
            tokens[seed] = [len(tokenizer.encode(x.text)) for x in prompts]
        return tokens[seed]

    every = [n for r in record["runs"] for n in lengths(r.get("prompt_seed", s["seed"]))]
    print(f"{s['model']}, {s['num_prompts']} {s['dataset']} prompts ({min(every)}-"
          f"{max(every)} tokens), {s['max_tokens']} out; goodput at TTFT <= {s['slo_ttft']:g} "
          f"s and TPOT <= {s['slo_tpot'] * 1000:g} ms\n")
    print("| placement | rate | measured goodput | predicted | error | TTFT p50 measured / "
          "predicted s | ITL p50 measured / predicted ms |\n|---|---|---|---|---|---|---|")
    errors = []
    for name, fields in record["placements"].items():
        if fields is None:  # the adaptive cluster: the model has no planner
            continue
        placement = Placement(name, **fields)
        for rate in s["rates"]:
            runs = [r for r in record["runs"] if r["placement"] == name and r["rate"] == rate]
            if not runs:
                continue
            outcomes = [outcome(simulate(profile, placement, poisson(
                rate, lengths(r.get("prompt_seed", s["seed"])), s["max_tokens"],
                seed=s["seed"] + 1)), s["slo_ttft"], s["slo_tpot"]) for r in runs]
            got = min(outcomes, key=lambda o: o.goodput)  # TTFT and ITL shown: the worst run's
            predicted = statistics.mean(o.goodput for o in outcomes)
            measured = statistics.mean(r["goodput"] for r in runs)
            err = (predicted - measured) / measured if measured > 0 else math.nan
            if math.isfinite(err):
                errors.append(abs(err))
            print(f"| {name} | {rate:g} | {measured:.3f} | {predicted:.3f} | "
                  f"{percent(err)} | {statistics.mean(r['ttft_p50'] for r in runs):.2f} / "
                  f"{got.ttft_p50:.2f} | {statistics.mean(r['itl_p50'] for r in runs) * 1000:.0f}"
                  f" / {got.tpot_p50 * 1000:.0f} |", flush=True)
    if errors:
        within = sum(e <= 0.2 for e in errors)
        print(f"\n{within} of {len(errors)} predictions within ±20 % (where the measured goodput "
              f"was > 0); median |error| {statistics.median(errors) * 100:.0f} %")
    return 0


def adaptive(profile: Profile, record: dict[str, Any]) -> int:
    """Predict a bench_adaptive.py run's static placements, phase by phase."""
    s, schedule = record["settings"], record["schedule"]
    seconds, kinds, reps = s["phase_seconds"], s["phases"], s["repeats"]
    print(f"{len(schedule)} requests over {kinds} ({seconds:g} s phases, Poisson {s['rate']:g} "
          f"req/s); goodput at TTFT <= {s['slo_ttft']:g} s and TPOT <= "
          f"{s['slo_tpot'] * 1000:g} ms, requests met per phase second\n")
    print("| placement | span | measured goodput (met) | predicted (met) | error | TTFT p50 "
          "measured / predicted ms |\n|---|---|---|---|---|---|")
    errors = []
    for name, fields in record["placements"].items():
        measured = record["figures"]
        if name not in measured["overall"]:
            continue
        done = simulate(profile, Placement(name, **fields),
                        [Request(q["arrival"], q["prompt"], q["out"]) for q in schedule])
        spans = [(f"phase {k + 1} {kind}", [q["phase"] == k for q in schedule], seconds,
                  measured["phases"][k][name]) for k, kind in enumerate(kinds)]
        spans.append(("whole run", [True] * len(schedule), seconds * len(kinds),
                      measured["overall"][name]))
        for label, mask, span_s, got in spans:
            mine = [r for r, m in zip(done, mask, strict=True) if m]
            met = sum(r.ttft <= s["slo_ttft"] and r.tpot <= s["slo_tpot"] for r in mine)
            predicted = met / span_s
            err = ((predicted - got["goodput"]) / got["goodput"] if got["goodput"] > 0
                   else math.nan)
            if label == "whole run" and math.isfinite(err):
                errors.append(abs(err))
            ttfts = sorted(r.ttft for r in mine)
            ttft = ttfts[len(ttfts) // 2] * 1000 if ttfts else math.nan
            print(f"| {name} | {label} | {got['goodput']:.3f} ({got['met']:.0f}/"
                  f"{reps * len(mine)}) | {predicted:.3f} ({met}) | {percent(err)} | "
                  f"{got['ttft_p50_ms']:.0f} / {ttft:.0f} |", flush=True)
    if errors:
        within = sum(e <= 0.2 for e in errors)
        print(f"\nwhole run: {within} of {len(errors)} static placements predicted within "
              f"±20 % (where the measured goodput was > 0)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
