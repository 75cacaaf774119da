"""Failure paths between real processes: P killed mid-pull, a P that is gone before a pull
connects, a P that hangs mid-pull (its connection dropped), a uuid never registered, a layout
mismatch. Every wait has a deadline; the assertions on time are generous bounds on "failed by the
deadline" (or "before it": a pull's own deadline far past the bound), never performance
thresholds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import numpy as np
import pytest

from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest, PullResult
from tests.integration._procs import pools
from tests.integration._procs.client import PServer, stop

NAMES = ["main_kv"]
DEADLINE = 3.0
SLACK = 5.0
LONG = 60.0  # a pull deadline the tests below must never wait for
assert DEADLINE + SLACK < LONG


class DSide:
    def __init__(self) -> None:
        self.args = pools.kv_args(NAMES)
        self.holder = KVCacheHolder({n: pools.pool_jax(n, 5) for n in NAMES})
        self.engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
        self.executor = PullExecutor(self.engine, self.holder, self.args, deadline_s=DEADLINE)

    def result(self) -> PullResult:
        r = self.executor.get(timeout=DEADLINE + SLACK)
        assert r is not None, "no pull result by the deadline"
        return r

    def pull_ok(self, p: PServer, uuid: int, p_seed: int) -> None:
        p_pages, d_pages = [3, 4, 9], [20, 7, 8]
        p.call(op="register", uuid=uuid, pages=p_pages, lease_s=60)
        self.executor.submit(PullRequest(uuid, uuid, p.address, d_pages, p.layout_hash))
        r = self.result()
        assert r.ok, r.reason
        src = pools.pool_np("main_kv", p_seed)
        with self.holder.locked() as kv:
            got = [np.asarray(a) for a in kv["main_kv"]]
        for layer, g in enumerate(got):
            assert np.array_equal(g[d_pages], src[layer][p_pages])


@pytest.fixture(scope="module")
def d() -> Iterator[DSide]:
    side = DSide()
    yield side
    side.executor.close()
    side.engine.close()


def test_p_killed_mid_pull_fails_by_deadline_then_new_p_works(d: DSide) -> None:
    p1 = PServer(1, NAMES)
    try:
        # The pull is in flight (issued; P's server holds it waiting for the registration) when P
        # is SIGKILLed: deterministic, unlike racing a kill against a fast loopback transfer.
        d.executor.submit(PullRequest(1, 77, p1.address, [5, 6], p1.layout_hash))
        time.sleep(0.3)
        p1.kill()
        r = d.result()
        assert not r.ok
        assert r.seconds <= DEADLINE + SLACK
    finally:
        p1.kill()
    p2 = PServer(2, NAMES)
    try:
        d.pull_ok(p2, 78, p_seed=2)
    finally:
        p2.close()


def test_never_registered_and_layout_mismatch(d: DSide) -> None:
    p = PServer(3, NAMES)
    try:
        start = time.monotonic()
        d.executor.submit(PullRequest(2, 4242, p.address, [5, 6], p.layout_hash))
        r = d.result()
        assert not r.ok and "timeout" in r.reason, r.reason
        assert r.seconds >= DEADLINE - 0.5
        assert time.monotonic() - start <= DEADLINE + SLACK
        # The timed-out connection was retired: the next pull to the same P works.
        d.pull_ok(p, 4343, p_seed=3)

        # Layout mismatch: refused before pulling, so P's registration is left untouched...
        p.call(op="register", uuid=4444, pages=[1, 2], lease_s=60)
        d.executor.submit(PullRequest(3, 4444, p.address, [9, 10], "0" * 32))
        r = d.result()
        assert not r.ok and "layout mismatch" in r.reason and r.bytes == 0
        assert 4444 in p.call(op="status")["registrations"]
        # ...and still pullable with the right layout.
        d.executor.submit(PullRequest(4, 4444, p.address, [9, 10], p.layout_hash))
        r = d.result()
        assert r.ok, r.reason
    finally:
        p.close()


def test_a_pull_to_a_p_that_is_gone_fails_at_once_not_at_its_deadline(d: DSide) -> None:
    """P is SIGKILLed before D ever connects to it: the new connection's probe is refused
    (nothing listens there), so the pull fails at once, naming it, instead of waiting on the
    library's connect until its deadline."""
    p = PServer(4, NAMES)
    address = p.address
    p.kill()
    start = time.monotonic()
    d.executor.submit(PullRequest(5, 5151, address, [5, 6], p.layout_hash, deadline_s=LONG))
    r = d.result()
    assert not r.ok and "nothing listens" in r.reason, r.reason
    assert time.monotonic() - start <= DEADLINE + SLACK


def test_dropping_the_connection_ends_a_pull_blocked_on_a_hung_p(d: DSide) -> None:
    """P hangs (SIGSTOP) while D's pull from it is on the wire: the pull would wait until its
    deadline. ``drop_connection`` (the core's ForgetTransfer, once P is lost) poisons the
    connection with the pull on it: the pull fails now. P, resumed, serves a new pull on a
    fresh connection."""
    p = PServer(5, NAMES)
    try:
        d.pull_ok(p, 6161, p_seed=5)  # a connection to P, cached
        p.call(op="register", uuid=6262, pages=[3, 4], lease_s=60)
        stop(p.pid)
        try:
            d.executor.submit(PullRequest(6, 6262, p.address, [5, 6], p.layout_hash,
                                          deadline_s=LONG))
            give_up = time.monotonic() + SLACK
            while d.engine._conns[p.address].inflight == 0:  # the pull is on the wire
                assert time.monotonic() < give_up, "the pull never started"
                time.sleep(0.01)
            time.sleep(0.2)
            assert d.executor.get(timeout=0) is None  # blocked, as on a dead host
            dropped = time.monotonic()
            d.engine.drop_connection(p.address, "test: P lost")
            r = d.result()
            assert not r.ok, r
            assert time.monotonic() - dropped <= SLACK
        finally:
            os.kill(p.pid, signal.SIGCONT)
        d.pull_ok(p, 6363, p_seed=5)
    finally:
        p.close()
