"""The data plane ahead of compute: the transfer server's socket threads at a higher CPU priority.

Why: under load P and D compute on every core (XLA's intra-op threads plus its execution
threads), and the threads that move a room's KV — ``jax.experimental.transfer``'s
``send-thread`` / ``recv-thread``, one pair per server and one per connection — wait for a core
behind them at equal priority. bench/RESULTS_pulls.md: a 5-20 ms pull alone took up to 94-188 ms
(p99) with 6-16 requests in flight. Linux's nice is per thread, so only those threads are
raised; compute keeps its priority. XLA names its compute pool ``tf_XLAEigen`` but leaves its
execution threads unnamed, so lowering compute instead is not possible by name.

D's pull threads, which poll the transfer for its end, are raised the same way
(``raise_this_thread``, their pool's initializer): measured with bench/bench_pull_priority.py,
a 16 MiB pull while both processes compute took 3.4-3.6x its time alone with every thread at
nice 0, 2.3x with the transfer threads raised, 1.75x with the pull thread raised too.

Raising a priority (a negative nice) needs CAP_SYS_NICE or an ``RLIMIT_NICE`` that allows it;
without either the first attempt is refused, logged once, and the threads keep their priority.
Threads appear with each new connection, so the owner calls ``apply`` periodically; a thread is
reniced once (its id remembered).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

DATA_PLANE_THREADS = frozenset({"send-thread", "recv-thread"})
_TASKS = Path("/proc/self/task")


def raise_this_thread(nice: int) -> bool:
    """Give the calling thread ``nice`` (< 0 raises it; 0 does nothing): for threads that wait on
    the data plane, such as D's pull threads, which poll the transfer and would otherwise wait for
    a core behind compute to see it done. Returns whether it was applied; a refusal is logged."""
    if nice == 0:
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (PermissionError, AttributeError) as exc:  # not allowed, or not Linux
        log.info("pull thread keeps its priority: %s", exc)
        return False
    return True


class DataPlanePriority:
    """Give this process's transfer threads the nice value ``nice`` (-20..0; 0: leave them)."""

    def __init__(self, nice: int) -> None:
        if not -20 <= nice <= 0:
            raise ValueError(f"transfer thread nice must be in -20..0, got {nice}")
        self.nice = nice
        self.raised = 0  # threads given ``nice`` so far
        self.refused: str | None = None  # why raising is not possible here (then never retried)
        self._seen: set[int] = set()

    def apply(self) -> int:
        """Renice data-plane threads not seen before; returns how many were raised now. Cheap:
        one directory listing, one small read per new thread."""
        if self.nice == 0 or self.refused is not None:
            return 0
        try:
            tids = [int(name) for name in os.listdir(_TASKS)]
        except OSError:  # no /proc: not Linux
            self.refused = "no /proc/self/task"
            return 0
        raised = 0
        for tid in tids:
            if tid in self._seen:
                continue
            self._seen.add(tid)
            try:
                name = (_TASKS / str(tid) / "comm").read_text().strip()
            except OSError:  # the thread ended meanwhile
                continue
            if name not in DATA_PLANE_THREADS:
                continue
            try:
                os.setpriority(os.PRIO_PROCESS, tid, self.nice)
            except PermissionError as exc:
                self.refused = f"{exc} (needs CAP_SYS_NICE or RLIMIT_NICE)"
                log.info("transfer threads keep their priority: %s", self.refused)
                return raised
            except OSError:  # the thread ended meanwhile
                continue
            raised += 1
        self._seen &= set(tids)  # forget ended threads: ids are reused
        self.raised += raised
        return raised

    def as_dict(self) -> dict[str, object]:
        return {"nice": self.nice, "raised_total": self.raised, "refused": self.refused}
