"""Writes ``bench/tpu_v5e_profile_derived.json``: a TPU profile DERIVED from the figures
measured on one v5e chip (bench/RESULTS_tpu.md, shared/TPU.md), not measured as a profile. It
stands in for the profile ``pd-fsm profile`` will measure on the chip, so that ``pd-fsm plan``
and its tests run meanwhile; every figure's derivation is in the file's ``_derivation`` (the
profile reader skips that key).

    .venv/bin/python bench/derive_tpu_profile.py
"""

from __future__ import annotations

import json
from pathlib import Path

from pd_fsm.sim.perf_profile import CoreProfile, Profile

OUT = Path(__file__).resolve().parent / "tpu_v5e_profile_derived.json"

HBM = 819e9  # bytes/s, v5e
PEAK = 197e12  # bf16 FLOP/s, v5e
LAYERS, Q_DIM = 28, 2048  # Qwen3-0.6B: 16 heads x 128
KV_PER_TOKEN = LAYERS * 2 * 8 * 128 * 2  # K and V, 8 KV heads of 128, bf16: 114,688
WEIGHTS = 1.19e9  # bytes read a decode step (the tied embedding once, as the head)
NON_EMBEDDING = 440.4e6  # parameters in the 28 layers
MFU = 0.35  # a 1,024-token prefill measured 14.75 ms = 35 % MFU
# Decode steps overlapped, share of the HBM floor by rows (the floor: weights + KV read).
EFFICIENCY = ((1, 0.83), (8, 0.86), (64, 0.47), (256, 0.47))
ROOMS = (117_440_512, 469_762_048, 1_879_048_192)  # 1,024 / 4,096 / 16,384 tokens of KV

DERIVATION = {
    "what": "DERIVED from single figures measured on one v5e chip (2026-12-07), NOT a measured "
            "profile: bench/RESULTS_tpu.md and shared/TPU.md. Replace with the profile "
            "`pd-fsm profile` measures on the chip.",
    "decode": "floor = (1.19e9 weight bytes + rows x context x 114,688 KV bytes) / 819 GB/s, "
              "divided by the share of the floor measured overlapped: 83 % at 1 row and 86 % at "
              "8 rows (x 2,048, measured 2.11 and 4.35 ms), 47 % at 64 rows (x 2,048, measured "
              "41.98 ms, run 1, not overlapped); 256 rows: 47 % ASSUMED (not measured). "
              "Points beyond the chip's 16 GB of KV are extrapolation only.",
    "prefill": "2 x 440.4e6 x tokens + 2 x 28 x tokens^2 x 2,048 FLOPs (+ the head for one "
               "token) at 35 % of 197 TFLOP/s (the 1,024-token prefill measured 14.75 ms, 35 % "
               "MFU; this formula gives 14.8 ms); at least the weights' read at 83 % of the "
               "floor (1.75 ms). Other lengths: the same MFU ASSUMED (not measured).",
    "gather": "HBM -> HBM: 117 MB in 0.43 ms measured; linear in bytes plus 0.05 ms ASSUMED.",
    "d2h": "per-layer arrays, copy_to_host_async first: 117 MB in 11.8-47.5 ms measured; the "
           "midpoint 29.7 ms (3.95 GB/s) taken, linear in bytes plus 0.3 ms ASSUMED.",
    "d2h_pinned": "device_put into pinned_host: 104 / 396 / 1,616 ms for 117 MB / 470 MB / "
                  "1.88 GB, measured (one array).",
    "h2d": "numpy -> chip: 22.7 / 88 / 317 ms for 117 MB / 470 MB / 1.88 GB, measured.",
    "scatter": "the Pallas scatter into a SmolLM2 pool: 4.37 ms for one page, 6.1 ms for 256 "
               "pages (94.4 MB), bf16, measured; Qwen3-0.6B rooms taken on that line.",
    "settings": "max_batched_tokens 2,048 and max_running 256 ASSUMED for a TPU worker.",
}


def decode_s(rows: int, context: int) -> float:
    floor = (WEIGHTS + rows * context * KV_PER_TOKEN) / HBM
    share = dict(EFFICIENCY)[rows]
    return floor / share


def prefill_s(tokens: int) -> float:
    flops = 2 * NON_EMBEDDING * tokens + 2 * LAYERS * tokens ** 2 * Q_DIM + 2 * 155.6e6
    return max(flops / (PEAK * MFU), WEIGHTS / HBM / 0.83)


def profile() -> Profile:
    prefill = tuple((t, prefill_s(t)) for t in (128, 256, 512, 1024, 2048, 4096, 8192, 16384))
    decode = tuple((rows, ctx, decode_s(rows, ctx)) for ctx in (512, 2048, 8192)
                   for rows, _ in EFFICIENCY)
    gather = tuple((b, 0.05e-3 + b / (117e6 / 0.43e-3)) for b in (1_000_000, *ROOMS))
    d2h = tuple((b, 0.3e-3 + b / 3.95e9) for b in (1_000_000, *ROOMS))
    d2h_pinned = tuple(zip(ROOMS, (0.104, 0.396, 1.616), strict=True))
    h2d = tuple(zip(ROOMS, (0.0227, 0.088, 0.317), strict=True))
    scatter = tuple((b, 4.37e-3 + b * (6.1e-3 - 4.37e-3) / 94.4e6)
                    for b in (1_000_000, *ROOMS))
    chip = CoreProfile(cores=1, prefill=prefill, decode=decode, copy=gather, pull=(),
                       gather=gather, d2h=d2h, d2h_pinned=d2h_pinned, h2d=h2d, scatter=scatter)
    return Profile(model="Qwen3-0.6B shape (derived)", kv_bytes_per_token=KV_PER_TOKEN,
                   page_size=16, max_batched_tokens=2048, max_running=256, by_cores=(chip,),
                   platform="tpu", device_kind="TPU v5 lite", step="fused", kv_dtype="bfloat16",
                   skipped=("DERIVED, not measured: see _derivation",))


def main() -> None:
    profile().dump(OUT)
    raw = json.loads(OUT.read_text())
    raw["_derivation"] = DERIVATION
    OUT.write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
