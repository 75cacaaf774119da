"""The headline figures that fit a 2-core machine in minutes, run one after another and printed
as one table (``make bench``). Each line runs an existing bench in its quick form; the full runs,
their setups and the TPU machine's set are in bench/README.md.

    .venv/bin/python bench/headline.py [--only NAME ...] [--log-dir DIR]

Every bench's whole output goes to DIR/NAME.log (default: a temporary folder, printed); the table
shows the figure read from it, how long the bench took and its RESULTS page. Exit status 1 when a
bench failed or its figure could not be read. Asserts nothing about the figures themselves.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _grab(pattern: str, template: str) -> Callable[[str], str | None]:
    """A reader that formats the first match of ``pattern`` (multiline) with ``template``."""
    def read(out: str) -> str | None:
        m = re.search(pattern, out, re.MULTILINE)
        return template.format(*m.groups()) if m else None
    return read


def _tax(out: str) -> str | None:
    m = re.search(r"^TTFT p50 ms\s+([\d.]+)\s+([\d.]+)", out, re.MULTILINE)
    d = re.search(r"TTFT p50 PD - colocated: ([+-][\d.]+) ms", out)
    if not (m and d):
        return None
    return f"{d.group(1)} ms p50 (PD {m.group(1)} vs colocated {m.group(2)} ms)"


@attrs.frozen
class Headline:
    name: str
    what: str
    argv: tuple[str, ...]
    read: Callable[[str], str | None]
    page: str
    timeout_s: int = 600


HEADLINES = (
    Headline("core", "core: full room lifecycles, 1,000 live rooms",
             (PY, "bench/bench_core.py"),
             _grab(r"^core, 1,000 live rooms\s+([\d.]+) us/event\s+([\d,]+) events/s",
                   "{1} events/s ({0} µs/event)"),
             "docs/performance.md (core rows)"),
    Headline("sim", "simulation: the whole cluster's cores, 1,000 seeds with faults",
             (PY, "-m", "pd_fsm.cli", "sim", "--seeds", "0:1000"),
             _grab(r"^(\d+) seeds, (\d+) failing, (\d+) seeds/s",
                   "{0} seeds, {1} failing, {2} seeds/s"),
             "docs/simulation.md"),
    Headline("transfer",
             "P→D transfer at 16 MiB, two processes: vs the library's defaults / a raw socket",
             (PY, "bench/bench_transfer.py", "--quick"),
             _grab(r"^\| 16 MiB \| ([\d.]+) \|.*\| ([\d.]+)x \| [\d.]+x \| ([\d.]+)x \|$",
                   "{0} GB/s, {1}x the defaults, {2}x a raw socket"),
             "bench/RESULTS_transfer.md"),
    Headline("io",
             "bootstrap registry with 1,000 instances: heartbeats/s (4 connections), GET /route",
             (PY, "bench/bench_io.py", "--instances", "1000", "--seconds", "3"),
             _grab(r"heartbeats/s \( 4 connection\(s\)\)\s+(\d+)[\s\S]*?"
                   r"GET /route by key\s+p50\s+([\d.]+) ms",
                   "{0} heartbeats/s; GET /route p50 {1} ms"),
             "bench/RESULTS_io.md"),
    Headline("model", "SmolLM2 forward, 512-token prompt: prefill; decode at batch 1",
             (PY, "bench/bench_model.py", "--repeats", "2", "--decode-steps", "10",
              "--batches", "1"),
             _grab(r"-> (\d+) tokens/s[\s\S]*?decode batch 1: ([\d.]+) ms/step",
                   "prefill {0} tokens/s; decode {1} ms/token"),
             "bench/RESULTS_model.md"),
    Headline("pd", "D's decode steps at batch 8 while other rooms' KV arrives, vs none",
             (PY, "bench/bench_pd.py", "--steps", "30"),
             _grab(r"p99 ratio \(arriving / baseline\): ([\d.]+)\s+p50 ratio: ([\d.]+)",
                   "p99 {0}x, p50 {1}x the baseline"),
             "bench/RESULTS_pd.md"),
    Headline("tax", "PD tax: TTFT(PD via proxy) minus TTFT(colocated), short prompts one at a time",
             (PY, "bench/bench_serving.py", "--part", "tax", "--num-prompts", "8", "--rounds", "1",
              "--max-tokens", "16"),
             _tax, "bench/RESULTS_goodput.md", timeout_s=900),
)


def run(h: Headline, log_dir: Path) -> tuple[str, float, bool]:
    log = log_dir / f"{h.name}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    with log.open("w") as sink:
        try:
            rc = subprocess.run(h.argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT,
                                env=env, timeout=h.timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    took = time.monotonic() - start
    out = log.read_text(errors="replace")
    figure = h.read(out) if rc == 0 else None
    if figure is None:
        why = f"exit {rc}" if rc else "figure not found in its output"
        return f"FAILED ({why}; see {log})", took, False
    return figure, took, True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=[h.name for h in HEADLINES])
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd_fsm_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    chosen = [h for h in HEADLINES if not args.only or h.name in args.only]
    print(f"make bench: {len(chosen)} benches, logs in {log_dir}", flush=True)
    rows, ok_all, begun = [], True, time.monotonic()
    for h in chosen:
        shown = " ".join("python" if a == PY else a for a in h.argv)
        print(f"  {h.name}: {shown} ...", flush=True)
        figure, took, ok = run(h, log_dir)
        ok_all &= ok
        print(f"    {took:.0f} s: {figure}", flush=True)
        rows.append((h, figure, took))
    print("\n| what | figure | s | command | page |\n|---|---|---|---|---|")
    for h, figure, took in rows:
        command = " ".join(".venv/bin/python" if a == PY else a for a in h.argv)
        print(f"| {h.what} | {figure} | {took:.0f} | `{command}` | {h.page} |")
    print(f"\nall {len(rows)} in {time.monotonic() - begun:.0f} s on {os.cpu_count()} cores; "
          "baselines are measured in the same runs, absolute figures vary with the machine's load")
    return 0 if ok_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
