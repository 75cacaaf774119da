"""Start-up and the first requests (issue 13 §3): how long a worker takes to be ready, and whether
the first pass of a load after ready is slower than the second (a compile on the request path).

Three starts of one `pd-fsm serve` (colocated, SmolLM2 by default), one after the other:

    full, cold cache     --warmup full, an empty --compilation-cache-dir: compiles everything
    full, second start   the same command again: loads the executables from that cache
    minimal, no cache    --warmup minimal --no-compilation-cache: the old behaviour (baseline)

For each: wall time from launch to /health 200, the worker's own ready phases
(``pd_fsm_worker_backend_ready_seconds``), then the same load twice (mixed prompts, a fixed
concurrency): TTFT p50/p99 of the first and of the second pass, and the compiles after ready.

Then the whole PD cluster (``--cluster-starts N``, 0 to skip): ``pd-fsm cluster --ask`` (bootstrap,
one P, one D and the proxy, all started at once on this machine's cores) once with an empty
compilation cache and N more times with it filled; "ready" is the launcher's own "ready in" (every
child answering /health), and the asked answer must be the same every time.
Prints tables; asserts nothing.

    .venv/bin/python bench/bench_startup.py [--model smollm2 --num-prompts 16 --concurrency 4]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_fsm.io_trio.bench_client import make_prompts, run_load
from pd_fsm.io_trio.ports import free_ports
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


def cluster_start(model: str, cache: str) -> tuple[float, str]:
    """One ``pd-fsm cluster --ask``: its "ready in" seconds and the PD answer it printed."""
    out = subprocess.run(
        cli("cluster", "--model", model, "--ask", "Hi", "--max-tokens", "4",
            "--worker-args", f"--compilation-cache-dir {cache}"),
        capture_output=True, text=True, timeout=1800,
    )
    ready = re.search(r"ready in ([\d.]+) s", out.stdout + out.stderr)
    answer = re.search(r"^PD .*$", out.stdout, re.M)
    if out.returncode != 0 or ready is None or answer is None:
        raise RuntimeError(f"pd-fsm cluster failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    return float(ready.group(1)), answer.group(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--num-pages", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cluster-starts", type=int, default=3,
                   help="second starts of the PD cluster to time (0: skip the cluster)")
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
    if args.cluster_starts > 0:
        with tempfile.TemporaryDirectory() as tmp:
            cache = str(Path(tmp) / "xla")
            starts = [cluster_start(args.model, cache) for _ in range(1 + args.cluster_starts)]
        print(f"\npd-fsm cluster (bootstrap + 1 P + 1 D + proxy), {args.model}: ready in s")
        print(f"  cold cache     {starts[0][0]:.1f}")
        warm = sorted(r for r, _ in starts[1:])
        print(f"  second starts  {', '.join(f'{r:.1f}' for r, _ in starts[1:])}"
              f"  (median {warm[len(warm) // 2]:.1f})")
        same = len({answer for _, answer in starts}) == 1
        print(f"  answers        {'the same every start' if same else 'DIFFER'}: {starts[0][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
