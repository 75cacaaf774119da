"""``pd-fsm sim --profile FILE``: the performance model's predictions (``perf.py``) for every
static placement of one P and one D against a colocated worker, at each arrival rate."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from pd_fsm.sim.perf import Placement, outcome, poisson, simulate
from pd_fsm.sim.perf_profile import Profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("performance model: predict TTFT, TPOT and goodput of placements "
                             "from a `pd-fsm profile` file")
    g.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="run the performance model on this profile instead of seeds")
    g.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5],
                   help="Poisson arrival rates (default 0.25 0.5 1 1.5)")
    g.add_argument("--prompts", type=int, default=24, help="requests per rate (default 24)")
    g.add_argument("--prompt-tokens", default="12-45,260-520", metavar="A-B[,C-D]",
                   help="prompt lengths drawn from these ranges in turn (default 12-45,260-520: "
                        "the benches' mixed prompts)")
    g.add_argument("--output-tokens", type=int, default=32)
    g.add_argument("--cores", type=int, default=2, help="the machine's cores (default 2)")
    g.add_argument("--nice-pairs", nargs="*", default=["0,-10", "10,-5"], metavar="P,D",
                   help="shared placements with these nice values (default 0,-10 10,-5)")
    g.add_argument("--tpot-targets", type=float, nargs="+", default=[0.1, 0.05],
                   help="goodput's TPOT targets (default 0.1 0.05; TTFT: --ttft-target)")


def placements(cores: int, nice_pairs: list[str]) -> list[Placement]:
    out = [Placement(f"colocated (cores 0-{cores - 1})", colocated=True, cores=cores),
           Placement("PD pinned (P and D on half the cores each)", cores=cores),
           Placement("PD shared (equal priority)", cores=cores, shared=True)]
    for pair in nice_pairs:
        p, d = (int(x) for x in pair.split(","))
        out.append(Placement(f"PD shared, nice P {p:+d} / D {d:+d}", cores=cores, shared=True,
                             nice_p=p, nice_d=d))
    return out


def prompt_lengths(spec: str, n: int, seed: int) -> list[int]:
    ranges = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ranges.append((int(lo), int(hi or lo)))
    rng = random.Random(seed)
    return [rng.randint(*ranges[i % len(ranges)]) for i in range(n)]


def main(args: argparse.Namespace) -> int:
    try:
        profile = Profile.load(args.profile)
        lengths = prompt_lengths(args.prompt_tokens, args.prompts, args.seed or 0)
        chosen = placements(args.cores, args.nice_pairs)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pd-fsm sim --profile: {exc}", file=sys.stderr)
        return 2
    targets = " and ".join(f"{t * 1000:g} ms" for t in args.tpot_targets)
    print(f"{profile.model}: {args.prompts} prompts of {args.prompt_tokens} tokens, "
          f"{args.output_tokens} out, cores {args.cores}; goodput at TTFT <= "
          f"{args.ttft_target:g} s and TPOT <= {targets}")
    for rate in args.rates:
        print(f"\n### Poisson {rate:g} req/s (predicted)\n\n| placement | TTFT p50 s | TPOT p50 "
              f"ms | goodput req/s at each TPOT target |\n|---|---|---|---|")
        for placement in chosen:
            done = simulate(profile, placement,
                            poisson(rate, lengths, args.output_tokens, seed=(args.seed or 0) + 1))
            got = [outcome(done, args.ttft_target, t) for t in args.tpot_targets]
            print(f"| {placement.name} | {got[0].ttft_p50:.2f} | {got[0].tpot_p50 * 1000:.0f} | "
                  + " / ".join(f"{o.goodput:.3f} ({o.met})" for o in got) + " |", flush=True)
    return 0
