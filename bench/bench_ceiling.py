"""How far above the best static placement can any choice among the static placements go on
bench_adaptive.py's shifting workload? The performance model's answer, rate by rate (issue 30 §5).

An adaptive cluster on this machine chooses among the placements the static ones hold
(colocated, P and D split across the cores, P and D sharing them with D above P). If it held, in
every phase, the placement that was best in that phase, it would meet every phase's best static
count; the sum of those over the best static placement's whole run is the most such switching
can gain. bench_adaptive.py prints that ceiling from what it measured; this script asks the
performance model (``pd_fsm.sim.perf``, a ``pd-fsm profile`` file) for it at many rates and
seeds in a few minutes of CPU, to find where the 1.3x goal is within reach at all. The model
held within ±20 % of measured goodput below saturation (RESULTS_adaptive.md: runs 8 and 11,
3 of 3 placements each), not past it: beyond the rate where a placement falls behind, read its
figures as a direction.

    .venv/bin/python bench/bench_ceiling.py --profile bench/profile_smollm2_busy.json \\
        --rates 0.25,0.5,0.75,1,1.5 --seeds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_adaptive import add_workload_args, make_schedule, static_fields  # bench/

from pd_fsm.sim.perf import Placement, Request, simulate
from pd_fsm.sim.perf_cli import load_profile


def met_per_phase(done: list[Request], phase_of: list[int], phases: int, ttft: float,
                  tpot: float) -> list[int]:
    met = [0] * phases
    for r, k in zip(done, phase_of, strict=True):
        met[k] += r.ttft <= ttft and r.tpot <= tpot
    return met


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--rates", default="0.25,0.5,0.75,1,1.5",
                   help="Poisson rates to model, comma-separated")
    p.add_argument("--seeds", type=int, default=3, help="schedules per rate (seeds 0..N-1)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--tpot", default="0.1,0.05", help="TPOT targets, comma-separated")
    add_workload_args(p)
    args = p.parse_args()
    profile = load_profile(args.profile, 0)
    tpots = [float(x) for x in args.tpot.split(",")]
    fields = static_fields(args)
    names = list(fields)
    print(f"{args.phases}, {args.phase_seconds:g} s phases (A: prompts {args.a_prompt[0]}-"
          f"{args.a_prompt[1]} tokens, {args.a_out[0]}-{args.a_out[1]} out; B: prompts "
          f"{args.b_prompt[0]}-{args.b_prompt[1]}, {args.b_out[0]}-{args.b_out[1]} out), "
          f"{args.seeds} schedule(s) per rate, profile {args.profile.name}; met at TTFT <= "
          f"{args.slo_ttft:g} s, as the model predicts it\n")
    print("| rate | TPOT target | sent | " + " | ".join(f"{n} met" for n in names)
          + " | each phase's best, summed | switching's ceiling | every request met |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|---|")
    for rate in (float(x) for x in args.rates.split(",")):
        # placement -> TPOT target -> met per phase, summed over the seeds
        per: dict[str, dict[float, list[int]]] = {
            n: {t: [0] * len(args.phases) for t in tpots} for n in names}
        sent = 0
        for seed in range(args.seeds):
            sched = make_schedule(argparse.Namespace(**{**vars(args), "rate": rate,
                                                        "seed": seed}))
            sent += len(sched.arrivals)
            for name in names:
                done = simulate(profile, Placement(name, **fields[name]), [
                    Request(a, q.words, q.max_tokens)
                    for a, q in zip(sched.arrivals, sched.prompts, strict=True)])
                for t in tpots:
                    got = met_per_phase(done, sched.phase_of, len(args.phases),
                                        args.slo_ttft, t)
                    per[name][t] = [a + b for a, b in zip(per[name][t], got, strict=True)]
        for t in tpots:
            totals = {n: sum(per[n][t]) for n in names}
            best = max(totals.values())
            picked = sum(max(per[n][t][k] for n in names) for k in range(len(args.phases)))
            ratio = f"{picked / best:.2f}x" if best else "-"
            every = f"{sent / best:.2f}x" if best else "-"
            print(f"| {rate:g} | {t * 1000:g} ms | {sent} | "
                  + " | ".join(str(totals[n]) for n in names)
                  + f" | {picked} | {ratio} | {every} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
