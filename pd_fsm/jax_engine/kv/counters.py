"""Counters bumped from several threads (the forward thread, pull threads, tracing), read by others.

``Counter[key] += 1`` is a read-modify-write: two threads can interleave and lose a count, and a
reader iterating the Counter while a new key is added raises. So the counts sit behind a lock and
readers get a copy (``snapshot``), never the live object.
"""

from __future__ import annotations

import threading
from collections import Counter


class SharedCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def bump(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def __getitem__(self, key: str) -> int:
        with self._lock:
            return self._counts[key]

    def snapshot(self) -> Counter[str]:
        """A copy, consistent at one instant."""
        with self._lock:
            return Counter(self._counts)


# How many times each KV copy function was traced, bumped from inside the traced Python
# functions, i.e. once per (re)compilation: tests read it to prove the compile count is bounded
# by the number of buckets. The copies of gather_scatter and pallas_copy both bump it; it lives
# here so that those two modules need not import each other.
TRACE_COUNTS = SharedCounter()
