"""The paged KV pool layout and the page allocator.

Layout (one array per layer), close to sgl-jax / tpu-inference:

    kv[layer].shape == (num_pages, page_size, 2 * num_kv_heads, head_dim)    # heads (the CPU's)
    kv[layer].shape == (num_pages, page_size, 2 * num_kv_heads * head_dim)    # lanes (a TPU's)

K and V are interleaved: K of kv-head ``h`` at ``2*h``, V at ``2*h + 1`` (in the lanes layout,
lanes ``[2hD, 2hD + D)`` and the ``D`` after). The two layouts hold the same bytes in the same
order; they differ where an array's minor axes are tiled, as on a TPU (16 x 128 for bf16), where
only the lanes layout keeps a page dense for any head count and for head_dim 64. Page-major order
makes a request's KV a gather along axis 0 and keeps every page one contiguous block, which is
what the transfer path moves.

Page 0 is reserved as the *null page*: padded token positions (prompt lengths rounded up to a
bucket, padded batch rows, padded page lists) write there and read from there, so jitted code
never needs a branch for padding. The allocator never hands it out.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import attrs
import jax
import jax.numpy as jnp

NULL_PAGE = 0


@attrs.frozen
class KVPoolConfig:
    num_layers: int
    num_pages: int  # including the reserved null page
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"  # what the KV is: float32 or bfloat16
    lanes: bool = False  # the lanes layout (above); False: the heads layout
    # bf16 KV kept as its bits in uint16 (``storage_dtype``); a TPU keeps bf16 itself.
    bf16_bits: bool = True

    @property
    def storage_dtype(self) -> str:
        """What the pool's arrays hold: bf16 KV is kept as its bits in uint16. XLA:CPU updates a
        donated bf16 array by copying all of it (3.3 ms per layer for 12 MB, against 0.06 ms in
        place for uint16, measured here), which made a bf16 pool's decode step 4.6x and its
        scatter 30x slower; integer updates stay in place. ``forward.kv_encode`` /
        ``kv_decode`` convert at the two ends (round to nearest even, and a shift)."""
        return "uint16" if self.dtype == "bfloat16" and self.bf16_bits else self.dtype

    @property
    def page_shape(self) -> tuple[int, ...]:
        if self.lanes:
            return (self.page_size, 2 * self.num_kv_heads * self.head_dim)
        return (self.page_size, 2 * self.num_kv_heads, self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return (self.num_pages, *self.page_shape)

    @property
    def usable_pages(self) -> int:
        return self.num_pages - 1

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)


class PageAllocatorError(RuntimeError):
    """A caller asked for what the allocator's accounting forbids (double free, foreign page)."""


class PageAllocator:
    """Single owner of the free/used page accounting. Page ``NULL_PAGE`` is never handed out."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError("num_pages must be >= 2 (page 0 is the reserved null page)")
        self.total = num_pages - 1
        # LIFO free list: recently freed pages are reused first (warm in cache).
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._used: set[int] = set()
        # Pages with more than one holder (sequences forked from one prompt): their count.
        self._holders: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` page ids, or ``None`` (nothing taken) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def share(self, pages: Iterable[int], holders: int) -> None:
        """``holders`` more holders of each of ``pages`` (in use): a page goes back to the free
        list only when every holder has freed it."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._used]
        if bad or holders < 0:
            raise PageAllocatorError(f"cannot share pages not in use: {sorted(set(bad))}")
        for p in pages:
            self._holders[p] = self._holders.get(p, 1) + holders

    def holders(self, page: int) -> int:
        return self._holders.get(page, 1 if page in self._used else 0)

    def free(self, pages: Iterable[int]) -> None:
        """Give pages up (a shared page: one holder's share); refuses (changing nothing) on a
        double free or a page never handed out."""
        pages = list(pages)
        bad = [p for p in pages if p not in self._used]
        if bad or len(set(pages)) != len(pages):
            raise PageAllocatorError(f"free of pages not in use (double free?): {sorted(set(bad))}")
        released = []
        for p in pages:
            held = self._holders.pop(p, 1) - 1
            if held > 1:
                self._holders[p] = held
            elif held == 0:
                released.append(p)
        self._used.difference_update(released)
        self._free.extend(released)


def allocate_kv_pool(
    cfg: KVPoolConfig, sharding: jax.sharding.Sharding | None = None
) -> list[jax.Array]:
    """A zeroed pool: ``cfg.num_layers`` arrays of ``cfg.layer_shape`` placed as ``sharding``
    (default: the first device; a tensor-parallel instance passes its mesh's pool sharding)."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    zeros = jax.jit(lambda: jnp.zeros(cfg.layer_shape, jnp.dtype(cfg.storage_dtype)),
                    out_shardings=sharding)
    return [zeros() for _ in range(cfg.num_layers)]


@functools.partial(jax.jit, donate_argnames=("kv",))
def copy_pages(kv: list[jax.Array], src: jax.Array, dst: jax.Array) -> list[jax.Array]:
    """Page ``src[i]`` copied onto page ``dst[i]`` in every layer, in place (a forked sequence's
    own copy of the page it will write next)."""
    return [pool.at[dst].set(pool[src]) for pool in kv]
