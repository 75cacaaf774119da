import pytest

from pd_fsm.jax_engine.kv.pool import (
    NULL_PAGE,
    KVPoolConfig,
    PageAllocator,
    PageAllocatorError,
    allocate_kv_pool,
)


def test_accounting_exact_and_null_page_never_handed_out() -> None:
    alloc = PageAllocator(9)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert a is not None and b is not None
    assert NULL_PAGE not in a + b
    assert len(set(a + b)) == 8
    assert (alloc.num_used, alloc.num_free) == (8, 0)
    assert alloc.allocate(1) is None
    assert (alloc.num_used, alloc.num_free) == (8, 0)
    alloc.free(a)
    assert (alloc.num_used, alloc.num_free) == (5, 3)
    alloc.free(b)
    assert (alloc.num_used, alloc.num_free) == (0, 8)


def test_double_free_refused_and_changes_nothing() -> None:
    alloc = PageAllocator(6)
    pages = alloc.allocate(3)
    assert pages is not None
    alloc.free(pages[:1])
    with pytest.raises(PageAllocatorError):
        alloc.free(pages[:2])  # pages[0] already free
    assert (alloc.num_used, alloc.num_free) == (2, 3)
    with pytest.raises(PageAllocatorError):
        alloc.free([pages[1], pages[1]])  # duplicate in one call
    with pytest.raises(PageAllocatorError):
        alloc.free([NULL_PAGE])
    assert (alloc.num_used, alloc.num_free) == (2, 3)


def test_a_shared_page_comes_back_when_its_last_holder_frees_it() -> None:
    alloc = PageAllocator(6)
    pages = alloc.allocate(3)
    assert pages is not None
    alloc.share(pages[:2], 2)  # three holders of the first two pages
    assert [alloc.holders(p) for p in pages] == [3, 3, 1]
    alloc.free(pages)  # one holder's share of each; the unshared page is free now
    assert (alloc.num_used, alloc.num_free) == (2, 3)
    alloc.free(pages[:2])
    assert (alloc.num_used, alloc.num_free) == (2, 3)
    alloc.free(pages[:2])
    assert (alloc.num_used, alloc.num_free) == (0, 5)
    with pytest.raises(PageAllocatorError):
        alloc.free(pages[:1])  # more frees than holders
    with pytest.raises(PageAllocatorError):
        alloc.share(pages[:1], 1)  # not in use


def test_allocate_kv_pool_layout() -> None:
    cfg = KVPoolConfig(num_layers=2, num_pages=5, page_size=4, num_kv_heads=3, head_dim=8,
                       dtype="bfloat16")
    pool = allocate_kv_pool(cfg)
    assert len(pool) == 2
    assert pool[0].shape == (5, 4, 6, 8)
    assert str(pool[0].dtype) == "uint16"  # bf16 KV is stored as its bits (storage_dtype)
