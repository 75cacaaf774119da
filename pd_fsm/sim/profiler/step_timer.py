"""The step the engine runs on a backend whose step is one fused program (an accelerator), timed
through ``ModelRunner.prefill_step`` / ``decode_step`` as the scheduler calls them, with random
prompts of the grid's shapes placed in the pool by hand (no prefill of a 256-row batch's context
to reach its decode step).

- A prefill of ``n`` tokens is the steps the scheduler plans for one prompt (chunks of
  ``--max-batched-tokens``), its first token read back.
- A decode step is as served: where the backend overlaps steps (``Backend.overlap_steps``) each
  step is dispatched before the previous one's tokens are read, and a step costs the steady
  state's time per step, read-backs included; elsewhere one ``decode_step`` (dispatch, wait,
  tokens read). Every row has pages of its own.

The pool is sized for the largest grid point that fits the device's memory (what is free once
the weights are loaded, less ``reserve`` bytes for the step's own buffers); a point that does
not fit is skipped and named in ``skipped``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import jax
import numpy as np

from pd_fsm.jax_engine.compilation.buckets import bucket
from pd_fsm.jax_engine.model.dummy import param_bytes
from pd_fsm.jax_engine.model.registry import load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.model_runner import MAIN_KV, Launched
from pd_fsm.schedulers.plan import DecodeBatch, plan_prefill
from pd_fsm.schedulers.request import Req
from pd_fsm.schedulers.scheduler import Scheduler
from pd_fsm.sim.profiler.engine_timer import Lap, lap

GREEDY = SamplingParams(max_new_tokens=1 << 20, temperature=0.0, ignore_eos=True)


def free_device_bytes(limit: int | None = None) -> int | None:
    """Bytes free on the first device: ``limit`` (else the device's own, where it says) less
    what is in use; None where neither is known (a CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    total = limit if limit is not None else stats.get("bytes_limit")
    if total is None:
        return None
    return int(total) - int(stats.get("bytes_in_use", 0))


class StepTimer:
    """``ModelRunner``'s steps over a pool sized for the grid (module docstring)."""

    def __init__(self, model: str, *, load_format: str, dtype: str, kv_dtype: str | None,
                 page_size: int, max_batched_tokens: int, prefill_grid: Sequence[int],
                 decode_grid: Sequence[tuple[int, int]], reserve_bytes: int,
                 hbm_bytes: int | None = None) -> None:
        self.page_size = page_size
        loaded = load_model(model, dtype, 0, load_format)
        for leaf in jax.tree_util.tree_leaves(loaded.params):
            leaf.block_until_ready()
        self.config = loaded.config
        one = self.config.kv_pool_config(2, page_size, kv_dtype)
        self.kv_dtype = one.dtype
        self.page_bytes = (one.num_layers * math.prod(one.page_shape)
                           * np.dtype(one.storage_dtype).itemsize)
        free = free_device_bytes(hbm_bytes)
        self.capacity = None if free is None else max(free - reserve_bytes, 0) // self.page_bytes
        self.weight_bytes = param_bytes(loaded.params)
        self.skipped: list[str] = []
        self.prefill_grid = [n for n in prefill_grid if self._fits(f"prefill {n}", n, 1)]
        self.decode_grid = [(r, c) for r, c in decode_grid
                            if self._fits(f"decode {r} x {c}", c + 1, r)]
        pages = max([-(-n // page_size) for n in self.prefill_grid]
                    + [r * -(-(c + 1) // page_size) for r, c in self.decode_grid] + [1])
        longest = max([*self.prefill_grid, *(c for _, c in self.decode_grid), page_size])
        self.sched = Scheduler(SchedulerArgs(
            model=model, load_format=load_format, dtype=dtype, kv_dtype=kv_dtype,
            num_pages=pages + 1, page_size=page_size,
            max_running=max([r for r, _ in self.decode_grid] + [1]),
            max_batched_tokens=max_batched_tokens, context_length=longest + page_size),
            model=loaded)
        self.runner = self.sched.runner
        self._rid = iter(range(1 << 30))

    def close(self) -> None:
        """Free the pool's device memory now (whatever still refers to its arrays)."""
        with self.runner.kv_holder.locked() as pools:
            for layer in pools[MAIN_KV]:
                layer.delete()

    def _fits(self, what: str, tokens: int, rows: int) -> bool:
        need = rows * -(-tokens // self.page_size)
        if self.capacity is None or need <= self.capacity:
            return True
        self.skipped.append(
            f"{what}: its KV ({need * self.page_bytes / 1e6:,.1f} MB) does not fit the "
            f"{self.capacity * self.page_bytes / 1e6:,.1f} MB of device memory left for the "
            "pool")
        return False

    def _request(self, tokens: int, first_page: int, room: int = 0) -> Req:
        """A request whose prompt of ``tokens`` random ids holds the pages from
        ``first_page`` on, as if prefilled there, and pages for ``room`` tokens more (a
        decode step's new token, as the scheduler allocates them before the step)."""
        vocab = self.config.vocab_size
        ids = ((np.arange(tokens) * 7 + next(self._rid)) % (vocab - 1) + 1).tolist()
        req = self.sched.make_request(f"r{next(self._rid)}", ids, GREEDY)
        req.pages = list(range(first_page,
                               first_page + -(-(tokens + room) // self.page_size)))
        return req

    def prefill(self, n: int) -> Lap:
        """The prefill steps of one prompt of ``n`` tokens, as the scheduler plans them
        (chunks of its budget), the first token read back."""
        req = self._request(n, 1)
        budget = self.sched.max_batched_tokens

        def run() -> None:
            req.prefilled = 0
            while req.prefilled < n:
                batch = plan_prefill([req], budget, lambda _: None)
                assert batch is not None
                length = batch.rows[0].length
                done = req.prefilled + length == n
                self.runner.prefill_step(batch, [req if done else None])
                req.prefilled += length

        return lap(run)

    def decode(self, rows: int, context: int, steps: int) -> tuple[Lap, float]:
        """A decode step of ``rows`` rows at ``context`` tokens each, as served (overlapped
        where the backend overlaps steps: the steady state's time per step over ``steps``),
        and one ``decode_step`` alone (dispatch, wait, tokens read): its median seconds."""
        per_row = -(-(context + 1) // self.page_size)
        reqs = [self._request(context, 1 + i * per_row, room=1) for i in range(rows)]
        batch = DecodeBatch(tuple(reqs), bucket(rows))
        runner = self.runner

        def served() -> None:
            if not runner.can_overlap(reqs):
                for _ in range(steps):
                    runner.decode_step(batch)
                return
            previous: Launched | None = None
            for _ in range(steps):
                launched = runner.decode_launch(batch, previous)
                if previous is not None:
                    runner.collect(previous)
                previous = launched
            assert previous is not None
            runner.collect(previous)

        served()  # its compiles (a carried input is placed otherwise than an uploaded one)
        runs = [lap(served) for _ in range(3)]
        best = min(runs, key=lambda one: one.wall)
        alone = [lap(lambda: runner.decode_step(batch)).wall for _ in range(steps)]
        return Lap(best.wall / steps, best.cpu / steps), statistics.median(alone)
