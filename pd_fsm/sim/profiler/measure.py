"""What ``pd-fsm profile`` measures, run on this backend and gathered into a ``Profile``: the
steps by the timer of the step this backend runs (``engine_timer.py`` on a CPU's chain,
``step_timer.py`` where the step is fused), then the KV moves and legs."""

from __future__ import annotations

import argparse
import functools
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pd_fsm.jax_engine import backend
from pd_fsm.jax_engine.kv.gather_scatter import default_gather_method, default_scatter_method
from pd_fsm.sim.perf_profile import CoreProfile, Profile
from pd_fsm.sim.profiler.engine_timer import EngineTimer, Lap, timed
from pd_fsm.sim.profiler.kv_legs import (
    Leg,
    model_config,
    reference_gbps,
    room_legs,
    schema_legs,
    table,
)
from pd_fsm.sim.profiler.step_timer import StepTimer

Moves = Callable[[argparse.Namespace],
                 tuple[list[tuple[int, float]], list[tuple[int, float]], list[str]]]
# (prefill {tokens: (seconds, busy)}, decode {(rows, context): (seconds, busy)}, kv bytes per
# token, KV dtype, what was skipped)
Steps = tuple[dict[int, tuple[float, float]], dict[tuple[int, int], tuple[float, float]], int,
              str, list[str]]


class BudgetClock:
    """``--budget-s``: the time the measuring may take; a point reached after it is skipped and
    named, so a run cut short still writes what it measured."""

    def __init__(self, budget_s: float | None) -> None:
        self.end = None if budget_s is None else time.monotonic() + budget_s
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if self.end is None or time.monotonic() < self.end:
            return True
        return self._skip(f"{what}: not measured, the time budget (--budget-s) ran out")

    def survives(self, what: str, run: Callable[[], Any], into: dict[Any, Any],
                 key: object) -> bool:
        """Run one point into ``into[key]``; one that fails (the device's memory, a compile) is
        skipped with its error, and the rest go on."""
        try:
            into[key] = run()
        except Exception as exc:
            return self._skip(f"{what}: failed: {type(exc).__name__}: {str(exc)[:400]}")
        return True

    def _skip(self, line: str) -> bool:
        self.skipped.append(line)
        print(f"skipped: {line}", flush=True)
        return False


def _chain_steps(args: argparse.Namespace, clock: BudgetClock) -> Steps:
    """The scheduler's steps through its public API (a CPU's chain)."""
    timer = EngineTimer(args.model, num_pages=args.num_pages, max_running=max(args.decode_rows),
                        max_batched_tokens=args.max_batched_tokens,
                        load_format=args.load_format, dtype=args.dtype)
    prefills = {n: timed(functools.partial(timer.prefill, n), args.repeats)
                for n in args.prefill_tokens if clock.allows(f"prefill {n}")}
    decodes = {(b, c): timed(functools.partial(timer.decode, b, c), args.repeats)
               for c in args.decode_contexts for b in args.decode_rows
               if clock.allows(f"decode {b} x {c}")}
    cfg = timer.sched.pool_config
    kv_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(
        cfg.storage_dtype).itemsize
    return prefills, decodes, int(kv_bytes), cfg.dtype, []


def _fused_steps(args: argparse.Namespace, clock: BudgetClock) -> Steps:
    """``ModelRunner``'s fused steps over a pool sized for the grid (an accelerator)."""
    grid = [(r, c) for c in args.decode_contexts for r in args.decode_rows]
    timer = StepTimer(args.model, load_format=args.load_format, dtype=args.dtype,
                      kv_dtype=args.kv_dtype, page_size=args.page_size,
                      max_batched_tokens=args.max_batched_tokens,
                      prefill_grid=args.prefill_tokens, decode_grid=grid,
                      reserve_bytes=int(args.hbm_reserve_gb * 1e9),
                      hbm_bytes=None if args.hbm_gb is None else int(args.hbm_gb * 1e9))
    for line in timer.skipped:
        print(f"skipped: {line}", flush=True)
    print(f"pool: {timer.sched.pool_config.num_pages} pages of {timer.page_bytes} bytes; "
          f"weights {timer.weight_bytes / 1e9:.2f} GB", flush=True)
    prefills: dict[int, tuple[float, float]] = {}
    for n in timer.prefill_grid:
        if clock.allows(f"prefill {n}") and clock.survives(f"prefill {n}", functools.partial(
                timed, functools.partial(timer.prefill, n), args.repeats), prefills, n):
            print(f"prefill {n}: {prefills[n][0] * 1e3:.3f} ms", flush=True)
    decodes: dict[tuple[int, int], tuple[float, float]] = {}
    laps: dict[tuple[int, int], tuple[Lap, float]] = {}
    for rows, context in timer.decode_grid:
        what = f"decode {rows} x {context}"
        if clock.allows(what) and clock.survives(what, functools.partial(
                timer.decode, rows, context, args.decode_steps), laps, (rows, context)):
            served, alone = laps[rows, context]
            decodes[rows, context] = (served.wall, served.cpu / max(served.wall, 1e-9))
            print(f"{what}: {served.wall * 1e3:.3f} ms a step as served, {alone * 1e3:.3f} ms "
                  "alone", flush=True)
    kv_bytes = timer.page_bytes // args.page_size
    result = prefills, decodes, kv_bytes, timer.kv_dtype, list(timer.skipped)
    timer.close()  # the pool's memory back before the legs' pools
    del timer
    gc.collect()
    return result


def _legs(args: argparse.Namespace, kv_dtype: str, clock: BudgetClock
          ) -> dict[str, tuple[tuple[int, float], ...]]:
    """The KV legs of each ``--legs-tokens`` room at the model's KV shape (gather and scatter by
    the methods P and D run here; ``bench/bench_kv_legs.py`` times every method), printed, and
    as the profile holds them."""
    legs: list[Leg] = []
    config = model_config(args.model)
    gather, scatter = default_gather_method(), default_scatter_method()
    rooms: dict[int, list[Leg]] = {}
    for tokens in args.legs_tokens:
        what = f"KV legs of a room of {tokens} tokens"
        if clock.allows(what) and clock.survives(what, functools.partial(
                room_legs, config, tokens, kv_dtype=kv_dtype, repeats=args.legs_repeats,
                gathers=[gather], scatters=[scatter], tier_wait_s=args.legs_tier_wait_s),
                rooms, tokens):
            legs += rooms[tokens]
    print("\n".join(table(legs, reference_gbps(jax.devices()[0].device_kind))), flush=True)
    return schema_legs(legs, gather, scatter)


def measure(args: argparse.Namespace, moves: Moves) -> Profile:
    be = backend.current()
    if args.dtype is None:
        args.dtype = "bfloat16" if be.fused_step else "float32"
    clock = BudgetClock(args.budget_s)
    prefills, decodes, kv_bytes, kv_dtype, skipped = (
        _fused_steps if be.fused_step else _chain_steps)(args, clock)
    print(f"prefill: {[(n, s) for n, (s, _) in prefills.items()]}\nprefill cores busy: "
          f"{[(n, round(b, 2)) for n, (_, b) in prefills.items()]}", flush=True)
    print(f"decode: {[(b, c, s) for (b, c), (s, _) in decodes.items()]}\ndecode cores busy: "
          f"{[(b, c, round(n, 2)) for (b, c), (_, n) in decodes.items()]}", flush=True)
    copies, pulls, unmoved = moves(args)
    print(f"copy: {copies}\npull: {pulls}", flush=True)
    for line in unmoved:
        print(f"skipped: {line}", flush=True)
    legs = _legs(args, kv_dtype, clock) if args.legs_tokens else {}
    return Profile(
        model=args.model, kv_bytes_per_token=kv_bytes, page_size=args.page_size,
        max_batched_tokens=args.max_batched_tokens, max_running=args.max_running,
        platform=jax.default_backend(), device_kind=jax.devices()[0].device_kind,
        step="fused" if be.fused_step else "chain", kv_dtype=kv_dtype,
        prefill_grid=tuple(args.prefill_tokens),
        decode_grid=tuple((r, c) for c in args.decode_contexts for r in args.decode_rows),
        skipped=(*skipped, *unmoved, *clock.skipped),
        by_cores=(CoreProfile(
            cores=len(os.sched_getaffinity(0)), prefill=tuple((n, s) for n, (s, _) in
                                                              prefills.items()),
            decode=tuple((r, c, s) for (r, c), (s, _) in decodes.items()),
            copy=tuple(copies), pull=tuple(pulls),
            prefill_busy=tuple((n, b) for n, (_, b) in prefills.items()),
            decode_busy=tuple((r, c, b) for (r, c), (_, b) in decodes.items()),
            **legs),))
