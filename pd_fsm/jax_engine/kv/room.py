"""One room's KV across all pools of a ``KVArgs``: gather on P, scatter on D, via the holder.

``pages`` maps pool name -> that pool's page ids for the room (a plain sequence means the same
page ids in every pool). Arrays are in ``kv_args.pools`` order, which is the wire order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax

from pd_fsm.jax_engine.kv import tiered
from pd_fsm.jax_engine.kv.gather_scatter import (
    GatherMethod,
    ScatterMethod,
    as_struct,
    check_packed,
    default_gather_method,
    default_scatter_method,
    insert_kv_chunks,
    page_buckets_upto,
    select_from_kv_caches,
    validate_pages,
    warm_pallas_gather,
    warm_pallas_scatter,
)
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool_spec import KVArgs
from pd_fsm.jax_engine.parallel.tensor_parallel import split_shards

RoomPages = Mapping[str, Sequence[int]] | Sequence[int]


class ScatterSkipped(Exception):
    """``scatter_rooms`` wrote nothing for this room: ``keep`` said no under the lock."""


def pages_by_pool(kv_args: KVArgs, pages: RoomPages) -> dict[str, tuple[int, ...]]:
    if isinstance(pages, Mapping):
        missing = [p.name for p in kv_args.pools if p.name not in pages]
        if missing:
            raise ValueError(f"no pages for pools {missing}")
        return {p.name: tuple(int(i) for i in pages[p.name]) for p in kv_args.pools}
    flat = tuple(int(i) for i in pages)
    return {p.name: flat for p in kv_args.pools}


def gather_room(holder: KVCacheHolder, kv_args: KVArgs, pages: RoomPages, *,
                method: GatherMethod | None = None) -> list[jax.Array]:
    """P side: the arrays to register, ``kv_args.kv_shards`` per pool (one single-device array
    per kv-head shard; ``tensor_parallel.split_shards``), pools in wire order. Only the dispatch
    happens under the lock; the gathered arrays are new buffers, so later steps may donate the
    pool freely. ``method``: by default this backend's (``take`` alone on a TPU, the XLA tiers
    elsewhere: ``default_gather_method``)."""
    by_pool = pages_by_pool(kv_args, pages)
    method = method or default_gather_method()
    with holder.locked() as kv:
        out = []
        for p in kv_args.pools:
            validate_pages(by_pool[p.name], kv[p.name][0].shape[0])
            packed = (select_from_kv_caches(kv[p.name], by_pool[p.name], method="pallas")
                      if method == "pallas" else
                      tiered.gather(kv[p.name], by_pool[p.name], run_tier=method == "xla"))
            out.extend(split_shards(packed, kv_args.kv_shards))
        return out


def scatter_room(
    holder: KVCacheHolder,
    kv_args: KVArgs,
    arrays: Sequence[jax.Array],
    pages: RoomPages,
    *,
    method: ScatterMethod | None = None,
    lock_timeout_s: float = -1,
) -> None:
    """D side: write the pulled arrays into the room's preallocated pages and wait until the pool
    holds them, so any error of the scatter surfaces here (tests, tools; D's pull executor uses
    :func:`scatter_rooms` on its forward thread instead)."""
    (error,) = scatter_rooms(holder, kv_args, [(arrays, pages)], method=method,
                             lock_timeout_s=lock_timeout_s)
    if error is not None:
        raise error
    with holder.locked(timeout=lock_timeout_s) as kv:
        jax.block_until_ready([kv[spec.name] for spec in kv_args.pools])


def scatter_rooms(
    holder: KVCacheHolder,
    kv_args: KVArgs,
    rooms: Sequence[tuple[Sequence[jax.Array], RoomPages]],
    *,
    method: ScatterMethod | None = None,
    lock_timeout_s: float = -1,
    keep: Callable[[int], bool] = lambda i: True,
) -> list[Exception | None]:
    """D side: write several pulled rooms into their preallocated pages with one hold of the
    lock, dispatching the copies without waiting for them; one error (or None) per room.
    ``keep(i)`` is asked under the lock, just before room ``i``'s copies: False skips it
    (its error is a :class:`ScatterSkipped`), so whoever decides it under the same lock knows
    that no copy of it starts afterwards.

    Call it on the thread that dispatches the forward steps, between two steps: the next step's
    forward then runs on the pool the copies return, so JAX orders it after them, and no copy
    ever waits for a step in flight (a copy dispatched from another thread while a step runs is
    ordered after that whole step, and used to hold the lock, and its pull thread, meanwhile).
    Checks and compiles happen outside the lock; a room that fails them is skipped."""
    errors: list[Exception | None] = [None] * len(rooms)
    method = method or default_scatter_method()  # this backend's (Pallas on a TPU)
    if method != "xla":
        with holder.locked(timeout=lock_timeout_s) as kv:
            for i, (arrays, pages) in enumerate(rooms):
                if not keep(i):
                    errors[i] = ScatterSkipped()
                    continue
                try:
                    by_pool = _room_pages(kv_args, arrays, pages)
                    for spec, packed in zip(kv_args.pools, arrays, strict=True):
                        kv[spec.name] = insert_kv_chunks(
                            kv[spec.name], packed, by_pool[spec.name], method=method
                        )
                except Exception as exc:  # one room's bad input fails that room alone
                    errors[i] = exc
        return errors
    with holder.locked(timeout=lock_timeout_s) as kv:
        structs = {spec.name: [as_struct(a) for a in kv[spec.name]] for spec in kv_args.pools}
    plans = _scatter_plans(kv_args, structs, rooms, errors)
    if not plans:
        return errors
    with holder.locked(timeout=lock_timeout_s) as kv:
        for i, room_plans in plans:
            if not keep(i):
                errors[i] = ScatterSkipped()
                continue
            try:
                for name, run in room_plans:
                    kv[name] = run(list(kv[name]))
            except Exception as exc:
                errors[i] = exc
    return errors


_Plan = Callable[[list[jax.Array]], list[jax.Array]]


def _scatter_plans(
    kv_args: KVArgs,
    structs: Mapping[str, list[jax.ShapeDtypeStruct]],
    rooms: Sequence[tuple[Sequence[jax.Array], RoomPages]],
    errors: list[Exception | None],
) -> list[tuple[int, list[tuple[str, _Plan]]]]:
    """Each room's copies (the XLA tiers), planned outside the lock against the pools' shapes:
    (room index, [(pool, copy)]); a room whose input does not fit gets its error instead."""
    plans = []
    for i, (arrays, pages) in enumerate(rooms):
        try:
            by_pool = _room_pages(kv_args, arrays, pages)
            room_plans = []
            for spec, packed in zip(kv_args.pools, arrays, strict=True):
                pool = structs[spec.name]
                check_packed(pool, packed, by_pool[spec.name])
                room_plans.append(
                    (spec.name, tiered.scatter_plan(pool, packed, by_pool[spec.name]))
                )
            plans.append((i, room_plans))
        except Exception as exc:
            errors[i] = exc
    return plans


def _room_pages(
    kv_args: KVArgs, arrays: Sequence[jax.Array], pages: RoomPages
) -> dict[str, tuple[int, ...]]:
    """One room's destination pages per pool, after checking it brought one array per pool."""
    if len(arrays) != len(kv_args.pools):
        raise ValueError(f"{len(arrays)} arrays for {len(kv_args.pools)} pools")
    return pages_by_pool(kv_args, pages)


def warm_room_copies(holder: KVCacheHolder, kv_args: KVArgs, max_pages: int, what: str,
                     *, method: GatherMethod | None = None) -> int:
    """Compile the quick-tier gather (P) or scatter (D) of every page bucket a room of up to
    ``max_pages`` pages lands in, in every pool, or the Pallas kernel where ``method`` (by
    default this backend's, as P's gathers and D's pulls use it) says so; returns how many
    were compiled."""
    buckets = page_buckets_upto(max_pages)
    if what == "gather" and (method or default_gather_method()) == "pallas":
        with holder.locked() as kv:
            for spec in kv_args.pools:
                for bucket in buckets:
                    warm_pallas_gather(kv[spec.name], bucket)
        return len(buckets) * len(kv_args.pools)
    if what == "scatter" and (method or default_scatter_method()) == "pallas":
        with holder.locked() as kv:
            for spec in kv_args.pools:
                for bucket in buckets:
                    kv[spec.name] = warm_pallas_scatter(kv[spec.name], bucket)
        return len(buckets) * len(kv_args.pools)
    with holder.locked() as kv:
        structs = {spec.name: [as_struct(a) for a in kv[spec.name]] for spec in kv_args.pools}
    return sum(tiered.warm(structs[spec.name], buckets, what) for spec in kv_args.pools)
