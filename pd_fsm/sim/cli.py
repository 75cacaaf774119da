"""`pd-fsm sim`: run seeds of the simulated cluster (``pd_fsm.sim.world``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import attrs

from pd_fsm.core.routing import POLICIES, RoutingConfig
from pd_fsm.sim.config import PLANTS, SimConfig
from pd_fsm.sim.world import run_seed


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="the whole cluster's core, simulated and seeded: find bugs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--seeds", default="0:1000", metavar="A:B",
                       help="run seeds A..B-1 and print the failing ones (default 0:1000)")
    which.add_argument("--seed", type=int, default=None,
                       help="run one seed (with --trace: print every step, bit for bit)")
    p.add_argument("--trace", action="store_true", help="with --seed: print its steps")
    p.add_argument("--plant", choices=sorted(PLANTS), default=None,
                   help="run with a known bug planted (the invariants must catch it)")
    p.add_argument("--plants", action="store_true",
                   help="run every planted bug over the seeds; print the first seed that caught "
                        "each")
    p.add_argument("--no-faults", dest="faults", action="store_false",
                   help="no crashes, partitions, lost or corrupt frames, failing pulls")
    p.add_argument("--recompute", action="store_true",
                   help="D prefills a room itself when P or the transfer fails it")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--requests", type=int, default=10, help="clients per seed (default 10)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin",
                   help="the proxy's routing policy, both legs (default round_robin)")
    p.set_defaults(func=main)


def _seeds(text: str) -> range:
    a, _, b = text.partition(":")
    if not a.isdigit() or not b.isdigit() or int(b) <= int(a):
        raise ValueError(f"--seeds takes A:B with A < B, got {text!r}")
    return range(int(a), int(b))


def main(args: argparse.Namespace) -> int:
    try:
        seeds = _seeds(args.seeds)
        if min(args.prefill, args.decode, args.requests) < 1:
            raise ValueError("--prefill, --decode and --requests must be >= 1")
    except ValueError as exc:
        print(f"pd-fsm sim: {exc}", file=sys.stderr)
        return 2
    routing = RoutingConfig(prefill_policy=args.policy, decode_policy=args.policy)
    config = SimConfig(prefill=args.prefill, decode=args.decode, requests=args.requests,
                       faults=args.faults, recompute=args.recompute, plant=args.plant,
                       routing=routing)
    if args.seed is not None:
        result = run_seed(args.seed, config, trace=args.trace)
        if args.trace:
            print("\n".join(result.trace))
        print(f"seed {args.seed}: {result.steps} steps, answers {dict(result.answered)}, "
              f"{result.violation or 'every invariant held'}")
        return 1 if result.violation else 0
    if args.plants:
        for plant in sorted(PLANTS):
            planted = attrs.evolve(config, plant=plant)
            first = next((s for s in seeds if run_seed(s, planted).violation), None)
            found = f"first caught by seed {first}" if first is not None else "NOT caught"
            print(f"{plant:<26} {found}  ({PLANTS[plant]})", flush=True)
        return 0
    start = time.perf_counter()
    failed = 0
    answers: Counter[str] = Counter()
    steps = 0
    for seed in seeds:
        result = run_seed(seed, config)
        answers.update(result.answered)
        steps += result.steps
        if result.violation:
            failed += 1
            print(f"seed {seed}: {result.violation}", flush=True)
    took = time.perf_counter() - start
    print(f"{len(seeds)} seeds, {failed} failing, {len(seeds) / took:.0f} seeds/s "
          f"({steps / len(seeds):.0f} steps a seed); answers {dict(sorted(answers.items()))}")
    return 1 if failed else 0
