"""``pd-fsm profile``: measure the real engine for the performance model (``cli.py`` says what
it measures): the scheduler's steps on a CPU (``engine_timer.py``), the fused step on an
accelerator (``step_timer.py``), and the KV path's legs per room (``kv_legs.py``, also run by
``bench/bench_kv_legs.py``)."""

from pd_fsm.sim.profiler.cli import add_parser, main
from pd_fsm.sim.profiler.engine_timer import EngineTimer

__all__ = ["EngineTimer", "add_parser", "main"]
