import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.kv.gather_scatter import (
    TRACE_COUNTS,
    contiguous_runs,
    insert_kv_chunks,
    page_bucket,
    page_buckets_upto,
    select_from_kv_caches,
)

PAGE = (2, 2, 4)
NUM_PAGES = 80


def _pool(rng: np.random.Generator, dtype: str = "float32", layers: int = 2) -> list[jax.Array]:
    return [
        jnp.asarray(rng.standard_normal((NUM_PAGES, *PAGE)).astype(np.float32)).astype(dtype)
        for _ in range(layers)
    ]


def test_page_bucket_bounds() -> None:
    for n in range(1, 3000):
        b = page_bucket(n)
        assert b >= n
        assert n <= 8 or b <= 1.25 * n + 1
    assert [page_bucket(n) for n in (1, 2, 3, 5, 9, 11, 17, 33)] == [1, 2, 4, 8, 10, 12, 20, 40]


def test_contiguous_runs() -> None:
    runs = contiguous_runs(range(7), [5, 6, 7, 2, 9, 10, 3], bucket=8)
    assert runs.n_runs == 4
    assert runs.table[:, :4].T.tolist() == [[0, 5, 3], [3, 2, 1], [4, 9, 2], [6, 3, 1]]
    assert runs.table[:, 4:].sum() == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gather_scatter_equal_numpy_reference(dtype: str) -> None:
    rng = np.random.default_rng(1)
    src = _pool(rng, dtype)
    dst = _pool(rng, dtype)
    for trial in range(12):
        n = int(rng.integers(1, 17))
        src_pages = rng.choice(np.arange(1, NUM_PAGES), n, replace=False)
        if trial % 2:  # mostly-contiguous like a LIFO allocator, not only random
            start = int(rng.integers(1, NUM_PAGES - n))
            src_pages = np.arange(start, start + n)
        dst_pages = rng.choice(np.arange(1, NUM_PAGES), n, replace=False)
        ref = [np.asarray(d).copy() for d in dst]
        packed = select_from_kv_caches(src, src_pages.tolist())
        assert packed.shape == (2, page_bucket(n), *PAGE)
        for layer in range(2):
            want = np.asarray(src[layer])[src_pages]
            assert np.array_equal(np.asarray(packed[layer, :n]), want)
            assert not np.asarray(packed[layer, n:]).any()
            ref[layer][dst_pages] = want
        dst = insert_kv_chunks(dst, packed, dst_pages.tolist())
        for layer in range(2):
            got = np.ascontiguousarray(dst[layer])  # a TPU's come back strided
            assert np.array_equal(got.view(np.uint8), ref[layer].view(np.uint8))


def test_scatter_donates_destination() -> None:
    rng = np.random.default_rng(2)
    dst = _pool(rng)
    packed = select_from_kv_caches(_pool(rng), [3, 4])
    old = dst[0]
    insert_kv_chunks(dst, packed, [7, 9])
    assert old.is_deleted()


def test_bad_pages_refused() -> None:
    rng = np.random.default_rng(3)
    pool = _pool(rng)
    for pages in ([0, 1], [1, 1], [NUM_PAGES], []):
        with pytest.raises(ValueError):
            select_from_kv_caches(pool, pages)
    packed = select_from_kv_caches(pool, [1, 2])
    with pytest.raises(ValueError):
        insert_kv_chunks(pool, packed, [3, 4, 5])  # more pages than the packed bucket
    with pytest.raises(ValueError):
        insert_kv_chunks(pool, packed.astype(jnp.bfloat16), [3, 4])


def test_compile_count_bounded_over_1000_sizes() -> None:
    rng = np.random.default_rng(4)
    src = _pool(rng, layers=1)
    dst = _pool(rng, layers=1)
    r = random.Random(5)
    max_pages = 64
    before = TRACE_COUNTS.snapshot()
    for i in range(1000):
        n = r.randint(1, max_pages)
        pages = r.sample(range(1, NUM_PAGES), n)
        packed = select_from_kv_caches(src, pages)
        dst = insert_kv_chunks(dst, packed, r.sample(range(1, NUM_PAGES), n))
        if i % 100 == 0:
            jax.block_until_ready(dst)
    jax.block_until_ready(dst)
    n_buckets = len(page_buckets_upto(max_pages))
    gathers = TRACE_COUNTS["gather"] - before["gather"]
    scatters = TRACE_COUNTS["multi_layer_copy"] - before["multi_layer_copy"]
    allocs = TRACE_COUNTS["gather_alloc"] - before["gather_alloc"]
    assert 0 < gathers <= n_buckets
    assert 0 < allocs <= n_buckets
    assert 0 < scatters <= n_buckets
