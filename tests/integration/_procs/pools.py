"""Pool definitions and deterministic contents shared by the P helper and the D-side tests."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pd_fsm.jax_engine.kv.pool import KVPoolConfig
from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec, PoolType

# Two pools with different dtypes and shapes: the main KV and a draft-model KV.
POOLS: dict[str, dict[str, Any]] = {
    "main_kv": dict(num_layers=3, num_pages=48, page_size=4, num_kv_heads=2, head_dim=8,
                    dtype="float32"),
    "draft_kv": dict(num_layers=2, num_pages=40, page_size=4, num_kv_heads=1, head_dim=16,
                     dtype="bfloat16"),
}
TYPES = {"main_kv": PoolType.MAIN_KV, "draft_kv": PoolType.DRAFT_KV}


def config(name: str, num_pages: int | None = None) -> KVPoolConfig:
    d = dict(POOLS[name])
    if num_pages is not None:
        d["num_pages"] = num_pages
    return KVPoolConfig(**d)


def kv_args(names: list[str] | None = None) -> KVArgs:
    names = names or list(POOLS)
    return KVArgs([PoolTransferSpec.from_config(n, config(n), TYPES[n]) for n in names])


def pool_np(name: str, seed: int, num_pages: int | None = None) -> list[np.ndarray]:
    """Deterministic contents of pool ``name`` for ``seed`` (per layer, numpy, as the pool
    stores them: bf16 values as their uint16 bits, ``KVPoolConfig.storage_dtype``)."""
    cfg = config(name, num_pages)
    out = []
    for layer in range(cfg.num_layers):
        rng = np.random.default_rng([seed, list(POOLS).index(name), layer])
        values = rng.standard_normal(cfg.layer_shape).astype(np.float32)
        if cfg.dtype == "bfloat16":
            out.append(values.astype(ml_dtypes.bfloat16).view(np.uint16))
        else:
            out.append(values.astype(cfg.storage_dtype))
    return out


def pool_jax(name: str, seed: int, num_pages: int | None = None) -> list[jax.Array]:
    return [jnp.asarray(a) for a in pool_np(name, seed, num_pages)]
