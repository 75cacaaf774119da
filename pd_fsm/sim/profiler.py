"""``pd-fsm profile``: measure the real engine for the performance model (issue 30 §4).

It runs the colocated scheduler (the same forwards P and D run) through its public API, on the
cores it is given (``--cpus``, set before JAX starts: XLA sizes its pools from the affinity):

- a prefill of one prompt of each length (the step that prefills a request of one output token);
- a decode step by batch rows at two context lengths (every row in the decode batch);
- a device copy of a KV-sized buffer (what gather and scatter move) and a pull of it through
  ``jax.experimental.transfer`` over loopback, by bytes;
- for each prefill and decode shape, the cores it kept busy: the process's CPU seconds over the
  wall seconds (XLA's pool threads spin while they wait, so a step keeps more cores busy than
  its speed-up says, and a worker sharing those cores gets less).

Each shape runs once unmeasured (its compile), then ``--repeats`` times; the median is kept.
``--merge FILE`` adds this run's core count to an existing profile, so one file holds the
pinned (one core) and the colocated (all cores) costs:

    pd-fsm profile --cpus 0 --out prof.json && pd-fsm profile --cpus 0-1 --merge prof.json
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus, pin_to
from pd_fsm.sim.perf_profile import CoreProfile, Profile

if TYPE_CHECKING:  # imported where used: main pins the cores before JAX starts
    import jax

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

PREFILL_TOKENS = (16, 64, 128, 256, 512, 1024)
DECODE_ROWS = (1, 2, 4, 8)
DECODE_CONTEXTS = (64, 512)
COPY_MIB = (1, 4, 16, 64)


def _median(fn: Callable[[], float], repeats: int) -> float:
    fn()  # its compile
    return statistics.median(fn() for _ in range(repeats))


def _timed(fn: Callable[[], Lap], repeats: int) -> tuple[float, float]:
    """(median wall seconds, cores busy over all the timed runs) of ``fn`` after its compile."""
    fn()
    laps = [fn() for _ in range(repeats)]
    return (statistics.median(lap.wall for lap in laps),
            sum(lap.cpu for lap in laps) / max(sum(lap.wall for lap in laps), 1e-9))


@attrs.frozen
class Lap:
    """Wall and CPU seconds (every thread of this process) of one timed run."""

    wall: float
    cpu: float


def _lap(fn: Callable[[], object]) -> Lap:
    """Run ``fn`` once, timed."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return Lap(time.perf_counter() - wall, time.process_time() - cpu)


def _measure(args: argparse.Namespace) -> Profile:
    import jax.numpy as jnp

    timer = EngineTimer(args.model, num_pages=args.num_pages, max_running=max(args.decode_rows),
                        max_batched_tokens=args.max_batched_tokens)
    prefills = {n: _timed(functools.partial(timer.prefill, n), args.repeats)
                for n in args.prefill_tokens}
    rows = [(n, s) for n, (s, _) in prefills.items()]
    print(f"prefill: {rows}\nprefill cores busy: "
          f"{[(n, round(b, 2)) for n, (_, b) in prefills.items()]}", flush=True)
    decodes = {(b, c): _timed(functools.partial(timer.decode, b, c), args.repeats)
               for c in args.decode_contexts for b in args.decode_rows}
    steps = [(b, c, s) for (b, c), (s, _) in decodes.items()]
    print(f"decode: {steps}\ndecode cores busy: "
          f"{[(b, c, round(n, 2)) for (b, c), (_, n) in decodes.items()]}", flush=True)
    copies, pulls = _kv_moves(args)
    print(f"copy: {copies}\npull: {pulls}", flush=True)
    sched, cfg = timer.sched, timer.sched.config
    kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(
        sched.pool_config.storage_dtype).itemsize
    return Profile(model=args.model, kv_bytes_per_token=int(kv_bytes),
                   page_size=sched.args.page_size, max_batched_tokens=args.max_batched_tokens,
                   max_running=args.max_running, by_cores=(CoreProfile(
                       cores=len(os.sched_getaffinity(0)), prefill=tuple(rows),
                       decode=tuple(steps), copy=tuple(copies), pull=tuple(pulls),
                       prefill_busy=tuple((n, b) for n, (_, b) in prefills.items()),
                       decode_busy=tuple((r, c, b) for (r, c), (_, b) in decodes.items())),))


class EngineTimer:
    """The colocated scheduler (the same forwards P and D run), timed through its public API
    (also by ``bench/bench_tpu.py``). JAX and the engine are imported here, not at the top:
    ``main`` pins the cores first."""

    def __init__(self, model: str, *, num_pages: int, max_running: int,
                 max_batched_tokens: int) -> None:
        from pd_fsm.schedulers.args import SchedulerArgs
        from pd_fsm.schedulers.scheduler import Scheduler

        self.sched = Scheduler(SchedulerArgs(model=model, num_pages=num_pages,
                                             max_running=max_running,
                                             max_batched_tokens=max_batched_tokens))
        self._rid = iter(range(1 << 30))

    def _prompt(self, n: int) -> list[int]:
        vocab = self.sched.config.vocab_size
        return [(7 * i + 3) % (vocab - 1) + 1 for i in range(n)]

    def prefill(self, n: int) -> Lap:
        """Prefill one prompt of ``n`` tokens (a request of one output token)."""
        from pd_fsm.jax_engine.sampling.params import SamplingParams

        sched = self.sched
        sched.add_request(sched.make_request(f"p{next(self._rid)}", self._prompt(n),
                                             SamplingParams(max_new_tokens=1, temperature=0.0,
                                                            ignore_eos=True)))
        return _lap(sched.run_until_idle)

    def decode(self, rows: int, context: int) -> Lap:
        """A decode step of ``rows`` rows at ``context`` tokens each: the median step's wall
        seconds, and the CPU seconds of a step of the eight timed (their mean)."""
        from pd_fsm.jax_engine.sampling.params import SamplingParams

        sched = self.sched
        for _ in range(rows):
            sched.add_request(sched.make_request(f"d{next(self._rid)}", self._prompt(context),
                                                 SamplingParams(max_new_tokens=64, temperature=0.0,
                                                                ignore_eos=True)))
        while sched.waiting or sched.prefilling or len(sched.running) < rows:
            sched.step()
        laps = [_lap(sched.step) for _ in range(8)]
        for req in list(sched.running):
            sched.abort(req.rid)
        sched.drain_outputs()
        wall = statistics.median(lap.wall for lap in laps)
        return Lap(wall, wall * sum(lap.cpu for lap in laps) / sum(lap.wall for lap in laps))


def _kv_moves(args: argparse.Namespace) -> tuple[list[tuple[int, float]],
                                                  list[tuple[int, float]]]:
    """(bytes, seconds) of a device copy of each KV-sized buffer (what gather and scatter move),
    and of a pull of it over loopback."""
    import jax.numpy as jnp

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    copies, pulls = [], []
    uuids = iter(range(1, 1 << 30))
    try:
        for mib in args.copy_mib:
            n = mib << 20
            x = jnp.ones((n // 4,), jnp.float32)
            x.block_until_ready()
            copies.append((n, _median(functools.partial(_copy_seconds, x), args.repeats)))
            pulls.append((n, _median(functools.partial(_pull_seconds, engine, x, uuids),
                                     args.repeats)))
    finally:
        engine.close()
    return copies, pulls


def _copy_seconds(x: jax.Array) -> float:
    start = time.perf_counter()
    (x + 0).block_until_ready()
    return time.perf_counter() - start


def _pull_seconds(engine: JaxTransferKVEngine, x: jax.Array, uuids: Iterator[int]) -> float:
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
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny (default smollm2)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="measure on these cores (e.g. 0 or 0-1), set before JAX starts")
    p.add_argument("--num-pages", type=int, default=512)
    p.add_argument("--max-batched-tokens", type=int, default=1024)
    p.add_argument("--max-running", type=int, default=8,
                   help="the workers' --max-running the model will assume (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per shape (median)")
    p.add_argument("--prefill-tokens", type=int, nargs="+", default=list(PREFILL_TOKENS))
    p.add_argument("--decode-rows", type=int, nargs="+", default=list(DECODE_ROWS))
    p.add_argument("--decode-contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS))
    p.add_argument("--copy-mib", type=int, nargs="+", default=list(COPY_MIB),
                   help="KV-sized buffers to copy and pull (MiB)")
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
    profile = _measure(args)
    if args.merge is not None:
        profile = Profile.load(args.merge).merged(profile) if args.merge.exists() else profile
        profile.dump(args.merge)
    else:
        profile.dump(args.out)
    print(f"wrote {args.merge or args.out}: cores {[c.cores for c in profile.by_cores]}")
    return 0
