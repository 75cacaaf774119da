"""``pd-fsm plan --planner``: the SLA planner acting on a cell (``fleet_planner.py``) beside
every static configuration of it, on the same arrivals: goodput over the run and per phase,
against the best static configuration over the run and the best one per phase (an oracle
that switches for free, within this run)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import attrs

from pd_fsm.core.planner import PlannerConfig
from pd_fsm.sim.fleet import FleetConfig, FleetReq, goodput, simulate_fleet
from pd_fsm.sim.fleet_planner import FleetPlanning, PlannedRun, simulate_planned
from pd_fsm.sim.plan import Settings


@attrs.frozen
class Compared:
    phases: list[tuple[float, float]]  # [start, end) of each phase, seconds
    static: dict[str, list[float]]  # configuration -> its goodput a phase (cell, req/s)
    start: FleetConfig  # the planner's starting configuration
    planned: list[float]  # the planner's goodput a phase
    run: PlannedRun


def phase_spans(s: Settings) -> list[tuple[float, float]]:
    out, t = [], 0.0
    for seconds, _, _ in s.workload.phases:
        out.append((t, t + seconds))
        t += seconds
    return out


def per_phase(s: Settings, reqs: Sequence[FleetReq], spans: Sequence[tuple[float, float]]
              ) -> list[float]:
    return [goodput(reqs, s.slo, a, b) for a, b in spans]


def compare(s: Settings, configs: Sequence[FleetConfig], rates: Sequence[float],
            planning: FleetPlanning, start: str = "") -> Compared:
    """Every configuration of ``configs`` static, then the planner from ``start`` (a name;
    empty: the best static configuration over the run), on the same arrivals."""
    p = s.costs.profile
    limits = (s.max_batched_tokens or p.max_batched_tokens, s.max_running or p.max_running)
    reqs = s.workload.requests(rates, s.seed)
    horizon = s.workload.seconds + s.drain_s
    spans = phase_spans(s)
    static = {c.name: per_phase(s, simulate_fleet(s.costs, c, reqs, horizon, *limits).requests,
                                spans) for c in configs}
    by_name = {c.name: c for c in configs}
    if start and start not in by_name:
        raise ValueError(f"--planner-start {start!r}: not a configuration of this cell")
    first = by_name[start] if start else by_name[best_static(static)]
    run = simulate_planned(s.costs, first, reqs, horizon, *limits, planning)
    return Compared(spans, static, first, per_phase(s, run.requests, spans), run)


def best_static(static: dict[str, list[float]]) -> str:
    return max(sorted(static), key=lambda n: sum(static[n]))


def planning_for(s: Settings, chips: int, launcher: bool, interval: float, cooldown: float
                 ) -> FleetPlanning:
    """The planner on the run's SLOs (TTFT: the short prompts' target; ITL: the p90 of the
    gaps against the ITL target), free to make instances colocated and split them back."""
    config = PlannerConfig(ttft_slo=s.slo.ttft_s, itl_slo=s.slo.itl_s, colocate=True,
                           cooldown=cooldown, max_workers=chips if launcher else 0)
    return FleetPlanning(config, interval=interval, window=5 * interval, launcher=launcher,
                         chips=chips)


def report(c: Compared, replicas: int, kinds: Sequence[str]) -> str:
    """The planner's row beside the best static configuration and the per-phase oracle."""
    best = best_static(c.static)
    n = len(c.phases)
    oracle = [max(g[i] for g in c.static.values()) for i in range(n)]
    chosen = [max(sorted(c.static), key=lambda k: c.static[k][i]) for i in range(n)]
    seconds = [b - a for a, b in c.phases]

    def total(g: Sequence[float]) -> float:  # over the run: requests met / its seconds
        return sum(x * t for x, t in zip(g, seconds, strict=True)) / sum(seconds) * replicas

    rows = [("planner (from " + c.start.name + ")", c.planned), ("best static: " + best,
            c.static[best]), ("best per phase (free switches)", oracle)]
    if c.start.name != best:  # what the planner did beside leaving its start alone
        rows.insert(1, ("static: " + c.start.name, c.static[c.start.name]))
    head = " | ".join(f"{kinds[i % len(kinds)]} {i + 1}" for i in range(n))
    lines = [f"| goodput req/s | {head} | run |", "|---" * (n + 2) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{x * replicas:.2f}" for x in g)
              + f" | {total(g):.2f} |" for name, g in rows]
    # A phase where the best static configuration met nothing: 1.0 if the planner met
    # nothing either (neither is below the other).
    ratio = [p / b if b else (float("inf") if p else 1.0)
             for p, b in zip(c.planned, c.static[best], strict=True)]
    over = total(c.planned) / max(total(c.static[best]), 1e-9)
    lines.append(f"\nplanner / best static: {over:.2f}x over the run; a phase: "
                 + ", ".join(f"{r:.2f}x" for r in ratio)
                 + f"; below it in {sum(r < 1.0 for r in ratio)} of {n} phases")
    lines.append("best per phase: " + ", ".join(chosen))
    run = c.run
    lines.append(f"decisions: {len(run.decisions)} ({run.ignored} with no meaning on a chip "
                 f"ignored, {run.refused} ScaleUp refused); arrivals deferred (no entry "
                 f"serving): {run.deferred}")
    lines += [f"  {t:7.1f} s  {type(d).__name__} {getattr(d, 'worker', '')}"
              f"{' -> ' + str(getattr(d, 'to', '')) if hasattr(d, 'to') else ''}: {d.reason}"
              for t, d in run.decisions]
    lines.append("serving (time s: P, D, colocated): " + ", ".join(
        f"{t:.0f}: {p}/{d}/{k}" for t, p, d, k in run.roles))
    return "\n".join(lines)


def add_planner_args(p: argparse.ArgumentParser) -> None:
    """``pd-fsm plan``'s flags of the planner's run."""
    p.add_argument("--planner", action="store_true",
                   help="run the SLA planner (core/planner.py) on the cell from a starting "
                        "configuration, beside every static one on the same arrivals: goodput "
                        "over the run and per phase (fleet_planner.py)")
    p.add_argument("--planner-start", default="", metavar="NAME",
                   help="--planner: the starting configuration, by its name in the table "
                        "(default: the best static one over the run)")
    p.add_argument("--phase-rates", type=float, nargs="*", default=[], metavar="R",
                   help="--planner: fleet req/s a phase, in turn (shifting: chat, RAG, "
                        "reasoning; default: the first --rates, else colocated's half-miss "
                        "rate, for every phase)")
    p.add_argument("--planner-interval", type=float, default=2.0,
                   help="--planner: seconds between observations (2; its window 5x that)")
    p.add_argument("--planner-cooldown", type=float, default=30.0,
                   help="--planner: seconds after a decision before the next (30)")
    p.add_argument("--launcher", action="store_true",
                   help="--planner: carry out ScaleUp/ScaleDown within the cell's chips")
    p.add_argument("--plot", default="", metavar="NAME",
                   help="draw goodput against rate to bench/plots/NAME.png (bench/plots.py; "
                        "needs the checkout and matplotlib)")
