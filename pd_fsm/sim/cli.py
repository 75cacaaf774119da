"""`pd-fsm sim`: run seeds of the simulated cluster (``pd_fsm.sim.world``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Mapping

import attrs

from pd_fsm.core.routing import POLICIES, RoutingConfig
from pd_fsm.sim import perf_cli
from pd_fsm.sim.config import (
    PLANTS,
    REAL_ONLY_PLANTS,
    SCENARIO_PLANTS,
    SimConfig,
    Violation,
    Workload,
)
from pd_fsm.sim.scenarios import SCENARIOS, scenario_config
from pd_fsm.sim.world import run_seed, run_workload


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim", help="the whole cluster's core, simulated and seeded: find bugs")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--seeds", default="0:1000", metavar="A:B",
                       help="run seeds A..B-1 and print the failing ones (default 0:1000)")
    which.add_argument("--seed", type=int, default=None,
                       help="run one seed (with --trace: print every step, bit for bit)")
    p.add_argument("--trace", action="store_true", help="with --seed: print its steps")
    p.add_argument("--stream-tokens", type=int, default=0, metavar="N",
                   help="P streams each room's KV in parts of N prompt tokens while it "
                        "prefills (--disaggregation-stream-tokens; 0: after the prefill)")
    p.add_argument("--plant", choices=sorted(PLANTS), default=None,
                   help="run with a known bug planted (the invariants must catch it)")
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help="stage a named fault on purpose, with a check of its own "
                        "(pd_fsm/sim/scenarios.py): " + "; ".join(
                            f"{k}: {v}" for k, v in sorted(SCENARIOS.items())))
    p.add_argument("--plants", action="store_true",
                   help="run every planted bug over the seeds; print the first seed that caught "
                        "each")
    p.add_argument("--schedulers", choices=("modelled", "real"), default="modelled",
                   help="modelled schedulers (default; thousands of seeds a minute) or the real "
                        "PD schedulers on the tiny model, every step run (sim/real.py)")
    p.add_argument("--no-faults", dest="faults", action="store_false",
                   help="no crashes, partitions, lost or corrupt frames, failing pulls")
    p.add_argument("--recompute", action="store_true",
                   help="D prefills a room itself when P or the transfer fails it")
    p.add_argument("--kv-checksum", action="store_true",
                   help="P and D run KV checksums (--disaggregation-kv-checksum), and some pulls "
                        "arrive corrupted among the faults")
    p.add_argument("--role-switches", type=float, default=SimConfig().role_switches,
                   metavar="P",
                   help="with faults: the chance (drawn twice a seed) that a worker is asked to "
                        "switch its role, P to D or D to P (default %(default)s; 0: none)")
    p.add_argument("--sigterms", type=float, default=SimConfig().sigterms, metavar="P",
                   help="with faults: the chance (drawn twice a seed) that a worker gets "
                        "SIGTERM: it drains (a D hands its streams off), exits and restarts "
                        "(default %(default)s; 0: none)")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--requests", type=int, default=10, help="clients per seed (default 10)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin",
                   help="the proxy's routing policy, both legs (default round_robin)")
    p.add_argument("--local-prefill-without-prefill", action="store_true",
                   help="the proxy's D prefills a room alone while no P is listed (`pd-fsm "
                        "proxy --local-prefill-without-prefill`), as under pd-fsm cluster "
                        "--planner")
    _add_workload_arguments(p)
    perf_cli.add_arguments(p)
    p.set_defaults(func=main)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload mode: try P:D ratios and routing policies on the "
                             "cost model (no faults)")
    w.add_argument("--workload", action="store_true",
                   help="Poisson arrivals through each ratio x policy; print TTFT, TPOT, "
                        "throughput and goodput")
    w.add_argument("--rate", type=float, default=2.0, help="requests per second (default 2)")
    w.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    w.add_argument("--groups", type=int, default=8,
                   help="shared prompt prefixes (default 8; 0: none)")
    w.add_argument("--prefix-tokens", type=int, default=200, help="tokens of each prefix (200)")
    w.add_argument("--max-output", type=int, default=32, help="output tokens, 1..N (32)")
    w.add_argument("--ratios", default="1:3,2:2,3:1", help="P:D ratios (default 1:3,2:2,3:1)")
    w.add_argument("--policies", default=",".join(POLICIES),
                   help="routing policies to compare (default all)")
    w.add_argument("--ttft-target", type=float, default=2.0, help="goodput: TTFT (s, 2)")
    w.add_argument("--tpot-target", type=float, default=0.2, help="goodput: TPOT (s, 0.2)")


def _seeds(text: str) -> range:
    a, _, b = text.partition(":")
    if not a.isdigit() or not b.isdigit() or int(b) <= int(a):
        raise ValueError(f"--seeds takes A:B with A < B, got {text!r}")
    return range(int(a), int(b))


def main(args: argparse.Namespace) -> int:
    if args.profile is not None:
        return perf_cli.main(args)
    if args.workload:
        return _workload(args)
    try:
        seeds = _checked_seeds(args)
    except ValueError as exc:
        print(f"pd-fsm sim: {exc}", file=sys.stderr)
        return 2
    routing = RoutingConfig(prefill_policy=args.policy, decode_policy=args.policy,
                            local_prefill_without_prefill=args.local_prefill_without_prefill)
    config = SimConfig(prefill=args.prefill, decode=args.decode, requests=args.requests,
                       faults=args.faults, recompute=args.recompute, plant=args.plant,
                       kv_checksum=args.kv_checksum, role_switches=args.role_switches,
                       sigterms=args.sigterms,
                       routing=routing, schedulers=args.schedulers,
                       stream_tokens=args.stream_tokens)
    if args.plant in REAL_ONLY_PLANTS and args.schedulers != "real":
        print(f"pd-fsm sim: --plant {args.plant} needs --schedulers real", file=sys.stderr)
        return 2
    if args.scenario is not None:
        config = scenario_config(args.scenario, config)
    if args.seed is not None:
        return _one_seed(args.seed, config, args.trace)
    if args.plants:
        return _every_plant(seeds, config, args.schedulers)
    return _many_seeds(seeds, config)


def _checked_seeds(args: argparse.Namespace) -> range:
    """``--seeds``, once every numeric flag is in range (ValueError naming the flag if not)."""
    seeds = _seeds(args.seeds)
    if min(args.prefill, args.decode, args.requests) < 1:
        raise ValueError("--prefill, --decode and --requests must be >= 1")
    if not 0.0 <= args.role_switches <= 1.0:
        raise ValueError("--role-switches is a chance: between 0 and 1")
    if not 0.0 <= args.sigterms <= 1.0:
        raise ValueError("--sigterms is a chance: between 0 and 1")
    if args.stream_tokens < 0:
        raise ValueError("--stream-tokens must be >= 0")
    return seeds


def _one_seed(seed: int, config: SimConfig, trace: bool) -> int:
    """``--seed``: its outcome (with ``--trace``, every step first)."""
    result = run_seed(seed, config, trace=trace)
    if trace:
        print("\n".join(result.trace))
    print(f"seed {seed}: {result.steps} steps, answers {dict(result.answered)}, "
          f"{result.violation or 'every invariant held'}")
    if result.switches:
        print(_switches(result.switches, result.races, "switches"))
    if result.sigterms:
        print(f"SIGTERMs {result.sigterms}")
    if result.handoffs:
        print(_handoffs(result.handoffs))
    if result.scenario:
        print(f"scenario {result.scenario}")
    return 1 if result.violation else 0


def _every_plant(seeds: range, config: SimConfig, schedulers: str) -> int:
    """``--plants``: the first seed that caught each planted bug."""
    for plant in sorted(PLANTS):
        if plant in REAL_ONLY_PLANTS and schedulers != "real":
            continue
        planted = attrs.evolve(config, plant=plant)
        if plant in SCENARIO_PLANTS:  # only its scenario stages the fault it lets through
            planted = scenario_config(SCENARIO_PLANTS[plant], planted)
        first = next((s for s in seeds if run_seed(s, planted).violation), None)
        found = f"first caught by seed {first}" if first is not None else "NOT caught"
        print(f"{plant:<26} {found}  ({PLANTS[plant]})", flush=True)
    return 0


def _many_seeds(seeds: range, config: SimConfig) -> int:
    """``--seeds``: every failing seed, then the totals."""
    start = time.perf_counter()
    failed = 0
    answers: Counter[str] = Counter()
    switches: Counter[str] = Counter()
    raced: Counter[str] = Counter()  # kind -> seeds with a switch that raced it
    handoffs: Counter[str] = Counter()
    sigterms: Counter[str] = Counter()
    scenario: Counter[str] = Counter()
    steps = 0
    for seed in seeds:
        result = run_seed(seed, config)
        answers.update(result.answered)
        switches.update(result.switches)
        handoffs.update(result.handoffs)
        sigterms.update(result.sigterms)
        scenario.update(result.scenario)
        raced.update(result.races.keys())
        steps += result.steps
        if result.violation:
            failed += 1
            print(f"seed {seed}: {result.violation}", flush=True)
    took = time.perf_counter() - start
    print(f"{len(seeds)} seeds, {failed} failing, {len(seeds) / took:.0f} seeds/s "
          f"({steps / len(seeds):.0f} steps a seed); answers {dict(sorted(answers.items()))}")
    if switches:
        print(_switches(switches, raced, "seeds"))
    if sigterms:
        print(f"SIGTERMs {dict(sorted(sigterms.items()))}")
    if handoffs:
        print(_handoffs(handoffs))
    if config.scenario is not None:
        print(f"scenario {config.scenario}: {dict(sorted(scenario.items()))} (seeds)")
    return 1 if failed else 0


def _switches(outcomes: Mapping[str, int], raced: Mapping[str, int], per: str) -> str:
    """Role switches by outcome, and what they raced (counted in switches, or in seeds with a
    switch that raced it)."""
    text = f"role switches {dict(sorted(outcomes.items()))}"
    return text + (f"; raced ({per}) {dict(sorted(raced.items()))}" if raced else "")


def _handoffs(counts: Mapping[str, int]) -> str:
    """Live KV hand-offs (handoff.py): streams a draining D handed off; their next rooms taken
    (pulled, went on), fallen back to a re-prefill, or failed; registrations released, expired
    or closed with a role stopped past its drain deadline; hand-off pulls that failed, by
    cause; the clients handed off, by the status they got in the end (other than 200: by cause,
    ``proxy.why_lost``); drains whose gate found the listed Ds down (their streams finished in
    place); claims that waited for pages."""
    keys = ("handed_off", "taken", "fell_back", "failed", "released", "expired", "closed",
            "in_place_no_healthy_decode", "waited_for_pages")
    pulls = {k[5:]: n for k, n in sorted(counts.items()) if k.startswith("pull ")}
    clients = {k[7:]: n for k, n in sorted(counts.items()) if k.startswith("client ")}
    lost = {k[5:]: n for k, n in sorted(counts.items()) if k.startswith("lost ")}
    return ("hand-offs " + ", ".join(f"{k.replace('_', ' ')} {counts.get(k, 0)}" for k in keys)
            + f"; pulls failed {pulls}; clients handed off {sum(clients.values())}, "
              f"answered {clients}" + (f", not 200 by cause {lost}" if lost else ""))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def _workload(args: argparse.Namespace) -> int:
    try:
        ratios = [tuple(int(x) for x in r.split(":")) for r in args.ratios.split(",")]
        if any(len(r) != 2 or min(r) < 1 for r in ratios):
            raise ValueError(f"--ratios takes P:D pairs such as 1:3,2:2, got {args.ratios!r}")
        policies = args.policies.split(",")
        bad = [x for x in policies if x not in POLICIES]
        if bad:
            raise ValueError(f"--policies: unknown {bad}; one of {', '.join(POLICIES)}")
        workload = Workload(rate=args.rate, duration=args.duration, groups=args.groups,
                            prefix_tokens=args.prefix_tokens, max_output=args.max_output)
        if min(args.rate, args.duration, args.max_output) <= 0 or args.groups < 0:
            raise ValueError("--rate, --duration, --max-output must be > 0, --groups >= 0")
    except ValueError as exc:
        print(f"pd-fsm sim: {exc}", file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else 0
    print(f"workload: {args.rate:g} req/s for {args.duration:g} s, {args.groups} prefixes of "
          f"{args.prefix_tokens} tokens, 1-{args.max_output} tokens out, seed {seed}; goodput: "
          f"TTFT <= {args.ttft_target:g} s and TPOT <= {args.tpot_target:g} s "
          f"(cost model: pd_fsm/sim/config.py CostModel)")
    head = (f"{'P:D':<6}{'policy':<14}{'TTFT p50':>9}{'p99 s':>8}{'TPOT p50':>10}"
            f"{'tok/s':>8}{'goodput':>9}{'done':>6}{'failed':>7}")
    print(head + "\n" + "-" * len(head))
    for n_p, n_d in ratios:
        for policy in policies:
            config = SimConfig(prefill=n_p, decode=n_d, faults=False, pages=4096,
                               recompute=args.recompute, workload=workload,
                               routing=RoutingConfig(prefill_policy=policy,
                                                     decode_policy=policy))
            try:
                r = run_workload(config, seed, args.ttft_target, args.tpot_target)
            except Violation as exc:
                print(f"{n_p}:{n_d:<4}{policy:<14}invariant broken: {exc}")
                return 1
            print(f"{n_p}:{n_d:<4}{policy:<14}{_pct(r.ttft, 50):>9.2f}{_pct(r.ttft, 99):>8.2f}"
                  f"{_pct(r.tpot, 50):>10.3f}{r.rate(r.output_tokens):>8.1f}"
                  f"{r.rate(r.good):>9.2f}{r.completed:>6}{r.failed:>7}", flush=True)
    return 0
