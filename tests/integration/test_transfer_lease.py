"""A registration D never pulls is released by P's lease reaper, and the memory really returns:
measured as the serving process's VmRSS (/proc/PID/status), which stays up if the release does not
happen (the transfer server keeps never-pulled buffers alive; shared/JAX_TRANSFER.md). Both with
glibc's default heap and as workers run by default (huge pages,
pd_fsm.jax_engine.kv.host_memory)."""

from __future__ import annotations

import time

import pytest

from tests.integration._procs.client import PServer

MIB = 96
HALF_KIB = (MIB // 2) << 10


def _wait_released(p: PServer, uuid: int) -> None:
    deadline = time.monotonic() + 15
    status = p.call(op="status")
    # The reaper drops the registration first, then verifies and reports the release.
    while (status["registrations"] or not status["released"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        status = p.call(op="status")
    assert status["registrations"] == [], "lease never expired"
    released = status["released"][-1]
    assert released["uuid"] == uuid and released["verified"], released
    assert "lease expired" in released["reason"]


@pytest.mark.parametrize("host_heap", ["default", "hugepages"])
def test_unpulled_registration_released_on_lease_expiry(host_heap: str) -> None:
    p = PServer(4, ["main_kv"], host_heap=host_heap)
    try:
        base = p.rss_kib()
        reply = p.call(op="register_big", uuid=31337, mib=MIB, lease_s=1.5)
        held = p.rss_kib()
        assert reply["ok"]
        # The registration (Python reference already dropped) holds the memory.
        assert held - base >= HALF_KIB, (base, held)
        _wait_released(p, 31337)
        # The runtime frees device buffers asynchronously: give the memory a deadline to return.
        after = p.rss_kib()
        deadline = time.monotonic() + 10
        while held - after < HALF_KIB and time.monotonic() < deadline:
            time.sleep(0.2)
            after = p.rss_kib()
        assert held - after >= HALF_KIB, (base, held, after)
    finally:
        p.close()
