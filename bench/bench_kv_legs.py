"""The KV path's legs per room on this machine's first device, with only the KV pool (no
weights): P's gather (each method), device -> host into numpy (one array; one per layer with
``copy_to_host_async`` first) and into ``pinned_host`` memory, host -> device, D's scatter
(each method); the best of ``--repeats`` runs on fresh arrays, bytes checked equal once
(``pd_fsm/sim/profiler/kv_legs.py`` says how each is timed).

    python bench/bench_kv_legs.py --shapes qwen3-0.6b,qwen3-1.7b,qwen3-4b \\
        --tokens 1024,4096,16384 --json kv_legs.json                    # on the TPU machine
    JAX_PLATFORMS=cpu python bench/bench_kv_legs.py --shapes tiny --tokens 64   # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import attrs
import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pd_fsm.jax_engine import backend
from pd_fsm.sim.profiler.kv_legs import model_config, reference_gbps, room_legs, table


def _methods(text: str | None) -> list[Any] | None:
    return None if text is None else [m for m in text.split(",") if m]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b")
    parser.add_argument("--tokens", default="1024,4096,16384", help="room sizes, tokens")
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per leg (best)")
    parser.add_argument("--gather-methods", help="comma list (default: each the backend "
                        "compiles; Pallas only where it is not interpreted)")
    parser.add_argument("--scatter-methods", help="comma list (default: as --gather-methods)")
    parser.add_argument("--tier-wait-s", type=float, default=60.0, help="how long the XLA "
                        "methods' run loop may compile in the background before the quick "
                        "tier's time is reported (default 60)")
    parser.add_argument("--hbm-gbps", type=float, help="the reference rate (default: the "
                        "device kind's published one)")
    parser.add_argument("--accelerator-on-cpu", action="store_true",
                        help="the accelerator's pool layout and methods on a CPU (tests)")
    parser.add_argument("--json", type=Path, help="write every leg here as well")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    hbm = args.hbm_gbps or reference_gbps(device.device_kind)
    doc: dict[str, Any] = {"platform": jax.default_backend(), "device_kind": device.device_kind,
                           "jax": jax.__version__, "kv_dtype": args.kv_dtype,
                           "hbm_gbps": hbm, "repeats": args.repeats, "rooms": []}
    print(f"{doc['platform']} ({doc['device_kind']}), jax {doc['jax']}, KV {args.kv_dtype}, "
          f"best of {args.repeats}", flush=True)
    failed = 0
    with (backend.using(backend.accelerator_on_cpu()) if args.accelerator_on_cpu
          else contextlib.nullcontext()):
        for shape in (s for s in args.shapes.split(",") if s):
            for tokens in (int(t) for t in args.tokens.split(",") if t):
                try:
                    legs = room_legs(model_config(shape), tokens, kv_dtype=args.kv_dtype,
                                     repeats=args.repeats,
                                     gathers=_methods(args.gather_methods),
                                     scatters=_methods(args.scatter_methods),
                                     tier_wait_s=args.tier_wait_s)
                except Exception as exc:  # one room's failure (memory, a wrong copy) is said
                    failed += 1
                    doc["rooms"].append({"shape": shape, "tokens": tokens,
                                         "error": f"{type(exc).__name__}: {exc}"[:2000]})
                    print(f"{shape} {tokens} tokens: FAILED {type(exc).__name__}: {exc}\n"
                          f"{traceback.format_exc()[-1500:]}", flush=True)
                    continue
                doc["rooms"].append({"shape": shape, "tokens": tokens,
                                     "legs": [attrs.asdict(leg) | {"gbps": leg.gbps}
                                              for leg in legs]})
                print(f"\n{shape}, a room of {tokens} tokens", flush=True)
                print("\n".join(table(legs, hbm)), flush=True)
                if args.json:  # as it goes: a run cut short keeps what it measured
                    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
