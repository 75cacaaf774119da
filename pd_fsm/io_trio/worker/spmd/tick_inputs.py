"""What a PD scheduler reads besides its events, made the same on every rank of an instance that
spans processes: the clock and the random numbers.

A PD scheduler's decisions depend on ``self.clock()`` (leases, timers, the room's stamps) and,
on P, on random transfer uuids. Replaying rank 0's every clock read is impossible (a replica
must run the tick alongside rank 0, whose reads are not known until its tick has run), so every
rank reads one clock per tick: rank 0's ``time.monotonic()`` when the tick starts, sent in the
tick's frame. The core already judges time at that grain (P judges leases at a step's start).
What it costs: the phase histograms of such an instance have a tick's resolution.

The random numbers come from one ``random.Random`` reseeded at every tick from a key all ranks
share (drawn by rank 0 from the OS and broadcast once, over JAX's own collectives, at start) and
the tick's number: every rank draws the same uuids, and a listener who sees uuids learns
nothing of the next tick's, short of the key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random

KEY_BYTES = 32


def shared_key() -> bytes:
    """32 bytes from rank 0's OS random source, the same on every rank (a collective: every
    process of the instance calls it at the same point of its start-up)."""
    import numpy as np
    from jax.experimental import multihost_utils

    mine = np.frombuffer(os.urandom(KEY_BYTES), dtype=np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(mine)).astype(np.uint8))


class TickInputs:
    """The clock and random source a replicated PD scheduler is built with (``clock=``,
    ``rng=``); :meth:`start` sets both for a tick, on every rank alike."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"the tick key is {KEY_BYTES} bytes, got {len(key)}")
        self._key = key
        self.now = 0.0
        self.rng = random.Random(self._seed(0))

    def _seed(self, tick: int) -> bytes:
        return hmac.new(self._key, tick.to_bytes(8, "big"), hashlib.sha256).digest()

    def clock(self) -> float:
        return self.now

    def start(self, tick: int, now: float) -> None:
        self.now = now
        self.rng.seed(self._seed(tick))
