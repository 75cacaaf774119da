"""CPU placement: pin a process to a set of cores (``--cpus``) and give it a CPU priority
(``--nice``) before JAX starts.

Fair PD-vs-colocated comparisons need P and D each on their own cores (DistServe's "equal
hardware"), and a pinned process shows what an operator sees when a worker shares a host. XLA's
CPU client sizes its thread pools from the schedulable CPUs (``sched_getaffinity``) when it is
created, so the affinity must be set before the first JAX call: ``pd-fsm serve`` does it first
thing, before the huge-page re-exec (affinity survives ``exec``).

Priority: P and D may share the same cores with D above P, so that a decode step
takes a core from a running prefill instead of waiting for it. Linux's nice is per thread and a
thread starts with its creator's, so the main thread's value, set before XLA starts its pools,
is the whole process's.

A role carries its priority (``--role-nice``): a worker that switches role at runtime moves every
thread still at the old role's value to the new role's, so a D that becomes P steps back behind
the Ds it shares cores with (the adaptive bench's second run lost to a merged worker that kept its
start-up priority; bench/RESULTS_adaptive.md).

Cores at runtime (``POST /set_cpus``, the planner's lever between P and D splitting the cores and
sharing them): affinity is per thread too, so every thread moves. A worker pinned before JAX
starts has pools sized to its cores, and widening them later buys no parallelism; one that may
be widened starts on every core (``--cpu-pools all``) and is pinned once its pools exist.

Pool threads (``--cpu-pools N``): XLA's idle pool threads spin while they wait for work, so a
step keeps more cores busy than it speeds up on (a batch-1 SmolLM2 decode step on two cores: 1.4
cores busy, 27 ms, against 25 ms on one), and a P sharing those cores gets only the rest. A
worker pinned to one core while its pools are made and then widened to two runs that step in 21
ms keeping 1.1 cores busy: its pools are sized by the first pin and its threads float over both.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("pd_fsm.io_trio.cluster.cpu_placement")

ROLE_NICE_ROLES = ("null", "prefill", "decode")  # the worker roles (flags.DISAGGREGATION_MODES)


def parse_cpus(spec: str, flag: str = "--cpus") -> frozenset[int]:
    """``"0"``, ``"0-3"``, ``"0,2,4-5"`` -> the set of ids (cores, or TPU chips: ``flag`` names
    the flag in the message); ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"{flag} {spec!r}: empty item")
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ValueError(f"{flag} {spec!r}: {part!r} is not an id or a range") from None
        if first < 0 or last < first:
            raise ValueError(f"{flag} {spec!r}: bad range {part!r}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def cpu_list(cpus: frozenset[int]) -> str:
    """The cores as ``--cpus`` and ``POST /set_cpus`` take them: ``"0,1"``."""
    return ",".join(map(str, sorted(cpus)))


def pin_to(cpus: frozenset[int]) -> frozenset[int]:
    """Restrict this process (and threads it starts later) to ``cpus``; returns the set now in
    force. A core this machine does not let us use is a ValueError, not a silent no-op."""
    check_cpus(cpus)
    os.sched_setaffinity(0, cpus)
    return frozenset(os.sched_getaffinity(0))


def pools_cores(cpus: frozenset[int], pools: str) -> frozenset[int] | None:
    """The cores to pin to before JAX starts so that XLA sizes its pools as ``--cpu-pools``
    says: ``cpus`` ("cpus"), none ("all": every core), the first N of ``cpus`` ("N")."""
    if pools == "all":
        return None
    return cpus if pools == "cpus" else frozenset(sorted(cpus)[:int(pools)])


def check_cpus(cpus: frozenset[int]) -> None:
    """ValueError naming the cores of ``cpus`` this process may not run on."""
    allowed = os.sched_getaffinity(0)
    missing = sorted(cpus - allowed)
    if missing:
        raise ValueError(f"--cpus: cores {missing} are not available here (have {sorted(allowed)})")


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


def parse_role_nice(spec: str) -> dict[str, int]:
    """``"prefill=10,decode=-5,null=0"`` -> {role: nice}; ValueError names what is wrong."""
    out: dict[str, int] = {}
    for part in spec.split(","):
        role, eq, value = (x.strip() for x in part.partition("="))
        if not eq or role not in ROLE_NICE_ROLES:
            raise ValueError(f"--role-nice {spec!r}: {part.strip()!r} is not ROLE=N with ROLE "
                             f"one of {', '.join(ROLE_NICE_ROLES)}")
        if role in out:
            raise ValueError(f"--role-nice {spec!r}: {role} is named twice")
        try:
            out[role] = int(value)
        except ValueError:
            raise ValueError(f"--role-nice {spec!r}: {value!r} is not an integer") from None
        if not -20 <= out[role] <= 19:
            raise ValueError(f"--role-nice {spec!r}: {role}={out[role]} is not in -20..19")
    return out


def renice_threads(old: int, new: int) -> int:
    """Move every thread of this process now at nice ``old`` to ``new`` (a role switch, with
    ``--role-nice``); returns how many moved. Linux's nice is per thread: XLA's pools, trio's
    worker threads and the main thread (whose value threads started later inherit) each move.
    A thread at another value keeps it: the KV transfer threads (``--transfer-nice``) are placed
    relative to compute on purpose. A value this process may not take is a ValueError."""
    moved = 0
    for entry in os.listdir("/proc/self/task"):
        tid = int(entry)
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != old:
                continue
            os.setpriority(os.PRIO_PROCESS, tid, new)
        except ProcessLookupError:  # the thread ended since the listing
            continue
        except PermissionError:
            raise ValueError(f"--role-nice: nice {new} not allowed here (a lower value needs "
                             "CAP_SYS_NICE or an RLIMIT_NICE that allows it)") from None
        moved += 1
    return moved


def may_take_nice(nice: int) -> bool:
    """Whether this process may set ``nice``: raising it is always allowed; lowering it needs
    root (CAP_SYS_NICE) or an RLIMIT_NICE whose ceiling, 20 - limit (setrlimit(2)), reaches it."""
    if nice >= os.getpriority(os.PRIO_PROCESS, 0) or os.geteuid() == 0:
        return True
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - soft <= nice


class ComputePriority:
    """A worker's compute priority, owned by its event loop: the nice value its compute threads
    are at (``/server_info``'s ``nice``), moved by a role switch (``--role-nice``) or by
    ``POST /set_nice`` (the planner's lever on shared cores)."""

    def __init__(self, nice: int) -> None:
        self.nice = nice  # set at start (worker/cli.py), before any thread

    def move_to(self, nice: int, why: str) -> int:
        """Every thread at the compute priority now to ``nice``; returns how many moved. A
        value this process may not take is a PermissionError, checked first: nothing moves."""
        if nice == self.nice:
            return 0
        if not may_take_nice(nice):
            raise PermissionError(f"nice {nice}: not allowed here (a lower value needs "
                                  "CAP_SYS_NICE or an RLIMIT_NICE that allows it)")
        moved = renice_threads(self.nice, nice)
        log.info("nice %d -> %d for %s (%d threads)", self.nice, nice, why, moved)
        self.nice = nice
        return moved


def pin_threads(cpus: frozenset[int]) -> int:
    """Move every thread of this process to ``cpus`` (threads started later inherit their
    creator's affinity); returns how many moved. A core outside this process's cgroup is an
    OSError from the kernel."""
    moved = 0
    for entry in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(entry), cpus)
        except ProcessLookupError:  # the thread ended since the listing
            continue
        moved += 1
    return moved


class CorePlacement:
    """A worker's cores, owned by its event loop: those its threads run on now
    (``/server_info``'s ``cpus``), and those it may be moved to — the affinity it had at start,
    before ``--cpus`` narrowed it."""

    def __init__(self, available: frozenset[int], cpus: frozenset[int]) -> None:
        self.available = available
        self.cpus = cpus

    def unavailable(self, cpus: frozenset[int]) -> list[int]:
        """The cores of ``cpus`` this worker may not be moved to."""
        return sorted(cpus - self.available)

    def move_to(self, cpus: frozenset[int], why: str) -> int:
        """Every thread to ``cpus``; returns how many moved. Cores it may not use are a
        ValueError naming them, checked first: nothing moves."""
        missing = self.unavailable(cpus)
        if not cpus or missing:
            raise ValueError(f"cores {missing or '[]'} are not available to this worker (it "
                             f"may use {cpu_list(self.available)})")
        moved = pin_threads(cpus)
        log.info("cores %s -> %s for %s (%d threads)", cpu_list(self.cpus), cpu_list(cpus), why,
                 moved)
        self.cpus = cpus
        return moved
