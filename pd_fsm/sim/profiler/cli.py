"""``pd-fsm profile``: measure the real engine for the performance model, on the cores it is given
(``--cpus``, set before JAX starts: XLA sizes its pools from the affinity):

- a prefill of one prompt of each length, and a decode step by batch rows at each context
  length, as the engine runs them on this backend: on a CPU the colocated scheduler's steps
  through its public API (``engine_timer.py``); on an accelerator the fused step through
  ``ModelRunner.prefill_step`` / ``decode_step``, decode steps as served (overlapped, tokens
  read back), over a pool sized for the largest grid point that fits (``step_timer.py``);
- a device copy of a KV-sized buffer, and a pull of it through ``jax.experimental.transfer``
  over loopback, by bytes (skipped, and said, where the machine refuses TCP sockets: the
  transfer listens on TCP only);
- with ``--legs-tokens``, the KV path's legs per room of those sizes at the model's KV shape
  (``kv_legs.py``): P's gather, device -> host, into ``pinned_host``, host -> device, D's scatter;
- for each prefill and decode shape, the cores it kept busy: the process's CPU seconds over the
  wall seconds (XLA's pool threads spin while they wait, so a step keeps more cores busy than
  its speed-up says, and a worker sharing those cores gets less).

Each shape runs once unmeasured (its compile), then ``--repeats`` times; the median is kept.
``--merge FILE`` adds this run's core count to an existing profile, so one file holds the
pinned (one core) and the colocated (all cores) costs:

    pd-fsm profile --cpus 0 --out prof.json && pd-fsm profile --cpus 0-1 --merge prof.json

On a TPU (random weights at a published shape, chip-sized grids; ``bench/tpu_profile.sh``):

    pd-fsm profile --model qwen3-0.6b --load-format dummy --dtype bfloat16 \\
        --prefill-tokens 128,1024,4096,8192 --decode-rows 1,8,64,256 \\
        --decode-contexts 512,2048,8192 --legs-tokens 1024,4096,16384 --out prof.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus, pin_to
from pd_fsm.sim.perf_profile import Profile
from pd_fsm.sim.profiler.engine_timer import median_of

if TYPE_CHECKING:  # imported where used: main pins the cores before JAX starts
    import jax

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)
DECODE_ROWS = (1, 2, 4, 8)
DECODE_CONTEXTS = (64, 512)
COPY_MIB = (1, 4, 16, 64)
# Room sizes of the KV legs where the backend runs the fused step (an accelerator); none on a
# CPU unless asked (its legs are memory copies of the host's).
ACCELERATOR_LEGS_TOKENS = (1024, 4096, 16384)


def _ints(text: str) -> list[int]:
    """``128,1024`` (or one number): the grid's values."""
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None


def _grid(values: list[list[int]] | None, default: tuple[int, ...]) -> list[int]:
    """A grid given as ``1,8,64`` or ``1 8 64`` (both forms, flattened)."""
    return list(default) if values is None else [v for group in values for v in group]


def _kv_moves(args: argparse.Namespace) -> tuple[list[tuple[int, float]],
                                                  list[tuple[int, float]], list[str]]:
    """(bytes, seconds) of a device copy of each KV-sized buffer (what gather and scatter move),
    and of a pull of it over loopback (none where TCP is refused: the reason, in the third)."""
    import jax.numpy as jnp

    from pd_fsm.io_trio.worker.cli import check_transfer_tcp

    copies: list[tuple[int, float]] = []
    pulls: list[tuple[int, float]] = []
    skipped: list[str] = []
    for mib in args.copy_mib:
        n = mib << 20
        x = jnp.ones((n // 4,), jnp.float32)
        x.block_until_ready()
        copies.append((n, median_of(functools.partial(_copy_seconds, x), args.repeats)))
    try:
        check_transfer_tcp("127.0.0.1")
    except ValueError as exc:
        skipped.append(f"pull over loopback: not measured: {exc}")
        return copies, pulls, skipped
    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    uuids = iter(range(1, 1 << 30))
    try:
        for mib in args.copy_mib:
            n = mib << 20
            x = jnp.ones((n // 4,), jnp.float32)
            x.block_until_ready()
            pulls.append((n, median_of(functools.partial(_pull_seconds, engine, x, uuids),
                                       args.repeats)))
    finally:
        engine.close()
    return copies, pulls, skipped


def _copy_seconds(x: jax.Array) -> float:
    import time

    start = time.perf_counter()
    (x + 0).block_until_ready()
    return time.perf_counter() - start


def _pull_seconds(engine: JaxTransferKVEngine, x: jax.Array, uuids: Iterator[int]) -> float:
    import time

    import jax

    uuid = next(uuids)
    engine.register(uuid, [x], lease_s=60)
    start = time.perf_counter()
    spec = jax.ShapeDtypeStruct(  # type: ignore[no-untyped-call]  # jax's own
        x.shape, x.dtype, sharding=engine.sharding)
    engine.start_pull(engine.address, uuid, [spec], deadline_s=60).wait()
    took = time.perf_counter() - start
    engine.release(uuid, "profiled")
    return took


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("profile", help="measure the engine's prefill, decode and KV-move costs "
                       "for the performance model (pd-fsm sim --profile)")
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny, or with --load-format "
                   "dummy a published shape (qwen3-0.6b, ...; default smollm2)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="auto: the model's weights; dummy: random weights at its shape")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="the weights' (default: bfloat16 where the step is fused, an "
                   "accelerator; float32 on a CPU)")
    p.add_argument("--kv-dtype", default=None, choices=("float32", "bfloat16"),
                   help="the KV pool's (default: --dtype)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="measure on these cores (e.g. 0 or 0-1), set before JAX starts")
    p.add_argument("--num-pages", type=int, default=512,
                   help="the CPU's pool (an accelerator's is sized for the grid)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--max-running", type=int, default=8,
                   help="the workers' --max-running the model will assume (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per shape (median)")
    p.add_argument("--decode-steps", type=int, default=8,
                   help="steps per timed run of a fused decode step (default 8)")
    p.add_argument("--prefill-tokens", type=_ints, nargs="+", metavar="N[,N...]")
    p.add_argument("--decode-rows", type=_ints, nargs="+", metavar="N[,N...]")
    p.add_argument("--decode-contexts", type=_ints, nargs="+", metavar="N[,N...]")
    p.add_argument("--copy-mib", type=_ints, nargs="+", metavar="N[,N...]",
                   help="KV-sized buffers to copy and pull (MiB)")
    p.add_argument("--legs-tokens", type=_ints, nargs="+", metavar="N[,N...]",
                   help="rooms (tokens) whose KV legs to time (default: 1024,4096,16384 where "
                   "the step is fused, none on a CPU)")
    p.add_argument("--legs-repeats", type=int, default=3, help="timed runs per leg (best)")
    p.add_argument("--legs-tier-wait-s", type=float, default=60.0, help="how long the XLA "
                   "gather's and scatter's run loop may compile in the background before the "
                   "quick tier's time is kept (default 60)")
    p.add_argument("--hbm-gb", type=float, default=None,
                   help="the device memory to size the pool in (default: the device's own)")
    p.add_argument("--hbm-reserve-gb", type=float, default=2.0,
                   help="device memory kept from the pool for the step's own buffers")
    p.add_argument("--budget-s", type=float, default=None, help="the time the measuring may "
                   "take: grid points and rooms reached after it are skipped (and named), so a "
                   "run with a deadline still writes what it measured")
    p.add_argument("--backend", default="auto", choices=("auto", "accelerator-on-cpu"),
                   help="accelerator-on-cpu: the accelerator's step and pool on a CPU (tests)")
    out = p.add_mutually_exclusive_group(required=True)
    out.add_argument("--out", type=Path, help="write a new profile here")
    out.add_argument("--merge", type=Path, help="add this core count to this profile")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.cpus is not None:
        try:
            pin_to(parse_cpus(args.cpus))  # before JAX: XLA sizes its pools from it once
        except (ValueError, OSError) as exc:
            print(f"pd-fsm profile: {exc}", file=sys.stderr)
            return 2
    args.prefill_tokens = _grid(args.prefill_tokens, PREFILL_TOKENS)
    args.decode_rows = _grid(args.decode_rows, DECODE_ROWS)
    args.decode_contexts = _grid(args.decode_contexts, DECODE_CONTEXTS)
    args.copy_mib = _grid(args.copy_mib, COPY_MIB)
    from pd_fsm.jax_engine import backend
    from pd_fsm.sim.profiler.measure import measure

    with (backend.using(backend.accelerator_on_cpu()) if args.backend == "accelerator-on-cpu"
          else contextlib.nullcontext()):
        if args.legs_tokens is None:
            args.legs_tokens = [[*ACCELERATOR_LEGS_TOKENS]] if backend.current().fused_step \
                else []
        args.legs_tokens = _grid(args.legs_tokens, ())
        profile = measure(args, _kv_moves)
    if args.merge is not None:
        profile = Profile.load(args.merge).merged(profile) if args.merge.exists() else profile
        profile.dump(args.merge)
    else:
        profile.dump(args.out)
    print(f"wrote {args.merge or args.out}: {profile.platform} ({profile.device_kind}), "
          f"step {profile.step}, cores {[c.cores for c in profile.by_cores]}"
          + (f"; not measured: {len(profile.skipped)} (above)" if profile.skipped else ""))
    return 0
