"""Where P and D run, and at which priority (issue 30 §3): goodput of every static placement of
one P and one D on this machine's cores, next to a colocated worker on the same cores, in one run.

Placements (each a ``pd-fsm cluster`` of its own, all started before the first measurement and
left idle while another is measured):

    colocated          one worker on every core              (--colocated)
    PD pinned          P on core 0, D on core 1              (--prefill-cpus 0 --decode-cpus 1;
                                                             what `--pd-cores split` gives here)
    PD shared          P and D on every core, equal priority (--pd-cores shared, nice 0 and 0)
    PD shared, nice    P and D on every core, P at nice P, D at nice D (--pd-cores shared
                       --prefill-nice P --decode-nice D; one placement per --nice-pairs item),
                       D's pools sized to both cores (--decode-cpu-pools all), as in runs 1-12
    ... D pools of N   each nice pair, D's XLA pools of N threads on every core
                       (--decode-cpu-pools N; one placement per --decode-pools item): XLA's
                       idle pool threads spin, so a two-thread D keeps ~1.5 cores busy
                       even at batch 1 and P gets the rest. One thread is `pd-fsm cluster
                       --pd-cores shared`'s default since run 12
    ... local prefill  the last nice pair, and conditional disaggregation by P's queue: D
                       prefills a prompt itself while P has N or more requests (Dynamo's
                       max_prefill_queue_size; --proxy-args "--local-prefill-queue N"; one
                       placement per --local-queues item)
    PD adaptive        (--adaptive [split] [shared]) `pd-fsm cluster --planner --pd-cores
                       START` at the last nice pair: P and D start split as PD pinned (or
                       shared as PD shared), and the planner moves them between split and
                       shared cores (and P's priority while shared) by the SLO targets below;
                       it acts from the warm-up on, and what it learnt at one rate carries into
                       the next

At each ``--rates`` value (and repeat) a fresh set of prompts arrives as a Poisson process, the
same set at every placement in turn; the order rotates from rate to rate (the machine is shared:
a neighbour's burst should not land on one placement only). Every placement first gets a set of
other prompts of the same kinds, unmeasured (each new shape's first use). Runs 1-4 of
RESULTS_placement.md reused one set for the warm-up and every rate, so after the warm-up every
prompt was a prefix-cache hit on colocated workers and on P: prefill cost next to nothing there.
Goodput (DistServe): requests per second that met both the TTFT target and
the time-per-output-token target (a request's mean inter-token gap); also at a tighter TPOT
target. Nothing is asserted; ratios to colocated are printed (machines differ in speed).

    .venv/bin/python bench/bench_placement.py [--rates 0.25 0.5 1 1.5 --num-prompts 24
        --nice-pairs 10,-5 19,-5 --repeats 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_serving import _load_args, goodput  # bench/, beside this script

from pd_fsm.io_trio.bench_client import Summary, make_prompts, run_load
from tests.integration.serve_support import PDCluster

COLOCATED = "colocated (cores 0-1)"
PINNED = "PD pinned (P core 0, D core 1)"
SHARED = "PD shared (cores 0-1, equal priority)"
def adaptive_name(start: str) -> str:
    return f"PD adaptive ({start} at start, planner --cores)"


ADAPTIVE = adaptive_name("split")


Spec = tuple[list[str], str, dict[str, Any] | None]
WARM_SEED = 1_000_000  # the warm-up's prompts: a seed no measured set takes


def nice_flags(p: int, d: int, cores: str = "shared") -> list[str]:
    return ["--pd-cores", cores, "--prefill-nice", str(p), "--decode-nice", str(d)]


def nice_placement(p: int, d: int, threads: int = 0) -> tuple[str, Spec]:
    """P and D on every core, P at nice ``p`` and D at nice ``d``, D's pools sized to every
    core (as in runs 1-12; the cluster's default since run 12 is one thread) or of ``threads``:
    its name and spec."""
    name = f"PD shared, nice P {p:+d} / D {d:+d}"
    if threads:
        name += f", D pools of {threads} thread{'s' * (threads > 1)}"
    return (name, ([*nice_flags(p, d), "--decode-cpu-pools", str(threads or "all")], "proxy",
                   {"shared": True, "nice_p": p, "nice_d": d, "decode_threads": threads}))


def local_placement(p: int, d: int, queue: int) -> tuple[str, Spec]:
    """``nice_placement(p, d)`` whose D prefills alone while P has ``queue`` or more requests."""
    name, (flags, which, fields) = nice_placement(p, d)
    return (f"{name}, local prefill at P queue >= {queue}",
            ([*flags, "--proxy-args", f"--local-prefill-queue {queue}"], which,
             {**(fields or {}), "local_prefill_queue": queue}))


def placements(args: argparse.Namespace) -> dict[str, Spec]:
    """name -> (the cluster's flags, which of its URLs to measure, the placement as the
    performance model takes it: pd_fsm.sim.perf.Placement's fields)."""
    out: dict[str, Spec] = {
        COLOCATED: (["--prefill", "0", "--decode", "0", "--colocated"], "colocated",
                    {"colocated": True}),
        PINNED: (["--prefill-cpus", "0", "--decode-cpus", "1"], "proxy", {}),
        # Equal priority stated: the cluster's default on shared cores is D above P.
        SHARED: (["--pd-cores", "shared", "--prefill-nice", "0", "--decode-nice", "0"], "proxy",
                 {"shared": True}),
    }
    for pair in args.nice_pairs:
        p, d = (int(x) for x in pair.split(","))
        name, spec = nice_placement(p, d)
        out[name] = spec
        for threads in args.decode_pools:
            name, spec = nice_placement(p, d, threads)
            out[name] = spec
    for queue in args.local_queues if args.nice_pairs else []:  # on the last pair's p and d
        name, spec = local_placement(p, d, queue)
        out[name] = spec
    for start in getattr(args, "adaptive", None) or []:
        p, d = (int(x) for x in (args.nice_pairs or ["10,-5"])[-1].split(","))
        planner = (f"--ttft-slo {args.slo_ttft:g} --itl-slo {args.slo_tpot:g} "
                   f"{args.planner_args}")
        # No fields: the performance model does not model the planner (bench_perf_model skips it).
        out[adaptive_name(start)] = (["--planner", "--pd-cores", start, "--prefill-nice", str(p),
                                      "--decode-nice", str(d), "--planner-args", planner],
                                     "proxy", None)
    return out


def start(flags: list[str], args: argparse.Namespace) -> PDCluster:
    return PDCluster.start([
        "--model", args.model, "--prefill", "1", "--decode", "1", "--num-pages", "256",
        "--startup-timeout", "1200", *flags,
        # Compiles while another cluster starts take minutes: long windows for first rooms.
        "--worker-args", "--disaggregation-peer-timeout 120 --disaggregation-lease-initial 120",
    ], timeout=1260)


def row(name: str, s: Summary, args: argparse.Namespace, base: float) -> str:
    r = s.rows()
    _, rps = goodput(s, args.slo_ttft, args.slo_tpot)
    _, tight = goodput(s, args.slo_ttft, args.tight_tpot)
    return (f"| {name} | {r['TTFT p50 ms']:.0f} / {r['TTFT p99 ms']:.0f} | "
            f"{r['ITL p50 ms']:.0f} / {r['ITL p99 ms']:.0f} | {r['output tokens/s']:.2f} | "
            f"{rps:.3f} ({goodput(s, args.slo_ttft, args.slo_tpot)[0]}/{len(s.results)}) | "
            f"{vs_colocated(rps, base)} | {tight:.3f} |")


def vs_colocated(rps: float, base: float) -> str:
    """``rps`` as a multiple of colocated's ``base``; where colocated met none, says so."""
    return f"{rps / base:.2f}x" if base > 0 else "- (colocated 0)"


async def decisions(name: str, planner: str) -> None:
    """An adaptive cluster's planner decisions (``GET /decisions``: its last 100)."""
    async with httpx.AsyncClient(timeout=10) as http:
        listed = (await http.get(f"{planner}/decisions")).json()["decisions"]
    print(f"\n### {name}: planner decisions ({len(listed)})\n", flush=True)
    for d in listed:
        print(f"- {time.strftime('%H:%M:%S', time.gmtime(d['wall']))} {d['kind']} "
              f"to={d['to'] or '-'} worker={d['worker'] or '-'} outcome={d['outcome']}: "
              f"{d['reason']}", flush=True)


async def measure(targets: dict[str, str], args: argparse.Namespace) -> None:
    record: dict[str, Any] = {"settings": {k: getattr(args, k) for k in (
        "model", "dataset", "num_prompts", "max_tokens", "seed", "rates", "repeats",
        "local_queues", "decode_pools",
        "slo_ttft", "slo_tpot", "tight_tpot")},
        "placements": {name: args.placement_fields[name] for name in targets},
        "runs": []}
    warm = _load_args(args, args.model)
    warm_prompts = make_prompts(args.dataset, args.num_prompts, WARM_SEED + args.seed)
    for url in targets.values():  # unmeasured: every shape's first use, other words
        await run_load(url, warm, warm_prompts)
    names = list(targets)
    totals: dict[str, list[float]] = {name: [0.0, 0.0] for name in names}  # met, seconds
    step = 0
    for repeat in range(args.repeats):
        for rate in args.rates:
            # New words at every rate: none of them in any placement's prefix cache yet.
            prompt_seed = args.seed + 1 + step
            prompts = make_prompts(args.dataset, args.num_prompts, prompt_seed)
            load = _load_args(args, args.model)
            load.request_rate, load.max_concurrency = rate, None
            results: dict[str, Summary] = {}
            for name in names[step % len(names):] + names[: step % len(names)]:
                results[name] = await run_load(targets[name], load, prompts)
            step += 1
            base = goodput(results[COLOCATED], args.slo_ttft, args.slo_tpot)[1]
            print(f"\n### Poisson {rate:g} req/s, {args.num_prompts} {args.dataset} prompts, "
                  f"{args.max_tokens} tokens out (repeat {repeat + 1})\n\n"
                  f"| placement | TTFT p50 / p99 ms | ITL p50 / p99 ms | output tok/s | "
                  f"goodput req/s (met) at TTFT <= {args.slo_ttft:g} s, TPOT <= "
                  f"{args.slo_tpot * 1000:g} ms | vs colocated | goodput at TPOT <= "
                  f"{args.tight_tpot * 1000:g} ms |\n|---|---|---|---|---|---|---|", flush=True)
            for name in names:
                print(row(name, results[name], args, base), flush=True)
                r = results[name].rows()
                record["runs"].append({
                    "placement": name, "rate": rate, "repeat": repeat,
                    "prompt_seed": prompt_seed,
                    "goodput": goodput(results[name], args.slo_ttft, args.slo_tpot)[1],
                    "goodput_tight": goodput(results[name], args.slo_ttft, args.tight_tpot)[1],
                    "ttft_p50": r["TTFT p50 ms"] / 1000, "itl_p50": r["ITL p50 ms"] / 1000,
                    "completed": r["completed"]})
                met, _ = goodput(results[name], args.slo_ttft, args.slo_tpot)
                totals[name][0] += met
                totals[name][1] += results[name].duration
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print("\n### Over the whole run (requests that met the SLO / seconds under load)\n",
          flush=True)
    base = totals[COLOCATED][0] / totals[COLOCATED][1]
    for name in names:
        met, secs = totals[name]
        print(f"- {name}: {met / secs:.3f} req/s ({met:.0f} met in {secs:.0f} s), "
              f"{vs_colocated(met / secs, base)} vs colocated", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dataset", default="mixed", help="bench_client prompts (default mixed)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--endpoint", default="completions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", type=int, default=4, help="the unmeasured pass")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 1.5])
    p.add_argument("--repeats", type=int, default=1, help="passes over every rate")
    p.add_argument("--nice-pairs", nargs="*", default=["0,-10", "10,-5"], metavar="P,D",
                   help="one shared placement per P,D pair of nice values (default 0,-10 and "
                        "10,-5: P at 0 keeps its share against the machine's other work)")
    p.add_argument("--local-queues", type=int, nargs="*", default=[], metavar="N",
                   help="one placement per N: the last --nice-pairs item with D prefilling "
                        "alone while P has N or more requests")
    p.add_argument("--decode-pools", type=int, nargs="*", default=[], metavar="N",
                   help="PD shared at each nice pair with D's XLA pools of N threads "
                        "(pd-fsm cluster --decode-cpu-pools N), one placement each")
    p.add_argument("--adaptive", nargs="*", choices=("split", "shared"), default=None,
                   metavar="START",
                   help="also the adaptive cluster, one per START (split, shared; none given: "
                        "split): P and D start so, the planner moving them between split and "
                        "shared cores")
    p.add_argument("--planner-args", default="--interval 2 --patience 2 --cooldown 15",
                   help="with --adaptive: more `pd-fsm planner` flags")
    p.add_argument("--only", nargs="*", default=None, metavar="NAME",
                   help="placements to run (substrings of their names; colocated always runs)")
    p.add_argument("--slo-ttft", type=float, default=2.0)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--tight-tpot", type=float, default=0.05)
    p.add_argument("--json", type=Path, default=None,
                   help="also write every run's figures here (bench_perf_model.py reads it)")
    args = p.parse_args()
    if args.adaptive == []:
        args.adaptive = ["split"]
    chosen = placements(args)
    if args.only:
        chosen = {k: v for k, v in chosen.items()
                  if k == COLOCATED or any(s in k for s in args.only)}
    began = time.monotonic()
    clusters: list[PDCluster] = []
    try:
        targets: dict[str, str] = {}
        args.placement_fields = {name: fields for name, (_, _, fields) in chosen.items()}
        for name, (flags, which, _) in chosen.items():
            clusters.append(start(flags, args))
            targets[name] = clusters[-1].urls[which]
            print(f"started {name} after {time.monotonic() - began:.0f} s", flush=True)
        trio.run(measure, targets, args)
        for i, name in enumerate(chosen):
            if "planner" in clusters[i].urls:
                trio.run(decisions, name, clusters[i].urls["planner"])
    finally:
        for c in clusters:
            c.stop()
    print(f"\nwhole run: {time.monotonic() - began:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
