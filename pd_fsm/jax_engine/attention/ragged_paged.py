"""Ragged paged attention: a Pallas TPU kernel of pd_fsm's own, for one layer of a step.

A step's new tokens are the concatenation of its sequences' (``q_lens[s]`` tokens of sequence
``s``; a decode row feeds one, a prefill chunk many). Sequence ``s`` attends over ``kv_lens[s]``
tokens of context — its cached ones and its new ones, whose K/V the step has already written
into the pool — read from the pages ``page_table[s]`` lists, causally: its ``k``-th new token sits
at position ``kv_lens[s] - q_lens[s] + k`` and sees keys at positions up to its own.

The pool is the lanes layout (``KVPoolConfig.lanes``): per layer ``(pages, page_size,
2 * Nkv * D)``, each token's K of kv-head ``h`` at lanes ``[2hD, 2hD + D)`` and its V right after.
Those are the same bytes as the heads layout ``(pages, page_size, 2 * Nkv, D)``; on a TPU, where an
array's two minor axes are tiled (16 x 128 for bf16), only this one keeps a page dense in HBM for
any head count and for head_dim 64 (the heads layout pads ``2 * Nkv`` to 16 rows and ``D`` to 128
lanes per token).

How the kernel runs: the queries are cut into blocks of ``block_q`` tokens of one sequence each
(a *work item*), laid out kv-head-major so that a kv-head's block is a plain ``[G * block_q, W]``
matrix (G query heads per kv-head). The grid walks the items in order; each item loops over its
sequence's pages ``block_pages`` at a time, DMA'd from HBM into one of two VMEM buffers while the
other is computed on (the next item's first block is fetched during the current item's last), and
keeps an online softmax per kv-head. Only pages holding context are fetched. With ``D`` a multiple
of 128, K and V are lane-aligned slices of a page; with ``D == 64`` a kv-head's ``[K | V]`` is one
128-lane slot, so the query is padded with 64 zero lanes (``q . [K | V] == q . K``) and the output
is the slot's upper half (``p @ [K | V] == [p @ K | p @ V]``): twice the matrix work of an
aligned head, none of the unaligned lane slicing Mosaic cannot do.

JAX ships a ragged paged attention kernel too (``jax.experimental.pallas.ops.tpu.
ragged_paged_attention``, the heads layout); it refuses head counts that do not tile (SmolLM2's 3
kv-heads) and head_dim 64, and it does not run in Pallas's TPU interpret mode, which is how the
CPU suite runs this one.
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Finite, so that a row whose block holds no visible key keeps a finite running maximum (the
# first block of every row holds position 0, which every query sees).
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)
_LANES = 128


def slot_width(head_dim: int) -> int:
    """The lanes one kv-head's query block and output take in the kernel (``W``)."""
    if head_dim % _LANES == 0:
        return head_dim
    if 2 * head_dim == _LANES:
        return _LANES
    raise ValueError(f"head_dim {head_dim}: the kernel takes multiples of 128, or 64")


def rows_multiple(dtype: Any) -> int:
    """The sublane multiple a VMEM block's second-minor axis needs in ``dtype``."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def decode_block_q(group: int, dtype: Any) -> int:
    """The smallest power-of-two query block (at least 8) whose ``G * block_q`` rows tile."""
    block_q = 8
    while (block_q * group) % rows_multiple(dtype):
        block_q *= 2
    return block_q


def max_items(tokens: int, seqs: int, block_q: int) -> int:
    """How many work items ``tokens`` new tokens over ``seqs`` sequences can need at most."""
    return -(-tokens // block_q) + seqs


def _items(q_lens: jax.Array, n_items: int, block_q: int
           ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Each work item's sequence and first query (within the sequence's new tokens), the number
    of real items, and each sequence's first item."""
    blocks = (q_lens + block_q - 1) // block_q
    end = jnp.cumsum(blocks)
    start = end - blocks
    item = jnp.arange(n_items, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(end, item, side="right"), q_lens.shape[0] - 1)
    q0 = (item - start[seq]) * block_q
    return seq.astype(jnp.int32), q0.astype(jnp.int32), end[-1:].astype(jnp.int32), start


@attrs.frozen
class _Shape:
    """The kernel's static shape: what one compiled kernel is built for."""

    nkv: int
    head_dim: int
    block_q: int
    block_pages: int
    pages_per_seq: int
    scale: float
    unroll_dma: bool


class _Refs:
    """One kernel invocation's refs, and what it does with them: where an item's keys are,
    the DMAs that bring its pages into VMEM, and the online softmax over a block of them."""

    def __init__(self, shape: _Shape, item_seq: Any, item_q0: Any, q_lens: Any, kv_lens: Any,
                 table: Any, q: Any, pool: Any, buf: Any, sem: Any, m: Any, denom: Any,
                 acc: Any) -> None:
        self.shape = shape
        self.item_seq, self.item_q0, self.q_lens, self.kv_lens = item_seq, item_q0, q_lens, kv_lens
        self.table, self.q, self.pool, self.buf, self.sem = table, q, pool, buf, sem
        self.m, self.denom, self.acc = m, denom, acc
        self.page_size = buf.shape[2]
        self.rows, self.width = q.shape[1], q.shape[2]
        self.block_tokens = shape.block_pages * self.page_size
        # A 16-bit pool's products at the MXU's own precision, whatever the process's default:
        # under JAX_DEFAULT_MATMUL_PRECISION=highest Mosaic is asked for an fp32 contraction of
        # bf16 operands and refuses the kernel ("Bad lhs type", seen on a v5e); f32 follows it.
        self.precision = (jax.lax.Precision.DEFAULT if jnp.dtype(pool.dtype).itemsize < 4
                          else None)

    def span(self, item: Any) -> tuple[Any, Any, Any, Any, Any]:
        """An item's sequence, first query, the sequence's new and context lengths, and the
        keys its queries see (positions below the block's last query's, and its own)."""
        seq = self.item_seq[item]
        q0 = self.item_q0[item]
        q_len = self.q_lens[seq]
        kv_len = self.kv_lens[seq]
        return seq, q0, q_len, kv_len, kv_len - q_len + jnp.minimum(q0 + self.shape.block_q,
                                                                    q_len)

    def pages(self, kv_end: Any) -> Any:
        return (kv_end + self.page_size - 1) // self.page_size

    def _copy(self, seq: Any, block: Any, p: Any, slot: Any) -> Any:
        shape = self.shape
        j = block * shape.block_pages + p
        page = self.table[seq * shape.pages_per_seq + jnp.minimum(j, shape.pages_per_seq - 1)]
        return pltpu.make_async_copy(self.pool.at[page], self.buf.at[slot, p],
                                     self.sem.at[slot])

    def each_page(self, seq: Any, n_pages: Any, block: Any, slot: Any, act: str) -> None:
        """Start (or wait for) the DMA of every page of the block that holds context."""
        block_pages = self.shape.block_pages
        count = jnp.minimum(block_pages, n_pages - block * block_pages)
        if self.shape.unroll_dma:
            for p in range(block_pages):
                pl.when(p < count)(getattr(self._copy(seq, block, p, slot), act))
            return

        def body(p: Any, carry: Any) -> Any:
            getattr(self._copy(seq, block, p, slot), act)()
            return carry

        jax.lax.fori_loop(0, count, body, 0)

    def item(self, i: Any, n_items: Any, slot: Any) -> Any:
        """Fold work item ``i``'s keys, block by block, the next block's DMAs started before
        the current one is waited for (the next item's first during this one's last). Its first
        block is in (or on its way to) buffer ``slot``; returns the buffer the next item's
        first block goes to."""
        shape = self.shape
        seq, q0, q_len, kv_len, kv_end = self.span(i)
        n_pages = self.pages(kv_end)
        n_blocks = (n_pages + shape.block_pages - 1) // shape.block_pages
        # Row g * BQ + t of the item's block holds its query t. Masks are built at full shape:
        # Mosaic lays out [n, 1] columns poorly.
        grid = (self.rows, self.block_tokens)
        q_pos = kv_len - q_len + q0 + (
            jax.lax.broadcasted_iota(jnp.int32, grid, 0) & (shape.block_q - 1))
        key = jax.lax.broadcasted_iota(jnp.int32, grid, 1)
        held_key = jax.lax.broadcasted_iota(jnp.int32, (self.block_tokens, self.width), 0)

        def body(block: Any, slot: Any) -> Any:
            nxt = 1 - slot

            @pl.when(block + 1 < n_blocks)
            def _prefetch_own() -> None:
                self.each_page(seq, n_pages, block + 1, nxt, "start")

            @pl.when(jnp.logical_and(block + 1 == n_blocks, i + 1 < n_items))
            def _prefetch_next_item() -> None:
                next_seq, _, _, _, next_end = self.span(i + 1)
                self.each_page(next_seq, self.pages(next_end), 0, nxt, "start")

            self.each_page(seq, n_pages, block, slot, "wait")
            first = block * self.block_tokens
            k_pos = first + key
            self.fold(slot, jnp.logical_and(k_pos <= q_pos, k_pos < kv_len),
                      first + held_key < kv_end)
            return nxt

        return jax.lax.fori_loop(0, n_blocks, body, slot)

    def fold(self, slot: Any, visible: Any, held: Any) -> None:
        """Fold the block of keys in buffer ``slot`` into every kv-head's running softmax:
        ``visible [rows, keys]`` says which each query sees, ``held [keys, W]`` which hold
        fetched context (the rest is stale or never-written VMEM, kept out of the sums: 0 * NaN
        is NaN)."""
        shape, width, rows, tokens = self.shape, self.width, self.rows, self.block_tokens
        for h in range(shape.nkv):
            lane = 2 * h * shape.head_dim
            k = self.buf[slot, :, :, pl.ds(lane, width)].reshape(tokens, width)
            v = k if width != shape.head_dim else self.buf[
                slot, :, :, pl.ds(lane + shape.head_dim, width)].reshape(tokens, width)
            v = jnp.where(held, v, jnp.zeros_like(v))
            q = self.q[h].astype(k.dtype)
            s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=self.precision,
                                    preferred_element_type=jnp.float32) * shape.scale
            s = jnp.where(visible, s, _MASK)
            m_cur = jnp.max(s, axis=1, keepdims=True)
            p = jnp.exp(s - m_cur)
            l_cur = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), (rows, _LANES))
            m_cur = jnp.broadcast_to(m_cur, (rows, _LANES))
            pv = jnp.dot(p.astype(v.dtype), v, precision=self.precision,
                         preferred_element_type=jnp.float32)
            m_prev = self.m[h]
            m_next = jnp.maximum(m_prev, m_cur)
            alpha = jnp.exp(m_prev - m_next)
            beta = jnp.exp(m_cur - m_next)
            self.denom[h] = alpha * self.denom[h] + beta * l_cur
            self.m[h] = m_next
            self.acc[h] = _lanes(alpha, width) * self.acc[h] + _lanes(beta, width) * pv


def _kernel(
    # scalar prefetch (SMEM)
    item_seq_ref: Any, item_q0_ref: Any, q_lens_ref: Any, kv_lens_ref: Any, table_ref: Any,
    n_items_ref: Any,
    # inputs
    q_ref: Any,  # VMEM [Nkv, G * BQ, W]: this item's queries, row g * BQ + t
    pool_ref: Any,  # HBM [pages, page_size, 2 * Nkv * D]
    # output
    o_ref: Any,  # VMEM [Nkv, G * BQ, W]
    # scratch
    buf_ref: Any,  # VMEM [2, BP, page_size, 2 * Nkv * D]
    sem_ref: Any,  # DMA semaphores [2]
    slot_ref: Any,  # SMEM [1]: the buffer the current item's first block is fetched into
    m_ref: Any, l_ref: Any,  # VMEM [Nkv, G * BQ, 128] f32: running max and denominator
    acc_ref: Any,  # VMEM [Nkv, G * BQ, W] f32
    *,
    shape: _Shape,
) -> None:
    r = _Refs(shape, item_seq_ref, item_q0_ref, q_lens_ref, kv_lens_ref, table_ref, q_ref,
              pool_ref, buf_ref, sem_ref, m_ref, l_ref, acc_ref)
    i = pl.program_id(0)
    n_items = n_items_ref[0]

    @pl.when(jnp.logical_and(i == 0, n_items > 0))
    def _first_fetch() -> None:
        seq, _, _, _, kv_end = r.span(0)
        slot_ref[0] = 0
        r.each_page(seq, r.pages(kv_end), 0, 0, "start")

    @pl.when(i < n_items)
    def _item() -> None:
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        slot_ref[0] = r.item(i, n_items, slot_ref[0])
        for h in range(shape.nkv):
            o_ref[h] = (acc_ref[h] / _lanes(l_ref[h], r.width)).astype(o_ref.dtype)


def _lanes(x: Any, width: int) -> Any:
    """A ``[rows, 128]`` lane-replicated column as ``[rows, width]``."""
    if width == _LANES:
        return x
    return jnp.concatenate([x] * (width // _LANES), axis=1)


def _kv_heads(pool: jax.Array, head_dim: int) -> int:
    return pool.shape[2] // (2 * head_dim)


@attrs.frozen
class ItemPlan:
    """Where a step's queries go in the kernel and come back from: the same for every layer of
    a step, so computed once (``plan_items``)."""

    block_q: int
    item_seq: jax.Array  # [I] each work item's sequence
    item_q0: jax.Array  # [I] its first query, among the sequence's new tokens
    n_real: jax.Array  # [1] work items in use
    src: jax.Array  # [I * BQ] the token whose query each padded row takes
    row: jax.Array  # [T] the padded row each token's output comes back from
    real: jax.Array  # [T] whether a token is a step's (not padding)


def plan_items(q_lens: jax.Array, tokens: int, block_q: int) -> ItemPlan:
    """The work items for ``tokens`` new tokens split ``q_lens`` (``[S]``) among sequences."""
    seqs = q_lens.shape[0]
    n_items = max_items(tokens, seqs, block_q)
    item_seq, item_q0, n_real, seq_first_item = _items(q_lens, n_items, block_q)
    # Padded row r (item r // BQ, query t = r % BQ) takes the query of token cu[seq] + q0 + t.
    cu = jnp.cumsum(q_lens) - q_lens
    r = jnp.arange(n_items * block_q, dtype=jnp.int32)
    src = cu[item_seq[r // block_q]] + item_q0[r // block_q] + (r & (block_q - 1))
    # Token k of sequence s comes back from row (first item of s) * BQ + k.
    token = jnp.arange(tokens, dtype=jnp.int32)
    ends = jnp.cumsum(q_lens)
    seq = jnp.minimum(jnp.searchsorted(ends, token, side="right"), seqs - 1)
    row = seq_first_item[seq] * block_q + token - cu[seq]
    return ItemPlan(block_q, item_seq, item_q0, n_real, jnp.clip(src, 0, tokens - 1),
                    jnp.clip(row, 0, n_items * block_q - 1), token < ends[-1])


jax.tree_util.register_dataclass(
    ItemPlan, data_fields=["item_seq", "item_q0", "n_real", "src", "row", "real"],
    meta_fields=["block_q"])


def _call(shape: _Shape, q_items: jax.Array, pool: jax.Array, plan: ItemPlan,
          q_lens: jax.Array, kv_lens: jax.Array, page_table: jax.Array, interpret: bool,
          vmem_limit_bytes: int) -> jax.Array:
    """The ``pallas_call``: a grid step per work item, the queries' blocks in VMEM, the pool in
    HBM, two VMEM buffers of ``block_pages`` pages and the softmax's running state."""
    rows, width = q_items.shape[1] // plan.item_seq.shape[0], q_items.shape[2]

    def item_block(i: Any, *prefetched: Any) -> tuple[Any, Any, Any]:
        # Past the items in use, the last one's block again: the pipeline fetches and writes
        # back a block only when its index changes, so an unused grid step (a step's padding
        # sequences) moves nothing; the kernel leaves its output alone there.
        n_items = prefetched[-1][0]
        return 0, jnp.maximum(jnp.minimum(i, n_items - 1), 0), 0

    block = pl.BlockSpec((shape.nkv, rows, width), item_block)
    page_size = pool.shape[1]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=6,
        grid=(plan.item_seq.shape[0],),
        in_specs=[block, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=block,
        scratch_shapes=[
            pltpu.VMEM((2, shape.block_pages, page_size, pool.shape[2]), pool.dtype),
            pltpu.SemaphoreType.DMA((2,)),
            pltpu.SMEM((1,), jnp.int32),
            pltpu.VMEM((shape.nkv, rows, _LANES), jnp.float32),
            pltpu.VMEM((shape.nkv, rows, _LANES), jnp.float32),
            pltpu.VMEM((shape.nkv, rows, width), jnp.float32),
        ],
    )
    out: jax.Array = pl.pallas_call(
        functools.partial(_kernel, shape=shape),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",), vmem_limit_bytes=vmem_limit_bytes),
        interpret=pltpu.InterpretParams() if interpret else False,
        name="pd_fsm_ragged_paged_attention",
    )(plan.item_seq, plan.item_q0, q_lens.astype(jnp.int32), kv_lens.astype(jnp.int32),
      page_table.reshape(-1).astype(jnp.int32), plan.n_real, q_items, pool)
    return out


def attend(
    q: jax.Array,
    pool: jax.Array,
    q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    plan: ItemPlan,
    *,
    block_pages: int,
    interpret: bool = False,
    unroll_dma: bool = False,
    vmem_limit_bytes: int = 64 * 1024 * 1024,
) -> jax.Array:
    """Attention of ``q [T, Nh, D]`` over the pool through ``plan`` (``plan_items`` of the same
    ``q_lens``); see ``ragged_paged_attention``."""
    _, nh, head_dim = q.shape
    block_q = plan.block_q
    nkv = _kv_heads(pool, head_dim)
    group = nh // nkv
    pages_per_seq = page_table.shape[1]
    width = slot_width(head_dim)
    if block_q & (block_q - 1) or (group * block_q) % rows_multiple(q.dtype):
        raise ValueError(f"block_q {block_q} does not tile {group} query heads per kv-head")
    n_items = plan.item_seq.shape[0]
    q_w = q if width == head_dim else jnp.pad(q, ((0, 0), (0, 0), (0, width - head_dim)))
    q_items = (q_w[plan.src].reshape(n_items, block_q, nkv, group, width)
               .transpose(2, 0, 3, 1, 4).reshape(nkv, n_items * group * block_q, width))

    shape = _Shape(nkv, head_dim, block_q, block_pages, pages_per_seq, head_dim**-0.5,
                   unroll_dma)
    out = _call(shape, q_items, pool, plan, q_lens, kv_lens, page_table, interpret,
                vmem_limit_bytes)
    out_rows = (out.reshape(nkv, n_items, group, block_q, width)
                .transpose(1, 3, 0, 2, 4).reshape(n_items * block_q, nh, width))
    out = out_rows[plan.row, :, width - head_dim:]
    # A padding token is in no item: its row is never written. Zeros, not whatever is there:
    # its K/V goes to the null page, which must stay finite for the paths that read it masked.
    return jnp.where(plan.real[:, None, None], out, jnp.zeros_like(out))


@functools.partial(jax.jit, static_argnames=("block_q", "block_pages", "interpret",
                                             "unroll_dma", "vmem_limit_bytes"))
def ragged_paged_attention(
    q: jax.Array,
    pool: jax.Array,
    q_lens: jax.Array,
    kv_lens: jax.Array,
    page_table: jax.Array,
    *,
    block_q: int,
    block_pages: int,
    interpret: bool = False,
    unroll_dma: bool = False,
    vmem_limit_bytes: int = 64 * 1024 * 1024,
) -> jax.Array:
    """Attention of ``q [T, Nh, D]`` (the step's new tokens, sequence after sequence; tokens past
    ``sum(q_lens)`` are padding) over the pool, as the module docstring says; ``[T, Nh, D]`` in
    ``q``'s dtype. ``q_lens``, ``kv_lens``: ``[S]`` (padding sequences have ``q_lens == 0``);
    ``page_table``: ``[S, P]``. ``block_q`` must be a power of two whose ``G * block_q`` rows tile
    (``decode_block_q``); ``block_pages`` pages are fetched at a time (their DMAs issued from a
    loop, or unrolled with ``unroll_dma``)."""
    plan = plan_items(q_lens, q.shape[0], block_q)
    return attend(q, pool, q_lens, kv_lens, page_table, plan, block_pages=block_pages,
                  interpret=interpret, unroll_dma=unroll_dma,
                  vmem_limit_bytes=vmem_limit_bytes)
