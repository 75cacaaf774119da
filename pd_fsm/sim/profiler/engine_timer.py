"""The colocated scheduler timed through its public API: what ``pd-fsm profile`` measures on a
backend whose step is the chain of jitted calls (a CPU), and what ``bench/bench_tpu.py`` drives.
JAX and the engine are imported where used: ``pd-fsm profile`` pins the cores before JAX starts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import attrs


@attrs.frozen
class Lap:
    """Wall and CPU seconds (every thread of this process) of one timed run."""

    wall: float
    cpu: float


def lap(fn: Callable[[], object]) -> Lap:
    """Run ``fn`` once, timed."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return Lap(time.perf_counter() - wall, time.process_time() - cpu)


def median_of(fn: Callable[[], float], repeats: int) -> float:
    """The median of ``repeats`` runs of ``fn`` (seconds it returns) after one unmeasured (its
    compile)."""
    fn()
    return statistics.median(fn() for _ in range(repeats))


def timed(fn: Callable[[], Lap], repeats: int) -> tuple[float, float]:
    """(median wall seconds, cores busy over all the timed runs) of ``fn`` after its compile."""
    fn()
    laps = [fn() for _ in range(repeats)]
    return (statistics.median(one.wall for one in laps),
            sum(one.cpu for one in laps) / max(sum(one.wall for one in laps), 1e-9))


class EngineTimer:
    """The colocated scheduler (the same forwards P and D run), timed through its public API:
    a prefill is a whole request of one output token, a decode step one ``Scheduler.step``."""

    def __init__(self, model: str, *, num_pages: int, max_running: int,
                 max_batched_tokens: int, load_format: str = "auto",
                 dtype: str = "float32") -> None:
        from pd_fsm.schedulers.args import SchedulerArgs
        from pd_fsm.schedulers.scheduler import Scheduler

        self.sched = Scheduler(SchedulerArgs(model=model, num_pages=num_pages,
                                             max_running=max_running, load_format=load_format,
                                             dtype=dtype, max_batched_tokens=max_batched_tokens))
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
        return lap(sched.run_until_idle)

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
        laps = [lap(sched.step) for _ in range(8)]
        for req in list(sched.running):
            sched.abort(req.rid)
        sched.drain_outputs()
        wall = statistics.median(one.wall for one in laps)
        return Lap(wall, wall * sum(one.cpu for one in laps) / sum(one.wall for one in laps))
