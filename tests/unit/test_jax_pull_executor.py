"""The pull executor and engine inside one process (two transfer servers); the cross-process cases
are in tests/integration/test_transfer_*.py."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.kv.checksum import kv_checksums
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool import KVPoolConfig
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec
from pd_fsm.jax_engine.kv.room import gather_room
from pd_fsm.jax_engine.transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.base import PendingPull
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest, PullResult
from tests.support.fake_engine import FakeEngine

CFG = KVPoolConfig(num_layers=2, num_pages=16, page_size=2, num_kv_heads=1, head_dim=4)
ARGS = KVArgs([PoolTransferSpec.from_config("main_kv", CFG)])


def _pool(seed: int) -> list[jax.Array]:
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(CFG.layer_shape).astype(np.float32))
            for _ in range(CFG.num_layers)]


def _p_and_d(p_seed: int, d_seed: int) -> tuple[JaxTransferKVEngine, JaxTransferKVEngine,
                                                KVCacheHolder, KVCacheHolder, list[np.ndarray]]:
    """P's and D's transfer engines and pools (one process), and D's pool as it starts."""
    d_holder = KVCacheHolder({"main_kv": _pool(d_seed)})
    with d_holder.locked() as kv:
        before = [np.asarray(a).copy() for a in kv["main_kv"]]
    return (JaxTransferKVEngine(reaper_interval_s=None), JaxTransferKVEngine(
        reaper_interval_s=None), KVCacheHolder({"main_kv": _pool(p_seed)}), d_holder, before)


def _executor(engine: JaxTransferKVEngine, holder: KVCacheHolder
              ) -> tuple[PullExecutor, threading.Semaphore]:
    """An executor on ``engine``, and a semaphore released as each job finishes."""
    arrived = threading.Semaphore(0)
    return PullExecutor(engine, holder, ARGS, deadline_s=10,
                        on_result=lambda room: arrived.release()), arrived


def _no_pull(deadline_s: float) -> PendingPull:
    raise AssertionError("must not pull")


def test_refusals_happen_before_any_pull() -> None:
    engine = FakeEngine(_no_pull)
    seen: list[PullResult] = []
    ex = PullExecutor(engine, KVCacheHolder({"main_kv": _pool(0)}), ARGS, on_result=seen.append)
    ex.submit(PullRequest(1, 5, "peer", [1, 2], "bad-hash"))
    ex.submit(PullRequest(2, 6, "peer", [0, 1], ARGS.layout_hash))  # null page as destination
    results = {r.room: r for r in (ex.get(5), ex.get(5))}
    ex.close()
    assert "layout mismatch" in results[1].reason and not results[1].ok
    assert "bad destination pages" in results[2].reason and not results[2].ok
    assert all(r.pull_seconds == r.scatter_seconds == 0 for r in results.values())
    assert engine.pulls == 0
    assert len(seen) == 2 and ex.poll() == []


def test_in_process_pull_scatter_and_verified_release() -> None:
    p_engine = JaxTransferKVEngine(reaper_interval_s=None)
    d_engine = JaxTransferKVEngine(reaper_interval_s=None)
    p_holder = KVCacheHolder({"main_kv": _pool(1)})
    d_holder = KVCacheHolder({"main_kv": _pool(2)})
    done = threading.Event()
    ex = PullExecutor(d_engine, d_holder, ARGS, deadline_s=10, on_result=lambda r: done.set())
    p_pages, d_pages = [2, 3, 4, 9], [15, 1, 2, 7]
    arrays = gather_room(p_holder, ARGS, p_pages)
    p_engine.register(7, arrays, lease_s=30)
    ex.submit(PullRequest(70, 7, p_engine.address, d_pages, ARGS.layout_hash))
    assert done.wait(15)
    (r,) = ex.poll()
    assert r.ok and r.bytes == ARGS.packed_nbytes(4), r
    # Where the job's time went (the phase histograms): parts of the whole, in order.
    assert 0 < r.transfer_seconds <= r.pull_seconds <= r.seconds
    assert 0 < r.scatter_seconds <= r.seconds - r.pull_seconds
    with p_holder.locked() as kv:
        src = [np.asarray(a) for a in kv["main_kv"]]
    with d_holder.locked() as kv:
        got = [np.asarray(a) for a in kv["main_kv"]]
    for layer in range(CFG.num_layers):
        assert np.array_equal(got[layer][d_pages], src[layer][p_pages])
    rel = p_engine.release(7, "done")
    assert rel.released and rel.verified and p_engine.registrations() == {}
    assert not p_engine.release(7, "done again").released  # idempotent
    ex.close()
    p_engine.close()
    d_engine.close()


def test_a_pull_that_fails_its_checksums_is_reported_and_never_scattered() -> None:
    """READY's checksums (``PullRequest.kv_checksums``): the pulled arrays are checked on the
    pull thread; KV that differs is reported as a mismatch naming the array and leaves D's pages
    as they were, KV that matches is scattered; a count that does not describe the registration
    is refused before any pull."""
    p_engine, d_engine, p_holder, d_holder, before = _p_and_d(5, 6)
    ex, arrived = _executor(d_engine, d_holder)
    arrays = gather_room(p_holder, ARGS, [5, 6])
    (good,) = kv_checksums(arrays)
    for uuid in (10, 11):  # two registrations of the same arrays: P's with its spare
        p_engine.register(uuid, arrays, lease_s=30)
    ex.submit(PullRequest(100, 10, p_engine.address, [1, 2], ARGS.layout_hash,
                          kv_checksums=(good ^ 1,)))
    ex.submit(PullRequest(101, 11, p_engine.address, [3, 4], ARGS.layout_hash,
                          kv_checksums=(good, good)))  # two sums for one registered array
    assert arrived.acquire(timeout=15) and arrived.acquire(timeout=15)
    results = {r.room: r for r in ex.poll()}
    bad, miscounted = results[100], results[101]
    assert not bad.ok and bad.checksum_mismatch and bad.bytes == 0
    assert bad.reason == (f"KV checksum mismatch: array 0 (main_kv, shard 0) sums to "
                          f"{good:#010x} here, {good ^ 1:#010x} on P")
    assert not miscounted.ok and not miscounted.checksum_mismatch
    assert "READY carries 2 KV checksums for 1 registered arrays; not pulled" in miscounted.reason
    with d_holder.locked() as kv:
        assert all(np.array_equal(np.asarray(a), b) for a, b in zip(kv["main_kv"], before,
                                                                    strict=True))
    ex.submit(PullRequest(102, 11, p_engine.address, [3, 4], ARGS.layout_hash,
                          kv_checksums=(good,)))
    assert arrived.acquire(timeout=15)
    (ok,) = ex.poll()
    assert ok.ok and not ok.checksum_mismatch, ok
    with d_holder.locked() as kv:
        assert np.array_equal(np.asarray(kv["main_kv"][0])[[3, 4]],
                              np.asarray(arrays[0])[0, :2])
    ex.close()
    p_engine.close()
    d_engine.close()


def test_lease_extension_and_reap() -> None:
    now = [100.0]
    engine = JaxTransferKVEngine(reaper_interval_s=None, clock=lambda: now[0])
    engine.register(1, [jnp.ones(4)], lease_s=5)
    engine.register(2, [jnp.ones(4)], lease_s=5)
    now[0] = 103.0
    assert engine.extend_lease(1, 20)
    assert engine.extend_lease(1, 1)  # never shortens
    now[0] = 106.0
    (r,) = engine.reap_expired()
    assert r.uuid == 2 and r.verified
    now[0] = 122.0
    assert engine.reap_expired() == []
    now[0] = 124.0
    assert [r.uuid for r in engine.reap_expired()] == [1]
    assert not engine.extend_lease(1, 5)
    engine.close()


def test_a_gate_collects_only_its_rooms_and_fails_what_another_rank_lost() -> None:
    """An instance spanning processes (``DecodeRole.set_pull_gate``): finished pulls wait
    (``ready``) until the gate names them; a room another rank failed is failed here too with
    that rank's reason, its pulled KV dropped, not scattered."""
    p_engine, d_engine, p_holder, d_holder, untouched = _p_and_d(3, 4)
    ex, arrived = _executor(d_engine, d_holder)
    for uuid, room, d_pages in ((8, 80, [1, 2]), (9, 90, [3, 4])):
        p_engine.register(uuid, gather_room(p_holder, ARGS, [5, 6]), lease_s=30)
        ex.submit(PullRequest(room, uuid, p_engine.address, d_pages, ARGS.layout_hash))
    assert arrived.acquire(timeout=15) and arrived.acquire(timeout=15)
    assert ex.ready() == {80: "", 90: ""}
    assert ex.poll({}) == [] and ex.inflight == 2  # nothing named: nothing collected
    (lost,) = ex.poll({90: "rank 1: timeout after 60s"})
    assert (lost.room, lost.ok, lost.reason) == (90, False, "rank 1: timeout after 60s")
    (kept,) = ex.poll({80: ""})
    assert kept.ok and ex.ready() == {} and ex.inflight == 0
    with p_holder.locked() as kv:
        src = [np.asarray(a) for a in kv["main_kv"]]
    with d_holder.locked() as kv:
        got = [np.asarray(a) for a in kv["main_kv"]]
    for layer in range(CFG.num_layers):
        assert np.array_equal(got[layer][[1, 2]], src[layer][[5, 6]])  # room 80 scattered
        assert np.array_equal(got[layer][[3, 4]], untouched[layer][[3, 4]])  # 90's dropped
    ex.close()
    for uuid in (8, 9):
        p_engine.release(uuid, "done")
    p_engine.close()
    d_engine.close()


def test_a_cancelled_rooms_kv_is_dropped_not_scattered() -> None:
    """``cancel``: the room failed while its pull ran, and its pages may be another room's
    now. KV that had arrived is dropped (reported ``cancelled`` and ``dropped``, the pages as
    they were); a pull of another room collected with it is scattered as usual."""
    p_engine, d_engine, p_holder, d_holder, before = _p_and_d(7, 8)
    ex, arrived = _executor(d_engine, d_holder)
    for uuid, room, d_pages in ((12, 120, [1, 2]), (13, 130, [3, 4])):
        p_engine.register(uuid, gather_room(p_holder, ARGS, [5, 6]), lease_s=30)
        ex.submit(PullRequest(room, uuid, p_engine.address, d_pages, ARGS.layout_hash))
    assert arrived.acquire(timeout=15) and arrived.acquire(timeout=15)
    assert ex.cancel(120) == 1 and ex.cancel(999) == 0
    assert ex.inflight == 2 and ex.cancelled_inflight == 1
    results = {r.room: r for r in ex.poll()}
    gone, kept = results[120], results[130]
    assert (gone.ok, gone.cancelled, gone.dropped, gone.bytes) == (False, True, True, 0)
    assert "dropped, not scattered" in gone.reason
    assert kept.ok and not kept.cancelled
    assert ex.inflight == ex.cancelled_inflight == 0
    with p_holder.locked() as kv:
        src = [np.asarray(a) for a in kv["main_kv"]]
    with d_holder.locked() as kv:
        got = [np.asarray(a) for a in kv["main_kv"]]
    for layer in range(CFG.num_layers):
        assert np.array_equal(got[layer][[1, 2]], before[layer][[1, 2]])  # 120's dropped
        assert np.array_equal(got[layer][[3, 4]], src[layer][[5, 6]])  # 130 scattered
    ex.close()
    for uuid in (12, 13):
        p_engine.release(uuid, "done")
    p_engine.close()
    d_engine.close()


class _Hung(PendingPull):
    """A pull blocked until ``release`` is set (a dead P's), failing then."""

    def __init__(self, release: threading.Event, deadline_s: float) -> None:
        self.peer, self.uuid, self.arrays = "peer", 0, []
        self._release, self._deadline_s = release, deadline_s

    def wait(self) -> None:
        from pd_fsm.jax_engine.transfer.base import PullError

        if not self._release.wait(self._deadline_s):
            raise PullError("timeout")
        raise PullError("connection poisoned")


def test_a_cancelled_job_still_queued_never_pulls() -> None:
    """One pull thread, blocked on a hung pull; the room queued behind it is cancelled (its
    P died too): when the thread frees up, the job reports cancelled without pulling (no
    connection opened to a P that is gone). The hung one, cancelled as well, reports when
    its pull ends (here: when the test lets it fail, as a dropped connection does)."""
    release = threading.Event()
    started = threading.Event()

    def hung(deadline_s: float) -> PendingPull:
        started.set()
        return _Hung(release, deadline_s)

    engine = FakeEngine(hung)
    ex = PullExecutor(engine, KVCacheHolder({"main_kv": _pool(9)}), ARGS, max_workers=1,
                      deadline_s=30)
    ex.submit(PullRequest(1, 5, "peer", [1, 2], ARGS.layout_hash))
    assert started.wait(15)
    ex.submit(PullRequest(2, 6, "peer", [3, 4], ARGS.layout_hash))
    assert ex.cancel(2) == 1 and ex.cancel(1) == 1
    release.set()
    results = {r.room: r for r in (ex.get(15), ex.get(15))}  # type: ignore[union-attr]
    ex.close()
    assert engine.pulls == 1
    assert results[2].cancelled and "cancelled before it started" in results[2].reason
    assert results[1].cancelled and not results[1].dropped
    assert "connection poisoned" in results[1].reason
    assert ex.inflight == 0
