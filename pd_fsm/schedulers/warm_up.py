"""Warm-up: compile, before a worker says ready, every forward a scheduler can run, so that no
request waits for a compile, and run each fused step once. Apart from the scheduler because it
only reads it (its knobs, its role's shapes) and drives its runner."""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import jax
import numpy as np

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.sampling.sampler import greedy_arrays
from pd_fsm.jax_engine.step.program import pack
from pd_fsm.schedulers.model_runner import ModelRunner
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
    run each fused step once on padding (:func:`run_each_step_once`). Idempotent:
    shapes already compiled in this process cost a lookup."""
    start = time.perf_counter()
    before = EXECUTABLES.stats().built
    plan = shapes_of(sched)
    sched.runner.compile(plan)
    run_each_step_once(sched.runner, plan)
    compiled = EXECUTABLES.stats().built - before
    return WarmupReport(tuple(plan), compiled, time.perf_counter() - start)


def run_each_step_once(runner: ModelRunner, plan: Sequence[tuple[int, int]]) -> None:
    """Run the fused step of each shape serving ``plan`` once (none without a fused step or
    across processes, whose ranks step together), on padding: every sequence empty, so every
    token's KV goes to the null page and only the tokens come back. On the chip a worker's
    first request after ready took ~55 ms against ~27 for the rest (runs 8 and 9), the excess
    in its prefill: whatever a first run costs beyond the compile is paid here instead
    (tpu-inference's precompile likewise calls each shape on dummy arrays). Waits for each."""
    if not runner.backend.fused_step or jax.process_count() > 1:
        return
    width = runner.table_width
    for tokens, seqs in runner.step_shapes(plan):
        empty = np.zeros(seqs, np.int32)
        greedy = greedy_arrays(seqs)
        batch = pack(np.zeros(tokens, np.int32), np.full(tokens, -1, np.int32), empty, empty,
                     np.zeros((seqs, width), np.int32), greedy)
        (sampled, *_), _ = runner.run_step(tokens, seqs, batch,
                                           runner.every_token_allowed(seqs))
        sampled.block_until_ready()
