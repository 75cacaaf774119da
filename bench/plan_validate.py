"""The fleet model (pd_fsm/sim/fleet.py) against the one chip's colocated worker as measured:
the worker `bench/tpu_serve.sh` served (`pd-fsm serve --uds`, max_running 64, max_batched_tokens
1,024, 5,200 pages of 16 tokens, Qwen3-0.6B shape) under `pd-fsm bench --dataset random`
Poisson loads, simulated on the profile measured on that chip at each load's measured arrival
rate and prompt count, several seeds; the median of each figure against the measured one.

    .venv/bin/python bench/plan_validate.py \
        [--profile bench/tpu_v5e_profile_qwen3-0.6b.json] \
        [--runs bench/tpu_runs/2026-12-07/serve2] [--seeds 11] [--decode-scale 1.0 ...]

The figures are the bench's own kinds: TTFT p50 over requests; ITL p50 over every gap between
two streamed tokens of every request pooled (not a request's mean); goodput as the share of
requests with TTFT <= the load's bound and a mean gap <= its TPOT bound. The served worker's
prefix cache held some prompts from the load before (the record's `prefix_cache_hit_tokens`,
or before records carried it its log's "prompt tokens from its prefix cache"): the replay gives
that many prompts, first in order, that cache (their prefill starts after the cached tokens);
`--no-cache` leaves it out. A load of mixed lengths (the record's `ratio` < 1: the bench's
`--random-range-ratio`) draws each prompt's lengths as the bench does, from [ratio x len, len]:
the replay from the load's own seed (the very lengths it sent), each seed of the median from
that seed.

`--prefill-from FILE` takes the prefill points from another profile of the same model and chip
(the rest, decode and the KV legs, stay the profile's): the worker that runs a prefill of few
rows on a runner of a smaller capacity than its own (since run 7 on the chip, <= 8 rows at 8
sequences) is priced by that runner's measured prefill; past the longest prompt it measured,
its last segment's line goes on (`perf_profile.interpolate`). Neither file is rewritten.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from pd_fsm.io_trio.bench_client import random_prompts
from pd_fsm.sim.chip import HOSTS, ChipCosts, ChipModel
from pd_fsm.sim.fleet import FleetConfig, FleetReq, Slo, simulate_fleet
from pd_fsm.sim.perf_profile import CoreProfile, Profile

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "bench" / "tpu_v5e_profile_qwen3-0.6b.json"
RUNS = ROOT / "bench" / "tpu_runs" / "2026-12-07" / "serve2"
MODEL = "qwen3-0.6b"
POOL_TOKENS = 5200 * 16  # the served worker's --num-pages x --page-size
MAX_RUNNING, MAX_BATCHED = 64, 1024
WITHIN = 0.20
CACHE = re.compile(r"prefix cache [\d.]+ % \((\d+) of (\d+)\)")


@attrs.frozen
class Load:
    """One measured load (a line of the bench's JSONL) and what its log says was cached."""

    workload: str
    prompt: int
    out: int
    prompts: int
    rate: float  # nominal (what the bench drew its gaps at)
    arrival_rate: float  # as the requests arrived
    ttft_slo: float
    tpot_slo: float
    cached_tokens: int
    ttft_p50: float
    itl_p50: float
    met: float  # share of its requests within both bounds
    ratio: float = 1.0  # each length drawn from [ratio x len, len] (the bench's range ratio)
    seed: int = 0  # the bench's --seed: its prompts drawn from it, its arrivals from seed + 1


@attrs.frozen
class Figures:
    ttft_p50: float
    itl_p50: float
    met: float


def _records(runs: Path, model: str) -> list[dict[str, Any]]:
    return [rec for line in (runs / f"{model}.jsonl").read_text().splitlines()
            if (rec := json.loads(line)).get("event") == "load"]


def _cached(rec: dict[str, Any], runs: Path, model: str) -> int:
    """The prompt tokens the load's prompts found in the prefix cache: the record's own count,
    or (records before it carried one) what the load's log says."""
    if rec.get("prefix_cache_hit_tokens") is not None:
        return int(rec["prefix_cache_hit_tokens"])
    log = runs / f"{model}_{rec['workload']}_{float(rec['rate'])}.log"
    hit = CACHE.search(log.read_text()) if log.exists() else None
    return int(hit.group(1)) if hit else 0


def _load(rec: dict[str, Any], rate: float, arrival_rate: float, cached: int) -> Load:
    fig = rec["figures"]
    return Load(rec["workload"], rec["in"], rec["out"], rec["prompts"], rate, arrival_rate,
                rec["slo_s"]["ttft"], rec["slo_s"]["tpot"], cached, fig["TTFT p50 ms"] / 1000,
                fig["ITL p50 ms"] / 1000, rec["goodput"]["met"] / rec["prompts"],
                float(rec.get("ratio", 1.0)), int(rec.get("load", {}).get("seed", 0)))


def loads(runs: Path, model: str = MODEL) -> list[Load]:
    """The Poisson loads of ``runs/<model>.jsonl`` (the all-at-once one has no rate to replay),
    with the prompt tokens each found in the prefix cache."""
    return [_load(rec, rec["rate"], rec["arrival_rate"], _cached(rec, runs, model))
            for rec in _records(runs, model) if rec.get("rate")]


def all_at_once(runs: Path, model: str = MODEL) -> tuple[Load, float] | None:
    """The load sent all at once (no rate) and its measured output tokens/s: the worker's
    capacity, where TTFT is queueing and says little of the costs."""
    for rec in _records(runs, model):
        if rec.get("rate") is None:
            return _load(rec, math.inf, math.inf, 0), rec["figures"]["output tokens/s"]
    return None


def throughput(costs: ChipCosts, load: Load) -> float:
    """Output tokens/s of ``load``'s prompts all sent at 0: its tokens over the last answer's
    end (the bench's duration: the first send to the last answer)."""
    reqs = requests(load, [0.0] * load.prompts, draw=load.seed)
    run = simulate_fleet(costs, FleetConfig("colocated 1x TP1", colocated=1), reqs, 3600.0,
                         MAX_BATCHED, MAX_RUNNING)
    return sum(r.out for r in reqs) / max(r.last for r in run.requests)


def lengths(load: Load, draw: int) -> list[tuple[int, int]]:
    """Each prompt's (in, out) tokens: the load's own when it drew none (ratio 1), else drawn
    from ``draw`` as the bench draws them (bench_client.random_prompts)."""
    if load.ratio >= 1.0:
        return [(load.prompt, load.out)] * load.prompts
    return [(p.words, p.max_tokens or load.out) for p in
            random_prompts(load.prompts, draw, load.prompt, load.out, load.ratio)]


def requests(load: Load, arrivals: Sequence[float], cache: bool = True, draw: int = 0
             ) -> list[FleetReq]:
    """The load's prompts at ``arrivals`` (lengths: ``lengths(load, draw)``); the cached tokens
    as whole prompts less their last page, the first prompts in order (what a prefix cache of
    16-token pages keeps of a prompt it saw: every full page but the one holding the last
    token)."""
    per = load.prompt - 16
    hits = min(load.cached_tokens // per, load.prompts) if cache and per > 0 else 0
    return [FleetReq(t, n, out, cached=min(per, n - 16) if i < hits else 0)
            for i, (t, (n, out)) in enumerate(zip(arrivals, lengths(load, draw), strict=False))]


def poisson(n: int, rate: float, seed: int) -> list[float]:
    """``n`` arrivals the way the bench sends them: the first at 0, then a gap drawn each."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def pct(values: Sequence[float], q: float) -> float:
    """The bench's percentile (pd_fsm/io_trio/bench_client.py: nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else math.nan


def simulate(costs: ChipCosts, load: Load, arrivals: Sequence[float], cache: bool = True,
             draw: int = 0) -> Figures:
    run = simulate_fleet(costs, FleetConfig("colocated 1x TP1", colocated=1),
                         requests(load, arrivals, cache, draw), 3600.0, MAX_BATCHED,
                         MAX_RUNNING)
    slo = Slo(load.ttft_slo, load.ttft_slo, itl_s=load.tpot_slo)
    gaps = [g for r in run.requests if r.gaps is not None
            for g in r.gaps[r.first_step + 1:r.last_step + 1]]
    return Figures(pct([r.ttft for r in run.requests], 50), pct(gaps, 50),
                   sum(1 for r in run.requests if slo.met(r)) / len(run.requests))


def predict(costs: ChipCosts, load: Load, seeds: int, cache: bool = True) -> Figures:
    """The median of each figure over ``seeds`` Poisson draws at the load's arrival rate (and,
    at mixed lengths, a draw of the lengths from each seed)."""
    runs = [simulate(costs, load, poisson(load.prompts, load.arrival_rate, seed), cache, seed)
            for seed in range(seeds)]
    return Figures(*(statistics.median(getattr(f, k) for f in runs)
                     for k in ("ttft_p50", "itl_p50", "met")))


def replay(costs: ChipCosts, load: Load, cache: bool = True) -> Figures:
    """The bench's own schedule: its gaps drawn from Random(seed + 1) at the nominal rate, its
    prompts' lengths from its seed."""
    return simulate(costs, load, poisson(load.prompts, load.rate, load.seed + 1), cache,
                    load.seed)


def scaled(profile: Profile, term: str, factor: float) -> Profile:
    """``profile`` with one cost term (``prefill``, ``decode`` or a KV leg) times ``factor``:
    what a planted error in that term does to the prediction."""
    chip = profile.on(1)
    points = getattr(chip, term)
    new = tuple((*p[:-1], p[-1] * factor) for p in points)
    one: CoreProfile = attrs.evolve(chip, **{term: new})
    return attrs.evolve(profile, by_cores=(one,))


def prefill_from(profile: Profile, other: Profile) -> Profile:
    """``profile`` with ``other``'s prefill points (the same model and chip's prefill measured
    on a runner of another capacity); refuses a profile of another model, KV size or chip."""
    for key in ("model", "kv_bytes_per_token", "platform", "device_kind"):
        if getattr(profile, key) != getattr(other, key):
            raise ValueError(f"--prefill-from: {key} {getattr(other, key)!r} is not the "
                             f"profile's {getattr(profile, key)!r}")
    chip = attrs.evolve(profile.on(1), prefill=other.on(1).prefill)
    return attrs.evolve(profile, by_cores=(chip,))


def prefill_note(profile: Profile, path: Path | None, other: Profile | None) -> str:
    """Where the prefill's cost came from, said plainly."""
    if path is None or other is None:
        return f"prefill from the profile (its runner of max_running {profile.max_running})"
    tokens = ", ".join(f"{int(t):,}" for t, _ in other.on(1).prefill)
    return (f"PREFILL NOT THE PROFILE'S: taken from {_rel(path)}, a runner of max_running "
            f"{other.max_running} profiled in the same session (prompts of {tokens} tokens; "
            f"longer on its last segment's line), the rest from the profile (max_running "
            f"{profile.max_running})")


def costs_for(profile: Profile, mixed_extra: float = 0.0) -> ChipCosts:
    return ChipCosts(profile, HOSTS["v5e-8"], ChipModel(pool_tokens=POOL_TOKENS),
                     mixed_extra=mixed_extra)


# The cost term a figure rests on when it is off: a request's TTFT on its prefill's step(s),
# a gap between tokens on the decode step (goodput: on both, no one term to fit).
TERM = {"TTFT": ("prefill", "ttft_p50"), "ITL": ("decode", "itl_p50")}


def fit(profile: Profile, load: Load, figure: str, seeds: int, cache: bool = True,
        mixed_extra: float = 0.0) -> float:
    """The factor on ``figure``'s term (``TERM``) that brings its median prediction to the
    measured figure: bisected in log space over 1/4..4 (a figure that rises with its term)."""
    term, key = TERM[figure]
    want = getattr(load, key)
    lo, hi = math.log(0.25), math.log(4.0)
    for _ in range(10):
        mid = (lo + hi) / 2
        costs = costs_for(scaled(profile, term, math.exp(mid)), mixed_extra)
        got = getattr(predict(costs, load, seeds, cache), key)
        lo, hi = (mid, hi) if got < want else (lo, mid)
    return math.exp((lo + hi) / 2)


def off(profile: Profile, load: Load, f: Figures, seeds: int, cache: bool = True,
        mixed_extra: float = 0.0) -> list[str]:
    """Each figure outside +-20 % of the measurement, with the factor its term would need."""
    out = []
    for name, predicted, measured in (("TTFT", f.ttft_p50, load.ttft_p50),
                                      ("ITL", f.itl_p50, load.itl_p50),
                                      ("goodput", f.met, load.met)):
        ratio = predicted / measured if measured else math.inf
        if abs(ratio - 1) <= WITHIN:
            continue
        factor = fit(profile, load, name, seeds, cache, mixed_extra) if name in TERM else 0
        why = f": {TERM[name][0]} x {factor:.2f} would meet it" if name in TERM else ""
        out.append(f"{name} {ratio:.2f}x{why}")
    return out


def label(load: Load) -> str:
    if load.ratio >= 1.0:
        return f"{load.workload} {load.prompt}/{load.out}"
    return f"{load.workload} {load.ratio * 100:.0f} to 100 % of {load.prompt}/{load.out}"


def _rel(path: Path | None) -> str:
    if path is None:
        return ""
    p = path.resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", type=Path, default=PROFILE)
    p.add_argument("--runs", type=Path, default=RUNS)
    p.add_argument("--seeds", type=int, default=11)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--mixed-extra", type=float, default=0.0, metavar="SHARE",
                   help="a mixed step costs its parts and this share more (as pd-fsm plan)")
    p.add_argument("--prefill-from", type=Path, metavar="FILE",
                   help="take the prefill points from another profile (the same prefill "
                        "measured on a runner of another capacity)")
    p.add_argument("--scale", nargs=2, action="append", default=[], metavar=("TERM", "X"),
                   help="plant an error: a cost term (prefill, decode, d2h...) times X")
    args = p.parse_args()
    profile = Profile.load(args.profile)
    other = Profile.load(args.prefill_from) if args.prefill_from else None
    note = prefill_note(profile, args.prefill_from, other)
    if other is not None:
        profile = prefill_from(profile, other)
    for term, factor in args.scale:
        profile = scaled(profile, term, float(factor))
    costs, cache = costs_for(profile, args.mixed_extra), not args.no_cache
    print(f"{_rel(args.profile)} against {_rel(args.runs)}/{MODEL}.jsonl: one colocated worker, "
          f"max_running {MAX_RUNNING}, chunk {MAX_BATCHED}, pool {POOL_TOKENS} tokens; "
          f"median of {args.seeds} seeds at each measured arrival rate; replay: the bench's "
          f"own arrival schedule and prompt lengths; {note}; "
          f"prefix cache {'replayed' if cache else 'left out'}; mixed step extra "
          f"{args.mixed_extra:g}; "
          f"ITL: every gap between two streamed tokens, pooled (the bench's kind); where a "
          f"figure is off, the factor on its cost term (TTFT: prefill, ITL: decode) that would "
          f"bring the prediction to the measurement\n")
    print("| load | arrived req/s | prompts | cached | TTFT p50 ms pred / meas | ITL p50 ms "
          "pred / meas | met pred / meas | replay TTFT / ITL / met | outside ±20 % |")
    print("|---|---|---|---|---|---|---|---|---|")
    for load in loads(args.runs):
        f, r = predict(costs, load, args.seeds, cache), replay(costs, load, cache)
        missed = off(profile, load, f, args.seeds, cache, args.mixed_extra)
        print(f"| {label(load)} | {load.arrival_rate:.2f} | "
              f"{load.prompts} | {load.cached_tokens} | {f.ttft_p50 * 1e3:.1f} / "
              f"{load.ttft_p50 * 1e3:.1f} ({f.ttft_p50 / load.ttft_p50:.2f}) | "
              f"{f.itl_p50 * 1e3:.2f} / {load.itl_p50 * 1e3:.2f} "
              f"({f.itl_p50 / load.itl_p50:.2f}) | {f.met:.0%} / {load.met:.0%} | "
              f"{r.ttft_p50 * 1e3:.1f} / {r.itl_p50 * 1e3:.2f} / {r.met:.0%} | "
              f"{'; '.join(missed) or 'none'} |")
    sat = all_at_once(args.runs)
    if sat:
        load, measured = sat
        got = throughput(costs, load)
        print(f"\n{load.prompts} prompts of {load.prompt}/{load.out} at once: predicted "
              f"{got:,.0f} output tokens/s, measured {measured:,.0f} ({got / measured:.2f})")


if __name__ == "__main__":
    main()
