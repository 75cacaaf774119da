import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.kv.gather_scatter import (
    insert_kv_chunks,
    page_bucket,
    select_from_kv_caches,
)


def _xla_and_pallas_agree(dtype: str, *, interpret: bool) -> None:
    rng = np.random.default_rng(7)
    shape = (48, 2, 2, 8)
    src = [jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
           for _ in range(3)]
    base = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    # fragmented destination: runs of 3, 1, 2, 5 pages and singletons
    dst_pages = [5, 6, 7, 20, 30, 31, 40, 41, 42, 43, 44, 2, 11]
    packed = select_from_kv_caches(src, rng.choice(np.arange(1, 48), len(dst_pages),
                                                   replace=False).tolist())
    xla = insert_kv_chunks([jnp.asarray(b).astype(dtype) for b in base], packed, dst_pages,
                           method="xla")
    pallas = insert_kv_chunks([jnp.asarray(b).astype(dtype) for b in base], packed, dst_pages,
                              method="pallas", interpret=interpret)
    for a, b in zip(xla, pallas, strict=True):
        # a TPU's arrays come back to numpy strided: copy before viewing the bytes
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                              np.ascontiguousarray(b).view(np.uint8))
    untouched = sorted(set(range(48)) - set(dst_pages))
    got = np.asarray(pallas[0]).astype(np.float32)
    assert np.array_equal(got[untouched],
                          np.asarray(jnp.asarray(base[0]).astype(dtype)).astype(np.float32)[untouched])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_interpret_scatter_equals_xla(dtype: str) -> None:
    _xla_and_pallas_agree(dtype, interpret=True)


@pytest.mark.skipif(jax.default_backend() != "tpu",
                    reason="needs a TPU: the DMA kernel compiled for the chip (a CPU runs it "
                           "only in interpret mode, above); bench/bench_tpu.py runs it there")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_compiled_on_a_tpu_equals_xla(dtype: str) -> None:
    _xla_and_pallas_agree(dtype, interpret=False)


def _gathers_agree(dtype: str, *, interpret: bool) -> None:
    """P's gather by DMA packs the same bytes as the XLA run loop: the pages in their order,
    zeros past them (13 pages in their bucket), the pool untouched."""
    rng = np.random.default_rng(8)
    shape = (48, 2, 2, 8)
    pool = [jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
            for _ in range(3)]
    before = [np.ascontiguousarray(np.asarray(a)).view(np.uint8) for a in pool]
    # fragmented and out of order: runs of 3, 1, 2, 5 pages and singletons
    pages = [5, 6, 7, 20, 30, 31, 40, 41, 42, 43, 44, 2, 11]
    xla = select_from_kv_caches(pool, pages, method="xla")
    pallas = select_from_kv_caches(pool, pages, method="pallas", interpret=interpret)
    assert pallas.shape == xla.shape == (3, page_bucket(13), *shape[1:])
    assert page_bucket(13) > 13  # so the zeros past the pages are checked
    assert np.array_equal(np.ascontiguousarray(xla).view(np.uint8),
                          np.ascontiguousarray(pallas).view(np.uint8))
    want = np.stack([np.asarray(a)[pages] for a in pool])
    got = np.asarray(pallas)
    assert np.array_equal(np.ascontiguousarray(got[:, :13]).view(np.uint8),
                          np.ascontiguousarray(want).view(np.uint8))
    assert not np.ascontiguousarray(got[:, 13:]).view(np.uint8).any()
    assert all(np.array_equal(np.ascontiguousarray(np.asarray(a)).view(np.uint8), b)
               for a, b in zip(pool, before, strict=True))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_interpret_gather_equals_xla(dtype: str) -> None:
    _gathers_agree(dtype, interpret=True)


@pytest.mark.skipif(jax.default_backend() != "tpu",
                    reason="needs a TPU: the DMA kernel compiled for the chip (a CPU runs it "
                           "only in interpret mode, above); bench/bench_tpu.py runs it there")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_compiled_gather_on_a_tpu_equals_xla(dtype: str) -> None:
    _gathers_agree(dtype, interpret=False)
