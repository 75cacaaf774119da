import pytest

from pd_fsm.jax_engine.kv.pool import KVPoolConfig
from pd_fsm.jax_engine.kv.pool_spec import (
    KVArgs,
    LayoutMismatchError,
    PoolTransferSpec,
    PoolType,
)


def _cfg(**kw: object) -> KVPoolConfig:
    base: dict[str, object] = dict(num_layers=2, num_pages=10, page_size=4, num_kv_heads=2,
                                   head_dim=8, dtype="float32")
    base.update(kw)
    return KVPoolConfig(**base)  # type: ignore[arg-type]


def test_hash_ignores_pool_size_but_not_layout() -> None:
    a = KVArgs([PoolTransferSpec.from_config("main_kv", _cfg())])
    assert a.layout_hash == KVArgs([PoolTransferSpec.from_config("main_kv",
                                                                 _cfg(num_pages=99))]).layout_hash
    for other in (_cfg(dtype="bfloat16"), _cfg(page_size=8), _cfg(num_layers=3),
                  _cfg(head_dim=16)):
        assert KVArgs([PoolTransferSpec.from_config("main_kv", other)]).layout_hash != a.layout_hash
    two = KVArgs([PoolTransferSpec.from_config("main_kv", _cfg()),
                  PoolTransferSpec.from_config("draft_kv", _cfg(), PoolType.DRAFT_KV)])
    assert two.layout_hash != a.layout_hash
    meta = KVArgs([PoolTransferSpec.from_config("main_kv", _cfg(),
                                                metadata={"attention_window": "4096"})])
    assert meta.layout_hash != a.layout_hash


def test_check_peer_and_shapes() -> None:
    args = KVArgs([PoolTransferSpec.from_config("main_kv", _cfg(dtype="bfloat16"))])
    args.check_peer(args.layout_hash)
    with pytest.raises(LayoutMismatchError):
        args.check_peer("f" * 32)
    spec = args.pool("main_kv")
    assert spec.packed_shape(5) == (2, 8, 4, 4, 8)
    assert spec.packed_nbytes(5) == 2 * 8 * 4 * 4 * 8 * 2
    with pytest.raises(ValueError):
        KVArgs([spec, spec])
