"""A colocated worker on the chip under load: ``pd-fsm serve`` on a unix socket (the TPU machine
refuses every TCP and UDP socket), driven by ``pd-fsm bench`` with Poisson arrivals at several
rates and then all at once (saturation), with the engine's own closed loop (``bench_engine.py
--scheduler``: ``Scheduler.step`` in one process, no server) measured first in the same run as
the ceiling the server is compared with.

    python bench/tpu_serve.py --model qwen3-0.6b --load-format dummy --out DIR \\
        --loads "chat:1024:256:1,2,4,8:inf" --loads "rag:8192:256:0.5,1:"

A load is ``NAME:IN:OUT:RATES:SATURATION[:RATIO]``: IN random token ids in and OUT out (EOS
ignored, greedy), at each rate in requests/s, then (when SATURATION is ``inf``) all at once;
with RATIO each prompt's lengths are drawn from RATIO x IN .. IN and RATIO x OUT .. OUT (a
mixed-length set, ``pd-fsm bench --random-range-ratio``). The prompt
count per rate is what ``--seconds`` of arrivals bring (at least ``--min-prompts``). Goodput:
TTFT <= ``--ttft-ms`` (2x for prompts of 8,192 tokens or more) and a request's mean ITL <=
``--tpot-ms``. Every record goes to ``DIR/<model>.json``; each bench's own JSON and the server's
log beside it. Every wait has a deadline; the server is stopped however the run ends.

Runs here too, on the CPU (``JAX_PLATFORMS=cpu``, ``--model tiny``, small loads): the same
commands, so what the chip runs was run first.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parents[1]
START_S = 600.0  # a start compiles every step shape: minutes for a 28-layer model on a TPU


def emit(record: dict[str, Any], path: Path) -> None:
    print(json.dumps(record), flush=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pd_fsm.cli", *args]


def wait_healthy(sock: Path, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(base_url="http://localhost", timeout=10,
                      transport=httpx.HTTPTransport(uds=str(sock))) as client:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if client.get("/health").status_code == 200:
                    return True
            except httpx.HTTPError:  # not listening yet
                pass
            time.sleep(1)
    return False


# The worker's counters a load's record takes the difference of: compiles, prefix-cache hits,
# its own TTFT (request arrival to first output: the client's TTFT less the HTTP edge's and the
# client's share), of which the wait before the scheduler took the request, and its steps
# (their count and the thread's seconds in them), and its TTFT's parts (queue: arrival to the
# prompt's first forward; prefill: that to its first token on the host; delivery: that to the
# HTTP handler).
COUNTERS = {
    "prompts": "pd_fsm_worker_backend_prompts_total",
    "intake_wait": "pd_fsm_worker_backend_intake_wait_seconds_total",
    "compiles": "pd_fsm_worker_backend_compiles_after_ready_total",
    "cached": "pd_fsm_worker_backend_prefix_cache_hit_tokens_total",
    "ttft_sum": "pd_fsm_worker_time_to_first_token_seconds_sum",
    "ttft_count": "pd_fsm_worker_time_to_first_token_seconds_count",
    "steps": "pd_fsm_worker_backend_steps_total",
    "step_seconds": "pd_fsm_worker_backend_step_seconds_total",
    **{f"ttft_{part}_{stat}":
       f'pd_fsm_worker_time_to_first_token_part_seconds_{stat}{{part="{part}"}}'
       for part in ("queue", "prefill", "delivery") for stat in ("sum", "count")},
}


# What the worker's start found in the compilation cache (the closed loop before it filled it).
AT_READY = {
    "cache_hits": "pd_fsm_worker_backend_compilation_cache_hits_before_ready",
    "cache_misses": "pd_fsm_worker_backend_compilation_cache_misses_before_ready",
}


def scrape(sock: Path, names: dict[str, str] = COUNTERS) -> dict[str, float]:
    """``names`` from the worker's /metrics (nan where absent)."""
    import httpx

    with httpx.Client(base_url="http://localhost", timeout=10,
                      transport=httpx.HTTPTransport(uds=str(sock))) as client:
        lines = client.get("/metrics").text.splitlines()
    values = {line.split()[0]: line.split()[1] for line in lines
              if line and not line.startswith("#") and len(line.split()) == 2}
    return {key: float(values.get(name, "nan")) for key, name in names.items()}


def server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the worker saw of one load: compiles, prefix-cache hits, its mean TTFT and steps."""
    d = {key: after[key] - before[key] for key in COUNTERS}
    return {"compiles_after_ready": d["compiles"], "prefix_cache_hit_tokens": d["cached"],
            "server_ttft_mean_ms": 1e3 * d["ttft_sum"] / d["ttft_count"] if d["ttft_count"]
            else math.nan,
            "intake_wait_mean_ms": 1e3 * d["intake_wait"] / d["prompts"] if d["prompts"]
            else math.nan,
            "steps": d["steps"],
            "step_mean_ms": 1e3 * d["step_seconds"] / d["steps"] if d["steps"] else math.nan,
            **{f"ttft_{part}_mean_ms": 1e3 * d[f"ttft_{part}_sum"] / d[f"ttft_{part}_count"]
               if d[f"ttft_{part}_count"] else math.nan
               for part in ("queue", "prefill", "delivery")}}


def engine_ceiling(args: argparse.Namespace, out: Path, records: Path, in_tokens: int,
                   out_tokens: int, requests: int) -> None:
    """The closed loop with the server's settings (its compiles then land in the persistent
    compilation cache the server's start reads)."""
    log = out / f"{args.model}_engine.log"
    argv = [sys.executable, str(ROOT / "bench" / "bench_engine.py"), "--no-kernel-check",
            "--shapes", "", "--scheduler", args.model, "--loop-requests", str(requests),
            "--loop-in", str(in_tokens), "--loop-out", str(out_tokens),
            "--loop-context", str(args.context_length), "--loop-num-pages", str(args.num_pages),
            "--loop-max-running", str(args.max_running), "--loop-batched",
            str(args.max_batched_tokens), "--json", str(out / f"{args.model}_engine.json")]
    if args.cpu:
        argv += ["--cpu-f32"]
    started = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                              timeout=args.engine_timeout)
    # Its records in the one JSONL too: the device tool brings back a few files only.
    engine_json = out / f"{args.model}_engine.json"
    engine = json.loads(engine_json.read_text()) if engine_json.exists() else []
    emit({"event": "engine closed loop", "model": args.model, "rc": done.returncode,
          "seconds": time.monotonic() - started, "requests": requests, "in": in_tokens,
          "out": out_tokens, "records": engine}, records)


def serve(args: argparse.Namespace, sock: Path, log: Path) -> subprocess.Popen[bytes]:
    argv = cli("serve", "--model", args.model, "--uds", str(sock), "--num-pages",
               str(args.num_pages), "--page-size", "16", "--max-running", str(args.max_running),
               "--max-batched-tokens", str(args.max_batched_tokens), "--context-length",
               str(args.context_length), "--log-level", "WARNING")
    if args.load_format != "auto":
        argv += ["--load-format", args.load_format]
    if not args.cpu:
        argv += ["--dtype", "bfloat16", "--kv-dtype", "bfloat16"]
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            start_new_session=True)


def stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            return proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait(30)
    return proc.returncode


class Load(NamedTuple):
    name: str
    in_tokens: int
    out_tokens: int
    rates: list[float]
    ratio: float


def one_load(args: argparse.Namespace, sock: Path, out: Path, records: Path, load: Load,
             rate: float, seed: int) -> None:
    """One load at ``rate`` with prompts of its own (``seed``): a load that repeated an earlier
    one's prompts would be served from the worker's prefix cache (runs of 2026-12-07 before
    10:00 UTC: half the prompt tokens at 4 and 8 requests/s)."""
    name, in_tokens, out_tokens = load.name, load.in_tokens, load.out_tokens
    n = (args.saturation_prompts if math.isinf(rate)
         else max(args.min_prompts, round(rate * args.seconds)))
    ttft_ms = args.ttft_ms * (2 if in_tokens >= 8192 else 1)
    tag = f"{args.model}_{name}_{'sat' if math.isinf(rate) else rate}"
    argv = cli("bench", "--url", f"unix:{sock}", "--endpoint", "generate", "--dataset",
               "random", "--random-input-len", str(in_tokens), "--random-output-len",
               str(out_tokens), "--random-ids", args.random_ids, "--num-prompts", str(n),
               "--request-rate", str(rate), "--goodput", f"ttft:{ttft_ms:g}",
               f"tpot:{args.tpot_ms:g}", "--json", str(out / f"{tag}.json"),
               "--timeout", str(args.request_timeout), "--seed", str(seed),
               "--random-range-ratio", f"{load.ratio:g}")
    before = scrape(sock)
    started = time.monotonic()
    with (out / f"{tag}.log").open("w") as f:
        # The client keeps off the chip: one program holds it, the server.
        done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, check=False,
                              timeout=args.load_timeout, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    rec: dict[str, Any] = {"event": "load", "model": args.model, "workload": name, "in": in_tokens,
                           "out": out_tokens, "ratio": load.ratio,
                           "rate": None if math.isinf(rate) else rate,
                           "prompts": n, "rc": done.returncode,
                           "wall_s": time.monotonic() - started,
                           **server_side(before, scrape(sock))}
    if (out / f"{tag}.json").exists():
        rec |= json.loads((out / f"{tag}.json").read_text())
    emit(rec, records)


def parse_load(spec: str) -> Load:
    name, tin, tout, rates, sat, *ratio = spec.split(":")
    listed = [float(r) for r in rates.split(",") if r]
    return Load(name, int(tin), int(tout), listed + ([math.inf] if sat == "inf" else []),
                float(ratio[0]) if ratio else 1.0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--loads", action="append", default=[],
                   help="NAME:IN:OUT:RATES:SATURATION[:RATIO]")
    p.add_argument("--num-pages", type=int, default=5200)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--context-length", type=int, default=8448)
    p.add_argument("--seconds", type=float, default=12.0, help="of arrivals per rate")
    p.add_argument("--min-prompts", type=int, default=12)
    p.add_argument("--saturation-prompts", type=int, default=128)
    p.add_argument("--ttft-ms", type=float, default=1000.0)
    p.add_argument("--tpot-ms", type=float, default=50.0)
    p.add_argument("--random-ids", default="1000-32000")
    p.add_argument("--seed", type=int, default=100, help="the first load's prompt seed (each "
                   "load the next: no load repeats another's prompts)")
    p.add_argument("--engine-loop", default="1024:256:64", help="IN:OUT:REQUESTS ('' to skip)")
    p.add_argument("--engine-timeout", type=float, default=300)
    p.add_argument("--load-timeout", type=float, default=180)
    p.add_argument("--request-timeout", type=float, default=120)
    p.add_argument("--cpu", action="store_true", help="a smoke run on a CPU (f32)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    records = args.out / f"{args.model}.jsonl"
    if args.engine_loop:
        tin, tout, n = (int(x) for x in args.engine_loop.split(":"))
        try:
            engine_ceiling(args, args.out, records, tin, tout, n)
        except subprocess.TimeoutExpired:
            emit({"event": "engine closed loop", "model": args.model, "error": "timed out"},
                 records)
    sock = Path(tempfile.mkdtemp(prefix="pdfsm-serve-")) / "worker.sock"
    started = time.monotonic()
    proc = serve(args, sock, args.out / f"{args.model}_serve.log")
    try:
        if not wait_healthy(sock, proc, START_S):
            emit({"event": "server not ready", "model": args.model, "rc": proc.poll(),
                  "seconds": time.monotonic() - started}, records)
            return 1
        emit({"event": "server ready", "model": args.model,
              "seconds": time.monotonic() - started, **scrape(sock, AT_READY)}, records)
        seeds = iter(range(args.seed, args.seed + 1000))
        for spec in args.loads:
            load = parse_load(spec)
            for rate in load.rates:
                try:
                    one_load(args, sock, args.out, records, load, rate, next(seeds))
                except subprocess.TimeoutExpired:
                    emit({"event": "load", "model": args.model, "workload": load.name, "rate": rate,
                          "error": "timed out"}, records)
    finally:
        emit({"event": "server stopped", "model": args.model, "rc": stop(proc)}, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
