"""A step's KV write as DMAs of token runs, or as whole pages then tokens: the alternatives to
one scatter row per token.

The step's new K/V (``entry``: ``[tokens, lanes]``, the lanes layout) goes into one layer's
pool (``[pages, page_size, lanes]``) at each token's page and offset. As an XLA scatter that is
one row per token (a profile of a 1,024-token prefill of Qwen3-0.6B on a v5e: ~0.1 ms a layer,
~39 GB/s). Here the tokens are split into runs that stay inside one page — consecutive tokens
of one sequence, cut where a page begins — and each run is copied by DMA from ``entry`` into
``pool[page, off:off+m]``: a prefill of 1,024 tokens from a page boundary is 64 runs of 16, a
decode row a run of 1, a chunk starting mid-page has a short first run. Padding tokens (past
``sum(q_lens)``) write nothing.

The copies are :func:`pd_fsm.jax_engine.kv.pallas_copy.copy_runs`'s power-of-two pieces (DMA
slice sizes static, offsets dynamic), all started before any is waited on (the runs never
overlap). The run table is computed inside the jitted step; its static length bounds the runs
any step of that shape can have (:func:`max_runs`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pd_fsm.jax_engine.kv.pallas_copy import copy_runs, dma_call, leading_rows
from pd_fsm.jax_engine.kv.pool import NULL_PAGE


def max_runs(tokens: int, seqs: int, page_size: int) -> int:
    """The most runs ``tokens`` new tokens of ``seqs`` sequences split into: each run holds a
    token, and sequence ``s``'s ``q`` tokens from offset ``o`` touch ``(o + q - 1) // P + 1 <=
    (q + P - 2) // P + 1`` pages, which summed over the sequences is below ``tokens / P + 2 *
    seqs``."""
    return max(1, min(tokens, tokens // page_size + 2 * seqs))


def token_runs(write_page: jax.Array, write_off: jax.Array, first: jax.Array, real: jax.Array,
               page_size: int, runs: int) -> tuple[jax.Array, jax.Array]:
    """The run table ``[3, runs]`` (each run's first token, its first pool row ``page *
    page_size + off``, its length) and the run count, from each token's page and offset,
    whether it is its sequence's first new token, and whether it is real (padding: not)."""
    tokens = write_page.shape[0]
    starts = real & (first | (write_off == 0))
    (start,) = jnp.nonzero(starts, size=runs, fill_value=tokens)
    end = jnp.minimum(jnp.append(start[1:], tokens), jnp.sum(real))
    at = jnp.clip(start, 0, tokens - 1)
    table = jnp.stack([start, write_page[at] * page_size + write_off[at],
                       jnp.maximum(end - start, 0)]).astype(jnp.int32)
    return table, jnp.sum(starts).astype(jnp.int32)


def _kernel(table_ref: Any, n_runs_ref: Any, entry_ref: Any, pool_in: Any, pool_ref: Any,
            sems: Any, *, page_size: int) -> None:
    del pool_in  # aliased to pool_ref
    def pool_rows(layer: int, row: Any, size: int) -> Any:
        # A piece never crosses a page: its run does not. (Truncating division: the row is not
        # negative, and floor division's sign test needs the chip's description to lower.)
        return pool_ref.at[jax.lax.div(row, page_size), pl.ds(jax.lax.rem(row, page_size), size)]

    copy_runs(table_ref, n_runs_ref[0], leading_rows(lambda layer: entry_ref), pool_rows, sems,
              n_layers=1, n_bits=page_size.bit_length(), wait_each_run=False)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("interpret",))
def write_runs(pool: jax.Array, entry: jax.Array, table: jax.Array, n_runs: jax.Array, *,
               interpret: bool = False) -> jax.Array:
    """``pool[page, off:off+m] = entry[s:s+m]`` for each of the first ``n_runs`` runs of
    ``table`` (:func:`token_runs`), by DMA; ``pool`` donated and written in place."""
    kernel = functools.partial(_kernel, page_size=pool.shape[1])
    out: jax.Array = dma_call(
        kernel, 1, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
        # operand order: table, n_runs, entry, pool -> pool aliases the output
        {3: 0}, interpret,
    )(table, n_runs.reshape(1), entry, pool)
    return out


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
