"""The host heap policy: with it, a freed large block is reused without page faults.

Counted, not timed: minor page faults (``ru_minflt``) while touching a fresh 64 MiB block after an
earlier one of the same size was freed. Each case runs in its own interpreter because the policy is
process-wide and one-way.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from pd_fsm.jax_engine import host_memory

_PROBE = """
import ctypes, resource, sys
from pd_fsm.jax_engine.host_memory import retain_freed_host_memory
if sys.argv[1] == "retain":
    assert retain_freed_host_memory()
    assert retain_freed_host_memory()  # idempotent
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
n = 64 << 20
def touch():  # what XLA's CPU allocator does for a buffer: malloc, then write every page
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
libc.free(touch())                      # first use: the heap grows (faults either way)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = touch()                             # same size again: reused, or mapped afresh?
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

PAGES = (64 << 20) // 4096


def _faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(host_memory._glibc() is None, reason="the policy needs glibc")
def test_retained_heap_reuses_a_freed_block_without_faulting() -> None:
    default, retained = _faults("default"), _faults("retain")
    # glibc's default maps a 64 MiB block afresh (one fault per page); retained, it is reused.
    assert default > PAGES // 2, default
    assert retained < PAGES // 20, retained


def test_negative_keep_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="keep_bytes"):
        host_memory.retain_freed_host_memory(-1)
