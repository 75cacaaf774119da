"""The one lock around the current per-layer KV pool arrays (DESIGN §6 ordering hazard).

Both a forward step and a scatter *replace* the pool: each donates the arrays it was given and
returns new ones. If a step read ``pools["main_kv"]`` while a pull thread swapped in a scatter's
result, one of them would work on donated (deleted) buffers or write into a pool that the other
then overwrites with a stale copy. So every read-modify-write of the pool reference goes through
one :class:`KVCacheHolder`:

    with holder.locked() as kv:            # scheduler thread, between/around a forward step
        logits, kv["main_kv"] = step(params, kv["main_kv"], batch)

    holder.swap(lambda pools: {**pools, "main_kv": insert_kv_chunks(pools["main_kv"], x, pages)})

Inside the lock only *dispatch* has to happen: JAX orders work on the same buffers, so a scatter
dispatched after a step's dispatch sees the step's writes and vice versa. Never keep a reference to
pool arrays obtained under the lock after leaving it: the next holder of the lock may donate them.
The lock is not re-entrant.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import jax

Pools = dict[str, list[jax.Array]]


class HeldPools:
    """The pools while the holder's lock is held: read with ``kv[name]``, replace with
    ``kv[name] = new_arrays``. Invalid once the ``with`` block exits."""

    def __init__(self, holder: KVCacheHolder) -> None:
        self._holder = holder
        self._open = True

    def _check(self) -> None:
        if not self._open:
            raise RuntimeError("KV pools used outside holder.locked()")

    def __getitem__(self, name: str) -> list[jax.Array]:
        self._check()
        return list(self._holder._pools[name])

    def __setitem__(self, name: str, arrays: Sequence[jax.Array]) -> None:
        self._check()
        old = self._holder._pools[name]
        new = list(arrays)
        if len(new) != len(old):
            raise ValueError(f"pool {name!r}: {len(new)} layers replace {len(old)}")
        self._holder._pools[name] = new
        self._holder._generation += 1

    def names(self) -> list[str]:
        return list(self._holder._pools)


class KVCacheHolder:
    """Owns the current pool arrays (pool name -> per-layer arrays) and the lock guarding them."""

    def __init__(self, pools: Mapping[str, Sequence[jax.Array]]) -> None:
        self._pools: Pools = {name: list(arrays) for name, arrays in pools.items()}
        self._lock = threading.Lock()
        self._generation = 0

    @property
    def generation(self) -> int:
        """How many times a pool was replaced (for tests and metrics)."""
        return self._generation

    @contextmanager
    def locked(self, timeout: float = -1) -> Iterator[HeldPools]:
        """Hold the lock; ``timeout`` (seconds, -1 = forever) raises ``TimeoutError`` if not got."""
        if not self._lock.acquire(timeout=timeout):
            raise TimeoutError("KV cache holder lock not acquired in time")
        held = HeldPools(self)
        try:
            yield held
        finally:
            held._open = False
            self._lock.release()

    def swap(self, fn: Callable[[Pools], Mapping[str, Sequence[jax.Array]]]) -> None:
        """Replace pools with ``fn(current)`` under the lock; pools missing from the result stay."""
        with self.locked() as held:
            current = {name: held[name] for name in held.names()}
            for name, arrays in fn(current).items():
                held[name] = arrays
