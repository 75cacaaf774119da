"""Serving benchmark over real processes: PD vs colocated, our proxy vs sglang-router, and the
proxy's own overhead. Prints tables with a baseline measured in the same run; asserts nothing.

Part ``pd`` (SmolLM2 by default): ``pd-fsm cluster --prefill 1 --decode 1 --colocated`` plus the
real sglang-router (PyPI) over the same P and D. For each prompt set (short: 8-32 words, long:
200-400 words) the same fixed-seed requests go, streamed, at a fixed concurrency, to

    (a) our proxy -> 1P1D,   (b) sglang-router -> the same 1P1D,   (c) the colocated worker,

and the tables give TTFT / ITL / E2E with (a)/(c) and (a)/(b). Every target first gets the same
load once unmeasured (XLA compiles each new shape on first use; a cold pass would measure
compilers). All processes share the machine's cores: PD runs two model processes where colocated
runs one, and the idle ones still take their share of nothing.

Part ``overhead`` (tiny model): a proxy needs a P and a D, so its cost is measured with two
colocated workers A and B: ``pd-fsm proxy --prefill A none --decode B`` posts every request to
both (A's answer is drained and dropped, B's relayed); baseline = the same requests straight to B.
sglang-router over the same A and B is measured the same way. A's duplicate work competes for the
same cores, so this is an upper bound on the proxy's added latency.

Part ``goodput`` (issue 13 §4, DistServe's measure): equal hardware, each side alone on it. ``pd-fsm
cluster`` pins P to core 0 and D to core 1 (``--prefill-cpus 0 --decode-cpus 1``) and the colocated
worker to cores 0-1; the same mixed prompts (short and long alternating) arrive as a Poisson
process at each ``--rates`` value, first at the proxy, then at the colocated worker (the order
alternates between rates; the side not measured is idle). Per target: TTFT and ITL p50/p99,
output tokens/s, and goodput: requests per second that met both the TTFT target and the
time-per-output-token target (a request's mean ITL). After each PD pass, where its time went
(phase histograms of P, D and the proxy) and whether any request waited for a compile.

    .venv/bin/python bench/bench_serving.py --part pd [--num-prompts 16 --concurrency 4]
    .venv/bin/python bench/bench_serving.py --part overhead
    .venv/bin/python bench/bench_serving.py --part goodput [--rates 0.15 0.3 --num-prompts 16]
    .venv/bin/python bench/bench_serving.py --part tax [--num-prompts 16 --rounds 2]

Part ``pulls`` (issue 13 §2): D's pull and scatter times under the mixed load at concurrency 1
(each pull alone: the baseline for the same sizes) and at 6 and 16, from D's phase histograms,
next to D's mean forward step in the same run.

    .venv/bin/python bench/bench_serving.py --part pulls [--num-prompts 24 --concurrencies 6 16]
        [--transfer-nice 0]   # the workers' transfer threads left at normal priority (A/B)

Part ``tax`` (issue 13 §5): the price of disaggregation at concurrency 1, short prompts:
TTFT(PD via proxy) - TTFT(colocated), unpinned (one target runs at a time), and PD's phases.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import plots  # bench/, beside this script

from pd_fsm.io_trio.bench_client import (
    Summary,
    diff_histograms,
    histogram_quantile,
    make_prompts,
    metrics_urls,
    parse_histograms,
    phase_rows,
    phase_table,
    render,
    run_load,
    scrape,
)
from pd_fsm.io_trio.phases import PHASE_BY_KEY
from pd_fsm.io_trio.ports import free_ports
from tests.integration.serve_support import PDCluster, Proc, cli, wait_http_ok

HOST = "127.0.0.1"


def _load_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    return argparse.Namespace(endpoint=args.endpoint, max_tokens=args.max_tokens, model=model,
                              request_rate=math.inf, max_concurrency=args.concurrency,
                              timeout=600.0, seed=args.seed)


def start_router(prefill: str, bootstrap_port: str, decode: str) -> tuple[Proc, str]:
    port, metrics_port = free_ports(2)
    proc = Proc.start("sglang-router", [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", prefill, bootstrap_port, "--decode", decode,
        "--host", HOST, "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
    ])
    return proc, f"http://{HOST}:{port}"


def wait_router(url: str, proc: Proc, model: str) -> None:
    """The router answers once it has registered both workers (health + info endpoints)."""
    body = {"model": model, "prompt": "warm", "max_tokens": 1, "temperature": 0}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"sglang-router exited:\n{proc.tail()}")
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"sglang-router never relayed a request:\n{proc.tail()}")


async def measure(targets: dict[str, str], args: argparse.Namespace, model: str,
                  dataset: str) -> dict[str, Summary]:
    prompts = make_prompts(dataset, args.num_prompts, args.seed)
    load = _load_args(args, model)
    for url in targets.values():  # unmeasured: compiles every shape this load will use
        await run_load(url, load, prompts)
    # Rounds rotate the order: the machine is shared, and a neighbour's burst should not land
    # on one target only. A target's rounds are merged (all requests, summed durations).
    names = list(targets)
    runs: dict[str, list[Summary]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            runs[name].append(await run_load(targets[name], load, prompts))
    return {name: Summary([x for s in ss for x in s.results], sum(s.duration for s in ss))
            for name, ss in runs.items()}


def _cdfs(name: str, what: str, results: dict[str, Summary],
          targets: tuple[float, float] | None = None) -> None:
    """TTFT and ITL CDFs of each target's requests (``targets``: the SLO's, drawn as lines)."""
    ok = {label: [r for r in s.results if r.ok] for label, s in results.items()}
    plots.latency_cdf(f"{name}_ttft_cdf", f"TTFT: {what}",
                      {label: [r.ttft for r in rs] for label, rs in ok.items()}, "TTFT",
                      targets[0] if targets else None)
    plots.latency_cdf(f"{name}_itl_cdf", f"ITL: {what}",
                      {label: [x for r in rs for x in r.itl] for label, rs in ok.items()},
                      "inter-token latency", targets[1] if targets else None)


def table(title: str, a: Summary, b: Summary, a_name: str, b_name: str) -> str:
    return f"### {title}\n\n```\n{render(a, b, a_name, b_name)}\n```\n"


def part_pd(args: argparse.Namespace) -> None:
    # Shared cores (D above P), as this part's results were measured before split became the
    # cluster's default.
    cluster = PDCluster.start(["--model", args.model, "--prefill", "1", "--decode", "1",
                               "--colocated", "--pd-cores", "shared", "--num-pages", "512",
                               "--startup-timeout", "400",
                               "--worker-args", "--disaggregation-peer-timeout 120 "
                               "--disaggregation-lease-initial 120"], timeout=420)
    router: Proc | None = None
    try:
        u = cluster.urls
        targets = {"proxy->1P1D": u["proxy"], "colocated": u["colocated"]}
        if importlib.util.find_spec("sglang_router") is not None:
            router, router_url = start_router(u["prefill-0"],
                                              str(cluster.bootstrap_ports["prefill-0"]),
                                              u["decode-0"])
            wait_router(router_url, router, args.model)
            targets["sglang-router->1P1D"] = router_url
        for dataset in args.datasets:
            results = trio.run(measure, targets, args, args.model, dataset)
            head = (f"{dataset} prompts, {args.num_prompts} requests x {args.rounds} rounds, "
                    f"concurrency {args.concurrency}, {args.max_tokens} output tokens, "
                    f"{args.endpoint}")
            print(table(f"PD vs colocated: {head}", results["proxy->1P1D"],
                        results["colocated"], "proxy->1P1D", "colocated"), flush=True)
            if "sglang-router->1P1D" in results:
                print(table(f"our proxy vs sglang-router, same 1P1D: {head}",
                            results["proxy->1P1D"], results["sglang-router->1P1D"],
                            "proxy->1P1D", "sglang-router->1P1D"), flush=True)
            _cdfs(f"pd_{dataset}", f"{dataset} prompts, concurrency {args.concurrency}",
                  results)
    finally:
        if router is not None:
            router.stop()
        cluster.stop()


def part_overhead(args: argparse.Namespace) -> None:
    procs: list[Proc] = []
    try:
        a_port, b_port, proxy_port = free_ports(3)
        worker = ["--model", "tiny", "--host", HOST, "--num-pages", "512", "--page-size", "4",
                  "--context-length", "512"]
        a = Proc.start("worker-a", cli("serve", *worker, "--port", str(a_port)))
        b = Proc.start("worker-b", cli("serve", *worker, "--port", str(b_port)))
        procs += [a, b]
        a_url, b_url = f"http://{HOST}:{a_port}", f"http://{HOST}:{b_port}"
        proxy = Proc.start("proxy", cli("proxy", "--host", HOST, "--port", str(proxy_port),
                                        "--prefill", a_url, "none", "--decode", b_url))
        procs.append(proxy)
        proxy_url = f"http://{HOST}:{proxy_port}"
        for url, proc in ((a_url, a), (b_url, b), (proxy_url, proxy)):
            wait_http_ok(f"{url}/health", proc, timeout=300)
        targets = {"direct B": b_url, "proxy(A,B)": proxy_url}
        if importlib.util.find_spec("sglang_router") is not None:
            router, router_url = start_router(a_url, "none", b_url)
            procs.append(router)
            wait_router(router_url, router, "tiny")
            targets["sglang-router(A,B)"] = router_url
        for concurrency in (1, 4):
            args.concurrency = concurrency
            results = trio.run(measure, targets, args, "tiny", "short")
            head = (f"tiny model, short prompts, {args.num_prompts} requests x {args.rounds} "
                    f"rounds, concurrency {concurrency}, {args.max_tokens} output tokens, "
                    f"{args.endpoint}")
            print(table(f"proxy overhead: {head}", results["proxy(A,B)"],
                        results["direct B"], "proxy(A,B)", "direct B"), flush=True)
            if "sglang-router(A,B)" in results:
                print(table(f"sglang-router overhead: {head}", results["sglang-router(A,B)"],
                            results["direct B"], "sglang-router(A,B)", "direct B"),
                      flush=True)
    finally:
        for proc in reversed(procs):
            proc.stop()


def goodput(s: Summary, ttft_s: float, tpot_s: float) -> tuple[int, float]:
    return s.goodput(ttft_s, tpot_s)


def _counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return math.nan


async def _compiles_after_ready(http: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    name = "pd_fsm_worker_backend_compiles_after_ready_total"
    return {url: _counter((await http.get(f"{url}/metrics")).text, name) for url in urls}


async def measure_goodput(proxy: str, colocated: str, args: argparse.Namespace) -> None:
    prompts = make_prompts("mixed", args.num_prompts, args.seed)
    targets = {"PD (P core 0, D core 1)": proxy, "colocated (cores 0-1)": colocated}
    async with httpx.AsyncClient(timeout=30) as http:
        urls = await metrics_urls(http, proxy)
        workers = [u for u in urls if u != proxy] + [colocated]
        # Unmeasured: the first use of each KV page bucket queues its fast kernel's compile.
        warm = _load_args(args, args.model)
        for url in targets.values():
            await run_load(url, warm, prompts)
        curves: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        samples: dict[str, Summary] = {}
        phase_data: list[Any] = []
        for i, rate in enumerate(args.rates):
            load = _load_args(args, args.model)
            load.request_rate, load.max_concurrency = rate, None
            names = list(targets) if i % 2 == 0 else list(reversed(targets))
            results: dict[str, Summary] = {}
            phases = ""
            for name in names:
                before = await scrape(http, urls)
                results[name] = await run_load(targets[name], load, prompts)
                if targets[name] == proxy:
                    after = await scrape(http, urls)
                    phases, phase_data = phase_table(before, after), phase_rows(before, after)
            pd, colo = (results[name] for name in targets)
            head = (f"{args.num_prompts} mixed prompts, Poisson {rate:g} req/s, "
                    f"{args.max_tokens} output tokens, {args.endpoint}")
            print(table(f"goodput: PD vs colocated at equal cores: {head}", pd, colo,
                        "PD (proxy)", "colocated"), flush=True)
            slo = f"TTFT <= {args.slo_ttft:g} s and TPOT <= {args.slo_tpot * 1000:g} ms"
            for name, summary in (("PD (proxy)", pd), ("colocated", colo)):
                n, rps = goodput(summary, args.slo_ttft, args.slo_tpot)
                print(f"goodput {name}: {n}/{len(summary.results)} requests met {slo}: "
                      f"{rps:.3f} req/s", flush=True)
            for name in targets:
                # Against the rate the requests really came at (a few Poisson arrivals stray
                # from the nominal one): the requests that met the targets over the span they
                # arrived in, which that rate bounds.
                s = results[name]
                met = goodput(s, args.slo_ttft, args.slo_tpot)[0]
                curves[name].append((s.arrival_rate(), met / s.arrivals))
                print(f"{name}: arrived at {s.arrival_rate():.3f} req/s (nominal {rate:g}); "
                      f"{met}/{len(s.results)} met the targets: {met / s.arrivals:.3f} req/s",
                      flush=True)
                samples[f"{name} @ {rate:g} req/s"] = s
            print(f"\n```\n{phases}\n```\n", flush=True)
            print(f"compiles after ready: {await _compiles_after_ready(http, workers)}\n",
                  flush=True)
    what = f"{args.num_prompts} mixed prompts, {args.max_tokens} tokens out"
    plots.goodput_vs_rate("goodput_vs_rate", f"Goodput at equal cores: {what}", curves,
                          f"TTFT ≤ {args.slo_ttft:g} s, TPOT ≤ {args.slo_tpot * 1000:g} ms")
    _cdfs("goodput", what, samples, (args.slo_ttft, args.slo_tpot))
    plots.phase_bars("goodput_phases", f"PD phases at {args.rates[-1]:g} req/s: {what}",
                     plots.phases_by_side(phase_data))


async def measure_tax(proxy: str, colocated: str, args: argparse.Namespace) -> None:
    """Concurrency 1, short prompts: TTFT(PD via proxy) - TTFT(colocated), and PD's phases."""
    prompts = make_prompts("short", args.num_prompts, args.seed)
    load = _load_args(args, args.model)
    load.max_concurrency = 1
    async with httpx.AsyncClient(timeout=30) as http:
        urls = await metrics_urls(http, proxy)
        for url in (proxy, colocated):  # unmeasured: KV page buckets' first use
            await run_load(url, load, prompts)
        results: dict[str, Summary] = {}
        phases = ""
        phase_data: list[Any] = []
        for r in range(args.rounds):
            for name, url in (("PD", proxy), ("colocated", colocated))[:: 1 if r % 2 == 0 else -1]:
                before = await scrape(http, urls) if url == proxy else {}
                got = await run_load(url, load, prompts)
                if url == proxy:
                    after = await scrape(http, urls)
                    phases, phase_data = phase_table(before, after), phase_rows(before, after)
                old = results.get(name)
                results[name] = got if old is None else Summary(
                    old.results + got.results, old.duration + got.duration)
    pd, colo = results["PD"], results["colocated"]
    head = (f"short prompts, {len(pd.results)} requests one at a time, {args.max_tokens} output "
            f"tokens, {args.endpoint}")
    print(table(f"PD tax: {head}", pd, colo, "PD (proxy)", "colocated"), flush=True)
    tax = pd.rows()["TTFT p50 ms"] - colo.rows()["TTFT p50 ms"]
    print(f"TTFT p50 PD - colocated: {tax:+.1f} ms\n\n```\n{phases}\n```\n", flush=True)
    _cdfs("tax", f"short prompts one at a time, {args.max_tokens} tokens out", results)
    plots.phase_bars("tax_phases", "PD phases, short prompts one at a time",
                     plots.phases_by_side(phase_data))


async def measure_pulls(proxy: str, args: argparse.Namespace) -> None:
    """The same mixed prompts at concurrency 1 (each pull alone: the baseline for the same
    sizes), then at each ``--concurrencies``: D's pull and scatter p50/p99 from its phase
    histograms, and D's mean forward step over the same run (a scatter waits for one at most)."""
    prompts = make_prompts("mixed", args.num_prompts, args.seed)
    async with httpx.AsyncClient(timeout=30) as http:
        workers = (await http.get(f"{proxy}/workers")).json()
        d_url = workers["decode"][0]
        await run_load(proxy, _load_args(args, args.model), prompts)  # unmeasured
        rows = []
        for c in (1, *args.concurrencies):
            load = _load_args(args, args.model)
            load.max_concurrency = c
            before_text = (await http.get(f"{d_url}/metrics")).text
            summary = await run_load(proxy, load, prompts)
            after_text = (await http.get(f"{d_url}/metrics")).text
            hists = diff_histograms(parse_histograms(before_text), parse_histograms(after_text))
            q = {key: (histogram_quantile(0.5, hists[PHASE_BY_KEY[key].name]),
                       histogram_quantile(0.99, hists[PHASE_BY_KEY[key].name]))
                 for key in ("kv_pull", "kv_scatter", "decode_pull_report")}
            rate = hists[PHASE_BY_KEY["kv_transfer_gbps"].name]
            gbps = (histogram_quantile(0.5, rate), histogram_quantile(0.01, rate))
            waited = _scatter_steps(hists.get(PHASE_BY_KEY["kv_scatter_steps"].name, {}))
            steps = [_counter(t, "pd_fsm_worker_backend_steps_total")
                     for t in (before_text, after_text)]
            secs = [_counter(t, "pd_fsm_worker_backend_step_seconds_total")
                    for t in (before_text, after_text)]
            step_ms = (secs[1] - secs[0]) / max(steps[1] - steps[0], 1) * 1000
            rows.append((c, q, gbps, waited, step_ms, summary.rows()))
    print(f"D's pulls under concurrency: {args.num_prompts} mixed prompts, {args.max_tokens} "
          f"output tokens, unpinned 1P1D, workers' --transfer-nice "
          f"{'default' if args.transfer_nice is None else args.transfer_nice} "
          f"{args.worker_args}\n")
    head = (f"{'concurrency':>11}{'pull p50 ms':>13}{'pull p99 ms':>13}{'p99 / alone':>13}"
            f"{'GB/s p50':>10}{'GB/s p1':>9}"
            f"{'scatter p50':>13}{'scatter p99':>13}{'<=1 step':>10}{'max steps':>11}"
            f"{'report p50':>12}{'report p99':>12}{'D step ms':>11}{'TTFT p50 ms':>13}"
            f"{'TTFT p99 ms':>13}")
    print(head)
    print("-" * len(head))
    alone = rows[0][1]["kv_pull"][1]
    for c, q, (rate50, rate1), (share, most), step_ms, r in rows:
        report = q["decode_pull_report"]
        print(f"{c:>11}{q['kv_pull'][0] * 1000:>13.1f}{q['kv_pull'][1] * 1000:>13.1f}"
              f"{q['kv_pull'][1] / alone:>13.2f}{rate50:>10.2f}{rate1:>9.2f}"
              f"{q['kv_scatter'][0] * 1000:>13.1f}"
              f"{q['kv_scatter'][1] * 1000:>13.1f}{share:>9.0%} {most:>11}"
              f"{report[0] * 1000:>12.1f}"
              f"{report[1] * 1000:>12.1f}{step_ms:>11.1f}{r['TTFT p50 ms']:>13.0f}"
              f"{r['TTFT p99 ms']:>13.0f}")


def _scatter_steps(buckets: dict[float, float]) -> tuple[float, str]:
    """From D's ``kv_scatter_steps`` histogram (cumulative counts by upper bound): the share of
    scatters that waited at most one loop iteration, and the most any waited ("<= bound")."""
    total = buckets.get(float("inf"), 0.0)
    if total <= 0:
        return float("nan"), "-"
    most = min(le for le, n in buckets.items() if n >= total)
    return buckets.get(1.0, 0.0) / total, "inf" if most == float("inf") else f"{most:g}"


def _run_on_cluster(args: argparse.Namespace, cluster_args: list[str], measure: Any) -> None:
    """``pd-fsm cluster`` (1P1D SmolLM2 by default, ``--num-pages 256``) plus ``cluster_args``,
    then ``trio.run(measure, urls, args)``; the cluster stops whatever happens."""
    cluster = PDCluster.start([
        "--model", args.model, "--prefill", "1", "--decode", "1", "--num-pages", "256",
        "--startup-timeout", "1200", *cluster_args, *shlex.split(args.cluster_args),
        # A cold start compiles for minutes on these cores: long windows for the first rooms.
        "--worker-args", "--disaggregation-peer-timeout 120 --disaggregation-lease-initial 120"
        + (f" --transfer-nice {args.transfer_nice}" if args.transfer_nice is not None else "")
        + (f" {args.worker_args}" if args.worker_args else ""),
    ], timeout=1260)
    try:
        trio.run(measure, cluster.urls, args)
    finally:
        cluster.stop()


def part_pulls(args: argparse.Namespace) -> None:
    # 16 concurrent mixed requests hold up to ~430 pages of 16 tokens on D.
    _run_on_cluster(args, ["--num-pages", "512", "--pd-cores", "shared"],
                    lambda urls, a: measure_pulls(urls["proxy"], a))


def part_tax(args: argparse.Namespace) -> None:
    # Not pinned: P, D and the colocated worker each get the machine (one runs at a time).
    _run_on_cluster(args, ["--colocated", "--pd-cores", "shared"],
                    lambda urls, a: measure_tax(urls["proxy"], urls["colocated"], a))


def part_goodput(args: argparse.Namespace) -> None:
    pinned = ["--colocated", "--prefill-cpus", "0", "--decode-cpus", "1", "--colocated-cpus", "0-1"]
    _run_on_cluster(args, pinned,
                    lambda urls, a: measure_goodput(urls["proxy"], urls["colocated"], a))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("pd", "overhead", "goodput", "tax", "pulls"),
                   required=True)
    p.add_argument("--worker-args", default="",
                   help="parts on a cluster: more flags for every worker (one string)")
    p.add_argument("--cluster-args", default="",
                   help="parts tax, pulls, goodput: more `pd-fsm cluster` flags (one string; "
                        "e.g. '--prefill-nice 0 --decode-nice 0' for equal priority, which "
                        "older commits ran by default)")
    p.add_argument("--transfer-nice", type=int, default=None,
                   help="parts on a cluster: the workers' --transfer-nice (default: theirs)")
    p.add_argument("--concurrencies", type=int, nargs="+", default=[6, 16],
                   help="part pulls: concurrencies after the concurrency-1 baseline")
    p.add_argument("--model", default="smollm2", help="part pd: smollm2 | tiny")
    p.add_argument("--datasets", nargs="+", default=["short", "long"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--endpoint", choices=("completions", "generate", "chat"),
                   default="completions")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measured passes per target, in rotated order, merged")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5],
                   help="part goodput: Poisson arrival rates (requests/s)")
    p.add_argument("--slo-ttft", type=float, default=3.0, help="part goodput: TTFT target (s)")
    p.add_argument("--slo-tpot", type=float, default=0.2,
                   help="part goodput: time-per-output-token target (s)")
    args = p.parse_args()
    parts = {"pd": part_pd, "overhead": part_overhead, "goodput": part_goodput, "tax": part_tax,
             "pulls": part_pulls}
    parts[args.part](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
