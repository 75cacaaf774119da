"""Issue 16 §5: prefix caches and routing policies through PD, on shared-prefix workloads.

Two 2P2D SmolLM2 clusters run side by side: one without caches (``--disable-radix-cache``), one
with them on P (the default) and on D (``--decode-radix-cache``, delta-only transfer). In front of
the second, one ``pd-fsm proxy`` per routing policy (both legs the same policy), all over the same
workers. Each (configuration, round) gets prompts of its own seed, so no configuration finds
another's prefixes cached; rounds rotate the order of the configurations (the machine is shared).

Per configuration: TTFT p50/p99, output tokens/s, KV bytes D pulled per request (the D workers'
``pd_fsm_worker_kv_transfer_bytes`` histogram sum), the share of P's prompt tokens its cache
served, and the proxy's routing decisions (``cache_aware``'s hit rate). Asserts nothing.

Run: ``.venv/bin/python bench/bench_prefix_routing.py [--datasets shared-prefix multi-turn]``
"""

from __future__ import annotations

import argparse
import math

import httpx
import plots  # bench/, beside this script
import trio

from pd_fsm.io_trio.bench_client import (
    Summary,
    cache_lines,
    make_prompts,
    metrics_urls,
    prefix_reuse,
    run_load,
    scrape,
    scrape_totals,
    side_of,
)
from pd_fsm.io_trio.ports import free_ports
from tests.integration.serve_support import PDCluster, Proc, cli, wait_http_ok

POLICIES = ("round_robin", "cache_aware", "power_of_two")


def _cluster(model: str, worker_args: str) -> PDCluster:
    # Every worker on every core, as RESULTS_prefix_routing.md was measured.
    return PDCluster.start(["--model", model, "--prefill", "2", "--decode", "2",
                            "--pd-cores", "shared", "--num-pages", "512",
                            "--startup-timeout", "1500", f"--worker-args={worker_args}"],
                           timeout=1600)


def _proxy(cluster: PDCluster, policy: str) -> tuple[Proc, str]:
    (port,) = free_ports(1)
    argv = ["proxy", "--port", str(port), "--log-level", "WARNING",
            "--prefill-policy", policy, "--decode-policy", policy]
    for name in ("prefill-0", "prefill-1"):
        argv += ["--prefill", cluster.urls[name], str(cluster.bootstrap_ports[name])]
    for name in ("decode-0", "decode-1"):
        argv += ["--decode", cluster.urls[name]]
    proc = Proc.start(f"proxy-{policy}", cli(*argv))
    url = f"http://127.0.0.1:{port}"
    wait_http_ok(f"{url}/health", proc)
    return proc, url


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else math.nan


async def _run(url: str, args: argparse.Namespace, dataset: str, seed: int
               ) -> tuple[Summary, dict[str, float], str]:
    prompts = make_prompts(dataset, args.num_prompts, seed, args.num_prefixes, args.prefix_words)
    load = argparse.Namespace(endpoint="completions", max_tokens=args.max_tokens,
                              model=args.model, request_rate=math.inf,
                              max_concurrency=args.concurrency, timeout=900.0, seed=seed)
    async with httpx.AsyncClient(timeout=10) as http:
        urls = await metrics_urls(http, url)
        sides = {u: side_of(h) for u, h in (await scrape(http, urls)).items()}
        before = await scrape_totals(http, urls)
        summary = await run_load(url, load, prompts)
        after = await scrape_totals(http, urls)
    completed = sum(r.ok for r in summary.results)
    figures = {"pulled": 0.0, "p_tokens": 0.0, "p_cached": 0.0, "hit": 0.0, "routed": 0.0}
    for u, row in after.items():
        d = {k: v - before.get(u, {}).get(k, 0.0) for k, v in row.items()}
        if sides.get(u) == "D":
            figures["pulled"] += d.get("kv_bytes", 0.0)
        elif sides.get(u) == "P":
            figures["p_tokens"] += d.get("prompt_tokens", 0.0)
            figures["p_cached"] += d.get("cached_tokens", 0.0)
        elif sides.get(u) == "proxy":
            figures["hit"] += d.get("route:prefill:cache_hit", 0.0)
            figures["routed"] += sum(v for k, v in d.items() if k.startswith("route:prefill:"))
    figures["completed"] = completed
    return summary, figures, cache_lines(prompts, completed, sides, before, after)


def _report(name: str, runs: list[tuple[Summary, dict[str, float]]]) -> str:
    ok = [r for s, _ in runs for r in s.results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    duration = sum(s.duration for s, _ in runs)
    tokens = sum(r.output_tokens for r in ok)
    f = {k: sum(x[k] for _, x in runs) for k in runs[0][1]}
    failed = sum(len(s.results) for s, _ in runs) - len(ok)
    hit = f"{100 * f['hit'] / f['routed']:.0f} %" if f["routed"] and "cache_aware" in name \
        else "-"
    return (f"{name:<28}{_pct(ttft, 50):>9.0f}{_pct(ttft, 99):>9.0f}"
            f"{tokens / duration if duration else math.nan:>10.2f}"
            f"{f['pulled'] / max(f['completed'], 1) / 1e6:>10.3f}"
            f"{100 * f['p_cached'] / f['p_tokens'] if f['p_tokens'] else 0:>9.1f}"
            f"{hit:>8}{failed:>7}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--datasets", nargs="+", default=["shared-prefix", "multi-turn"])
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-words", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--verbose", action="store_true", help="each run's cache lines")
    args = ap.parse_args()

    plain = _cluster(args.model, "--disable-radix-cache")
    cached = proxies = None
    try:
        cached = _cluster(args.model, "--decode-radix-cache")
        proxies = {p: _proxy(cached, p) for p in POLICIES}
        targets = {"no caches, round_robin": plain.urls["proxy"]}
        targets |= {f"caches, {p}": url for p, (_, url) in proxies.items()}
        names = list(targets)
        for dataset in args.datasets:
            reuse = prefix_reuse(make_prompts(dataset, args.num_prompts, 0, args.num_prefixes,
                                              args.prefix_words))
            runs: dict[str, list[tuple[Summary, dict[str, float]]]] = {n: [] for n in names}
            for r in range(args.rounds):
                for i, name in enumerate(names[r % len(names):] + names[: r % len(names)]):
                    seed = 1000 * (r + 1) + 10 * names.index(name) + i
                    summary, figures, lines = trio.run(_run, targets[name], args, dataset, seed)
                    runs[name].append((summary, figures))
                    if args.verbose:
                        print(f"[{dataset} round {r} {name}]\n{lines}", flush=True)
            head = (f"{'configuration':<28}{'TTFT p50':>9}{'p99 ms':>9}{'tok/s':>10}"
                    f"{'MB/req':>10}{'P cache':>9}{'hit':>8}{'failed':>7}")
            print(f"\n{dataset}: {args.num_prompts} prompts x {args.rounds} rounds, "
                  f"{args.num_prefixes} groups of {args.prefix_words} words, prefix reuse "
                  f"{100 * reuse:.1f} %, concurrency {args.concurrency}, {args.max_tokens} "
                  f"tokens each\n{head}\n{'-' * len(head)}", flush=True)
            rows = {n: _report(n, runs[n]) for n in names}
            print("\n".join(rows.values()), flush=True)
            plots.latency_cdf(
                f"prefix_routing_{dataset}", f"TTFT through 2P2D, {dataset}",
                {n: [r.ttft for s, _ in runs[n] for r in s.results if r.ok] for n in names},
                "TTFT")
            for n in names:
                errors = [r.error for s, _ in runs[n] for r in s.results if not r.ok]
                if errors:
                    print(f"  {n}: first failure: {errors[0][:300]}", flush=True)
    finally:
        for proc, _ in (proxies or {}).values():
            proc.stop()
        if cached is not None:
            cached.stop()
        plain.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
