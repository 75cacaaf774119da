"""bench/bench_engine.py as the chip runs it (`bench/tpu_engine.sh prefill`: the fused step's
decode and prefill timed with today's KV write and each option, a prefill traced by kind, the
scheduler's closed loop into the workers' compilation cache), here on the CPU with a 2-layer
model at a shape of its own, and bench/bench_step_inputs.py and bench/bench_launch_host.py
beside it: CI keeps the chip's engine benches alive."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPE = {**json.loads((ROOT / "pd_fsm/jax_engine/model/configs/qwen3-0.6b.json").read_text()),
         "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512, "num_hidden_layers": 2}


def test_bench_engine_runs_the_chips_calls_on_a_cpu(tmp_path: Path) -> None:
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text(json.dumps(SHAPE))
    out = tmp_path / "engine.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_engine.py"), "--no-kernel-check",
         "--shapes", str(shape), "--chain-shapes", "", "--rows", "1,4", "--contexts", "32",
         "--prefills", "32", "--no-mixed", "--repeats", "2",
         "--variants", "kv_write=scatter,stacked", "--variants-at", "1x32",
         "--profile-prefill", "32", "--scheduler", str(shape), "--loop-requests", "2",
         "--loop-in", "16", "--loop-out", "4", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                       "PD_FSM_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads(out.read_text())
    assert not [r for r in records if "error" in r]
    timed = {(r["step"], r.get("rows", r.get("tokens")), r.get("variant")): r["ms"]
             for r in records if r.get("path") == "fused"}
    assert set(timed) == {("decode", 1, None), ("decode", 4, None), ("prefill", 32, None),
                          *((step, n, v) for v in ("kv_write=scatter", "stacked")
                            for step, n in (("decode", 1), ("prefill", 32)))}
    assert all(ms > 0 for ms in timed.values())
    # The prefill traced with each variant; a CPU's trace has no device rows to sum by kind.
    assert {r["profile"] for r in records if "profile" in r} == {
        f"{shape}-prefill-32", f"{shape}-prefill-32-kv_write-scatter",
        f"{shape}-prefill-32-stacked"}
    # Each decode variant says where its host time went, as the base step does.
    assert all(r["dispatch_ms"] > 0 for r in records
               if r.get("variant") and r.get("step") == "decode")
    warm = next(r for r in records if r.get("path") == "scheduler warm-up")
    assert warm["cache"]["writes"] == warm["compiled"] > 0
    loop = next(r for r in records if r.get("path") == "scheduler")
    assert loop["output_tokens_per_s"] > 0 and loop["output_tokens"] == 2 * 4


def test_bench_step_inputs_times_both_ways(tmp_path: Path) -> None:
    out = tmp_path / "inputs.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_step_inputs.py"), "--rows", "1,4",
         "--vocab", "512", "--repeats", "5", "--json", str(out)],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True, text=True,
        timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [r["rows"] for r in records] == [1, 4]
    assert all(r["apart_us"] > 0 and r["packed_us"] > 0 for r in records)


def test_bench_launch_host_times_a_launch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_launch_host.py"), "--rows", "1,2",
         "--launches", "3"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu",
                       "PD_FSM_CACHE_DIR": str(tmp_path / "cache")},
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["rows"] for r in records] == [1, 2]
    assert all(r["launch_ms_median"] > 0 for r in records)
