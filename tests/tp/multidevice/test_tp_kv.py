"""A tensor-parallel pool's KV copies and the wire between different tp sizes: gather and
scatter (XLA and the Pallas kernel per shard) on a pool sharded on its kv-head axis, the cut into
per-shard arrays and the regroup for every pair of tp sizes, and a real
``jax.experimental.transfer`` pull of P's shards onto D's devices."""

from __future__ import annotations

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.kv import tiered
from pd_fsm.jax_engine.kv.checksum import kv_checksums
from pd_fsm.jax_engine.kv.gather_scatter import insert_kv_chunks, select_from_kv_caches
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool import KVPoolConfig, allocate_kv_pool
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec
from pd_fsm.jax_engine.parallel.tensor_parallel import (
    PACKED_KV_AXIS,
    packed_sharding,
    pool_sharding,
    regroup,
    shard_structs,
    split_shards,
)
from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest

CFG = KVPoolConfig(num_layers=2, num_pages=24, page_size=4, num_kv_heads=4, head_dim=8)
PAGES = [5, 6, 7, 12, 3, 20]
SIZES = (1, 2, 4)


def _pool(tp: int, seed: int) -> tuple[list[jax.Array], np.ndarray]:
    values = np.random.default_rng(seed).standard_normal(
        (CFG.num_layers, *CFG.layer_shape)).astype(np.float32)
    sharding = pool_sharding(tp)
    return [jax.device_put(v, sharding) for v in values], values


@pytest.mark.parametrize("tp", [2, 4])
def test_gather_every_way_on_sharded_pool(tp: int) -> None:
    kv, values = _pool(tp, 0)
    want = values[:, PAGES]
    quick = tiered.gather(kv, PAGES)
    assert tiered.KV_COPIES.wait_idle(120)
    runs = tiered.gather(kv, PAGES)
    direct = select_from_kv_caches(kv, PAGES)
    quick_only = tiered.gather(kv, PAGES, run_tier=False)  # P's take on a TPU
    pallas = select_from_kv_caches(kv, PAGES, method="pallas")  # per shard, interpreted here
    for got in (quick, runs, direct, quick_only, pallas):
        np.testing.assert_array_equal(np.asarray(got)[:, : len(PAGES)], want)
        assert got.sharding.is_equivalent_to(packed_sharding(kv[0].sharding), got.ndim)


@pytest.mark.parametrize(("tp", "method"), [(2, "xla"), (4, "xla"), (2, "pallas"), (4, "pallas")])
def test_scatter_on_sharded_pool(tp: int, method: str) -> None:
    kv, values = _pool(tp, 1)
    packed_np = np.random.default_rng(2).standard_normal(
        (CFG.num_layers, 8, *CFG.page_shape)).astype(np.float32)
    packed = jax.device_put(packed_np, packed_sharding(kv[0].sharding))
    out = insert_kv_chunks(kv, packed, PAGES, method=method)  # type: ignore[arg-type]
    want = values.copy()
    want[:, PAGES] = packed_np[:, : len(PAGES)]
    np.testing.assert_array_equal(np.stack([np.asarray(a) for a in out]), want)
    assert all(a.sharding == pool_sharding(tp) for a in out)


@pytest.mark.parametrize(("p", "d"), list(itertools.product(SIZES, SIZES)))
def test_split_then_regroup_every_pair(p: int, d: int) -> None:
    kv, values = _pool(p, 3)
    packed = tiered.gather(kv, PAGES)
    shards = split_shards(packed, p)
    assert len(shards) == p and all(len(s.devices()) == 1 for s in shards)
    target = packed_sharding(pool_sharding(d))
    structs = shard_structs(packed.shape, packed.dtype, p, target)
    landed = [jax.device_put(s, struct.sharding) for s, struct in zip(shards, structs, strict=True)]
    assert [s.shape for s in landed] == [st.shape for st in structs]
    got = regroup(landed, target)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(packed))
    np.testing.assert_array_equal(np.asarray(got)[:, : len(PAGES)], values[:, PAGES])
    assert got.sharding.is_equivalent_to(target, got.ndim)
    # Each D device holds exactly its kv-heads' entries.
    width = CFG.page_shape[1] // d
    for shard in got.addressable_shards:
        assert shard.data.shape[PACKED_KV_AXIS] == width


@pytest.mark.parametrize(("p", "d"), [(4, 2), (1, 2), (2, 1), (2, 2)])
def test_real_pull_between_tp_sizes(p: int, d: int) -> None:
    """P's per-shard registration pulled over jax.experimental.transfer onto D's devices, then
    regrouped and scattered into D's sharded pool: D's pages hold P's bytes."""
    sender, receiver = JaxTransferKVEngine(reaper_interval_s=None), JaxTransferKVEngine(
        reaper_interval_s=None)
    try:
        p_kv, p_values = _pool(p, 4)
        packed = tiered.gather(p_kv, PAGES)
        sender.register(77, split_shards(packed, p), lease_s=30)
        d_kv = allocate_kv_pool(CFG, pool_sharding(d))
        target = packed_sharding(d_kv[0].sharding)
        pending = receiver.start_pull(
            sender.address, 77, shard_structs(packed.shape, packed.dtype, p, target), 30)
        pending.wait()
        dest = [9, 10, 11, 1, 2, 22]
        out = insert_kv_chunks(d_kv, regroup(pending.arrays, target), dest)
        got = np.stack([np.asarray(a) for a in out])
        np.testing.assert_array_equal(got[:, dest], p_values[:, PAGES])
        assert all(a.sharding == pool_sharding(d) for a in out)
    finally:
        sender.close()
        receiver.close()


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (4, 2)])
def test_checksums_are_checked_per_shard_between_tp_sizes(p: int, d: int) -> None:
    """``--disaggregation-kv-checksum`` across tp sizes: READY carries one checksum per shard P
    registered, D's pull executor checks each pulled shard against its own (not against the
    regrouped array): the right ones pass and the KV is scattered, one wrong shard's is named."""
    sender, receiver = JaxTransferKVEngine(reaper_interval_s=None), JaxTransferKVEngine(
        reaper_interval_s=None)
    args = KVArgs([PoolTransferSpec.from_config("main_kv", CFG)])
    holder = KVCacheHolder({"main_kv": allocate_kv_pool(CFG, pool_sharding(d))})
    done = threading.Semaphore(0)
    ex = PullExecutor(receiver, holder, args, deadline_s=30, on_result=lambda room: done.release())
    try:
        p_kv, p_values = _pool(p, 5)
        shards = split_shards(tiered.gather(p_kv, PAGES), p)
        sums = kv_checksums(shards)
        wrong = (*sums[:-1], sums[-1] ^ 1)
        for uuid in (80, 81):
            sender.register(uuid, shards, lease_s=30)
        dest = [9, 10, 11, 1, 2, 22]
        ex.submit(PullRequest(1, 80, sender.address, dest, args.layout_hash, kv_shards=p,
                              kv_checksums=wrong))
        assert done.acquire(timeout=30)
        (bad,) = ex.poll()
        assert bad.checksum_mismatch and f"array {p - 1} (main_kv, shard {p - 1})" in bad.reason
        ex.submit(PullRequest(2, 81, sender.address, dest, args.layout_hash, kv_shards=p,
                              kv_checksums=sums))
        assert done.acquire(timeout=30)
        (good,) = ex.poll()
        assert good.ok, good.reason
        with holder.locked() as kv:
            got = np.stack([np.asarray(a) for a in kv["main_kv"]])
        np.testing.assert_array_equal(got[:, dest], p_values[:, PAGES])
    finally:
        ex.close()
        sender.close()
        receiver.close()


def test_shard_structs_refuse_uneven_split() -> None:
    from pd_fsm.jax_engine.parallel.tensor_parallel import TensorParallelError

    with pytest.raises(TensorParallelError, match="do not split into 3 shards"):
        shard_structs((2, 8, 4, 8, 8), jnp.dtype("float32"), 3, pool_sharding(1))
