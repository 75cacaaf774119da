"""A backend's start-up: build its scheduler, compile what it can run, prove it works.

``Startup`` times each phase (model_load, forward_compile, kv_copy_compile, first_request) for
``/server_info``'s ``ready_seconds``, and remembers the compile and compilation-cache counts when
the worker became ready: every compile after that made a request wait.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from pd_fsm.io_trio.worker.backend import Stats
from pd_fsm.io_trio.worker.flags import WARMUP_MODES
from pd_fsm.jax_engine.compilation import cache as compilation_cache
from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.kv.tiered import total_compiles
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.scheduler import Scheduler
from pd_fsm.schedulers.warm_up import warm_up

log = logging.getLogger("pd_fsm.io_trio.worker.startup")

WARMUP_PROMPT = (1, 2, 3, 4)

R = TypeVar("R")
S = TypeVar("S", bound=Scheduler)


class Startup:
    def __init__(self, warmup: str) -> None:
        if warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
        # "full": compile every shape before ready; "minimal": one short request only.
        self._warmup = warmup
        # Seconds each start-up phase took, and the compile count when ready.
        self.ready_seconds: dict[str, float] = {}
        self._compiles_at_ready: int | None = None
        self._cache_at_ready: dict[str, int] = {}

    def timed(self, phase: str, fn: Callable[[], R]) -> R:
        start = time.perf_counter()
        out = fn()
        self.ready_seconds[phase] = time.perf_counter() - start
        return out

    def build(self, make: Callable[[], S], warm_role: Callable[[S], None] | None = None) -> S:
        """``make()``'s scheduler, timed as the model load, then warmed (``warm``)."""
        scheduler = self.timed("model_load", make)
        self.warm(scheduler, warm_role)
        return scheduler

    def warm(self, scheduler: S, warm_role: Callable[[S], None] | None = None) -> None:
        """Before ready (in the scheduler's thread): with ``full``, compile every shape the
        scheduler can run (``schedulers.warm_up``) and whatever the role adds (``warm_role``);
        then one short request through the whole path, which also proves it works."""
        if self._warmup == "full":
            report = self.timed("forward_compile", lambda: warm_up(scheduler))
            log.info("compiled %d executables for %d forward shapes in %.1f s",
                     report.executables, len(report.shapes), report.seconds)
            if warm_role is not None:
                warm_role(scheduler)
        req = scheduler.make_request(
            "__warmup__", WARMUP_PROMPT, SamplingParams(max_new_tokens=2, temperature=0.0)
        )
        scheduler.add_request(req)
        self.timed("first_request", scheduler.run_until_idle)
        self._compiles_at_ready = sum(total_compiles())
        EXECUTABLES.mark_ready()
        self._cache_at_ready = compilation_cache.counts()
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.ready_seconds.items())
        log.info("ready after %s", phases)

    def stats(self) -> Stats:
        """``ready_seconds`` and the compile counters, for ``stats()``."""
        return {"ready_seconds": dict(self.ready_seconds), **self.compile_stats()}

    def compile_stats(self) -> dict[str, int]:
        compiled, loaded = total_compiles()
        at_ready = self._compiles_at_ready
        # Before ready every compile or load is the warm-up's; after, each made a request wait.
        cache = compilation_cache.counts()
        return {
            "compiles_total": compiled,
            "compiles_after_ready_total": (
                0 if at_ready is None else compiled + loaded - at_ready
            ),
            # The compilation cache (``executable_store``): executables loaded, not found,
            # written, and files that failed to load (removed and compiled afresh).
            "compilation_cache_writes_total": cache["writes"],
            "compilation_cache_corrupt_total": cache["corrupt"],
            "compilation_cache_write_errors_total": cache["write_errors"],
            # Executables loaded from the cache / compiled for want of an entry, and of those
            # the start-up's own.
            "compilation_cache_hits_total": cache["hits"],
            "compilation_cache_misses_total": cache["misses"],
            "compilation_cache_hits_before_ready": self._cache_at_ready.get("hits", 0),
            "compilation_cache_misses_before_ready": self._cache_at_ready.get("misses", 0),
        }
