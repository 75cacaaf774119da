"""Where a PD room's time goes, as the role that holds it sees it.

Each room carries stamps (``clock`` times) of the boundaries it passed; ``lap`` turns two stamps
into a ``(phase key, seconds)`` sample, queued for the worker to take with ``take`` after the step
(pd_fsm/io_trio/phases.py names every phase).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

# Phase samples kept until the worker takes them (a scheduler driven without a worker drops the
# oldest).
PHASE_SAMPLES_MAX = 4096


class PhaseRecorder:
    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        # bootstrap_room -> boundary name -> clock() time, while the room is live here.
        self.stamps: dict[int, dict[str, float]] = {}
        self._samples: deque[tuple[str, float]] = deque(maxlen=PHASE_SAMPLES_MAX)

    def take(self) -> list[tuple[str, float]]:
        """``(phase key, value)`` samples since the last call."""
        out = list(self._samples)
        self._samples.clear()
        return out

    def sample(self, phase: str, value: float) -> None:
        self._samples.append((phase, value))

    def lap(self, room: int, phase: str, since: str, mark: str) -> None:
        """Stamp ``room`` with ``mark`` now and record ``phase`` = now - its ``since`` stamp;
        once per room (a room already stamped ``mark`` is left as it is)."""
        stamps = self.stamps.get(room)
        if stamps is None or mark in stamps:
            return
        now = stamps[mark] = self.clock()
        start = stamps.get(since)
        if start is not None:
            self.sample(phase, max(0.0, now - start))
