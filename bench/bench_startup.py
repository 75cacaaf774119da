"""Start-up and the first requests (issue 13 §3): how long a worker takes to be ready, and whether
the first pass of a load after ready is slower than the second (a compile on the request path).

Three starts of one `pd-fsm serve` (colocated, SmolLM2 by default), one after the other:

    full, cold cache     --warmup full, an empty --compilation-cache-dir: compiles everything
    full, second start   the same command again: loads the executables from that cache
    minimal, no cache    --warmup minimal --no-compilation-cache: the old behaviour (baseline)

For each: wall time from launch to /health 200, the worker's own ready phases
(``pd_fsm_worker_backend_ready_seconds``), then the same load twice (mixed prompts, a fixed
concurrency): TTFT p50/p99 of the first and of the second pass, and the compiles after ready.
Prints a table; asserts nothing.

    .venv/bin/python bench/bench_startup.py [--model smollm2 --num-prompts 16 --concurrency 4]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_fsm.io_trio.bench_client import make_prompts, run_load
from pd_fsm.io_trio.cluster import free_ports
from tests.integration.serve_support import Proc, cli, wait_http_ok

HOST = "127.0.0.1"


def _gauges(text: str, name: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}\{{key="([^"]+)"\}} (\S+)$', text, re.M)}


def _value(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else math.nan


def one_start(label: str, extra: list[str], args: argparse.Namespace) -> dict[str, object]:
    (port,) = free_ports(1)
    url = f"http://{HOST}:{port}"
    started = time.monotonic()
    proc = Proc.start(label, cli("serve", "--model", args.model, "--host", HOST,
                                 "--port", str(port), "--num-pages", str(args.num_pages), *extra))
    try:
        wait_http_ok(f"{url}/health", proc, timeout=1800)
        ready_wall = time.monotonic() - started
        phases = _gauges(httpx.get(f"{url}/metrics").text, "pd_fsm_worker_backend_ready_seconds")
        load = argparse.Namespace(endpoint="completions", max_tokens=args.max_tokens,
                                  model=None, request_rate=math.inf,
                                  max_concurrency=args.concurrency, timeout=600.0, seed=args.seed)
        prompts = make_prompts("mixed", args.num_prompts, args.seed)
        first = trio.run(run_load, url, load, prompts).rows()
        second = trio.run(run_load, url, load, prompts).rows()
        text = httpx.get(f"{url}/metrics").text
        after = _value(text, "pd_fsm_worker_backend_compiles_after_ready_total")
    finally:
        proc.stop()
    return {"label": label, "ready": ready_wall, "phases": phases, "first": first,
            "second": second, "compiles_after_ready": after}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "xla")
        runs = [
            one_start("full, cold cache", ["--warmup", "full", "--compilation-cache-dir", cache],
                      args),
            one_start("full, second start",
                      ["--warmup", "full", "--compilation-cache-dir", cache], args),
            one_start("minimal, no cache", ["--warmup", "minimal", "--no-compilation-cache"],
                      args),
        ]
    print(f"{args.model}, --num-pages {args.num_pages}; load: {args.num_prompts} mixed prompts, "
          f"concurrency {args.concurrency}, {args.max_tokens} output tokens, twice\n")
    head = (f"{'start':<20}{'ready s':>9}{'1st TTFT p50/p99 ms':>22}{'2nd TTFT p50/p99 ms':>22}"
            f"{'p99 1st/2nd':>13}{'compiles after ready':>22}")
    print(head)
    print("-" * len(head))
    for r in runs:
        f, s = r["first"], r["second"]
        assert isinstance(f, dict) and isinstance(s, dict)
        ratio = f["TTFT p99 ms"] / s["TTFT p99 ms"]
        print(f"{r['label']:<20}{r['ready']:>9.1f}"
              f"{f['TTFT p50 ms']:>11.0f}/{f['TTFT p99 ms']:<10.0f}"
              f"{s['TTFT p50 ms']:>11.0f}/{s['TTFT p99 ms']:<10.0f}"
              f"{ratio:>13.2f}{r['compiles_after_ready']:>22.0f}")
    print("\nready phases (s, the worker's own):")
    for r in runs:
        phases = r["phases"]
        assert isinstance(phases, dict)
        print(f"  {r['label']:<20}" + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
