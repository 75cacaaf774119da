"""Tensor parallelism inside one instance: the mesh, how weights and the KV pool are sharded, and
how a room's KV is cut into per-shard arrays for the wire and regrouped on the other side.

One process drives ``tp`` devices as a ``jax.sharding.Mesh`` with one axis, ``"tp"``. Weights are
sharded Megatron-style: the Q/K/V and gate/up projections by output column (so each device holds
whole attention heads and a slice of the MLP), the output and down projections by input row
(XLA adds the all-reduce); embeddings, norms and the LM head are replicated. The paged KV pool
``(pages, page_size, 2*Nkv, D)`` is sharded on its K/V-entry axis: K and V of kv-head ``h`` sit at
``2h`` and ``2h+1``, so a contiguous split gives device ``r`` whole kv-heads
``[r*Nkv/tp, (r+1)*Nkv/tp)`` with both their K and V, the same heads its Q/K/V columns produce.
The forward itself is unchanged: XLA's SPMD partitioner follows the arguments' shardings. Measured
on CPU (4 forced devices, the tiny model with 4 kv-heads): tp=2 and tp=4 logits within 4e-6 of
tp=1, the pool keeps its sharding through every step, and nothing compiles at call time after an
ahead-of-time warm-up (``tests/tp``).

On the wire a room's KV is one array per pool per kv-head shard (``kv_shards``, P's tp, named in
READY): ``jax.experimental.transfer`` cannot pull an array sharded over N devices into a process
with M != N devices ("Async transfer object was deleted before transfers completed",
shared/JAX_TRANSFER.md), but single-device arrays land on whichever device the puller names. D
pulls P's shards in one pull, each onto the D device that holds its first kv-head, and
:func:`regroup` builds D's own sharding from them: with equal tp every shard is already where it
belongs and the array is assembled without a copy; otherwise shards are concatenated (P tp > D tp)
or split and moved (P tp < D tp) per D device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


class ModelShape(Protocol):
    """What tensor parallelism reads of a model's config (``model.config.ModelConfig``):
    structural, so that this folder does not import the model's (which imports the pool's,
    which imports this)."""

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...


class WithParams(Protocol):
    """A loaded model (``model.registry.LoadedModel``), as far as sharding it goes."""

    @property
    def params(self) -> Any: ...

AXIS = "tp"
# The axis of the per-layer pool ``(pages, page_size, 2*Nkv, D)`` that tp splits, and of the
# packed wire array ``(layers, pages, page_size, 2*Nkv, D)``.
POOL_KV_AXIS = 2
PACKED_KV_AXIS = 3

# Split along their last axis (output columns): heads, and the MLP's intermediate dimension —
# an expert's too (``e_gate``/``e_up``: ``[E, H, I]``). Split along their second-to-last axis
# (input rows, summed by an all-reduce): ``wo``, ``w_down`` and the experts' ``e_down``
# ``[E, I, H]``. So every expert is cut in tp parts of its intermediate dimension, as sglang's
# "TP MoE" does; the router and the q/k norms are replicated.
_COLUMN = frozenset({"wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up", "e_gate", "e_up"})
_ROW = frozenset({"wo", "w_down", "e_down"})


class TensorParallelError(ValueError):
    """A tp size this model or this machine cannot run."""


def check_tp(config: ModelShape, tp: int, devices: int) -> None:
    """Refuse a tp size that would not split every sharded axis evenly or needs more devices than
    the process has (on CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` makes N)."""
    if tp < 1:
        raise TensorParallelError(f"tp must be >= 1, got {tp}")
    if tp > devices:
        raise TensorParallelError(
            f"tp={tp} needs {tp} devices, this process has {devices} (on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={tp} before JAX starts)"
        )
    if config.num_kv_heads % tp:
        raise TensorParallelError(
            f"tp={tp} does not divide the model's {config.num_kv_heads} kv-heads; valid: "
            f"{sorted(kv_shard_counts(config.num_kv_heads))}"
        )
    if config.intermediate_size % tp:
        raise TensorParallelError(
            f"tp={tp} does not divide the MLP width {config.intermediate_size}"
        )


def kv_shard_counts(num_kv_heads: int) -> frozenset[int]:
    """Every shard count a pool of ``num_kv_heads`` kv-heads can be cut into (and so every P tp a
    D of this model can regroup from)."""
    return frozenset(n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0)


@functools.cache
def mesh(tp: int) -> Mesh | None:
    """The instance's mesh over its first ``tp`` devices; None for tp=1 (one device, no mesh:
    arrays stay single-device exactly as before tensor parallelism existed)."""
    if tp == 1:
        return None
    return Mesh(np.array(jax.devices()[:tp]), (AXIS,))


def _split(ndim: int, axis: int) -> PartitionSpec:
    spec: list[str | None] = [None] * ndim
    spec[axis] = AXIS
    return PartitionSpec(*spec)


def pool_sharding(tp: int) -> jax.sharding.Sharding:
    """Where each layer of the paged pool lives."""
    m = mesh(tp)
    if m is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return NamedSharding(m, _split(4, POOL_KV_AXIS))


def logits_sharding(tp: int) -> jax.sharding.Sharding | None:
    """Where the forward's logits land: replicated over the mesh (None for tp=1: one device)."""
    m = mesh(tp)
    return None if m is None else NamedSharding(m, PartitionSpec())


def packed_sharding(pool: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of a packed array ``(layers, *pool layer shape)`` gathered from a pool sharded
    as ``pool``: the pool's, one leading (unsplit) axis on."""
    if isinstance(pool, NamedSharding):
        return NamedSharding(pool.mesh, PartitionSpec(None, *pool.spec))
    return pool


def _param_spec(name: str, ndim: int) -> PartitionSpec:
    if name in _COLUMN:
        return _split(ndim, ndim - 1)
    if name in _ROW:
        return _split(ndim, ndim - 2)
    return PartitionSpec()


def shard_params(params: dict[str, object], tp: int) -> dict[str, object]:
    """``params`` placed on the tp mesh (unchanged for tp=1)."""
    m = mesh(tp)
    if m is None:
        return params

    def place(path: tuple[object, ...], leaf: jax.Array) -> jax.Array:
        key = path[-1]
        name = str(getattr(key, "key", ""))
        return jax.device_put(leaf, NamedSharding(m, _param_spec(name, leaf.ndim)))

    return jax.tree_util.tree_map_with_path(place, params)


_SHARDED: dict[tuple[int, int], dict[str, object]] = {}


def sharded_params(model: WithParams, tp: int) -> dict[str, object]:
    """``model``'s weights on the tp mesh, placed once per (model, tp) in this process: schedulers
    sharing a model share its sharded copy too."""
    if tp == 1:
        params: dict[str, object] = model.params
        return params
    key = (id(model), tp)
    if key not in _SHARDED:
        _SHARDED[key] = shard_params(model.params, tp)
    return _SHARDED[key]


def split_shards(packed: jax.Array, kv_shards: int) -> list[jax.Array]:
    """P side: the packed array as ``kv_shards`` single-device arrays in kv-head order (what is
    registered). A tp=1 array is returned as is."""
    if kv_shards == 1:
        return [packed]
    expected = packed_sharding(pool_sharding(kv_shards))
    if not packed.sharding.is_equivalent_to(expected, packed.ndim):
        packed = jax.device_put(packed, expected)
    shards = sorted(packed.addressable_shards, key=lambda s: s.index[PACKED_KV_AXIS].start or 0)
    return [s.data for s in shards]


def _landing(j: int, p_shards: int, d_shards: int) -> int:
    """The D device that holds P shard ``j``'s first kv entry."""
    return (j * d_shards) // p_shards


def shard_structs(
    packed_shape: Sequence[int], dtype: jnp.dtype, p_shards: int, d_sharding: jax.sharding.Sharding
) -> list[jax.ShapeDtypeStruct]:
    """D side: what to pull for one pool whose packed array is ``packed_shape`` in all, registered
    by P as ``p_shards`` shards: one single-device struct per shard, each on its landing device."""
    entries = packed_shape[PACKED_KV_AXIS]
    if entries % p_shards:
        raise TensorParallelError(f"{entries} kv entries do not split into {p_shards} shards")
    shape = list(packed_shape)
    shape[PACKED_KV_AXIS] = entries // p_shards
    devices = _devices(d_sharding)
    return [
        jax.ShapeDtypeStruct(
            tuple(shape), dtype,
            sharding=jax.sharding.SingleDeviceSharding(
                devices[_landing(j, p_shards, len(devices))]
            ),
        )
        for j in range(p_shards)
    ]


def process_shards(p_shards: int, d_sharding: jax.sharding.Sharding) -> list[int]:
    """D side: which of P's ``p_shards`` shards this process pulls. All of them, unless the
    instance spans processes: then the shards landing on this process's own devices, which P
    registered on the transfer server of its rank of the same place (RFC-2 §6.2's N:N
    pairing); that needs P's shards to be D's devices one for one."""
    if jax.process_count() == 1:
        return list(range(p_shards))
    devices = _devices(d_sharding)
    if p_shards != len(devices):
        raise TensorParallelError(
            f"an instance spanning processes pairs with its P rank for rank: P's {p_shards} "
            f"shards must be its {len(devices)} devices one for one"
        )
    return [j for j, dev in enumerate(devices) if dev.process_index == jax.process_index()]


def _devices(sharding: jax.sharding.Sharding) -> list[jax.Device]:
    if isinstance(sharding, NamedSharding):
        return list(sharding.mesh.devices.flat)
    return sorted(sharding.device_set, key=lambda d: d.id)


def regroup(
    shards: Sequence[jax.Array], d_sharding: jax.sharding.Sharding, p_shards: int | None = None
) -> jax.Array:
    """D side: P's shards (pulled per :func:`shard_structs`) as one packed array sharded as
    ``d_sharding`` (the packed sharding of D's pool). Each D device gets exactly its kv-heads'
    entries: the P shards covering them, sliced where a boundary falls inside one, moved to it
    and concatenated in order. In an instance spanning processes, ``shards`` are this
    process's (:func:`process_shards`) of ``p_shards`` in all, one per local device."""
    devices = _devices(d_sharding)
    if p_shards is not None and len(shards) != p_shards:
        own_devices = [dev for dev in devices if dev.process_index == jax.process_index()]
        shape = list(shards[0].shape)
        shape[PACKED_KV_AXIS] *= p_shards
        return jax.make_array_from_single_device_arrays(
            tuple(shape), d_sharding,
            [jax.device_put(s, dev) for s, dev in zip(shards, own_devices, strict=True)],
        )
    p, d = len(shards), len(devices)
    if p == 1 and d == 1:
        return shards[0]
    width = shards[0].shape[PACKED_KV_AXIS]
    entries = width * p
    if entries % d:
        raise TensorParallelError(f"{entries} kv entries do not split onto {d} devices")
    own = entries // d
    locals_: list[jax.Array] = []
    for r, device in enumerate(devices):
        lo, hi = r * own, (r + 1) * own
        parts = []
        for j in range(lo // width, (hi - 1) // width + 1):
            start, stop = max(lo, j * width) - j * width, min(hi, (j + 1) * width) - j * width
            part = shards[j]
            if (start, stop) != (0, width):
                part = jax.lax.slice_in_dim(part, start, stop, axis=PACKED_KV_AXIS)
            parts.append(jax.device_put(part, device))
        locals_.append(parts[0] if len(parts) == 1 else
                       jnp.concatenate(parts, axis=PACKED_KV_AXIS))
    shape = list(shards[0].shape)
    shape[PACKED_KV_AXIS] = entries
    if d == 1:
        return locals_[0]
    return jax.make_array_from_single_device_arrays(tuple(shape), d_sharding, locals_)
