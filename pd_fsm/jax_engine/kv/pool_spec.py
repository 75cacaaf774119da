"""What crosses the wire: the list of pools a request's KV is made of, and the layout hash.

``KVArgs.pools`` is a list of :class:`PoolTransferSpec` from day one (RFC-2 §5.6): main KV only is
used end to end now, but a draft KV pool, a recurrent-state pool or SWA metadata are more entries,
not a new API. P and D each build their ``KVArgs`` from their own pools and compare
:attr:`KVArgs.layout_hash` before any pull, because ``jax.experimental.transfer`` checks neither
shape nor dtype: a float32 registration pulled as bfloat16 of the same byte size "succeeds" with
the bits reinterpreted (shared/JAX_TRANSFER.md).

The hash covers everything that decides the bytes on the wire: per pool its name, type, dtype,
layer count, the shape of one page, the sharding and metadata, plus the packing scheme (stacked
layers, page bucket rule). It deliberately excludes the number of pages in the pool: P and D size
their pools independently.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum

import attrs
import jax
import numpy as np

from pd_fsm.jax_engine.kv.gather_scatter import page_bucket
from pd_fsm.jax_engine.kv.pool import KVPoolConfig

# Bump when the packing in gather_scatter changes (layer stacking, page_bucket rule) or how a
# packed array is cut for the wire (v2: one array per kv-head shard, READY names how many; the
# shapes below are the whole array's, its K/V-entry axis split evenly).
PACKING_SCHEME = "stacked-layers/page_bucket-pow2-then-4-per-octave/kv-head-shards/v2"


class PoolType(StrEnum):
    MAIN_KV = "main_kv"
    DRAFT_KV = "draft_kv"
    RECURRENT_STATE = "recurrent_state"


class LayoutMismatchError(RuntimeError):
    """P's and D's transfer layouts differ; pulling would silently reinterpret bytes."""


def _metadata(
    value: Mapping[str, str] | Iterable[tuple[str, str]] | None,
) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, Mapping) else (value or ())
    return tuple(sorted((str(k), str(v)) for k, v in items))


def _shape(value: Iterable[int]) -> tuple[int, ...]:
    # A typed `tuple`: mypy's attrs plugin cannot take the generic builtin as a converter.
    return tuple(value)


@attrs.frozen
class PoolTransferSpec:
    """One pool as it crosses the wire: per request one array
    ``(num_layers, page_bucket(n), *page_shape)`` of ``dtype``."""

    name: str
    pool_type: PoolType
    dtype: str
    num_layers: int
    page_shape: tuple[int, ...] = attrs.field(converter=_shape)
    sharding: str = "single_device"
    metadata: tuple[tuple[str, str], ...] = attrs.field(default=(), converter=_metadata)

    @classmethod
    def from_config(
        cls,
        name: str,
        cfg: KVPoolConfig,
        pool_type: PoolType = PoolType.MAIN_KV,
        sharding: str = "single_device",
        metadata: Mapping[str, str] | None = None,
    ) -> PoolTransferSpec:
        return cls(
            name=name,
            pool_type=pool_type,
            dtype=str(jax.numpy.dtype(cfg.storage_dtype)),  # the bytes moved (bf16: uint16)
            num_layers=cfg.num_layers,
            page_shape=cfg.page_shape,
            sharding=sharding,
            metadata=metadata,
        )

    def packed_shape(self, n_pages: int) -> tuple[int, ...]:
        return (self.num_layers, page_bucket(n_pages), *self.page_shape)

    def packed_nbytes(self, n_pages: int) -> int:
        return int(np.prod(self.packed_shape(n_pages))) * jax.numpy.dtype(self.dtype).itemsize

    def canonical(self) -> dict[str, object]:
        return {
            "name": self.name,
            "pool_type": self.pool_type.value,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "page_shape": list(self.page_shape),
            "sharding": self.sharding,
            "metadata": [list(kv) for kv in self.metadata],
        }


def _pools(value: Iterable[PoolTransferSpec]) -> tuple[PoolTransferSpec, ...]:
    pools = tuple(value)
    names = [p.name for p in pools]
    if not pools:
        raise ValueError("KVArgs needs at least one pool")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate pool names: {names}")
    return pools


@attrs.frozen
class KVArgs:
    """The transfer layout of one worker. ``pools`` is ordered: it is the order of the arrays in a
    registration and in a pull."""

    pools: tuple[PoolTransferSpec, ...] = attrs.field(converter=_pools)
    # Arrays per pool this worker registers (its tensor-parallel size). Not in the hash: D
    # regroups any count that splits its kv-heads, and READY names P's.
    kv_shards: int = 1
    layout_hash: str = attrs.field(init=False)

    @layout_hash.default
    def _hash(self) -> str:
        doc = {"packing": PACKING_SCHEME, "pools": [p.canonical() for p in self.pools]}
        blob = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def pool(self, name: str) -> PoolTransferSpec:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(name)

    def packed_nbytes(self, n_pages: int) -> int:
        return sum(p.packed_nbytes(n_pages) for p in self.pools)

    def check_peer(self, remote_hash: str) -> None:
        """Raise :class:`LayoutMismatchError` unless the peer's layout hash equals ours."""
        if remote_hash != self.layout_hash:
            raise LayoutMismatchError(
                f"layout mismatch: local {self.layout_hash}, peer {remote_hash}"
            )


def pool_order(kv_args: KVArgs, pools: Mapping[str, object]) -> Sequence[str]:
    """Pool names in wire order, checking that ``pools`` holds exactly the pools of ``kv_args``."""
    names = [p.name for p in kv_args.pools]
    if set(pools) != set(names):
        raise ValueError(f"pools {sorted(pools)} do not match KVArgs pools {names}")
    return names
