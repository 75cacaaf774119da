"""CPU placement: pin a process to a set of cores before JAX starts (``--cpus``).

Fair PD-vs-colocated comparisons need P and D each on their own cores (DistServe's "equal
hardware"), and a pinned process shows what an operator sees when a worker shares a host. XLA's
CPU client sizes its thread pools from the schedulable CPUs (``sched_getaffinity``) when it is
created, so the affinity must be set before the first JAX call: ``pd-fsm serve`` does it first
thing, before the huge-page re-exec (affinity survives ``exec``).
"""

from __future__ import annotations

import os


def parse_cpus(spec: str) -> frozenset[int]:
    """``"0"``, ``"0-3"``, ``"0,2,4-5"`` -> the set of core ids; ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"--cpus {spec!r}: empty item")
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"--cpus {spec!r}: {part!r} is not a core id or a range") from None
        if first < 0 or last < first:
            raise ValueError(f"--cpus {spec!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def pin_to(cpus: frozenset[int]) -> frozenset[int]:
    """Restrict this process (and threads it starts later) to ``cpus``; returns the set now in
    force. A core this machine does not let us use is a ValueError, not a silent no-op."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(cpus - allowed)
    if missing:
        raise ValueError(f"--cpus: cores {missing} are not available here (have {sorted(allowed)})")
    os.sched_setaffinity(0, cpus)
    return frozenset(os.sched_getaffinity(0))
