"""``pd-fsm sim --profile FILE``: the performance model's predictions (``perf.py``) for every
static placement of one P and one D against a colocated worker, at each arrival rate."""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from pd_fsm.sim.perf import Placement, outcome, poisson, simulate
from pd_fsm.sim.perf_profile import Profile

if TYPE_CHECKING:
    from pd_fsm.sim.perf_cluster import ClusterConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("performance model: predict TTFT, TPOT and goodput of placements "
                             "from a `pd-fsm profile` file")
    g.add_argument("--profile", type=Path, default=None, metavar="FILE",
                   help="run the performance model on this profile instead of seeds")
    g.add_argument("--max-batched-tokens", type=int, default=0, metavar="N",
                   help="the modelled workers' prefill budget (`pd-fsm serve "
                        "--max-batched-tokens`) where it is not the profile's (default 0: the "
                        "profile's; profiles measured before the CPU default became 256 hold "
                        "1024)")
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
    g.add_argument("--local-queues", type=int, nargs="*", default=[], metavar="N",
                   help="also the last --nice-pairs placement with D prefilling alone while P "
                        "holds N or more requests (`pd-fsm proxy --local-prefill-queue N`)")
    g.add_argument("--decode-threads", type=int, nargs="*", default=[1], metavar="N",
                   help="also each --nice-pairs placement with D on XLA pools of N threads "
                        "(`pd-fsm cluster --decode-cpu-pools N`; default 1, the cluster's D "
                        "on shared cores)")
    g.add_argument("--tpot-targets", type=float, nargs="+", default=[0.1, 0.05],
                   help="goodput's TPOT targets (default 0.1 0.05; TTFT: --ttft-target)")
    c = p.add_argument_group("performance model over a cluster: static splits against the SLA "
                             "planner under a workload that shifts (with --profile)")
    c.add_argument("--workers", type=int, default=0, metavar="N",
                   help="N workers, each on --cores-per-worker cores: every static P:D split "
                        "in steps of N/4, N colocated workers, and the planner from N/2:N/2 "
                        "(moving workers between P and D only, and also making them colocated)")
    c.add_argument("--cores-per-worker", type=int, default=1)
    c.add_argument("--decode-cores-per-worker", type=int, default=0, metavar="N",
                   help="each D on fewer cores (XLA pools of N threads, kept across a role "
                        "switch: pd-fsm cluster's D has one beside a P of two); 0: "
                        "--cores-per-worker")
    c.add_argument("--phases", default="long:60,short:60,long:60,short:60", metavar="KIND:S,..",
                   help="the workload's phases: long (prompts --long-prompt, answers "
                        "--long-prompt-out) or short (--short-prompt, --short-prompt-out), "
                        "seconds each")
    c.add_argument("--rate-per-worker", type=float, default=0.1,
                   help="Poisson arrivals per second per worker (default 0.1)")
    c.add_argument("--long-prompt", default="300-500", metavar="A-B")
    c.add_argument("--long-prompt-out", default="4-8", metavar="A-B")
    c.add_argument("--short-prompt", default="20-60", metavar="A-B")
    c.add_argument("--short-prompt-out", default="48-96", metavar="A-B")
    c.add_argument("--planner-interval", type=float, default=5.0)
    c.add_argument("--planner-cooldown", type=float, default=15.0)
    c.add_argument("--planner-patience", type=int, default=2)
    c.add_argument("--planner-max-step", type=int, default=1,
                   help="role switches decided at once, at most (0: as many as the pressures "
                        "ask; default 1)")


def load_profile(path: Path, max_batched_tokens: int = 0) -> Profile:
    """``path``'s profile, with the workers' prefill budget in place of its own if given."""
    profile = Profile.load(path)
    if max_batched_tokens:
        profile = attrs.evolve(profile, max_batched_tokens=max_batched_tokens)
    return profile


def placements(cores: int, nice_pairs: list[str], local_queues: list[int],
               decode_threads: Sequence[int] = ()) -> list[Placement]:
    out = [Placement(f"colocated (cores 0-{cores - 1})", colocated=True, cores=cores),
           Placement("PD pinned (P and D on half the cores each)", cores=cores),
           Placement("PD shared (equal priority)", cores=cores, shared=True)]
    for pair in nice_pairs:
        p, d = (int(x) for x in pair.split(","))
        shared = Placement(f"PD shared, nice P {p:+d} / D {d:+d}", cores=cores, shared=True,
                           nice_p=p, nice_d=d)
        out.append(shared)
        out += [attrs.evolve(shared, name=f"{shared.name}, D pools of {n} thread"
                             f"{'s' * (n > 1)}", decode_threads=n) for n in decode_threads]
    if nice_pairs:
        last = next(p for p in reversed(out) if not p.decode_threads)
        out += [attrs.evolve(last, name=f"{last.name}, local prefill at P queue >= {q}",
                             local_prefill_queue=q) for q in local_queues]
    return out


def prompt_lengths(spec: str, n: int, seed: int) -> list[int]:
    ranges = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ranges.append((int(lo), int(hi or lo)))
    rng = random.Random(seed)
    return [rng.randint(*ranges[i % len(ranges)]) for i in range(n)]


def main(args: argparse.Namespace) -> int:
    if args.workers:
        return cluster_main(args)
    try:
        profile = load_profile(args.profile, args.max_batched_tokens)
        lengths = prompt_lengths(args.prompt_tokens, args.prompts, args.seed or 0)
        chosen = placements(args.cores, args.nice_pairs, args.local_queues,
                            args.decode_threads)
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


def _range(spec: str) -> tuple[int, int]:
    lo, _, hi = spec.partition("-")
    return int(lo), int(hi or lo)


def _cluster_configs(args: argparse.Namespace, n: int) -> dict[str, ClusterConfig]:
    """Every static P:D split in steps of n/4, n colocated workers, and the planner from
    n/2 : n/2, without and with colocate."""
    from pd_fsm.core.planner import PlannerConfig
    from pd_fsm.sim.perf_cluster import ClusterConfig

    step = max(n // 4, 1)
    narrow = args.decode_cores_per_worker
    configs = {f"static {p}P:{n - p}D": ClusterConfig(prefill=p, decode=n - p,
                                                       cores=args.cores_per_worker,
                                                       decode_cores=narrow)
               for p in range(step, n, step)}
    configs[f"colocated x{n}"] = ClusterConfig(colocated=n, cores=args.cores_per_worker)
    for colocate in (False, True):
        planner = PlannerConfig(ttft_slo=args.ttft_target, itl_slo=args.tpot_targets[0],
                                cooldown=args.planner_cooldown, patience=args.planner_patience,
                                max_step=args.planner_max_step, colocate=colocate)
        name = "adaptive P/D and colocated" if colocate else "adaptive P/D"
        # D prefills alone while no entry serves, as pd-fsm cluster --planner's proxy does.
        configs[f"{name} (from {n // 2}P:{n - n // 2}D)"] = ClusterConfig(
            prefill=n // 2, decode=n - n // 2, cores=args.cores_per_worker, planner=planner,
            interval=args.planner_interval, decode_cores=narrow, alone=True)
    return configs


def cluster_main(args: argparse.Namespace) -> int:
    """Every static split, colocated, and the planner, over one shifting workload."""
    from pd_fsm.sim.perf_cluster import Phase, goodput, run_cluster, shifting

    try:
        profile = load_profile(args.profile, args.max_batched_tokens)
        n = args.workers
        if n < 2:
            raise ValueError("--workers must be >= 2")
        if not 0 <= args.decode_cores_per_worker <= args.cores_per_worker:
            raise ValueError(f"--decode-cores-per-worker {args.decode_cores_per_worker}: "
                             f"0..--cores-per-worker ({args.cores_per_worker})")
        rate = args.rate_per_worker * n
        kinds = {"long": (_range(args.long_prompt), _range(args.long_prompt_out)),
                 "short": (_range(args.short_prompt), _range(args.short_prompt_out))}
        phases = []
        for item in args.phases.split(","):
            kind, _, secs = item.partition(":")
            prompt, out = kinds[kind]
            phases.append(Phase(float(secs), rate, prompt, out))
    except (OSError, ValueError, KeyError) as exc:
        print(f"pd-fsm sim --workers: {exc}", file=sys.stderr)
        return 2
    requests = shifting(phases, seed=args.seed or 0)
    configs = _cluster_configs(args, n)
    narrow = args.decode_cores_per_worker
    bounds, t = [], 0.0
    for ph in phases:
        bounds.append((t, t + ph.seconds))
        t += ph.seconds
    each = f"{args.cores_per_worker} core(s)" + (f", D {narrow}" if narrow else "")
    print(f"{profile.model}, {n} workers x {each}, {len(requests)} "
          f"requests at {rate:g} req/s, phases {args.phases}; goodput at TTFT <= "
          f"{args.ttft_target:g} s and TPOT <= {args.tpot_targets[0] * 1000:g} ms (predicted)\n")
    names = [f"{k} {b[0]:.0f}-{b[1]:.0f} s" for k, b in zip(
        (i.partition(":")[0] for i in args.phases.split(",")), bounds, strict=True)]
    print("| cluster | " + " | ".join(names) + " | whole run | decisions |")
    print("|---" * (len(names) + 3) + "|")
    for name, cfg in configs.items():
        run = run_cluster(profile, cfg, requests)
        per = [goodput(run.requests, a, b, args.ttft_target, args.tpot_targets[0])
               for a, b in bounds]
        whole = goodput(run.requests, 0.0, t, args.ttft_target, args.tpot_targets[0])
        print(f"| {name} | " + " | ".join(f"{g:.2f}" for g in per) + f" | {whole:.2f} | "
              f"{len(run.decisions)} |", flush=True)
        for at, decision in run.decisions:
            print(f"    {at:7.1f} s  {decision}", flush=True)
    return 0
