"""Liveness under load (issue 18): P pinned to core 0, D pinned to core 1, a bootstrap server and
our proxy, SmolLM2, chat requests with Poisson arrivals for ``--minutes``. Cold start included:
the first requests compile every new shape on one core, which is when heartbeats used to flap.

At the end it reads every process's log (the cluster prints them prefixed) and each worker's
``/metrics`` and prints: registry heartbeats sent / failed / retried on a stale connection,
tracebacks and ASGI errors logged, requests answered / failed, and whether the registry ever lost
a worker (``/list`` polled every second). Asserts nothing; the figures go to
``bench/RESULTS_liveness.md``.

    .venv/bin/python bench/soak_liveness.py --minutes 10 --request-rate 0.5
"""

from __future__ import annotations

import argparse
import collections
import math
import re
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_fsm.io_trio.bench_client import Summary, make_prompts, run_load
from tests.integration.serve_support import PDCluster

BAD_LINES = re.compile(r"Traceback|Error in ASGI|heartbeat failed|ClientDisconnect")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else math.nan


async def _watch_registry(url: str, seen: dict[str, int], stop: trio.Event) -> None:
    """Poll the registry's /list every second: how often each role was missing."""
    async with httpx.AsyncClient(timeout=5) as http:
        while not stop.is_set():
            try:
                listed = (await http.get(f"{url}/list")).json()["instances"]
                roles = {rec["role"] for rec in listed}
                seen["polls"] += 1
                for role in ("prefill", "decode"):
                    if role not in roles:
                        seen[f"{role}_missing"] += 1
            except (httpx.HTTPError, ValueError, KeyError):
                seen["poll_errors"] += 1
            with trio.move_on_after(1.0):
                await stop.wait()


async def _load(proxy: str, bootstrap: str, args: argparse.Namespace) -> tuple[Summary, dict]:
    seen = {"polls": 0, "prefill_missing": 0, "decode_missing": 0, "poll_errors": 0}
    stop = trio.Event()
    results = []
    duration = 0.0
    load = argparse.Namespace(endpoint="chat", max_tokens=args.max_tokens, model=None,
                              request_rate=args.request_rate, max_concurrency=None,
                              timeout=600.0, seed=0, api_key=None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_watch_registry, bootstrap, seen, stop)
        end = trio.current_time() + args.minutes * 60
        batch = 0
        while trio.current_time() < end:
            left = end - trio.current_time()
            n = max(1, min(args.batch, int(left * args.request_rate)))
            load.seed = batch
            prompts = make_prompts("mixed", n, seed=batch)
            summary = await run_load(proxy, load, prompts)
            results += summary.results
            duration += summary.duration
            batch += 1
        stop.set()
    return Summary(results, duration), seen


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--request-rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--batch", type=int, default=32, help="requests per load batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--model", default="smollm2")
    args = p.parse_args()
    started = time.monotonic()
    cluster = PDCluster.start(["--model", args.model, "--prefill", "1", "--decode", "1",
                               "--num-pages", "256", "--prefill-cpus", "0", "--decode-cpus", "1",
                               "--startup-timeout", "400"], timeout=420)
    try:
        ready_s = time.monotonic() - started
        u = cluster.urls
        summary, seen = trio.run(_load, u["proxy"], u["bootstrap"], args)
        metrics = {name: httpx.get(f"{u[name]}/metrics", timeout=10).text
                   for name in ("prefill-0", "decode-0")}
    finally:
        cluster.stop()
    bad = [line for line in cluster.proc.lines if BAD_LINES.search(line)]
    ok = sum(r.ok for r in summary.results)
    print(f"## Liveness soak: {args.minutes:g} min, {args.request_rate:g} req/s Poisson, "
          f"chat, mixed prompts, {args.max_tokens} output tokens, {args.model}\n")
    print(f"P pinned to core 0, D pinned to core 1; cluster ready after {ready_s:.0f} s "
          "(cold: the load compiled its shapes)\n")
    print("| what | value |\n|---|---|")
    print(f"| requests answered 200 / sent | {ok} / {len(summary.results)} |")
    rows = summary.rows()
    for key in ("TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "output tokens/s"):
        if key in rows:
            print(f"| {key} | {rows[key]:.1f} |")
    prefix = "pd_fsm_worker_backend_bootstrap_"
    for name, text in metrics.items():
        print(f"| {name}: registry heartbeats sent / failed / retried on a stale connection | "
              f"{_metric(text, prefix + 'heartbeats_total'):.0f} / "
              f"{_metric(text, prefix + 'heartbeat_failures_total'):.0f} / "
              f"{_metric(text, prefix + 'stale_connection_retries_total'):.0f} |")
    print(f"| registry polls (1/s): prefill missing / decode missing / poll errors | "
          f"{seen['prefill_missing']} / {seen['decode_missing']} / {seen['poll_errors']} "
          f"of {seen['polls']} |")
    print(f"| log lines with a traceback, an ASGI error or a failed heartbeat | {len(bad)} |")
    errors = collections.Counter(r.error[:120] for r in summary.results if not r.ok)
    for error, n in errors.most_common(5):
        print(f"| failed requests: {error} | {n} |")
    for line in bad[:20]:
        print(f"    {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
