"""``pd-fsm plan --profile F --chips N --workload W``: the best configuration of a fleet of
accelerators on a chip's profile (``plan.py``, ``fleet.py``, ``chip.py``), with its predicted
goodput, why, and a plot of goodput against rate per configuration."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import attrs

from pd_fsm.sim.chip import HOSTS, ChipCosts, ChipModel, Links
from pd_fsm.sim.fleet import FleetConfig, Slo, workload
from pd_fsm.sim.perf_profile import Profile
from pd_fsm.sim.plan import (
    Point,
    Settings,
    binding,
    configurations,
    evaluate,
    half_miss_rate,
    rate_grid,
    streamed_hidden,
)
from pd_fsm.sim.plan_planned import add_planner_args, compare, planning_for, report


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="the best P/D configuration of a fleet of accelerators, "
                                    "predicted on a chip's measured profile")
    p.add_argument("--profile", type=Path, required=True, metavar="FILE",
                   help="a `pd-fsm profile` file of one accelerator chip")
    p.add_argument("--chips", type=int, default=8, help="chips in the fleet (default 8)")
    p.add_argument("--host", choices=sorted(HOSTS), default="v5e-8",
                   help="the hosts' kind: chips a host, HBM, ICI (default v5e-8)")
    p.add_argument("--cell", type=int, default=0, metavar="CHIPS",
                   help="simulate cells of this many chips, each an equal share of the "
                        "arrivals (default 0: one host); the fleet's chips for all of it")
    p.add_argument("--workload", choices=("chat", "rag", "reasoning", "shifting"),
                   default="chat")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of arrivals (60)")
    p.add_argument("--phase-seconds", type=float, default=180.0,
                   help="shifting: seconds of each phase (180)")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="seconds (1; 2 at 8,192 in)")
    p.add_argument("--ttft-slo-long", type=float, default=2.0,
                   help="seconds, for prompts of 8,192 tokens or more (2)")
    p.add_argument("--itl-slo", type=float, default=0.05, help="seconds (0.05)")
    p.add_argument("--itl-measure", choices=("mean", "worst"), default="mean",
                   help="what --itl-slo bounds: a request's mean gap between tokens (TPOT) or "
                        "its longest (default mean)")
    p.add_argument("--rates", type=float, nargs="*", default=[], metavar="R",
                   help="fleet arrival rates, req/s (default: around the rate where "
                        "colocated first misses half its requests)")
    p.add_argument("--net-gbps", type=float, default=5.0,
                   help="GB/s of a P instance's KV transfers between hosts (5)")
    p.add_argument("--net-latency", type=float, default=200e-6, help="s a transfer (200e-6)")
    p.add_argument("--kv-path", choices=("host", "ici"), default="host",
                   help="P -> D through the hosts (pd_fsm's path) or chip to chip on ICI")
    p.add_argument("--d2h-leg", choices=("d2h", "d2h_pinned"), default="d2h")
    p.add_argument("--d2h-gbps", type=float, default=0.0,
                   help="GB/s of the KV off P's chips in place of the profile's leg (0: the leg)")
    p.add_argument("--ici-gbps", type=float, default=0.0,
                   help="the all-reduce's GB/s a chip (0: the host kind's)")
    p.add_argument("--mixed-extra", type=float, default=0.0, metavar="SHARE",
                   help="a colocated mixed step costs its decode and chunk and this share more "
                        "(0; the one mixed step measured on a v5e: 0.52)")
    p.add_argument("--stream-tokens", type=int, default=1024,
                   help="a streamed P's chunk (1,024)")
    p.add_argument("--layers", type=int, default=ChipModel().layers)
    p.add_argument("--hidden", type=int, default=ChipModel().hidden)
    p.add_argument("--weight-bytes", type=float, default=ChipModel().weight_bytes)
    p.add_argument("--top", type=int, default=4,
                   help="configurations besides colocated drawn against rate (4)")
    p.add_argument("--seed", type=int, default=0)
    add_planner_args(p)
    p.set_defaults(func=main)


def _settings(args: argparse.Namespace) -> tuple[Settings, int]:
    host = HOSTS[args.host]
    if args.ici_gbps:
        host = attrs.evolve(host, ici_gbps=args.ici_gbps)
    profile = Profile.load(args.profile)
    if profile.platform == "cpu":
        raise ValueError(f"{args.profile}: a CPU profile; plan takes an accelerator's")
    cell = args.cell or min(args.chips, host.chips)
    if args.chips % cell:
        raise ValueError(f"--chips {args.chips} is not a whole number of cells of {cell}")
    costs = ChipCosts(profile, host, ChipModel(args.layers, args.hidden, args.weight_bytes),
                      Links(args.kv_path, args.net_gbps, args.net_latency, args.d2h_leg,
                            args.d2h_gbps),
                      args.mixed_extra)
    slo = Slo(args.ttft_slo, args.ttft_slo_long, itl_s=args.itl_slo,
              itl_measure=args.itl_measure)
    wl = workload(args.workload, args.seconds, args.phase_seconds)
    return Settings(costs, wl, slo, args.seed), args.chips // cell


def main(args: argparse.Namespace) -> int:
    try:
        s, replicas = _settings(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"pd-fsm plan: {exc}", file=sys.stderr)
        return 2
    cell = args.chips // replicas
    configs = configurations(cell, args.stream_tokens)
    colocated = [c for c in configs if c.colocated]
    if args.planner:
        return _planned(args, s, configs, replicas)
    print(f"{s.costs.profile.model} on {s.costs.profile.device_kind or 'an accelerator'} "
          f"({args.profile}); {args.chips} chips of {args.host} as {replicas} cell(s) of {cell}; "
          f"workload {args.workload}; SLO TTFT <= {s.slo.ttft_s:g} s ({s.slo.ttft_long_s:g} s "
          f"at {s.slo.long_prompt} in), ITL ({s.slo.itl_measure}) <= {s.slo.itl_s * 1000:g} ms; "
          f"KV path {args.kv_path} at {args.net_gbps:g} GB/s; seed {args.seed} (predicted)")
    if args.rates:
        anchor = args.rates[0] / replicas
        rates = [r / replicas for r in args.rates]
    else:
        anchor = half_miss_rate(s, colocated)
        rates = list(rate_grid(anchor))
    at = {c.name: evaluate(s, c, anchor) for c in configs}
    best_colo = max(colocated, key=lambda c: at[c.name].goodput)
    ranked = sorted((c for c in configs if not c.colocated),
                    key=lambda c: (-at[c.name].goodput, c.name))
    _table(at, configs, anchor, replicas, "colocated's first half-miss rate"
           if not args.rates else "the first --rates", s.slo)
    best = ranked[0] if ranked else best_colo
    ratio = at[best.name].goodput / max(at[best_colo.name].goodput, 1e-9)
    print(f"\nbest: {best.name} — {at[best.name].goodput * replicas:.2f} req/s, "
          f"{ratio:.2f}x {best_colo.name} ({at[best_colo.name].goodput * replicas:.2f}) at "
          f"{anchor * replicas:g} req/s\n  {best.name}: {binding(best, at[best.name])}\n"
          f"  {best_colo.name}: {binding(best_colo, at[best_colo.name])}")
    prompt = max(p[1] for p in s.workload.phases)
    whole, left, hidden = streamed_hidden(s.costs, prompt, best.tp_prefill or 1,
                                          best.tp_decode or 1, args.stream_tokens)
    print(f"  streamed KV, {prompt} tokens alone: transfer {whole * 1000:.1f} ms whole, "
          f"{left * 1000:.1f} ms left after the prefill streamed: {hidden:.0%} hidden")
    drawn = [best_colo, *ranked[:args.top]]
    curves = {c.name: [(r * replicas, evaluate(s, c, r).goodput * replicas) for r in rates]
              for c in drawn}
    print("\n| configuration | " + " | ".join(f"{r * replicas:g}" for r in rates) + " |")
    print("|---" * (len(rates) + 1) + "|")
    for name, points in curves.items():
        print(f"| {name} | " + " | ".join(f"{g:.2f}" for _, g in points) + " |")
    if args.plot:
        _plot(args.plot, f"{args.workload}, {args.chips} chips ({args.host}), predicted",
              curves, s.slo)
    return 0


def _table(at: dict[str, Point], configs: list[FleetConfig], rate: float, replicas: int,
           what: str, slo: Slo) -> None:
    print(f"\nat {rate * replicas:g} req/s ({what}):\n\n| configuration | chips | goodput "
          f"req/s | met | TTFT p50 s | ITL p50 ms |\n|---|---|---|---|---|---|")
    for c in sorted(configs, key=lambda c: -at[c.name].goodput):
        p = at[c.name]
        ttft = sorted(r.ttft for r in p.run.requests)
        itl = sorted(slo.itl(r) for r in p.run.requests)
        mid = len(ttft) // 2
        print(f"| {c.name} | {c.chips * replicas} | {p.goodput * replicas:.2f} | {p.met:.0%} | "
              f"{ttft[mid]:.3f} | {itl[mid] * 1000:.1f} |" if ttft else f"| {c.name} | - |")


def _plot(name: str, title: str, curves: dict[str, list[tuple[float, float]]], slo: Slo
          ) -> None:
    """bench/plots.py's goodput_vs_rate, loaded from the checkout beside this package."""
    path = Path(__file__).resolve().parents[2] / "bench" / "plots.py"
    spec = importlib.util.spec_from_file_location("pd_fsm_bench_plots", path)
    if spec is None or spec.loader is None or not path.exists():
        print(f"(no plot: {path} is not here: a checkout has it)")
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.goodput_vs_rate(name, title, curves,
                           f"TTFT <= {slo.ttft_s:g} s ({slo.ttft_long_s:g} s at "
                           f"{slo.long_prompt} in), {slo.itl_measure} ITL <= "
                           f"{slo.itl_s * 1000:g} ms")


def _planned(args: argparse.Namespace, s: Settings, configs: list[FleetConfig],
             replicas: int) -> int:
    cell = args.chips // replicas
    rates = args.phase_rates or args.rates[:1]
    per_cell = ([r / replicas for r in rates] if rates
                else [half_miss_rate(s, [c for c in configs if c.colocated])])
    planning = planning_for(s, cell, args.launcher, args.planner_interval,
                            args.planner_cooldown)
    try:
        compared = compare(s, configs, per_cell, planning, args.planner_start)
    except ValueError as exc:
        print(f"pd-fsm plan: {exc}", file=sys.stderr)
        return 2
    print(f"{s.costs.profile.model} ({args.profile}); {args.chips} chips as {replicas} "
          f"cell(s) of {cell}; workload {args.workload}, phases of {args.phase_seconds:g} s at "
          + ", ".join(f"{r * replicas:g}" for r in per_cell) + " req/s; SLO TTFT <= "
          f"{s.slo.ttft_s:g} s ({s.slo.ttft_long_s:g} s at {s.slo.long_prompt} in), ITL "
          f"({s.slo.itl_measure}) <= {s.slo.itl_s * 1000:g} ms; planner every "
          f"{planning.interval:g} s, window {planning.window:g} s, cooldown "
          f"{planning.planner.cooldown:g} s, switch {planning.switch_s:g} s, launcher "
          f"{'on' if planning.launcher else 'off'}; seed {args.seed} (predicted)\n")
    kinds = ("chat", "rag", "reasoning") if args.workload == "shifting" else (args.workload,)
    print(report(compared, replicas, kinds))
    return 0
