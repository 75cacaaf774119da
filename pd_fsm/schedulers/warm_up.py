"""Warm-up: compile, before a worker says ready, every forward a scheduler can run, so that no
request waits for a compile. Apart from the scheduler because it only reads it: its knobs, its
role's shapes and its runner."""

from __future__ import annotations

import time

import attrs

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.schedulers.plan import shape_plan
from pd_fsm.schedulers.scheduler import Scheduler


@attrs.frozen
class WarmupReport:
    """What a warm-up compiled: forward shapes ``(rows, tokens)`` and executables, and how long."""

    shapes: tuple[tuple[int, int], ...]
    executables: int
    seconds: float


def shapes_of(sched: Scheduler) -> list[tuple[int, int]]:
    """Every padded forward shape ``(rows, tokens)`` ``sched`` can run, from its knobs
    (``plan.shape_plan``), less those its role never runs. The page table's width is fixed
    (``table_width``), so nothing else varies."""
    a = sched.args
    plan = shape_plan(a.max_running, sched.max_batched_tokens, sched.context_length)
    return [(n, t) for n, t in plan if sched.role.keeps_shape(n, t)]


def warm_up(sched: Scheduler) -> WarmupReport:
    """Compile every executable :func:`shapes_of` needs (the forward's and the samplers'), then
    run each fused step once on padding (``ModelRunner.run_each_step_once``). Idempotent:
    shapes already compiled in this process cost a lookup."""
    start = time.perf_counter()
    before = EXECUTABLES.stats().built
    plan = shapes_of(sched)
    sched.runner.compile(plan)
    sched.runner.run_each_step_once(plan)
    compiled = EXECUTABLES.stats().built - before
    return WarmupReport(tuple(plan), compiled, time.perf_counter() - start)
