"""Tiered gather/scatter: the quick tier serves a new bucket at once, the run-based tier takes
over once compiled, and both give the same bytes in the pages that matter."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.kv import tiered
from pd_fsm.jax_engine.kv.counters import TRACE_COUNTS
from pd_fsm.jax_engine.kv.gather_scatter import (
    default_gather_method,
    default_scatter_method,
    page_buckets_upto,
)
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool import KVPoolConfig
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec
from pd_fsm.jax_engine.kv.room import gather_room, scatter_room, warm_room_copies

# A pool shape no other test uses, so the executable cache starts cold for it.
CFG = KVPoolConfig(num_layers=3, num_pages=37, page_size=4, num_kv_heads=1, head_dim=8)


def _pool(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(CFG.layer_shape).astype(np.float32) for _ in range(CFG.num_layers)]


def _holder(arrays: list[np.ndarray]) -> KVCacheHolder:
    return KVCacheHolder({"main_kv": [jnp.asarray(a) for a in arrays]})


def test_quick_then_runs_tier_same_bytes() -> None:
    kv_args = KVArgs([PoolTransferSpec.from_config("main_kv", CFG)])
    src_np, dst_np = _pool(1), _pool(2)
    src, dst = _holder(src_np), _holder(dst_np)
    src_pages = [5, 6, 7, 20, 3]
    expected = [d.copy() for d in dst_np]
    before = tiered.TIER_COUNTS.snapshot()

    for round_, dst_pages in enumerate(([9, 10, 30, 31, 2], [11, 12, 13, 33, 1])):
        (packed,) = gather_room(src, kv_args, src_pages, method="xla")  # the tiers, on any
        scatter_room(dst, kv_args, [packed], dst_pages, method="xla")  # backend
        for layer in range(CFG.num_layers):
            expected[layer][dst_pages] = src_np[layer][src_pages]
        with dst.locked() as kv:
            got = [np.asarray(a) for a in kv["main_kv"]]
        for layer in range(CFG.num_layers):
            np.testing.assert_array_equal(got[layer], expected[layer])  # no other page touched
        if round_ == 0:
            assert tiered.TIER_COUNTS["gather_quick"] == before["gather_quick"] + 1
            assert tiered.TIER_COUNTS["scatter_quick"] == before["scatter_quick"] + 1
            assert tiered.KV_COPIES.wait_idle(120), "background compile never finished"
    assert tiered.TIER_COUNTS["gather_runs"] == before["gather_runs"] + 1
    assert tiered.TIER_COUNTS["scatter_runs"] == before["scatter_runs"] + 1


def test_warmed_buckets_compile_nothing_when_rooms_move() -> None:
    """``warm_room_copies`` compiles the quick tier of every page bucket up to the longest room,
    so gathers and scatters of rooms of any size up to it compile nothing on the request path."""
    cfg = KVPoolConfig(num_layers=2, num_pages=29, page_size=4, num_kv_heads=1, head_dim=8)
    kv_args = KVArgs([PoolTransferSpec.from_config("main_kv", cfg)])
    rng = np.random.default_rng(3)
    arrays = [rng.standard_normal(cfg.layer_shape).astype(np.float32) for _ in range(2)]
    src = KVCacheHolder({"main_kv": [jnp.asarray(a) for a in arrays]})
    dst = KVCacheHolder({"main_kv": [jnp.zeros(cfg.layer_shape, jnp.float32) for _ in range(2)]})
    n_gather = warm_room_copies(src, kv_args, 12, "gather")
    n_scatter = warm_room_copies(dst, kv_args, 12, "scatter")
    assert n_gather == n_scatter == len(page_buckets_upto(12))  # 1 2 4 8 10 12
    assert warm_room_copies(src, kv_args, 12, "gather") == 0  # idempotent
    before = tiered.KV_COPIES.quick_compiles
    for n in (1, 3, 5, 9, 11, 12):
        (packed,) = gather_room(src, kv_args, list(range(1, n + 1)))
        scatter_room(dst, kv_args, [packed], list(range(28 - n, 28)))
        with dst.locked() as kv:
            got = np.asarray(kv["main_kv"][1])[28 - n : 28]
        np.testing.assert_array_equal(got, arrays[1][1 : n + 1])
    assert tiered.KV_COPIES.quick_compiles == before


def test_the_pallas_scatter_is_warmed_per_bucket_and_writes_what_the_xla_one_does() -> None:
    """D's scatter on a TPU (``default_scatter_method``): its warm-up compiles the kernel for
    every page bucket without writing a page, and then rooms of any size up to the longest are
    written exactly as the XLA copy writes them, tracing nothing more. (Here the CPU runs the
    kernel in interpret mode; bench/bench_tpu.py and this test on the device machine ran it
    compiled on a TPU.)"""
    cfg = KVPoolConfig(num_layers=2, num_pages=31, page_size=4, num_kv_heads=1, head_dim=8)
    kv_args = KVArgs([PoolTransferSpec.from_config("main_kv", cfg)])
    rng = np.random.default_rng(5)
    src_np = [rng.standard_normal(cfg.layer_shape).astype(np.float32) for _ in range(2)]
    base = [rng.standard_normal(cfg.layer_shape).astype(np.float32) for _ in range(2)]
    src = KVCacheHolder({"main_kv": [jnp.asarray(a) for a in src_np]})
    by_pallas = KVCacheHolder({"main_kv": [jnp.asarray(a) for a in base]})
    by_xla = KVCacheHolder({"main_kv": [jnp.asarray(a) for a in base]})
    assert warm_room_copies(by_pallas, kv_args, 12, "scatter", method="pallas") == len(
        page_buckets_upto(12))
    with by_pallas.locked() as kv:  # the warm-up wrote nothing
        for got, want in zip(kv["main_kv"], base, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    traced = TRACE_COUNTS["multi_layer_copy_pallas"]
    for n, first in ((1, 30), (3, 2), (9, 11), (12, 17)):
        (packed,) = gather_room(src, kv_args, list(range(1, n + 1)))
        dst_pages = list(range(first, first + n))
        scatter_room(by_pallas, kv_args, [packed], dst_pages, method="pallas")
        scatter_room(by_xla, kv_args, [packed], dst_pages, method="xla")
    with by_pallas.locked() as kv_p, by_xla.locked() as kv_x:
        for a, b in zip(kv_p["main_kv"], kv_x["main_kv"], strict=True):
            assert np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                  np.ascontiguousarray(b).view(np.uint8))
    assert TRACE_COUNTS["multi_layer_copy_pallas"] == traced  # nothing compiled after warm-up
    assert default_scatter_method() == ("pallas" if jax.default_backend() == "tpu" else "xla")


def test_the_pallas_gather_is_warmed_per_bucket_and_packs_what_the_xla_tiers_do() -> None:
    """P's gather by the Pallas kernel (``method="pallas"``; not the default anywhere: on a
    TPU ``take`` measured faster): its warm-up compiles the kernel for every page bucket
    without touching the pool, and then rooms of any size up to the longest are packed exactly
    as the XLA tiers pack them, tracing nothing more. (Here the CPU runs the kernel in
    interpret mode; this test and bench/bench_tpu.py ran it compiled on a TPU.)"""
    cfg = KVPoolConfig(num_layers=2, num_pages=29, page_size=4, num_kv_heads=1, head_dim=8)
    kv_args = KVArgs([PoolTransferSpec.from_config("main_kv", cfg)])
    rng = np.random.default_rng(6)
    src_np = [rng.standard_normal(cfg.layer_shape).astype(np.float32) for _ in range(2)]
    src = KVCacheHolder({"main_kv": [jnp.asarray(a) for a in src_np]})
    assert warm_room_copies(src, kv_args, 12, "gather", method="pallas") == len(
        page_buckets_upto(12))
    with src.locked() as kv:  # the warm-up wrote nothing
        for got, want in zip(kv["main_kv"], src_np, strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
    traced = TRACE_COUNTS["multi_layer_gather_pallas"]
    for pages in ([28], [3, 4, 5], [9, 2, 20, 21, 22, 7, 8, 1, 27], list(range(13, 25))):
        (by_pallas,) = gather_room(src, kv_args, pages, method="pallas")
        (by_xla,) = gather_room(src, kv_args, pages, method="xla")
        n = len(pages)
        assert np.array_equal(np.asarray(by_pallas)[:, :n], np.asarray(by_xla)[:, :n])
        want = np.stack([a[pages] for a in src_np])
        np.testing.assert_array_equal(np.asarray(by_pallas)[:, :n], want)
    assert TRACE_COUNTS["multi_layer_gather_pallas"] == traced  # nothing compiled after warm-up


def test_a_take_gather_stays_on_the_quick_tier() -> None:
    """P's gather on a TPU (``default_gather_method``: ``take`` measured faster there than the
    run loop at every size): the warmed quick tier serves every room, nothing is queued for the
    background compile, and it packs what the tiers pack."""
    cfg = KVPoolConfig(num_layers=2, num_pages=23, page_size=4, num_kv_heads=1, head_dim=8)
    kv_args = KVArgs([PoolTransferSpec.from_config("main_kv", cfg)])
    rng = np.random.default_rng(9)
    src_np = [rng.standard_normal(cfg.layer_shape).astype(np.float32) for _ in range(2)]
    src = KVCacheHolder({"main_kv": [jnp.asarray(a) for a in src_np]})
    warm_room_copies(src, kv_args, 8, "gather", method="take")
    before, compiles = tiered.TIER_COUNTS.snapshot(), tiered.KV_COPIES.quick_compiles
    for pages in ([22], [4, 5, 6], [9, 2, 20, 21, 3, 7, 8, 1]):
        (packed,) = gather_room(src, kv_args, pages, method="take")
        np.testing.assert_array_equal(np.asarray(packed)[:, :len(pages)],
                                      np.stack([a[pages] for a in src_np]))
    assert tiered.TIER_COUNTS["gather_quick"] == before["gather_quick"] + 3
    assert tiered.TIER_COUNTS["gather_runs"] == before["gather_runs"]
    assert tiered.KV_COPIES.quick_compiles == compiles  # every bucket warmed
    # Nothing was queued: once the background thread is idle, the tiers' gather of a bucket
    # take served still finds no run-based kernel for it (and queues one now).
    assert tiered.KV_COPIES.wait_idle(60)
    gather_room(src, kv_args, [1, 2, 3, 4, 5, 6, 7, 8], method="xla")
    assert tiered.TIER_COUNTS["gather_runs"] == before["gather_runs"]
    assert tiered.TIER_COUNTS["gather_quick"] == before["gather_quick"] + 4
    assert tiered.KV_COPIES.wait_idle(120)
    assert default_gather_method() == ("take" if jax.default_backend() == "tpu" else "xla")


def test_a_warm_up_loads_the_run_tier_the_compilation_cache_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second start: the run-based kernels a first start compiled (in the background, into
    the compilation cache) are loaded by the warm-up, so nothing compiles in the background."""
    from pd_fsm.jax_engine.compilation.executable_store import ExecutableStore
    from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
    from pd_fsm.jax_engine.kv.gather_scatter import as_struct

    cfg = KVPoolConfig(num_layers=2, num_pages=11, page_size=2, num_kv_heads=1, head_dim=4)
    pool = [as_struct(jnp.zeros(cfg.layer_shape, jnp.float32)) for _ in range(cfg.num_layers)]
    EXECUTABLES.use_store(ExecutableStore(tmp_path))
    try:
        for what in ("gather", "scatter"):
            first_start = tiered._Executables()
            monkeypatch.setattr(tiered, "KV_COPIES", first_start)
            tiered.warm(pool, [4], what)  # an empty cache: nothing to load
            assert first_start.get(tiered._key(pool, 4, f"{what}_runs")) is None
            fn, args = tiered._runs_build(pool, 4, what)
            tiered._build(fn, *args, counted=False)  # what a first use compiles and stores
            second_start = tiered._Executables()
            monkeypatch.setattr(tiered, "KV_COPIES", second_start)
            tiered.warm(pool, [4], what)
            assert second_start.get(tiered._key(pool, 4, f"{what}_runs")) is not None
    finally:
        EXECUTABLES.use_store(None)
