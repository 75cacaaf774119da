"""The adaptive cluster against static placements under a workload that shifts (issue 30 §5):
goodput per phase and over the whole run, on the same cores, with the same arrivals.

The workload: phases of ``--phase-seconds`` each, in the order ``--phases`` spells them (A or B),
Poisson arrivals at ``--rate`` throughout (drawn as ``pd-fsm sim --workers`` draws them:
``pd_fsm.sim.perf_cluster.shifting``):

    A  long prompts, short answers   (--a-prompt 400-800 tokens, --a-out 8)
    B  short prompts, long answers   (--b-prompt 16-64 tokens, --b-out 64-128)

A prompt of k tokens is k words of bench_client's word list: for SmolLM2 each is one token
(checked with its tokenizer at the start; the table prints how far off any prompt is). Answers are
exactly their length (``ignore_eos``).

Placements (each a ``pd-fsm cluster`` of its own, all started before the first measurement and
left idle while another is measured; bench_placement.py's):

    colocated          one worker on both cores                       (--colocated)
    PD pinned          P on core 0, D on core 1                       (--prefill-cpus 0 ...)
    PD shared, nice    P and D on both cores, P at nice P, D at nice D (--nice P,D; 10,-5)
    control            (--control) the adaptive cluster with its planner in ``--dry-run``: the
                       same processes, flags and scrapes, no action
    adaptive           ``pd-fsm cluster --planner`` with the same nice values: PD workers that
                       switch roles at runtime and the planner switching them, and moving P's
                       priority first (the cluster passes ``--prefill-nices``, 19 through P's
                       and D's values; --planner-args; --adaptive-workers P,D, default 1,1).
                       ``--adaptive-cores shared`` (the default, as ``pd-fsm cluster
                       --planner``): they start shared, and the planner may split them;
                       ``split``: P and D start split as PD pinned's, and the planner moves
                       them between split and shared cores (``planner --cores``; runs 8-9;
                       runs 1-7 started shared and had no cores lever)
    variant            (--variant-args ARGS) the adaptive cluster again, its planner given ARGS
                       too (e.g. ``--no-move-standby``): a rule's A/B within one run

Every placement gets the same schedule (arrival times, prompts, answer lengths), one placement
after another; the order rotates from repeat to repeat, and each repeat after the first sends
the same shapes in other words (runs 4-5 of RESULTS_adaptive.md replayed the first pass's texts:
prefix-cache hits). Each placement first gets a few prompts of each kind unmeasured (every
shape's first use), of other words too. The adaptive cluster runs throughout: what the
planner learnt in one phase (and one repeat) carries into the next. While a placement is
measured, each of its workers' ``/server_info`` (role, role state, nice) and its planner's
``/decisions`` and ``/metrics`` (observations by pressure class) are read every ``--poll-s``:
the roles a planner's cluster passed through and the decisions are printed with their times (a
decision's time: when it was first seen). Every placement's workers are read alike: the reads
cost a worker 1.5-2 % of its mean inter-token gap at 1 s (bench_merged_worker.py, runs 27-29 of
RESULTS_adaptive.md; runs 1-26 read only the adaptive cluster's).

Goodput (DistServe): requests that met both TTFT <= --slo-ttft and TPOT (a request's mean gap
between output tokens) <= --slo-tpot, per second of arrivals: a phase's requests (those that
arrived in it) over ``--phase-seconds``, the whole run's over the phases' seconds; also at
--tight-tpot. Each placement's ratio to the best static placement (per phase: the best in that
phase; whole run: the best static placement over the whole run), and what bounds the goal of
1.3x the best static over the run: the best static placement of each phase summed (a cluster
that chose among the static placements at every phase's start) and every request met, each
over the best static placement's whole run. Nothing is asserted.

    .venv/bin/python bench/bench_adaptive.py [--phases ABAB --phase-seconds 60 --rate 0.5
        --nice 10,-5 --planner-args "--interval 2 --patience 2 --cooldown 15" --json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_placement import (  # bench/
    COLOCATED,
    PINNED,
    nice_flags,
    nice_placement,
    placements,
    start,
)
from bench_serving import _compiles_after_ready, _load_args, goodput  # bench/

from pd_fsm.io_trio.bench_client import BenchPrompt, Result, Summary, _words, run_load
from pd_fsm.sim.perf_cli import _range
from pd_fsm.sim.perf_cluster import Phase, shifting
from tests.integration.serve_support import PDCluster

ADAPTIVE = "adaptive (--planner)"
# The same cluster whose planner only decides (--dry-run): what the adaptive cluster measures
# without acting, so a gap between the two is the planner's and not the cluster's own
# (--control; RESULTS_adaptive.md run 4 saw a gap before the first decision).
# The static PD-shared placement: D's pools of one thread, `pd-fsm cluster --pd-cores shared`'s
# default since RESULTS_placement.md run 12 (runs 1-8 here measured D's pools of two).
SHARED_D_THREADS = 1
CONTROL = "adaptive cluster, planner --dry-run (control)"
# The same cluster with more planner flags (--variant-args): an A/B of a planner rule measured
# in the same run, interleaved with the others (runs 38-39 of RESULTS_adaptive.md, one after the
# other, saw colocated alone meet 45 and 72 of 137 on one schedule).
VARIANT = "adaptive, variant (--variant-args)"
WORKER_PREFIXES = ("prefill-", "decode-", "colocated")


# ----------------------------------------------------------------------------- the workload


@attrs.frozen
class Schedule:
    """What every placement gets: prompt i sent ``arrivals[i]`` s after the start, in phase
    ``phase_of[i]`` (an index into ``kinds``, each phase ``seconds`` long)."""

    kinds: str
    seconds: float
    arrivals: list[float]
    phase_of: list[int]
    prompts: list[BenchPrompt]

    @property
    def total_seconds(self) -> float:
        return self.seconds * len(self.kinds)

    def in_phase(self, k: int) -> list[int]:
        return [i for i, p in enumerate(self.phase_of) if p == k]


def make_schedule(args: argparse.Namespace) -> Schedule:
    ranges = {"A": (args.a_prompt, args.a_out), "B": (args.b_prompt, args.b_out)}
    phases = [Phase(args.phase_seconds, args.rate, *ranges[k]) for k in args.phases]
    requests = shifting(phases, seed=args.seed)
    rng = random.Random(args.seed)  # the words: the same texts for every placement
    return Schedule(
        args.phases, args.phase_seconds, [r.arrival for r in requests],
        [min(int(r.arrival // args.phase_seconds), len(phases) - 1) for r in requests],
        [BenchPrompt(_words(rng, r.prompt), r.prompt, r.out) for r in requests])


def warm_prompts(sched: Schedule, per_kind: int, seed: int) -> list[BenchPrompt]:
    """For the unmeasured pass: prompts of the first ``per_kind`` lengths of each kind (A and B
    shapes), of other words. Runs 1-4 warmed with the measured prompts themselves, so the prefix
    caches held most of phases 1 and 2's prompts before they were measured
    (RESULTS_adaptive.md)."""
    rng = random.Random(f"warm-{seed}")
    out: list[BenchPrompt] = []
    for kind in sorted(set(sched.kinds)):
        out += reworded([p for p, k in zip(sched.prompts, sched.phase_of, strict=True)
                         if sched.kinds[k] == kind][:per_kind], rng)
    return out


def reworded(prompts: list[BenchPrompt], rng: random.Random) -> list[BenchPrompt]:
    """The same lengths and answer lengths in other words: none of them in a prefix cache."""
    return [BenchPrompt(_words(rng, p.words), p.words, p.max_tokens) for p in prompts]


def token_check(sched: Schedule, model: str) -> str:
    """How many tokens the prompts are, by the model's tokenizer (SmolLM2 and tiny only)."""
    if model == "smollm2":
        import gguf

        # The tokenizer alone, from the GGUF's metadata (load_smollm2 would also put the
        # weights on the device, in this process).
        from pd_fsm.jax_engine.model.gguf_loader import _read_tokenizer, find_smollm2_gguf
        from pd_fsm.text.tokenizer import HFTokenizer

        spec = _read_tokenizer(gguf.GGUFReader(str(find_smollm2_gguf())))
        tok = HFTokenizer(spec.tokenizer_json, spec.eos_token_id,
                          bos_token_id=spec.bos_token_id, add_bos_token=spec.add_bos_token)
        counts = [len(tok.encode(p.text)) for p in sched.prompts]
    elif model == "tiny":
        counts = [len(p.text) for p in sched.prompts]  # one token per character
    else:
        return f"prompt tokens not checked ({model})"
    parts = []
    for kind in sorted(set(sched.kinds)):
        got = [c for c, k in zip(counts, sched.phase_of, strict=True) if sched.kinds[k] == kind]
        asked = [p.words for p, k in zip(sched.prompts, sched.phase_of, strict=True)
                 if sched.kinds[k] == kind]
        if got:
            off = max(abs(g - a) for g, a in zip(got, asked, strict=True))
            parts.append(f"{kind}: {min(got)}-{max(got)} tokens ({model}'s tokenizer; asked "
                         f"{min(asked)}-{max(asked)}, at most {off} off)")
    return "prompt lengths: " + "; ".join(parts)


# ----------------------------------------------------------------------------- the adaptive side


@attrs.define
class Watch:
    """What a placement did while it was measured, read every ``poll_s``: each worker's
    role, role state, CPU priority and cores (``/server_info``), and with a planner its decisions
    (``/decisions``, stamped when first seen: within ``poll_s`` of when it was made) and its
    observations by pressure class (``pd_fsm_planner_observations_total``). Times are seconds
    from the run's start."""

    workers: list[str]
    planner: str | None  # None: a static placement's (its workers' roles only)
    poll_s: float
    roles: list[tuple[float, str, str]] = attrs.field(factory=list)  # (t, worker, role)
    decisions: list[tuple[float | None, dict[str, Any]]] = attrs.field(factory=list)
    pressure: list[tuple[float, dict[str, float]]] = attrs.field(factory=list)
    _role: dict[str, str] = attrs.field(factory=dict)
    _seen: set[str] = attrs.field(factory=set)

    async def poll(self, http: httpx.AsyncClient, t: float, before: bool = False) -> None:
        for url in self.workers:
            try:
                info = (await http.get(f"{url}/server_info")).json()
                cores = ",".join(map(str, info.get("cpus") or [])) or "?"
                role = (f"{info.get('disaggregation_mode')} ({info.get('role_state', '?')}) "
                        f"nice {info.get('nice', '?')} cores {cores}")
            except (httpx.HTTPError, ValueError) as exc:
                role = f"unreadable ({type(exc).__name__})"
            if self._role.get(url) != role:
                self._role[url] = role
                self.roles.append((t, url, role))
        if self.planner is None:
            return
        try:
            listed = (await http.get(f"{self.planner}/decisions")).json()["decisions"]
            for entry in listed:
                key = json.dumps(entry, sort_keys=True)
                if key not in self._seen:
                    self._seen.add(key)
                    # Made before this run (warm-up, other placements' runs): no time here.
                    self.decisions.append((None if before else t, entry))
            text = (await http.get(f"{self.planner}/metrics")).text
            counts = {s.labels["pressure"]: s.value
                      for f in text_string_to_metric_families(text) for s in f.samples
                      if s.name == "pd_fsm_planner_observations_total"}
            self.pressure.append((t, counts))
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # the next poll tries again

    async def follow(self, http: httpx.AsyncClient, t0: float) -> None:
        while True:
            await trio.sleep(self.poll_s)
            await self.poll(http, trio.current_time() - t0)

    def start_run(self) -> None:
        """A new measured run: its own timelines (decisions already seen stay seen)."""
        self.roles, self.decisions, self.pressure = [], [], []
        self._role = {}

    def pressure_in(self, lo: float, hi: float) -> dict[str, float]:
        """Observations per pressure class between ``lo`` and ``hi`` s (nearest polls)."""
        def at(t: float) -> dict[str, float]:
            done = [c for when, c in self.pressure if when <= t]
            return done[-1] if done else {}
        a, b = at(lo), at(hi)
        return {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0) > 0}

    def report(self, sched: Schedule, names: dict[str, str]) -> list[str]:
        def when(t: float) -> str:
            k = min(max(int(t // sched.seconds), 0), len(sched.kinds) - 1)
            return f"{t:+7.1f} s (phase {k + 1} {sched.kinds[k]})"
        lines = ["roles as /server_info gave them:"]
        lines += [f"  {when(t)}  {names.get(url, url)}: {role}" for t, url, role in self.roles]
        passed: dict[str, list[str]] = {}
        for _, url, role in self.roles:
            seq = passed.setdefault(names.get(url, url), [])
            mode = role.split(" ")[0]
            if not seq or seq[-1] != mode:
                seq.append(mode)
        lines.append("roles passed through: " + "; ".join(
            f"{w}: {' -> '.join(seq)}" for w, seq in passed.items()))
        lines.append(f"planner decisions ({len(self.decisions)}):" if self.decisions
                     else "planner decisions: none")
        for t, d in self.decisions:
            stamp = "   before this run" if t is None else when(t)
            lines.append(f"  {stamp}  {d.get('kind')} to={d.get('to') or '-'} "
                         f"worker={names.get(d.get('worker', ''), d.get('worker') or '-')} "
                         f"outcome={d.get('outcome')} pressure={d.get('pressure')}: "
                         f"{d.get('reason')}")
        lines.append("planner observations by pressure class, per phase:")
        for k, kind in enumerate(sched.kinds):
            got = self.pressure_in(k * sched.seconds, (k + 1) * sched.seconds)
            lines.append(f"  phase {k + 1} {kind}: " + (", ".join(
                f"{c} {n:.0f}" for c, n in sorted(got.items())) or "none read"))
        return lines


# ----------------------------------------------------------------------------- measuring


@attrs.frozen
class Target:
    url: str  # where requests go
    workers: dict[str, str]  # name -> URL (compile counters; the adaptive's roles)
    planner: str | None = None


def figures(results: list[Result], seconds: float, args: argparse.Namespace) -> dict[str, float]:
    """One placement's figures over ``results`` (the requests that arrived in ``seconds``)."""
    s = Summary(results, seconds)
    r = s.rows()
    met, rps = goodput(s, args.slo_ttft, args.slo_tpot)
    met_tight, rps_tight = goodput(s, args.slo_ttft, args.tight_tpot)
    return {"sent": len(results), "completed": r["completed"], "met": met, "goodput": rps,
            "met_tight": met_tight, "goodput_tight": rps_tight,
            "ttft_p50_ms": r["TTFT p50 ms"], "ttft_p99_ms": r["TTFT p99 ms"],
            "itl_p50_ms": r["ITL p50 ms"], "itl_p99_ms": r["ITL p99 ms"]}


def _ratio(x: float, best: float | None) -> str:
    if best is None:  # no static placement measured (--only, --control)
        return "-"
    if best > 0:
        return f"{x / best:.2f}x"
    return "inf" if x > 0 else "-"


def table(title: str, figs: dict[str, dict[str, float]], static: list[str],
          args: argparse.Namespace) -> list[str]:
    best = max((figs[n]["goodput"] for n in static), default=None)
    best_tight = max((figs[n]["goodput_tight"] for n in static), default=None)
    lines = [f"\n#### {title}\n",
             f"| placement | TTFT p50 / p99 ms | ITL p50 / p99 ms | goodput req/s (met/sent) at "
             f"TTFT <= {args.slo_ttft:g} s, TPOT <= {args.slo_tpot * 1000:g} ms | vs best static "
             f"| goodput at TPOT <= {args.tight_tpot * 1000:g} ms (met) | vs best static |",
             "|---|---|---|---|---|---|---|"]
    for name, f in figs.items():
        lines.append(
            f"| {name} | {f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f} | "
            f"{f['itl_p50_ms']:.0f} / {f['itl_p99_ms']:.0f} | {f['goodput']:.3f} "
            f"({f['met']:.0f}/{f['sent']:.0f}) | {_ratio(f['goodput'], best)} | "
            f"{f['goodput_tight']:.3f} ({f['met_tight']:.0f}) | "
            f"{_ratio(f['goodput_tight'], best_tight)} |")
    return lines


def ceilings(per_phase: list[dict[str, dict[str, float]]], overall: dict[str, dict[str, float]],
             static: list[str], args: argparse.Namespace) -> list[str]:
    """What the 1.3x goal can be measured against, from the static placements alone: the most a
    cluster choosing among them at each phase's start could meet (every phase's best, summed),
    and every request met, each as a ratio to the best static placement over the run. An
    adaptive cluster that holds, in each phase, the placement that phase's best static one has
    reaches the first; to pass it, it has to beat every static placement within a phase."""
    lines = []
    for met, slo in (("met", args.slo_tpot), ("met_tight", args.tight_tpot)):
        best_run = max(overall[n][met] for n in static)
        picked = sum(max(f[n][met] for n in static) for f in per_phase)
        sent = overall[static[0]]["sent"]
        lines.append(
            f"\nTPOT <= {slo * 1000:g} ms: the best static placement of each phase, summed, "
            f"met {picked:.0f} of {sent:.0f} ({_ratio(picked, best_run)} the best static "
            f"placement's {best_run:.0f}); every request met would be "
            f"{_ratio(sent, best_run)}")
    return lines


def report(label: str, runs: dict[str, list[list[Result]]], sched: Schedule,
           args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    """Per-phase and whole-run tables over ``runs`` (placement -> one result list per repeat,
    merged: a phase's seconds times the repeats), and the goal's comparison."""
    static = [n for n in runs if n not in (ADAPTIVE, CONTROL, VARIANT)]
    reps = len(next(iter(runs.values())))
    lines: list[str] = [f"\n### {label}"]
    out: dict[str, Any] = {"phases": [], "overall": {}}
    per_phase: list[dict[str, dict[str, float]]] = []
    for k, kind in enumerate(sched.kinds):
        idx = sched.in_phase(k)
        figs = {name: figures([rs[i] for rs in runs[name] for i in idx],
                              sched.seconds * reps, args) for name in runs}
        per_phase.append(figs)
        out["phases"].append(figs)
        what = "long prompts, short answers" if kind == "A" else "short prompts, long answers"
        lines += table(f"phase {k + 1}: {kind} ({what}), {sched.seconds:g} s", figs, static,
                       args)
    overall = {name: figures([r for rs in runs[name] for r in rs], sched.total_seconds * reps,
                             args) for name in runs}
    out["overall"] = overall
    lines += table(f"whole run ({sched.kinds}, {sched.total_seconds:g} s)", overall, static,
                   args)
    if static:
        lines += ceilings(per_phase, overall, static, args)
    if ADAPTIVE in runs and static:
        for key, slo in (("goodput", args.slo_tpot), ("goodput_tight", args.tight_tpot)):
            ratios = [f[ADAPTIVE][key] / best if (best := max(f[n][key] for n in static)) > 0
                      else math.nan for f in per_phase]
            best_run = max(overall[n][key] for n in static)
            whole = overall[ADAPTIVE][key] / best_run if best_run > 0 else math.nan
            every = all(f[ADAPTIVE][key] >= max(f[n][key] for n in static) for f in per_phase)
            lines.append(
                f"\nTPOT <= {slo * 1000:g} ms: adaptive / best static per phase: "
                + ", ".join(f"{r:.2f}" for r in ratios)
                + f" ({'>=' if every else 'below'} the best static in "
                + ("every phase" if every else "some phase")
                + f"); whole run: {whole:.2f}x the best static placement (goal: >= 1.3x)")
    return lines, out


async def measure(targets: dict[str, Target], sched: Schedule, args: argparse.Namespace
                  ) -> dict[str, Any]:
    record: dict[str, Any] = {"runs": []}
    warm = _load_args(args, args.model)
    for name, target in targets.items():  # unmeasured: every shape's first use
        began = time.monotonic()
        await run_load(target.url, warm, warm_prompts(sched, args.warm_per_kind, args.seed))
        print(f"warmed {name} in {time.monotonic() - began:.0f} s", flush=True)
        if target.planner is not None:
            async with httpx.AsyncClient(timeout=10) as http:
                (await http.post(f"{target.planner}/resume")).raise_for_status()
            print(f"resumed {name}'s planner", flush=True)
    load = _load_args(args, args.model)
    load.max_concurrency = None
    names = list(targets)
    runs: dict[str, list[list[Result]]] = {name: [] for name in names}
    # Every placement is watched alike while it is measured: the polls cost its workers CPU
    # (bench_merged_worker.py: the watch on a merged worker, 1.5-2 % of its mean inter-token gap).
    watches = {name: Watch(list(t.workers.values()), t.planner, args.poll_s)
               for name, t in targets.items()}
    async with httpx.AsyncClient(timeout=10) as http:
        for repeat in range(args.repeats):
            # A later pass gets the same shapes and arrivals in other words: the first pass's
            # texts sit in every placement's prefix cache by then.
            prompts = sched.prompts if repeat == 0 else reworded(
                sched.prompts, random.Random(f"repeat-{repeat}-{args.seed}"))
            for name in names[repeat % len(names):] + names[: repeat % len(names)]:
                target = targets[name]
                workers = list(target.workers.values())
                compiles = await _compiles_after_ready(http, workers)
                began = time.monotonic()
                watch = watches[name]
                watch.start_run()
                await watch.poll(http, 0.0, before=True)
                t0 = trio.current_time()
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch.follow, http, t0)
                    summary = await run_load(target.url, load, prompts, sched.arrivals)
                    nursery.cancel_scope.cancel()
                await watch.poll(http, trio.current_time() - t0)
                after = await _compiles_after_ready(http, workers)
                runs[name].append(summary.results)
                failed = [r.error for r in summary.results if not r.ok]
                print(f"measured {name} (repeat {repeat + 1}) in {time.monotonic() - began:.0f}"
                      f" s; {len(failed)} failed" + (f", first: {failed[0]}" if failed else ""),
                      flush=True)
                compiled = {k: after[u] - compiles[u] for k, u in target.workers.items()}
                entry: dict[str, Any] = {
                    "placement": name, "repeat": repeat, "compiles_after_ready": compiled,
                    "requests": [{"ttft": r.ttft, "itl": r.itl, "ok": r.ok, "error": r.error,
                                  "output_tokens": r.output_tokens} for r in summary.results]}
                if any(v for v in compiled.values() if not math.isnan(v)):
                    print(f"  compiled during the run (requests that waited): {compiled}",
                          flush=True)
                if watch.planner is not None:
                    names_of = {u: k for k, u in target.workers.items()}
                    print("\n".join(watch.report(sched, names_of)), flush=True)
                    entry |= {"roles": watch.roles, "decisions": watch.decisions,
                              "pressure": watch.pressure}
                record["runs"].append(entry)
                # Each placement's figures as soon as it is measured, and the raw figures so far:
                # a run stopped half-way keeps what it measured.
                print(brief(summary.results, sched, args), flush=True)
                save(record, sched, args)
    for repeat in range(args.repeats if args.repeats > 1 else 0):
        lines, _ = report(f"repeat {repeat + 1}", {n: [rs[repeat]] for n, rs in runs.items()},
                          sched, args)
        print("\n".join(lines), flush=True)
    lines, record["figures"] = report(
        "all repeats" if args.repeats > 1 else "results", runs, sched, args)
    print("\n".join(lines), flush=True)
    save(record, sched, args)
    return record


def brief(results: list[Result], sched: Schedule, args: argparse.Namespace) -> str:
    """One placement's run in a line per phase: goodput (met/sent), TTFT and ITL p50."""
    parts = []
    for k, kind in enumerate(sched.kinds):
        f = figures([results[i] for i in sched.in_phase(k)], sched.seconds, args)
        parts.append(f"  phase {k + 1} {kind}: goodput {f['goodput']:.3f} req/s "
                     f"({f['met']}/{f['sent']}; {f['met_tight']} at the tight TPOT), TTFT p50 "
                     f"{f['ttft_p50_ms']:.0f} ms, ITL p50 {f['itl_p50_ms']:.0f} ms")
    return "\n".join(parts)


def save(record: dict[str, Any], sched: Schedule, args: argparse.Namespace) -> None:
    """``--json``: the command, the settings, the schedule and every run measured so far."""
    if args.json is None:
        return
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    schedule = [{"arrival": a, "phase": k, "prompt": q.words, "out": q.max_tokens}
                for a, k, q in zip(sched.arrivals, sched.phase_of, sched.prompts, strict=True)]
    out = {"command": args.command, "settings": settings, "schedule": schedule,
           "placements": static_fields(args), **record}
    args.json.write_text(json.dumps(out, indent=1, default=str) + "\n")


def static_fields(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The static placements as the performance model takes them (pd_fsm.sim.perf.Placement's
    fields): ``bench_perf_model.py --measured`` predicts this run's figures from them."""
    static = placements(argparse.Namespace(nice_pairs=[], local_queues=[]))
    p, d = (int(x) for x in args.nice.split(","))
    nice_name, (_, _, nice_fields) = nice_placement(p, d, SHARED_D_THREADS)
    return {COLOCATED: static[COLOCATED][2], PINNED: static[PINNED][2], nice_name: nice_fields}


def chosen_placements(args: argparse.Namespace) -> dict[str, tuple[list[str], str]]:
    """name -> (the cluster's flags, which of its URLs takes the requests)."""
    static = placements(argparse.Namespace(nice_pairs=[], local_queues=[]))
    p, d = (int(x) for x in args.nice.split(","))
    nice_name, (shared_flags, _, _) = nice_placement(p, d, SHARED_D_THREADS)
    n_p, n_d = (int(x) for x in args.adaptive_workers.split(","))
    # The cluster passes the planner --cores (its cores lever) and the same nice values; its
    # pools are the cluster's own choice (D's of one thread, P's of every core when split).
    adaptive_flags = nice_flags(p, d, args.adaptive_cores)
    # Paused until the warm-up is over (measure() resumes it): the warm-up's burst of every
    # shape is not the workload, and in run 2 it had merged both workers before measuring began.
    planner_args = (f"--ttft-slo {args.slo_ttft:g} --itl-slo {args.slo_tpot:g} --paused "
                    f"{args.planner_args}")
    out = {COLOCATED: (static[COLOCATED][0], static[COLOCATED][1]),
           PINNED: (static[PINNED][0], static[PINNED][1]),
           nice_name: (shared_flags, "proxy"),
           ADAPTIVE: (["--planner", "--prefill", str(n_p), "--decode", str(n_d),
                       *adaptive_flags, "--planner-args", planner_args], "proxy")}
    if args.control:
        out[CONTROL] = (["--planner", "--prefill", str(n_p), "--decode", str(n_d),
                         *adaptive_flags,
                         "--planner-args", f"{planner_args} --dry-run"], "proxy")
    if args.variant_args:
        out[VARIANT] = (["--planner", "--prefill", str(n_p), "--decode", str(n_d),
                         *adaptive_flags,
                         "--planner-args", f"{planner_args} {args.variant_args}"], "proxy")
    if args.only:
        out = {k: v for k, v in out.items() if any(s in k for s in args.only)}
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The shifting workload's flags (bench_ceiling.py models the same one)."""
    p.add_argument("--phases", default="ABAB", help="A and B phases in order (default ABAB)")
    p.add_argument("--phase-seconds", type=float, default=60.0)
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--a-prompt", type=_range, default=(400, 800), metavar="LO-HI",
                   help="phase A's prompt tokens (default 400-800)")
    p.add_argument("--a-out", type=_range, default=(8, 8), metavar="LO-HI",
                   help="phase A's output tokens (default 8)")
    p.add_argument("--b-prompt", type=_range, default=(16, 64), metavar="LO-HI",
                   help="phase B's prompt tokens (default 16-64)")
    p.add_argument("--b-out", type=_range, default=(64, 128), metavar="LO-HI",
                   help="phase B's output tokens (default 64-128)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nice", default="10,-5", metavar="P,D",
                   help="nice values of P and D in the shared and adaptive placements")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny (plumbing only)")
    add_workload_args(p)
    p.add_argument("--repeats", type=int, default=1, help="passes of every placement")
    p.add_argument("--adaptive-workers", default="1,1", metavar="P,D",
                   help="the adaptive cluster's prefill and decode workers at start (1,1)")
    p.add_argument("--adaptive-cores", choices=("split", "shared"), default="shared",
                   help="how the adaptive cluster's P and D start, shared (default, as "
                        "`pd-fsm cluster --planner`; runs 8-9 started split) or split; the "
                        "planner moves them between the two")
    p.add_argument("--planner-args", default="--interval 2 --patience 2 --cooldown 15",
                   help="more `pd-fsm planner` flags (its SLO targets are --slo-ttft and "
                        "--slo-tpot)")
    p.add_argument("--control", action="store_true",
                   help="also measure the adaptive cluster with its planner in --dry-run "
                        "(decides, never acts): the control for the planner's own effect")
    p.add_argument("--variant-args", default="", metavar="ARGS",
                   help="also measure the adaptive cluster with these planner flags after "
                        "--planner-args (e.g. --no-move-standby): a rule's A/B in one run")
    p.add_argument("--num-pages", type=int, default=512, help="KV pages of every worker")
    p.add_argument("--only", nargs="*", default=None, metavar="NAME",
                   help="placements to run (substrings of their names)")
    # 8 at once: D's batch shapes up to 8 rows compile before the measurement (the smoke run's
    # D, warmed with 2 of each kind at 4 at once, still compiled 8 executables while measured).
    p.add_argument("--warm-per-kind", type=int, default=8,
                   help="unmeasured prompts of each kind per placement first (default 8)")
    p.add_argument("--concurrency", type=int, default=8, help="the unmeasured pass (8)")
    p.add_argument("--poll-s", type=float, default=1.0,
                   help="how often every placement's roles (and a planner's decisions) are "
                        "read while it is measured")
    p.add_argument("--endpoint", default="completions")
    p.add_argument("--max-tokens", type=int, default=32, help="unused: each prompt has its own")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--tight-tpot", type=float, default=0.05)
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    args = p.parse_args()
    if not args.phases or set(args.phases) - {"A", "B"}:
        p.error("--phases: a string of A and B")
    command = args.command = "python bench/bench_adaptive.py " + shlex.join(sys.argv[1:])
    sched = make_schedule(args)
    print(f"{command}\n\n{len(sched.prompts)} requests over {sched.kinds} "
          f"({sched.seconds:g} s each, Poisson {args.rate:g} req/s): "
          + ", ".join(f"phase {k + 1} {kind} {len(sched.in_phase(k))}"
                      for k, kind in enumerate(sched.kinds)), flush=True)
    print(token_check(sched, args.model), flush=True)
    chosen = chosen_placements(args)
    began = time.monotonic()
    clusters: list[PDCluster] = []

    def terminated(signum: int, frame: Any) -> None:
        # SIGTERM (`timeout`, job control): the clusters are stopped, not left running. Here,
        # not by an exception: one raised inside trio.run could land in trio's machinery (and
        # SIGINT re-raised was not delivered while a load ran; Ctrl-C works as usual).
        print(f"bench_adaptive: signal {signum}, stopping the clusters", flush=True)
        for c in clusters:
            c.proc.stop(grace=120)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, terminated)
    try:
        targets: dict[str, Target] = {}
        for name, (flags, which) in chosen.items():
            clusters.append(start(["--num-pages", str(args.num_pages), *flags], args))
            urls = clusters[-1].urls
            targets[name] = Target(urls[which],
                                   {k: u for k, u in urls.items() if k.startswith(WORKER_PREFIXES)},
                                   urls.get("planner"))
            print(f"started {name} after {time.monotonic() - began:.0f} s", flush=True)
        trio.run(measure, targets, sched, args)
    finally:
        for c in clusters:
            c.proc.stop(grace=120)  # SIGTERM: a cluster stops in tiers; no kill while it does
    print(f"\n{command}\nwhole run: {time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
