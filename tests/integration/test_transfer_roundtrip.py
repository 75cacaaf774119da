"""P -> D round trip between two real processes: several rooms at once, two pools of different
dtypes (float32, bfloat16), destination pages fragmented differently from the source."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest
from tests.integration._procs import pools
from tests.integration._procs.client import PServer

P_SEED, D_SEED = 11, 99
NAMES = ["main_kv", "draft_kv"]
D_PAGES = {"main_kv": 64, "draft_kv": 33}  # D sizes its pools independently of P


@pytest.fixture
def p_server() -> Iterator[PServer]:
    p = PServer(P_SEED, NAMES)
    try:
        yield p
    finally:
        p.close()


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint8)


def test_bit_exact_round_trip_several_rooms(p_server: PServer) -> None:
    rng = np.random.default_rng(0)
    args = pools.kv_args(NAMES)
    assert p_server.layout_hash == args.layout_hash

    src = {n: pools.pool_np(n, P_SEED) for n in NAMES}
    expected = {n: [a.copy() for a in pools.pool_np(n, D_SEED, D_PAGES[n])] for n in NAMES}
    holder = KVCacheHolder({n: pools.pool_jax(n, D_SEED, D_PAGES[n]) for n in NAMES})
    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    executor = PullExecutor(engine, holder, args, max_workers=3, deadline_s=30)

    # P: mostly-contiguous runs (LIFO allocator style); D: shuffled singletons and short runs.
    p_free = {n: list(range(1, pools.POOLS[n]["num_pages"])) for n in NAMES}
    d_free = {n: list(rng.permutation(np.arange(1, D_PAGES[n]))) for n in NAMES}
    rooms = []
    for room, n_pages in enumerate([3, 5, 7, 9]):
        p_pages = {n: [int(x) for x in p_free[n][:n_pages]] for n in NAMES}
        d_pages = {n: [int(x) for x in d_free[n][:n_pages]] for n in NAMES}
        for n in NAMES:
            del p_free[n][:n_pages]
            del d_free[n][:n_pages]
        uuid = 1000 + room
        reply = p_server.call(op="register", uuid=uuid, pages=p_pages, lease_s=60)
        rooms.append((room, uuid, p_pages, d_pages, reply["nbytes"]))

    for room, uuid, _, d_pages, _ in rooms:
        executor.submit(PullRequest(room, uuid, p_server.address, d_pages, args.layout_hash))
    results = {}
    for _ in rooms:
        r = executor.get(timeout=60)
        assert r is not None, "pull result not delivered in time"
        results[r.room] = r
    for room, uuid, p_pages, d_pages, nbytes in rooms:
        r = results[room]
        assert r.ok, r.reason
        assert (r.uuid, r.bytes) == (uuid, nbytes)
        for n in NAMES:
            for layer in range(len(expected[n])):
                expected[n][layer][d_pages[n]] = src[n][layer][p_pages[n]]

    with holder.locked() as kv:
        got = {n: [np.asarray(a) for a in kv[n]] for n in NAMES}
    for n in NAMES:
        for layer, want in enumerate(expected[n]):
            assert got[n][layer].dtype == want.dtype
            assert np.array_equal(_bits(got[n][layer]), _bits(want)), (n, layer)

    # P releases on DONE: each release verified gone from its transfer server.
    for _, uuid, _, _, _ in rooms:
        rel = p_server.call(op="release", uuid=uuid)
        assert rel["released"] and rel["verified"], rel
    assert p_server.call(op="status")["registrations"] == []
    executor.close()
    engine.close()
