"""CPU placement: pin a process to a set of cores (``--cpus``) and give it a CPU priority
(``--nice``) before JAX starts.

Fair PD-vs-colocated comparisons need P and D each on their own cores (DistServe's "equal
hardware"), and a pinned process shows what an operator sees when a worker shares a host. XLA's
CPU client sizes its thread pools from the schedulable CPUs (``sched_getaffinity``) when it is
created, so the affinity must be set before the first JAX call: ``pd-fsm serve`` does it first
thing, before the huge-page re-exec (affinity survives ``exec``).

Priority: P and D may share the same cores with D above P (issue 30 §3), so that a decode step
takes a core from a running prefill instead of waiting for it. Linux's nice is per thread and a
thread starts with its creator's, so the main thread's value, set before XLA starts its pools,
is the whole process's.
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


def set_nice(nice: int) -> int:
    """Give this thread, and every thread it starts later, the nice value ``nice`` (-20..19;
    lower runs first). Returns the value now in force. A value this process may not take (a
    negative one needs CAP_SYS_NICE or an RLIMIT_NICE that allows it) is a ValueError naming the
    flag, not a silent no-op."""
    if not -20 <= nice <= 19:
        raise ValueError(f"--nice {nice}: must be in -20..19")
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except PermissionError:
        raise ValueError(f"--nice {nice}: not allowed here (a negative value needs "
                         "CAP_SYS_NICE or an RLIMIT_NICE that allows it)") from None
    return os.getpriority(os.PRIO_PROCESS, 0)
