"""A step's KV write as whole pages, then the other tokens: the alternative to one scatter row
per token.

The step's new K/V (``entry``: ``[tokens, lanes]``, the lanes layout) goes into one layer's
pool (``[pages, page_size, lanes]``) at each token's page and offset. As an XLA scatter that is
one row per token; a prompt's tokens mostly fill whole pages, and a scatter of one row per page
moves the same bytes in ``page_size`` times fewer rows. Measured on a v5e (bench/RESULTS_tpu.md,
run 8): a 1,024-token prefill of Qwen3-0.6B 17.8 -> 14.8 ms, a 4,096-token one 74.0 -> 61.4 ms.

(A Pallas kernel writing each in-page run by DMA was tried too: it lowered, ran in interpret
mode, and failed Mosaic's compile on the chip, a run's offset inside a page not being a
multiple of the 8-row tile. It was removed.)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pd_fsm.jax_engine.kv.pool import NULL_PAGE


def write_pages_then_tokens(write_page: jax.Array, write_off: jax.Array, first: jax.Array,
                            real: jax.Array, page_size: int, seqs: int
                            ) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The write as two XLA scatters, no kernel: the runs that fill a page as one scatter row
    of a whole page each (its tokens taken from ``entry`` as one window), then the other
    tokens one row each. A sequence's new tokens leave at most ``page_size - 1`` of them
    before its first whole page and as many after its last, so the second scatter has
    ``min(tokens, 2 * (page_size - 1) * seqs)`` rows where the token scatter has ``tokens``; a
    1,024-token prefill of one prompt from a page boundary is 64 page rows and no token row
    that writes. Unused rows write into the null page, as padding tokens do."""
    tokens = write_page.shape[0]
    starts = real & (first | (write_off == 0))
    # Each token's run: from the last start at or before it to the first start after it (or
    # the last real token); scans rather than a scatter-add of every token.
    index, n_real = jnp.arange(tokens), jnp.sum(real)
    begin = jax.lax.cummax(jnp.where(starts, index, 0))
    after = jnp.append(jax.lax.cummin(jnp.where(starts, index, tokens), reverse=True)[1:], tokens)
    in_page = real & (jnp.minimum(after, n_real) - begin == page_size)
    n_pages, n_rest = tokens // page_size, min(tokens, 2 * (page_size - 1) * seqs)
    (page_start,) = jnp.nonzero(starts & in_page, size=n_pages, fill_value=0)
    pages = jnp.where(jnp.arange(n_pages) < jnp.sum(starts & in_page), write_page[page_start],
                      NULL_PAGE)
    (rest,) = jnp.nonzero(real & ~in_page, size=n_rest, fill_value=0)
    rest_real = jnp.arange(n_rest) < jnp.sum(real & ~in_page)
    rest_page = jnp.where(rest_real, write_page[rest], NULL_PAGE)
    rest_off = jnp.where(rest_real, write_off[rest], 0)

    def write(pool: jax.Array, entry: jax.Array) -> jax.Array:
        if n_pages:
            window = jax.vmap(lambda s: jax.lax.dynamic_slice_in_dim(entry, s, page_size))
            pool = pool.at[pages].set(window(page_start))
        return pool.at[rest_page, rest_off].set(entry[rest])

    return write
