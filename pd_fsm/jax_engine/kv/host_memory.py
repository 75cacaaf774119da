"""Host heap policy for a worker process: large host buffers on transparent huge pages.

Why. On the CPU backend every pulled KV array, and every fresh XLA output, is new host memory from
glibc malloc. A block above malloc's mmap threshold (dynamic, at most 32 MiB) is mapped afresh on
every allocation and unmapped on free, so each use pays a page fault per 4 KiB page. Measured here
(2 vCPU, jax 0.10.2, THP in ``madvise`` mode): a jitted 256 MiB ``jnp.zeros`` took 50 ms, and
13.5 ms with ``glibc.malloc.hugetlb=1`` (malloc then asks for transparent huge pages on its
mappings: one fault per 2 MiB); a 256 MiB pull of our engine went from 1.4 to 2.3 GB/s
(bench/RESULTS_transfer.md).
On GPU and TPU the KV lives in device memory and this changes only host-side buffers.

Rejected alternative, measured: ``mallopt(M_MMAP_MAX, 0)`` with a high trim threshold (serve every
block from the heap and keep freed memory) was faster still (3.0 GB/s), but small long-lived
allocations carve the freed holes, so the next large block no longer fits: resident memory grew by
the block size on every register/release cycle (96 MiB per cycle, 12 cycles: 297 -> 1257 MiB),
where glibc's default and this policy stayed flat (201-209 MiB).

How. glibc reads its tunables once, at process start, from ``GLIBC_TUNABLES``. So
``pd-fsm serve`` (``--host-heap hugepages``, the default) re-executes itself once with the tunable
added when it is missing (:func:`reexec_with_hugepages`); ``--host-heap default`` opts out. Nothing
happens where the C library is not glibc 2.35+ or transparent huge pages are off (``[never]``).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

TUNABLE = "glibc.malloc.hugetlb=1"
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _is_glibc() -> bool:
    """glibc 2.35 or newer: the first with the ``glibc.malloc.hugetlb`` tunable."""
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()
        major, minor = (int(x) for x in version.split(".")[:2])
    except (ValueError, OSError, AttributeError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35)


def _thp_available() -> bool:
    try:
        return "[never]" not in _THP_ENABLED.read_text()
    except OSError:
        return False


def hugepage_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with the tunable added to ``GLIBC_TUNABLES``; None if it is already there."""
    current = env.get("GLIBC_TUNABLES", "")
    if TUNABLE in current.split(":"):
        return None
    return {**env, "GLIBC_TUNABLES": f"{current}:{TUNABLE}" if current else TUNABLE}


def hugepages_in_force() -> bool:
    """True if this process was started with the tunable (and it can take effect here)."""
    return _is_glibc() and _thp_available() and hugepage_env(os.environ) is None


def reexec_with_hugepages() -> None:
    """Re-execute this process with the tunable, unless it already has it or it cannot help.

    Call first thing in ``main``: the new image starts from the same command line and the same
    PID, with the same open descriptors.
    """
    if not (_is_glibc() and _thp_available()):
        log.info("host heap: huge pages not applied (not glibc 2.35+, or THP disabled)")
        return
    env = hugepage_env(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv[1:]], env)
