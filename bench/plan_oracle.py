"""The ceiling of any planner under a workload that shifts between chat, RAG and reasoning, on
a profile (the fleet model, pd_fsm/sim/plan.py): every configuration of one host in each phase
at that phase's own rate; the best single configuration over the phases against the best one
picked per phase (an oracle that switches for free). A planner that switches roles cannot beat
the oracle, so if the oracle is under 1.3x the best static one, so is any planner on these costs.

    .venv/bin/python bench/plan_oracle.py --profile bench/tpu_v5e_profile_derived.json \
        [--itl-measure worst] [--rates 81.5 12.4 17.4]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pd_fsm.sim.chip import HOSTS, ChipCosts
from pd_fsm.sim.fleet import Slo, workload
from pd_fsm.sim.perf_profile import Profile
from pd_fsm.sim.plan import Settings, configurations, evaluate

PHASES = ("chat", "rag", "reasoning")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--itl-measure", choices=("mean", "worst"), default="mean")
    p.add_argument("--rates", type=float, nargs=3, default=[81.5, 12.4, 17.4],
                   help="req/s of each phase, chat rag reasoning (default: each one's "
                        "colocated half-miss rate on the derived profile, 8 chips)")
    p.add_argument("--seconds", type=float, default=60.0)
    args = p.parse_args()
    costs = ChipCosts(Profile.load(args.profile), HOSTS["v5e-8"])
    slo = Slo(itl_measure=args.itl_measure)
    configs = configurations(8)
    good: dict[str, list[float]] = {c.name: [] for c in configs}
    for phase, rate in zip(PHASES, args.rates, strict=True):
        s = Settings(costs, workload(phase, args.seconds), slo)
        for c in configs:
            good[c.name].append(evaluate(s, c, rate).goodput)
    static = max(good, key=lambda n: sum(good[n]))
    per_phase = [max(configs, key=lambda c: good[c.name][i]).name for i in range(3)]
    oracle = sum(good[n][i] for i, n in enumerate(per_phase))
    print(f"{args.profile}, 8 chips, ITL {args.itl_measure}; phases {PHASES} at "
          f"{args.rates} req/s, {args.seconds:g} s each (predicted goodput, req/s)\n")
    print("| configuration | " + " | ".join(PHASES) + " | sum |\n|---|---|---|---|---|")
    for name in sorted(good, key=lambda n: -sum(good[n]))[:6]:
        print(f"| {name} | " + " | ".join(f"{g:.2f}" for g in good[name])
              + f" | {sum(good[name]):.2f} |")
    print(f"\nbest static: {static} ({sum(good[static]):.2f}); best per phase: "
          + ", ".join(f"{ph} {n}" for ph, n in zip(PHASES, per_phase, strict=True))
          + f" ({oracle:.2f}): oracle / best static = {oracle / sum(good[static]):.2f}x")


if __name__ == "__main__":
    main()
