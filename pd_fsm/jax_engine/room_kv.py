"""One room's KV across all pools of a ``KVArgs``: gather on P, scatter on D, via the holder.

``pages`` maps pool name -> that pool's page ids for the room (a plain sequence means the same
page ids in every pool). Arrays are in ``kv_args.pools`` order, which is the wire order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax

from pd_fsm.jax_engine import tiered
from pd_fsm.jax_engine.gather_scatter import (
    ScatterMethod,
    as_struct,
    check_packed,
    insert_kv_chunks,
    page_buckets_upto,
    validate_pages,
)
from pd_fsm.jax_engine.kv_holder import KVCacheHolder
from pd_fsm.jax_engine.pool_spec import KVArgs

RoomPages = Mapping[str, Sequence[int]] | Sequence[int]


def pages_by_pool(kv_args: KVArgs, pages: RoomPages) -> dict[str, tuple[int, ...]]:
    if isinstance(pages, Mapping):
        missing = [p.name for p in kv_args.pools if p.name not in pages]
        if missing:
            raise ValueError(f"no pages for pools {missing}")
        return {p.name: tuple(int(i) for i in pages[p.name]) for p in kv_args.pools}
    flat = tuple(int(i) for i in pages)
    return {p.name: flat for p in kv_args.pools}


def gather_room(holder: KVCacheHolder, kv_args: KVArgs, pages: RoomPages) -> list[jax.Array]:
    """P side: the packed arrays to register, one per pool. Only the dispatch happens under the
    lock; the gathered arrays are new buffers, so later steps may donate the pool freely."""
    by_pool = pages_by_pool(kv_args, pages)
    with holder.locked() as kv:
        out = []
        for p in kv_args.pools:
            validate_pages(by_pool[p.name], kv[p.name][0].shape[0])
            out.append(tiered.gather(kv[p.name], by_pool[p.name]))
        return out


def scatter_room(
    holder: KVCacheHolder,
    kv_args: KVArgs,
    arrays: Sequence[jax.Array],
    pages: RoomPages,
    *,
    method: ScatterMethod = "xla",
    lock_timeout_s: float = -1,
) -> None:
    """D side: write the pulled arrays into the room's preallocated pages. Blocks (under the lock)
    until the scatter is done, so that returning means "the pool holds this room's KV" and any
    error of the scatter surfaces here rather than in a later forward step."""
    by_pool = pages_by_pool(kv_args, pages)
    if len(arrays) != len(kv_args.pools):
        raise ValueError(f"{len(arrays)} arrays for {len(kv_args.pools)} pools")
    if method != "xla":
        with holder.locked(timeout=lock_timeout_s) as kv:
            for spec, packed in zip(kv_args.pools, arrays, strict=True):
                kv[spec.name] = insert_kv_chunks(
                    kv[spec.name], packed, by_pool[spec.name], method=method
                )
            jax.block_until_ready([kv[spec.name] for spec in kv_args.pools])
        return
    # XLA path: check and compile outside the lock (compiling can take seconds), copy under it.
    with holder.locked(timeout=lock_timeout_s) as kv:
        structs = {spec.name: [as_struct(a) for a in kv[spec.name]] for spec in kv_args.pools}
    plans = []
    for spec, packed in zip(kv_args.pools, arrays, strict=True):
        pool = structs[spec.name]
        check_packed(pool, packed, by_pool[spec.name])
        plans.append((spec.name, tiered.scatter_plan(pool, packed, by_pool[spec.name])))
    with holder.locked(timeout=lock_timeout_s) as kv:
        for name, run in plans:
            kv[name] = run(list(kv[name]))
        jax.block_until_ready([kv[spec.name] for spec in kv_args.pools])


def warm_room_copies(holder: KVCacheHolder, kv_args: KVArgs, max_pages: int, what: str) -> int:
    """Compile the quick-tier gather (P) or scatter (D) of every page bucket a room of up to
    ``max_pages`` pages lands in, in every pool; returns how many executables were compiled."""
    with holder.locked() as kv:
        structs = {spec.name: [as_struct(a) for a in kv[spec.name]] for spec in kv_args.pools}
    buckets = page_buckets_upto(max_pages)
    return sum(tiered.warm(structs[spec.name], buckets, what) for spec in kv_args.pools)
