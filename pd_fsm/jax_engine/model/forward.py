"""The Llama-architecture forward pass over the paged KV pool.

One batched "extend" step serves both prefill and decode: every row ``b`` feeds ``num_new[b]`` new
tokens starting at absolute position ``start_pos[b]`` (prefill: the prompt, or a chunk of it after
``start_pos`` cached tokens; decode: one token). Each layer attends over the row's cached K/V
(positions ``< start_pos``, gathered from its pages through a padded page table) plus the new
tokens' own K/V (causally). Rows and positions beyond ``num_new`` are padding: they write to the
null page and their outputs are ignored.

A step is a chain of jitted calls (``_forward``: a prelude, one call per layer, the head) that
reads the pool without donating it and returns the new K/V entries; a last, donating call writes
them into the pages. Read and write in one function, XLA:CPU
copied every layer's whole pool on every step (it cannot prove the gathers precede the in-place
update), which made decode time grow with the pool size instead of the batch.

Params are a plain pytree (dicts and a list of per-layer dicts, weights laid out ``[in, out]`` so a
projection is ``x @ w``)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied to "embed"),
     "layers": [{"attn_norm": [H], "wq": [H, Nh*D], "wk": [H, Nkv*D], "wv": [H, Nkv*D],
                 "wo": [Nh*D, H], "mlp_norm": [H], "w_gate": [H, I], "w_up": [H, I],
                 "w_down": [I, H], optional "bq"/"bk"/"bv" biases (Qwen2)}, ...]}

Rotary embeddings use the rotate-half (HF) convention; loaders convert other layouts to it.
The KV pool layout is one of ``kv/pool.py``'s: per layer ``(pages, page_size, 2*Nkv, D)`` with
K of kv-head ``h`` at ``2h`` and V at ``2h+1``, or the same bytes as ``(pages, page_size,
2*Nkv*D)`` (a TPU's, which normally runs ``step/program.py`` instead of this chain). The kv list
is donated: use the returned one.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.kv.pool import NULL_PAGE
from pd_fsm.jax_engine.model.config import ModelConfig

Params = dict[str, Any]
KV = list[jax.Array]

# Finite, not -inf: a fully masked padding row must give finite (ignored) values, because its K/V
# lands in the null page that every real row also reads (masked) — a NaN there would poison them.
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def kv_encode(x: jax.Array, storage: jnp.dtype) -> jax.Array:
    """K/V values as the pool stores them: cast, or for a bf16 pool (stored as ``uint16``,
    ``KVPoolConfig.storage_dtype``) the bf16 bits, rounded to nearest even as a cast would."""
    if storage != jnp.uint16:
        return x.astype(storage)
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    rounded = bits + ((bits >> 16) & 1) + 0x7FFF
    return (rounded >> 16).astype(jnp.uint16)


def kv_decode(x: jax.Array) -> jax.Array:
    """Pool values as f32, what attention accumulates in (bf16 bits: a shift)."""
    if x.dtype != jnp.uint16:
        return x.astype(jnp.float32)
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def rope(x: jax.Array, positions: jax.Array, config: ModelConfig) -> jax.Array:
    """Rotate-half rotary embedding at ``config``'s frequencies. ``x``: ``[B, T, heads, D]``,
    ``positions``: ``[B, T]``."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = config.rope_frequencies()
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def project(h: jax.Array, layer: Params, w: str, b: str) -> jax.Array:
    y = h @ layer[w]
    return y + layer[b] if b in layer else y


def qkv(h: jax.Array, layer: Params, config: ModelConfig
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The layer's q, k and v projections of ``h [..., H]`` (``[..., Nh*D]``, ``[..., Nkv*D]``
    twice): three products, or one where the weights are fused (``fuse_projections``)."""
    if "wqkv" not in layer:
        return (project(h, layer, "wq", "bq"), project(h, layer, "wk", "bk"),
                project(h, layer, "wv", "bv"))
    y = project(h, layer, "wqkv", "bqkv")
    nq, nkv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return y[..., :nq], y[..., nq : nq + nkv], y[..., nq + nkv :]


def mlp(h: jax.Array, layer: Params) -> jax.Array:
    """The dense MLP, ``silu(h W_gate) * (h W_up)`` then down (gate and up one product where
    fused)."""
    if "w_gu" not in layer:
        return (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]
    gate, up = jnp.split(h @ layer["w_gu"], 2, axis=-1)
    return (jax.nn.silu(gate) * up) @ layer["w_down"]


# Cached context is read in chunks of this many tokens (rounded to whole pages): attention cost
# follows each batch's longest context, and no shape depends on it.
CTX_CHUNK_TOKENS = 256


def ctx_chunk_pages(page_size: int) -> int:
    return max(1, CTX_CHUNK_TOKENS // page_size)


def table_width(pages: int, page_size: int) -> int:
    """Page-table width for rows of at most ``pages`` pages: whole context chunks, so a table's
    width only changes with the longest sequence a scheduler admits, never per batch."""
    chunk = ctx_chunk_pages(page_size)
    return max(1, -(-pages // chunk)) * chunk


@functools.partial(jax.jit, static_argnames=("page_size",))
def _prelude(
    embed: jax.Array,
    tokens: jax.Array,
    start_pos: jax.Array,
    num_new: jax.Array,
    page_table: jax.Array,
    *,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Embeddings, positions, the new tokens' causal mask, the page table padded to whole context
    chunks, and where each new token's K/V goes."""
    t = tokens.shape[1]
    num_pages_row = page_table.shape[1]
    width = table_width(num_pages_row, page_size)
    table = jnp.pad(page_table, ((0, 0), (0, width - num_pages_row)), constant_values=NULL_PAGE)

    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = start_pos[:, None] + offsets[None, :]  # [B, T]
    valid = offsets[None, :] < num_new[:, None]
    page_slot = jnp.clip(positions // page_size, 0, num_pages_row - 1)
    write_page = jnp.where(valid, jnp.take_along_axis(page_table, page_slot, axis=1), NULL_PAGE)
    write_off = jnp.where(valid, positions % page_size, 0)
    new_mask = (offsets[None, :, None] >= offsets[None, None, :]) & valid[:, None, :]  # [B, T, T]
    x = embed[tokens]
    return x, positions, new_mask, table, write_page.reshape(-1), write_off.reshape(-1)


def _attend(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    pool: jax.Array,
    table: jax.Array,
    start_pos: jax.Array,
) -> jax.Array:
    """Attention of ``q [B, T, Nkv, G, D]`` over each row's cached context (positions
    ``< start_pos``, read from its pages chunk by chunk) and its own new K/V (causal).

    Online softmax (flash-decoding): the loop runs ceil(max(start_pos) / chunk) times, a traced
    count, so neither the context length nor the page-table width is part of any compiled shape;
    a fresh prompt (start_pos 0) reads no page at all. Returns ``[B, T, Nkv, G, D]`` in f32."""
    batch, t, nkv, g, d = q.shape
    page_size = pool.shape[1]
    chunk_pages = ctx_chunk_pages(page_size)
    chunk = chunk_pages * page_size
    scale = d**-0.5
    q = q.astype(jnp.float32) * scale

    def scores_of(keys: jax.Array, mask: jax.Array) -> jax.Array:  # mask [B, T|1, S]
        s = jnp.einsum("btkgd,bskd->bkgts", q, kv_decode(keys))
        return jnp.where(mask[:, None, None, :, :], s, _MASK_VALUE)

    def step(
        c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        m, denom, acc = carry
        cols = jax.lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages, axis=1)
        kv = pool[cols].reshape(batch, chunk, nkv, 2, d)
        key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        mask = (key_pos[None, :] < start_pos[:, None])[:, None, :]  # [B, 1, S]
        return _merge(m, denom, acc, scores_of(kv[:, :, :, 0, :], mask), mask, kv[:, :, :, 1, :])

    m = jnp.full((batch, nkv, g, t), _MASK_VALUE, jnp.float32)
    denom = jnp.zeros((batch, nkv, g, t), jnp.float32)
    acc = jnp.zeros((batch, nkv, g, t, d), jnp.float32)
    n_chunks = (jnp.max(start_pos) + chunk - 1) // chunk
    m, denom, acc = jax.lax.fori_loop(0, n_chunks, step, (m, denom, acc))
    m, denom, acc = _merge(m, denom, acc, scores_of(k_new, new_mask), new_mask, v_new)
    # A padding row (nothing valid) has denom 0: give it zeros, never NaN (its K/V goes to the
    # null page that every real row reads, masked).
    out = acc / jnp.where(denom == 0, 1.0, denom)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4))


def _merge(
    m: jax.Array,
    denom: jax.Array,
    acc: jax.Array,
    scores: jax.Array,
    mask: jax.Array,
    values: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Fold one block of masked ``scores [B, Nkv, G, T, S]`` into the running max ``m``, the
    softmax denominator and the weighted values ``acc``."""
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    # where, not a multiply: a masked slot may hold anything (another request's K/V, padding).
    p = jnp.where(mask[:, None, None, :, :], jnp.exp(scores - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    denom = denom * corr + jnp.sum(p, axis=-1)
    acc = acc * corr[..., None] + jnp.einsum("bkgts,bskd->bkgtd", p, kv_decode(values))
    return m_new, denom, acc


@functools.partial(jax.jit, static_argnames=("config",))
def _layer(
    x: jax.Array,
    layer: Params,
    pool: jax.Array,
    positions: jax.Array,
    start_pos: jax.Array,
    table: jax.Array,
    new_mask: jax.Array,
    *,
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array]:
    """One decoder layer: the new hidden state and this layer's new K/V entries
    ``[B*T, 2*Nkv, D]``. Reads ``pool`` (the layer's pages) without writing it."""
    batch, t = positions.shape
    nh, nkv, d, g = config.num_heads, config.num_kv_heads, config.head_dim, config.group_size
    h = rms_norm(x, layer["attn_norm"], config.rms_eps)
    q, k, v = qkv(h, layer, config)
    q = q.reshape(batch, t, nh, d)
    k = k.reshape(batch, t, nkv, d)
    v = v.reshape(batch, t, nkv, d)
    if "q_norm" in layer:  # Qwen3: each head's q and k normalised before the rotation
        q = rms_norm(q, layer["q_norm"], config.rms_eps)
        k = rms_norm(k, layer["k_norm"], config.rms_eps)
    q = rope(q, positions, config)
    # As the pool keeps them, so that a token attends to itself as later tokens will.
    k = kv_encode(rope(k, positions, config), pool.dtype)
    v = kv_encode(v, pool.dtype)
    entry = jnp.stack([k, v], axis=3).reshape(batch * t, 2 * nkv, d)

    attn = _attend(q.reshape(batch, t, nkv, g, d), k, v, new_mask, pool, table, start_pos)
    x = x + attn.reshape(batch, t, nh * d).astype(x.dtype) @ layer["wo"]

    h = rms_norm(x, layer["mlp_norm"], config.rms_eps)
    if "router" in layer:
        return x + experts(h, layer, config), entry
    return x + mlp(h, layer), entry


def experts(h: jax.Array, layer: Params, config: ModelConfig) -> jax.Array:
    """A mixture-of-experts MLP (Qwen3-MoE): the router's softmax (in f32) over the experts,
    each token's ``experts_per_token`` best, weighted. Every expert runs on every token and the
    others get weight 0: exact, and E times the MLP's work — right for the small models this
    runs on CPU; a token-to-expert dispatch is what a large one needs."""
    shape = h.shape
    x = h.reshape(-1, shape[-1])
    probs = jax.nn.softmax((x @ layer["router"]).astype(jnp.float32), axis=-1)
    top, which = jax.lax.top_k(probs, config.experts_per_token)
    if config.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    weights = jnp.sum(jax.nn.one_hot(which, config.num_experts, dtype=jnp.float32)
                      * top[..., None], axis=1).astype(x.dtype)  # [N, E]
    gate = jnp.einsum("nh,ehi->eni", x, layer["e_gate"])
    up = jnp.einsum("nh,ehi->eni", x, layer["e_up"])
    out = jnp.einsum("eni,eih->enh", jax.nn.silu(gate) * up, layer["e_down"])
    return jnp.einsum("ne,enh->nh", weights, out).reshape(shape)


@functools.partial(jax.jit, static_argnames=("config", "all_logits", "tied"))
def _head(
    x: jax.Array,
    final_norm: jax.Array,
    head: jax.Array,
    num_new: jax.Array,
    *,
    config: ModelConfig,
    all_logits: bool,
    tied: bool,
) -> jax.Array:
    x = rms_norm(x, final_norm, config.rms_eps)
    w = head.T if tied else head
    batch = x.shape[0]
    logits = x @ w if all_logits else x[jnp.arange(batch), jnp.maximum(num_new - 1, 0)] @ w
    return logits.astype(jnp.float32)


def _forward(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    start_pos: jax.Array,
    num_new: jax.Array,
    page_table: jax.Array,
    *,
    config: ModelConfig,
    all_logits: bool,
) -> tuple[jax.Array, list[jax.Array], jax.Array, jax.Array]:
    """Logits, each layer's new K/V entries ``[B*T, 2*Nkv, D]`` and the (page, offset) each goes
    to.

    One jitted call per layer, not one for the whole model: every layer has the same shapes, so a
    new batch shape traces and compiles ONE layer instead of 30 unrolled ones. Measured for
    SmolLM2 on this 2-core CPU: a new decode shape cost 2.2-5 s to compile as one program and
    0.4 s to trace; ~33 dispatches per step cost well under a millisecond each next to a step of
    tens of milliseconds, and run asynchronously ahead of the computation."""
    run = EXECUTABLES.call
    x, positions, new_mask, table, write_page, write_off = run(
        _prelude,
        {"page_size": kv[0].shape[1]},
        params["embed"],
        tokens,
        start_pos,
        num_new,
        page_table,
    )
    entries: list[jax.Array] = []
    layer_static = {"config": config}
    for layer, pool in zip(params["layers"], kv, strict=True):
        x, entry = run(_layer, layer_static, x, layer, pool, positions, start_pos, table, new_mask)
        entries.append(entry)
    tied = config.tie_embeddings
    head = params["embed"] if tied else params["lm_head"]
    head_static = {"config": config, "all_logits": all_logits, "tied": tied}
    logits = run(_head, head_static, x, params["final_norm"], head, num_new)
    return logits, entries, write_page, write_off


@functools.partial(jax.jit, donate_argnames=("kv",))
def write_kv(kv: KV, entries: list[jax.Array], pages: jax.Array, offsets: jax.Array) -> KV:
    """Write ``entries[layer][i]`` at ``(pages[i], offsets[i])`` of every layer, in place (in
    either pool layout: an entry is a token's ``2 * Nkv * D`` values)."""
    return [pool.at[pages, offsets].set(entry.reshape(entry.shape[0], *pool.shape[2:]))
            for pool, entry in zip(kv, entries, strict=True)]


def extend(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    start_pos: jax.Array,
    num_new: jax.Array,
    page_table: jax.Array,
    *,
    config: ModelConfig,
    all_logits: bool = False,
) -> tuple[jax.Array, KV]:
    """Batched prefill (with an optional cached prefix per row) over the paged pool.

    ``tokens[int32, B, T]``: row ``b`` feeds ``tokens[b, :num_new[b]]`` at positions
    ``start_pos[b] + i``; ``page_table[int32, B, P]`` lists row ``b``'s pages in order (padded with
    the null page). Returns logits of each row's last new token ``[B, V]`` (or ``[B, T, V]`` with
    ``all_logits``) and the updated kv. Padding rows have ``num_new == 0``. Only the batch shape
    ``(B, T)`` and the page table's width in whole context chunks (``table_width``) are compiled
    in: the context each row reads is a traced length.
    """
    logits, entries, pages, offsets = _forward(
        params,
        kv,
        tokens,
        start_pos,
        num_new,
        page_table,
        config=config,
        all_logits=all_logits,
    )
    return logits, EXECUTABLES.call(write_kv, {}, kv, entries, pages, offsets)


def prefill(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    length: jax.Array | int,
    page_ids: jax.Array,
    start_pos: jax.Array | int = 0,
    *,
    config: ModelConfig,
    all_logits: bool = False,
) -> tuple[jax.Array, KV]:
    """One prompt: ``tokens[int32, T_pad]`` of which the first ``length`` are real, written at
    positions ``start_pos...`` into ``page_ids[int32, P_pad]`` (the request's pages in order).
    Returns the last real token's logits ``[V]`` (``[T_pad, V]`` with ``all_logits``) and kv."""
    logits, entries, pages, offsets = _forward(
        params,
        kv,
        tokens[None, :],
        jnp.asarray(start_pos, jnp.int32).reshape(1),
        jnp.asarray(length, jnp.int32).reshape(1),
        page_ids[None, :],
        config=config,
        all_logits=all_logits,
    )
    return logits[0], EXECUTABLES.call(write_kv, {}, kv, entries, pages, offsets)


def decode(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    config: ModelConfig,
) -> tuple[jax.Array, KV]:
    """One decode step for a padded batch: row ``b`` feeds ``tokens[b]`` at ``positions[b]`` and
    attends over ``lengths[b] == positions[b] + 1`` tokens in ``page_table[b]``. Padding rows have
    ``lengths == 0`` (and a null-page page table). Returns ``logits[B_pad, V]`` and kv."""
    num_new = jnp.clip(lengths - positions, 0, 1).astype(jnp.int32)
    logits, entries, pages, offsets = _forward(
        params, kv, tokens[:, None], positions, num_new, page_table, config=config, all_logits=False
    )
    return logits, EXECUTABLES.call(write_kv, {}, kv, entries, pages, offsets)


def compile_forward(
    params: Params,
    kv: Sequence[jax.Array | jax.ShapeDtypeStruct],
    batch: int,
    t: int,
    width: int,
    *,
    config: ModelConfig,
    all_logits: bool = False,
) -> None:
    """Compile, without running anything, every executable that ``extend`` (``decode`` when
    ``t == 1``) runs for ``tokens[batch, t]`` over a ``width``-page table, into ``EXECUTABLES``.
    ``kv``: the pools, or only their shapes (``ShapeDtypeStruct`` s)."""

    def i32(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    warm = EXECUTABLES.compile
    prelude_args = (params["embed"], i32(batch, t), i32(batch), i32(batch), i32(batch, width))
    x, positions, new_mask, table, pages, offsets = warm(
        _prelude, {"page_size": kv[0].shape[1]}, *prelude_args
    )
    layer_args = (x, params["layers"][0], kv[0], positions, i32(batch), table, new_mask)
    x_out, entry = warm(_layer, {"config": config}, *layer_args)
    tied = config.tie_embeddings
    head = params["embed"] if tied else params["lm_head"]
    head_static = {"config": config, "all_logits": all_logits, "tied": tied}
    warm(_head, head_static, x_out, params["final_norm"], head, i32(batch))
    warm(write_kv, {}, kv, [entry] * len(kv), pages, offsets)
