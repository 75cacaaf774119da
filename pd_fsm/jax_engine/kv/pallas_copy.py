"""Pallas TPU DMA kernels for the packed -> paged scatter (``multi_layer_copy``, D's side) and
the paged -> packed gather (``multi_layer_gather_pallas``, P's side).

Same contract as :func:`pd_fsm.jax_engine.kv.gather_scatter.multi_layer_copy`: for every layer ``l``
and run ``(s, d, m)`` of the run table, ``kv_caches[l][d:d+m] = packed[l, s:s+m]``, the pool
arrays aliased to the outputs (donated, written in place). The gather is its mirror:
``packed[l, d:d+m] = kv_caches[l][s:s+m]``, the packed array donated.

Everything stays in HBM (``pl.ANY``): the kernel only issues DMAs, it never stages pages through
VMEM. A run of ``m`` pages is copied as the power-of-two pieces of ``m`` (DMA slice sizes must be
static; offsets may be dynamic). Per run, the DMAs of *all* layers are started before any is
waited on, so the copies of different layers overlap (one DMA semaphore per layer).

On a tensor-parallel pool (sharded on its K/V-entry axis) the kernel runs once per shard under
``shard_map``: each device copies its own kv-heads' slice of the same pages, the run table
replicated; nothing crosses devices.

On CPU the kernel runs in Pallas TPU interpret mode (``pltpu.InterpretParams``), which simulates
the DMAs and semaphores; the tests check it against the XLA path bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from pd_fsm.jax_engine.kv.counters import TRACE_COUNTS


def _copy_runs(table_ref: Any, n_runs: Any, src: Any, dst: Any, sems: Any, *, n_layers: int,
               n_bits: int) -> None:
    """For every run ``(s, d, m)`` of the table: every layer's ``dst(layer)[d:d+m] =
    src(layer)[s:s+m]``, as the power-of-two pieces of ``m``; a run's DMAs of all layers are
    started before any is waited on."""

    def body(r: Any, carry: int) -> int:
        s = table_ref[0, r]
        d = table_ref[1, r]
        m = table_ref[2, r]

        def pieces() -> Any:
            for layer in range(n_layers):
                for k in range(n_bits):
                    size = 1 << k
                    off = m & (size - 1)
                    copy = pltpu.make_async_copy(
                        src(layer).at[pl.ds(s + off, size)],
                        dst(layer).at[pl.ds(d + off, size)],
                        sems.at[layer],
                    )
                    yield k, copy

        for k, copy in pieces():
            pl.when((m >> k) & 1 == 1)(copy.start)
        for k, copy in pieces():
            pl.when((m >> k) & 1 == 1)(copy.wait)
        return carry

    jax.lax.fori_loop(0, n_runs, body, 0)


def _kernel(
    table_ref: Any, n_runs_ref: Any, packed_ref: Any, *refs: Any, n_layers: int, n_bits: int
) -> None:
    # refs = n_layers aliased pool inputs (unused: outputs alias them), n_layers outputs, sems
    outs = refs[n_layers : 2 * n_layers]
    _copy_runs(table_ref, n_runs_ref[0], lambda layer: packed_ref.at[layer],
               lambda layer: outs[layer], refs[2 * n_layers], n_layers=n_layers, n_bits=n_bits)


def _gather_kernel(
    table_ref: Any, n_runs_ref: Any, *refs: Any, n_layers: int, n_bits: int
) -> None:
    # refs = n_layers pool inputs, the aliased packed input (unused: the output aliases it),
    # the packed output, sems
    pools = refs[:n_layers]
    out = refs[n_layers + 1]
    _copy_runs(table_ref, n_runs_ref[0], lambda layer: pools[layer],
               lambda layer: out.at[layer], refs[n_layers + 2], n_layers=n_layers, n_bits=n_bits)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("interpret",))
def multi_layer_copy_pallas(
    kv_caches: list[jax.Array],
    packed: jax.Array,
    table: jax.Array,
    n_runs: jax.Array,
    *,
    interpret: bool = False,
) -> list[jax.Array]:
    """Scatter ``packed`` into ``kv_caches`` by DMA. ``kv_caches`` is donated."""
    TRACE_COUNTS.bump("multi_layer_copy_pallas")
    n_layers = len(kv_caches)
    kernel = functools.partial(_kernel, n_layers=n_layers, n_bits=packed.shape[1].bit_length())
    out: list[jax.Array] = _dma_call(
        kernel, n_layers, [jax.ShapeDtypeStruct(c.shape, c.dtype) for c in kv_caches],
        # operand order: table, n_runs, packed, caches... -> caches alias outputs 0..n_layers-1
        {3 + i: i for i in range(n_layers)}, interpret,
    )(table, n_runs.reshape(1), packed, *kv_caches)
    return out


def _dma_call(kernel: Any, n_layers: int,
              out_shape: list[jax.ShapeDtypeStruct] | jax.ShapeDtypeStruct,
              aliases: dict[int, int], interpret: bool) -> Any:
    """``pallas_call`` of a DMA kernel: the run table and its length prefetched as scalars,
    the pool's layers and the packed array (``n_layers + 1`` operands) and the outputs left in
    HBM, one DMA semaphore per layer."""
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(1,),
        in_specs=[any_spec] * (n_layers + 1),
        out_specs=[any_spec] * len(out_shape) if isinstance(out_shape, list) else any_spec,
        scratch_shapes=[pltpu.SemaphoreType.DMA((n_layers,))],
    )
    return pl.pallas_call(kernel, grid_spec=grid_spec, out_shape=out_shape,
                          input_output_aliases=aliases,
                          interpret=pltpu.InterpretParams() if interpret else False)


def _mesh_of(kv_caches: list[jax.Array]) -> tuple[Mesh, PartitionSpec] | None:
    """The mesh and partition of a pool placed on more than one device (None: one device)."""
    sharding = kv_caches[0].sharding
    if (not isinstance(sharding, NamedSharding) or not isinstance(sharding.mesh, Mesh)
            or sharding.mesh.size == 1):
        return None
    return sharding.mesh, sharding.spec


def multi_layer_copy_pallas_per_shard(
    kv_caches: list[jax.Array],
    packed: jax.Array,
    table: jax.Array,
    n_runs: jax.Array,
    *,
    interpret: bool = False,
) -> list[jax.Array]:
    """:func:`multi_layer_copy_pallas` on every shard of a pool placed on a mesh (on one device:
    the kernel itself). ``kv_caches`` is donated."""
    placed = _mesh_of(kv_caches)
    if placed is None:
        return multi_layer_copy_pallas(kv_caches, packed, table, n_runs, interpret=interpret)
    return _per_shard(kv_caches, packed, table, n_runs, mesh=placed[0], pool_spec=placed[1],
                      interpret=interpret)


@functools.partial(
    jax.jit, donate_argnums=(0,), static_argnames=("mesh", "pool_spec", "interpret")
)
def _per_shard(
    kv_caches: list[jax.Array],
    packed: jax.Array,
    table: jax.Array,
    n_runs: jax.Array,
    *,
    mesh: Mesh,
    pool_spec: PartitionSpec,
    interpret: bool,
) -> list[jax.Array]:
    pools = [pool_spec] * len(kv_caches)

    def copy(caches: list[jax.Array], rows: jax.Array, runs: jax.Array, n: jax.Array
             ) -> list[jax.Array]:
        return list(multi_layer_copy_pallas(caches, rows, runs, n, interpret=interpret))

    per_shard = jax.shard_map(
        copy, mesh=mesh,
        in_specs=(pools, PartitionSpec(None, *pool_spec), PartitionSpec(), PartitionSpec()),
        out_specs=pools, check_vma=False,
    )
    out: list[jax.Array] = per_shard(kv_caches, packed, table, n_runs)
    return out


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("interpret",))
def multi_layer_gather_pallas(
    out: jax.Array,
    kv_caches: list[jax.Array],
    table: jax.Array,
    n_runs: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """Gather pages into the packed ``out`` by DMA (P's side, the reverse of
    :func:`multi_layer_copy_pallas`): for every layer ``l`` and run ``(s, d, m)``,
    ``out[l, d:d+m] = kv_caches[l][s:s+m]``; rows no run writes keep what ``out`` held (zeros,
    as ``gather_scatter._packed_zeros`` makes it). ``out`` is donated."""
    TRACE_COUNTS.bump("multi_layer_gather_pallas")
    n_layers = len(kv_caches)
    kernel = functools.partial(_gather_kernel, n_layers=n_layers,
                               n_bits=out.shape[1].bit_length())
    packed: jax.Array = _dma_call(
        kernel, n_layers, jax.ShapeDtypeStruct(out.shape, out.dtype),
        # operand order: table, n_runs, caches..., out -> out aliases the output
        {2 + n_layers: 0}, interpret,
    )(table, n_runs.reshape(1), *kv_caches, out)
    return packed


def multi_layer_gather_pallas_per_shard(
    out: jax.Array,
    kv_caches: list[jax.Array],
    table: jax.Array,
    n_runs: jax.Array,
    *,
    interpret: bool = False,
) -> jax.Array:
    """:func:`multi_layer_gather_pallas` on every shard of a pool placed on a mesh (on one
    device: the kernel itself); ``out`` placed as the pool's packed arrays. ``out`` is
    donated."""
    placed = _mesh_of(kv_caches)
    if placed is None:
        return multi_layer_gather_pallas(out, kv_caches, table, n_runs, interpret=interpret)
    return _gather_per_shard(out, kv_caches, table, n_runs, mesh=placed[0],
                             pool_spec=placed[1], interpret=interpret)


@functools.partial(
    jax.jit, donate_argnums=(0,), static_argnames=("mesh", "pool_spec", "interpret")
)
def _gather_per_shard(
    out: jax.Array,
    kv_caches: list[jax.Array],
    table: jax.Array,
    n_runs: jax.Array,
    *,
    mesh: Mesh,
    pool_spec: PartitionSpec,
    interpret: bool,
) -> jax.Array:
    packed_spec = PartitionSpec(None, *pool_spec)

    def gather(rows: jax.Array, caches: list[jax.Array], runs: jax.Array, n: jax.Array
               ) -> jax.Array:
        return multi_layer_gather_pallas(rows, caches, runs, n, interpret=interpret)

    per_shard = jax.shard_map(
        gather, mesh=mesh,
        in_specs=(packed_spec, [pool_spec] * len(kv_caches), PartitionSpec(), PartitionSpec()),
        out_specs=packed_spec, check_vma=False,
    )
    packed: jax.Array = per_shard(out, kv_caches, table, n_runs)
    return packed
