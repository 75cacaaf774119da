"""The Llama-architecture forward pass over the paged KV pool.

One batched "extend" step serves both prefill and decode: every row ``b`` feeds ``num_new[b]`` new
tokens starting at absolute position ``start_pos[b]`` (prefill: the prompt, or a chunk of it after
``start_pos`` cached tokens; decode: one token). Each layer attends over the row's cached K/V
(positions ``< start_pos``, gathered from its pages through a padded page table) plus the new
tokens' own K/V (causally). Rows and positions beyond ``num_new`` are padding: they write to the
null page and their outputs are ignored.

The step is two jitted calls: the forward reads the pool without donating it and returns the new
K/V entries; a second, donating call writes them into the pages. Done in one function, XLA:CPU
copied every layer's whole pool on every step (it cannot prove the gathers precede the in-place
update), which made decode time grow with the pool size instead of the batch.

Params are a plain pytree (dicts and a list of per-layer dicts, weights laid out ``[in, out]`` so a
projection is ``x @ w``)::

    {"embed": [V, H], "final_norm": [H], "lm_head": [H, V] (absent when tied to "embed"),
     "layers": [{"attn_norm": [H], "wq": [H, Nh*D], "wk": [H, Nkv*D], "wv": [H, Nkv*D],
                 "wo": [Nh*D, H], "mlp_norm": [H], "w_gate": [H, I], "w_up": [H, I],
                 "w_down": [I, H], optional "bq"/"bk"/"bv" biases (Qwen2)}, ...]}

Rotary embeddings use the rotate-half (HF) convention; loaders convert other layouts to it.
The KV pool layout is the one in ``kv_pool.py``: per layer ``(pages, page_size, 2*Nkv, D)`` with
K of kv-head ``h`` at ``2h`` and V at ``2h+1``. The kv list is donated: use the returned one.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pd_fsm.jax_engine.kv_pool import NULL_PAGE
from pd_fsm.jax_engine.model.config import ModelConfig

Params = dict[str, Any]
KV = list[jax.Array]

# Finite, not -inf: a fully masked padding row must give finite (ignored) values, because its K/V
# lands in the null page that every real row also reads (masked) — a NaN there would poison them.
_MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return normed.astype(x.dtype) * weight


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half rotary embedding. ``x``: ``[B, T, heads, D]``, ``positions``: ``[B, T]``."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _project(h: jax.Array, layer: Params, w: str, b: str) -> jax.Array:
    y = h @ layer[w]
    return y + layer[b] if b in layer else y


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
    ctx_pages: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logits, the new K/V entries ``[L, B*T, 2*Nkv, D]`` and the (page, offset) each goes to.

    Attention reads the first ``ctx_pages`` columns of the page table (all when None): they must
    cover every row's ``start_pos``. A prefill of fresh prompts passes 0 and gathers nothing."""
    batch, t = tokens.shape
    num_pages_row = page_table.shape[1]
    page_size = kv[0].shape[1]
    ctx_table = page_table if ctx_pages is None else page_table[:, :ctx_pages]
    ctx_len = ctx_table.shape[1] * page_size
    nh, nkv, d, g = config.num_heads, config.num_kv_heads, config.head_dim, config.group_size

    offsets = jnp.arange(t, dtype=jnp.int32)
    positions = start_pos[:, None] + offsets[None, :]  # [B, T]
    valid = offsets[None, :] < num_new[:, None]
    page_slot = jnp.clip(positions // page_size, 0, num_pages_row - 1)
    write_page = jnp.where(valid, jnp.take_along_axis(page_table, page_slot, axis=1), NULL_PAGE)
    write_off = jnp.where(valid, positions % page_size, 0)
    write_page, write_off = write_page.reshape(-1), write_off.reshape(-1)

    # Context slot s of a row is absolute position s, because the page table lists pages in order.
    # Only slots before start_pos hold this row's K/V; later ones may hold a previous owner's.
    key_pos = jnp.arange(ctx_len, dtype=jnp.int32)
    ctx_mask = key_pos[None, None, :] < start_pos[:, None, None]  # [B, 1, S]
    new_mask = (offsets[None, :, None] >= offsets[None, None, :]) & valid[:, None, :]  # [B, T, T]
    mask = jnp.concatenate([jnp.broadcast_to(ctx_mask, (batch, t, ctx_len)), new_mask], axis=-1)
    mask = mask[:, None, None, :, :]  # [B, 1, 1, T, S+T] against scores [B, Nkv, G, T, S+T]
    scale = d**-0.5

    x = params["embed"][tokens]
    entries: list[jax.Array] = []
    for layer, pool in zip(params["layers"], kv, strict=True):
        h = rms_norm(x, layer["attn_norm"], config.rms_eps)
        q = _project(h, layer, "wq", "bq").reshape(batch, t, nh, d)
        k = _project(h, layer, "wk", "bk").reshape(batch, t, nkv, d)
        v = _project(h, layer, "wv", "bv").reshape(batch, t, nkv, d)
        q = rope(q, positions, config.rope_theta)
        k = rope(k, positions, config.rope_theta)

        ctx = pool[ctx_table].reshape(batch, ctx_len, nkv, 2, d)
        k_all = jnp.concatenate([ctx[:, :, :, 0, :], k.astype(pool.dtype)], axis=1)
        v_all = jnp.concatenate([ctx[:, :, :, 1, :], v.astype(pool.dtype)], axis=1)
        entries.append(jnp.stack([k, v], axis=3).reshape(batch * t, 2 * nkv, d).astype(pool.dtype))

        qg = q.reshape(batch, t, nkv, g, d)
        scores = jnp.einsum(
            "btkgd,bskd->bkgts", qg, k_all, preferred_element_type=jnp.float32
        ) * scale
        scores = jnp.where(mask, scores, _MASK_VALUE)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_all.dtype)
        attn = jnp.einsum("bkgts,bskd->btkgd", probs, v_all).reshape(batch, t, nh * d)
        x = x + attn @ layer["wo"]

        h = rms_norm(x, layer["mlp_norm"], config.rms_eps)
        x = x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"]

    x = rms_norm(x, params["final_norm"], config.rms_eps)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    logits = x @ head if all_logits else x[jnp.arange(batch), jnp.maximum(num_new - 1, 0)] @ head
    return logits.astype(jnp.float32), jnp.stack(entries), write_page, write_off


@functools.partial(jax.jit, donate_argnames=("kv",))
def write_kv(kv: KV, entries: jax.Array, pages: jax.Array, offsets: jax.Array) -> KV:
    """Write ``entries[layer, i]`` at ``(pages[i], offsets[i])`` of every layer, in place."""
    return [pool.at[pages, offsets].set(entries[i]) for i, pool in enumerate(kv)]


_forward_jit = jax.jit(_forward, static_argnames=("config", "all_logits", "ctx_pages"))


@functools.partial(jax.jit, static_argnames=("config", "all_logits", "ctx_pages"))
def _prefill_forward(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    length: jax.Array | int,
    page_ids: jax.Array,
    start_pos: jax.Array | int,
    *,
    config: ModelConfig,
    all_logits: bool,
    ctx_pages: int | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    logits, entries, pages, offsets = _forward(
        params,
        kv,
        tokens[None, :],
        jnp.asarray(start_pos, jnp.int32).reshape(1),
        jnp.asarray(length, jnp.int32).reshape(1),
        page_ids[None, :],
        config=config,
        all_logits=all_logits,
        ctx_pages=ctx_pages,
    )
    return logits[0], entries, pages, offsets


@functools.partial(jax.jit, static_argnames=("config",))
def _decode_forward(
    params: Params,
    kv: KV,
    tokens: jax.Array,
    positions: jax.Array,
    page_table: jax.Array,
    lengths: jax.Array,
    *,
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    num_new = jnp.clip(lengths - positions, 0, 1).astype(jnp.int32)
    return _forward(
        params, kv, tokens[:, None], positions, num_new, page_table, config=config, all_logits=False
    )


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
    ctx_pages: int | None = None,
) -> tuple[jax.Array, KV]:
    """Batched prefill (with an optional cached prefix per row) over the paged pool.

    ``tokens[int32, B, T]``: row ``b`` feeds ``tokens[b, :num_new[b]]`` at positions
    ``start_pos[b] + i``; ``page_table[int32, B, P]`` lists row ``b``'s pages in order (padded with
    the null page). Returns logits of each row's last new token ``[B, V]`` (or ``[B, T, V]`` with
    ``all_logits``) and the updated kv. Padding rows have ``num_new == 0``. ``ctx_pages``
    (static): how many leading page-table columns hold cached context (they must cover every
    ``start_pos``); None reads them all, 0 (no row has a cached prefix) skips the gather.
    """
    logits, entries, pages, offsets = _forward_jit(
        params,
        kv,
        tokens,
        start_pos,
        num_new,
        page_table,
        config=config,
        all_logits=all_logits,
        ctx_pages=ctx_pages,
    )
    return logits, write_kv(kv, entries, pages, offsets)


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
    ctx_pages: int | None = None,
) -> tuple[jax.Array, KV]:
    """One prompt: ``tokens[int32, T_pad]`` of which the first ``length`` are real, written at
    positions ``start_pos...`` into ``page_ids[int32, P_pad]`` (the request's pages in order).
    Returns the last real token's logits ``[V]`` (``[T_pad, V]`` with ``all_logits``) and kv.
    ``ctx_pages`` as in ``extend`` (0 when ``start_pos == 0``: nothing cached to read)."""
    logits, entries, pages, offsets = _prefill_forward(
        params,
        kv,
        tokens,
        length,
        page_ids,
        start_pos,
        config=config,
        all_logits=all_logits,
        ctx_pages=ctx_pages,
    )
    return logits, write_kv(kv, entries, pages, offsets)


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
    logits, entries, pages, offsets = _decode_forward(
        params, kv, tokens, positions, page_table, lengths, config=config
    )
    return logits, write_kv(kv, entries, pages, offsets)
