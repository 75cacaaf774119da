"""Pallas TPU DMA kernel for the packed -> paged scatter (``multi_layer_copy``).

Same contract as :func:`pd_fsm.jax_engine.kv.gather_scatter.multi_layer_copy`: for every layer ``l``
and run ``(s, d, m)`` of the run table, ``kv_caches[l][d:d+m] = packed[l, s:s+m]``, the pool
arrays aliased to the outputs (donated, written in place).

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


def _kernel(
    table_ref: Any, n_runs_ref: Any, packed_ref: Any, *refs: Any, n_layers: int, n_bits: int
) -> None:
    # refs = n_layers aliased pool inputs (unused: outputs alias them), n_layers outputs, sems
    outs = refs[n_layers : 2 * n_layers]
    sems = refs[2 * n_layers]

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
                        packed_ref.at[layer, pl.ds(s + off, size)],
                        outs[layer].at[pl.ds(d + off, size)],
                        sems.at[layer],
                    )
                    yield k, copy

        for k, copy in pieces():
            pl.when((m >> k) & 1 == 1)(copy.start)
        for k, copy in pieces():
            pl.when((m >> k) & 1 == 1)(copy.wait)
        return carry

    jax.lax.fori_loop(0, n_runs_ref[0], body, 0)


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
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(1,),
        in_specs=[any_spec] * (n_layers + 1),
        out_specs=[any_spec] * n_layers,
        scratch_shapes=[pltpu.SemaphoreType.DMA((n_layers,))],
    )
    kernel = functools.partial(_kernel, n_layers=n_layers, n_bits=packed.shape[1].bit_length())
    out: list[jax.Array] = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(c.shape, c.dtype) for c in kv_caches],
        # operand order: table, n_runs, packed, caches... -> caches alias outputs 0..n_layers-1
        input_output_aliases={3 + i: i for i in range(n_layers)},
        interpret=pltpu.InterpretParams() if interpret else False,
    )(table, n_runs.reshape(1), packed, *kv_caches)
    return out


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
    sharding = kv_caches[0].sharding
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return multi_layer_copy_pallas(kv_caches, packed, table, n_runs, interpret=interpret)
    return _per_shard(kv_caches, packed, table, n_runs, mesh=sharding.mesh,
                      pool_spec=sharding.spec, interpret=interpret)


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
