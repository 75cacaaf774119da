"""The host heap policy: started with the tunable, a large block costs one fault per huge page.

Counted, not timed: minor page faults (``ru_minflt``) while malloc'ing and touching a 64 MiB block,
in a fresh interpreter started with or without ``GLIBC_TUNABLES`` (glibc reads it at start-up).
The re-exec that ``pd-fsm serve`` does is checked on a real worker in test_serve_worker.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pd_fsm.jax_engine.kv import host_memory

_PROBE = """
import ctypes, resource
from pd_fsm.jax_engine.kv.host_memory import hugepages_in_force
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
n = 64 << 20
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
p = libc.malloc(n)            # what XLA's CPU allocator does for a buffer: malloc, then write it
ctypes.memset(p, 1, n)
print(hugepages_in_force(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

PAGES = (64 << 20) // 4096


def _probe(hugepages: bool) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if hugepages:
        env = host_memory.hugepage_env(env) or env
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True,
        env=env,
    )
    in_force, faults = out.stdout.split()
    return in_force == "True", int(faults)


@pytest.mark.skipif(
    not (host_memory._is_glibc() and host_memory._thp_available()),
    reason="needs glibc and transparent huge pages",
)
def test_hugepage_tunable_cuts_page_faults() -> None:
    (off, default), (on, huge) = _probe(False), _probe(True)
    assert (off, on) == (False, True)
    assert default > PAGES // 2, default  # one fault per 4 KiB page
    assert huge < default // 4, huge  # one per 2 MiB page (measured 544 against 16,386)


def test_hugepage_env_adds_the_tunable_once() -> None:
    assert host_memory.hugepage_env({}) == {"GLIBC_TUNABLES": host_memory.TUNABLE}
    other = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"}
    assert host_memory.hugepage_env(other) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{host_memory.TUNABLE}", "X": "1",
    }
    assert host_memory.hugepage_env({"GLIBC_TUNABLES": host_memory.TUNABLE}) is None
