"""One instance over two processes (issue 15 §3): what the command stream and cross-process
collectives cost, against the same instance in one process, in the same run.

Three colocated workers of the tiny model (4 kv-heads), started one after the other on this
machine, each given the same load (short prompts, fixed concurrency, greedy):

    tp1            one process, one device (the baseline)
    tp2            one process, two forced CPU devices, one mesh
    tp2 nnodes2    two processes (`--nnodes 2`), one device each, one mesh over both
                   (jax.distributed, gloo collectives); rank 0 sends its scheduler's inputs to
                   rank 1 before every step

For each: requests/s, output tokens/s, TTFT and ITL percentiles, and the mean scheduler step
(``step_seconds_total / steps_total`` from /server_info), and whether its answers equal tp1's.
Prints a table; asserts nothing.

With ``--pd``: the same three shapes for a prefill and a decode instance behind our proxy
(``pd-fsm cluster --prefill 1 --decode 1``), the two-process one pairing P rank i with D rank i
(RFC-2 §6.2); the step column is D's, and "pull ms" D's mean KV pull (submit to scattered).

    .venv/bin/python bench/bench_nnodes.py [--num-prompts 24 --concurrency 4 --max-tokens 32]
    .venv/bin/python bench/bench_nnodes.py --pd
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_fsm.io_trio.bench_client import make_prompts, run_load
from pd_fsm.io_trio.ports import free_ports
from tests.integration.serve_support import PDCluster, Proc, cli, wait_http_ok

HOST = "127.0.0.1"
WORKER = ["--model", "tiny", "--page-size", "4", "--num-pages", "512", "--max-running", "8",
          "--context-length", "1024", "--warmup", "full", "--no-compilation-cache"]


async def _answers(url: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    async with httpx.AsyncClient(timeout=600) as http:
        out = []
        for text in prompts:
            r = await http.post(f"{url}/generate", json={
                "text": text, "sampling_params": {"max_new_tokens": max_tokens,
                                                  "temperature": 0}})
            r.raise_for_status()
            out.append(r.json()["output_ids"])
        return out


def _measure(label: str, url: str, stats_url: str, args: argparse.Namespace,
             ref: list[list[int]] | None) -> dict[str, object]:
    """The load on ``url``; the step (and D's pulls) from ``stats_url``'s /server_info."""
    load = argparse.Namespace(endpoint="completions", max_tokens=args.max_tokens,
                              model=None, request_rate=math.inf,
                              max_concurrency=args.concurrency, timeout=600.0, seed=args.seed)
    prompts = make_prompts("short", args.num_prompts, args.seed)
    trio.run(run_load, url, load, prompts[: args.concurrency])  # settle in
    before = httpx.get(f"{stats_url}/server_info").json()["internal_states"][0]
    rows = trio.run(run_load, url, load, prompts).rows()
    after = httpx.get(f"{stats_url}/server_info").json()["internal_states"][0]
    steps = after["steps_total"] - before["steps_total"]
    step_s = (after["step_seconds_total"] - before["step_seconds_total"]) / max(steps, 1)
    pull_ms = math.nan
    if "transfer" in after:
        pulls = after["transfer"]["pulls_ok"] - before["transfer"]["pulls_ok"]
        pull_ms = 1000 * (after["transfer"]["seconds"] - before["transfer"]["seconds"]) / max(
            pulls, 1)
    answers = trio.run(_answers, url, [p.text for p in prompts[:6]], 16)
    same = "-" if ref is None else ("yes" if answers == ref else "NO")
    return {"label": label, "rows": rows, "step ms": step_s * 1000, "steps": steps,
            "pull ms": pull_ms, "answers": answers, "same": same}


def one(label: str, extra: list[str], ranks: int, args: argparse.Namespace,
        ref: list[list[int]] | None) -> dict[str, object]:
    port, coordinator = free_ports(2)
    url = f"http://{HOST}:{port}"
    procs = []
    for rank in range(ranks):
        dist = [] if ranks == 1 else ["--nnodes", str(ranks), "--node-rank", str(rank),
                                      "--dist-init-addr", f"{HOST}:{coordinator}"]
        procs.append(Proc.start(f"{label} rank {rank}", cli(
            "serve", *WORKER, "--host", HOST, "--port", str(port), *extra, *dist)))
    try:
        wait_http_ok(f"{url}/health", procs[0], timeout=1800)
        return _measure(label, url, url, args, ref)
    finally:
        for proc in procs:
            proc.stop()


def one_pd(label: str, tp: int, nnodes: int, args: argparse.Namespace,
           ref: list[list[int]] | None) -> dict[str, object]:
    shape = [f"--{role}-{flag}={value}" for role in ("prefill", "decode")
             for flag, value in (("tp", tp), ("nnodes", nnodes))]
    # Every rank on every core, as RESULTS_nnodes.md was measured.
    cluster = PDCluster.start(["--model", "tiny", "--prefill", "1", "--decode", "1", *shape,
                               "--pd-cores", "shared",
                               "--worker-args", " ".join(WORKER[2:])], timeout=1800)
    try:
        return _measure(label, cluster.urls["proxy"], cluster.urls["decode-0"], args, ref)
    finally:
        cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pd", action="store_true",
                    help="a prefill and a decode instance of each shape, behind our proxy")
    args = ap.parse_args()
    if args.pd:
        base = one_pd("tp1", 1, 1, args, None)
        ref = base["answers"]
        results = [base, one_pd("tp2", 2, 1, args, ref),  # type: ignore[arg-type]
                   one_pd("tp2 nnodes2", 2, 2, args, ref)]  # type: ignore[arg-type]
    else:
        base = one("tp1", [], 1, args, None)
        ref = base["answers"]
        results = [base, one("tp2", ["--tp", "2"], 1, args, ref),  # type: ignore[arg-type]
                   one("tp2 nnodes2", ["--tp", "2"], 2, args, ref)]  # type: ignore[arg-type]
    what = "1P1D behind the proxy" if args.pd else "colocated"
    print(f"tiny model, {what}; load: {args.num_prompts} short prompts, concurrency "
          f"{args.concurrency}, {args.max_tokens} tokens, greedy")
    keys = ["completed", "requests/s", "output tokens/s", "TTFT p50 ms", "TTFT p99 ms",
            "ITL p50 ms", "ITL p99 ms"]
    head = (f"{'':<14}" + "".join(f"{k:>16}" for k in keys) + f"{'step ms':>10}"
            + (f"{'pull ms':>10}" if args.pd else "") + f"{'= tp1':>7}")
    print(head)
    print("-" * len(head))
    for r in results:
        rows = r["rows"]
        assert isinstance(rows, dict)
        pull = f"{r['pull ms']:>10.2f}" if args.pd else ""
        print(f"{r['label']:<14}" + "".join(f"{rows[k]:>16.2f}" for k in keys)
              + f"{r['step ms']:>10.2f}{pull}{r['same']:>7}")


if __name__ == "__main__":
    main()
