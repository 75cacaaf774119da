"""Host heap policy for a worker process: keep freed memory resident so that it is reused.

Why. On the CPU backend every pulled KV array, and every fresh XLA output, is new host memory from
glibc malloc. A block above malloc's mmap threshold (dynamic, at most 32 MiB) is mapped afresh on
every allocation and unmapped on free, so each use pays a page fault per 4 KiB page and the kernel
zeroing that page. Measured here (2 vCPU, jax 0.10.2): a jitted 256 MiB ``jnp.zeros`` took 50 ms,
and 9 ms once freed memory is kept; D's CPU time for a 256 MiB pull fell from ~200 ms to ~80 ms
(bench/RESULTS_transfer.md). On GPU and TPU the KV lives in device memory and this changes only
host-side buffers.

What. ``mallopt(M_MMAP_MAX, 0)`` serves every block from the heap, and ``M_TRIM_THRESHOLD`` keeps up
to ``keep_bytes`` of free memory at the top of the heap instead of handing it back to the kernel.

Cost. It is process-wide and should run before the process makes large allocations. Resident
memory stays at the working set plus up to ``keep_bytes``; free blocks in the middle of the heap
are reused but never returned to the kernel (a fragmented heap keeps its high-water mark). A
long-lived server with a preallocated KV pool and same-sized transient buffers is the case it fits;
``pd-fsm serve --host-heap default`` opts out.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

DEFAULT_KEEP_BYTES = 1 << 30

# glibc's mallopt parameter numbers (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

_applied: int | None = None  # keep_bytes of the call that took effect


def _glibc() -> ctypes.CDLL | None:
    libc = ctypes.CDLL(None)
    try:
        libc.gnu_get_libc_version  # noqa: B018 - probing: only glibc has it
        libc.mallopt  # noqa: B018
    except AttributeError:
        return None
    return libc


def retain_freed_host_memory(keep_bytes: int = DEFAULT_KEEP_BYTES) -> bool:
    """Apply the policy above to this process; True if it is in force (now or from an earlier call).

    False where the C library is not glibc (musl, macOS): nothing is changed there.
    """
    global _applied
    if keep_bytes < 0:
        raise ValueError("keep_bytes must be >= 0")
    if _applied is not None:
        return True
    libc = _glibc()
    if libc is None:
        log.info("host heap policy not applied: the C library is not glibc")
        return False
    # mallopt's value is a C int; a trim threshold above 2 GiB - 1 cannot be expressed.
    trim = min(keep_bytes, (1 << 31) - 1)
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, trim)):
        log.warning("host heap policy: mallopt refused")
        return False
    _applied = trim
    log.info("host heap: large blocks from the heap, up to %d MiB of free memory kept", trim >> 20)
    return True
