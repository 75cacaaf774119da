"""bench/tpu_serve.py as the chip runs it, here on the CPU with the tiny model and small loads:
the engine's closed loop, then ``pd-fsm serve --uds`` under ``pd-fsm bench`` loads (a fixed-length
one and a mixed-length one), every record in the one JSONL. Each load draws prompts of its own,
so the worker's prefix cache serves none of them (a run on the chip once repeated a load's
prompts in the next and half its prompt tokens came from the cache)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tpu_serve_runs_its_loads_on_a_cpu(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "tpu_serve.py"), "--cpu", "--model", "tiny",
         "--load-format", "auto", "--out", str(out), "--num-pages", "200", "--max-running", "4",
         "--max-batched-tokens", "128", "--context-length", "512", "--engine-loop", "32:4:4",
         "--seconds", "1", "--min-prompts", "3", "--saturation-prompts", "4",
         "--random-ids", "1-250", "--loads", "chat:48:4:3:inf", "--loads", "mixed:64:8:3::0.5"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                       # This run's cache only, and the chip's full warm-up (not the suite's).
                       "PD_FSM_CACHE_DIR": str(tmp_path / "cache"), "PD_FSM_WARMUP": "full"},
        capture_output=True, text=True, timeout=400, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in (out / "tiny.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events == ["engine closed loop", "server ready", "load", "load", "load",
                      "server stopped"]
    engine = records[0]
    assert engine["rc"] == 0
    assert any(r.get("output_tokens_per_s", 0) > 0 for r in engine["records"])
    # The closed loop compiled the server's executables into the workers' cache: the server's
    # start loads every one of them and compiles none.
    ready = records[1]
    assert ready["cache_hits"] > 0 and ready["cache_misses"] == 0
    loads = records[2:5]
    assert [(r["workload"], r["rate"], r["ratio"]) for r in loads] == [
        ("chat", 3.0, 1.0), ("chat", None, 1.0), ("mixed", 3.0, 0.5)]
    for load in loads:
        assert load["rc"] == 0 and not load["errors"]
        assert load["figures"]["completed"] == load["prompts"]
        # (Counted, not asserted: a CPU worker whose shapes an earlier process put in the
        # compilation cache loads them on first use, which the counter counts.)
        assert "compiles_after_ready" in load
        assert load["prefix_cache_hit_tokens"] == 0
        # The worker's side of the load: its own TTFT (under the client's, which adds the HTTP
        # edge and the client) and its steps, read from its counters.
        assert 0 < load["server_ttft_mean_ms"] <= load["figures"]["TTFT p99 ms"]
        assert 0 <= load["intake_wait_mean_ms"] <= load["server_ttft_mean_ms"]
        assert load["steps"] > 0 and load["step_mean_ms"] > 0
        # The worker prefilled every request: its TTFT's parts add up to its TTFT.
        parts = sum(load[f"ttft_{p}_mean_ms"] for p in ("queue", "prefill", "delivery"))
        assert 0 < load["ttft_prefill_mean_ms"] < parts
        assert abs(parts - load["server_ttft_mean_ms"]) < 0.05 * load["server_ttft_mean_ms"]
    assert records[-1]["rc"] == 0
