"""A deadline heap with lazy deletion and lazy re-arming.

Each key has one authoritative deadline in ``_due``. The heap may hold stale entries; they are
skipped when popped. Extending a deadline (a heartbeat) pushes nothing: the old entry pops, sees
the later deadline and re-arms once. So a heartbeat costs a dict write, not a heap push, and the
heap holds about one entry per live key.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class DeadlineHeap(Generic[K]):
    __slots__ = ("_armed", "_due", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[float, K]] = []
        self._due: dict[K, float] = {}
        self._armed: dict[K, float] = {}  # earliest heap entry per key

    def __len__(self) -> int:
        return len(self._due)

    def set(self, key: K, when: float) -> None:
        self._due[key] = when
        armed = self._armed.get(key)
        if armed is None or when < armed:
            self._armed[key] = when
            heapq.heappush(self._heap, (when, key))

    def get(self, key: K) -> float | None:
        return self._due.get(key)

    def cancel(self, key: K) -> None:
        self._due.pop(key, None)
        self._armed.pop(key, None)

    def maybe_due(self, now: float) -> bool:
        """Cheap pre-check for the hot path: False means nothing is due (True may be stale)."""
        heap = self._heap
        return bool(heap) and heap[0][0] <= now

    def next_deadline(self) -> float | None:
        heap, due = self._heap, self._due
        while heap:
            when, key = heap[0]
            current = due.get(key)
            if current is None or self._armed.get(key) != when:
                heapq.heappop(heap)  # cancelled, or superseded by an earlier entry
                continue
            if current > when:  # extended since armed: re-arm at the real deadline
                heapq.heapreplace(heap, (current, key))
                self._armed[key] = current
                continue
            return when
        return None

    def pop_due(self, now: float) -> list[K]:
        """Keys whose deadline is <= now, earliest first; they are removed."""
        fired: list[K] = []
        while True:
            when = self.next_deadline()
            if when is None or when > now:
                return fired
            _, key = heapq.heappop(self._heap)
            del self._due[key]
            del self._armed[key]
            fired.append(key)
