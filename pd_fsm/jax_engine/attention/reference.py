"""Ragged paged attention in plain XLA: the kernel's contract (``ragged_paged.py``) written the
obvious way, every sequence's pages gathered and every token's scores masked. The tests hold the
kernel to it; it is no path to serve on (it gathers each token's whole context)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_sequences(q_lens: jax.Array, tokens: int) -> tuple[jax.Array, jax.Array]:
    """Each new token's sequence and its index among the sequence's new tokens (tokens past
    ``sum(q_lens)`` get the last sequence and an index past its new tokens)."""
    ends = jnp.cumsum(q_lens)
    token = jnp.arange(tokens, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, token, side="right"), q_lens.shape[0] - 1)
    return seq.astype(jnp.int32), token - (ends - q_lens)[seq]


@jax.jit
def ragged_attention_reference(
    q: jax.Array, pool: jax.Array, q_lens: jax.Array, kv_lens: jax.Array, page_table: jax.Array
) -> jax.Array:
    tokens, nh, d = q.shape
    page_size = pool.shape[1]
    nkv = pool.shape[2] // (2 * d)
    seqs, pages = page_table.shape
    ctx = pool[page_table].reshape(seqs, pages * page_size, nkv, 2, d).astype(jnp.float32)
    seq, k = token_sequences(q_lens, tokens)
    pos = kv_lens[seq] - q_lens[seq] + k  # [T]
    keys = ctx[seq]  # [T, S_ctx, Nkv, 2, D]
    qg = q.astype(jnp.float32).reshape(tokens, nkv, nh // nkv, d) * d**-0.5
    scores = jnp.einsum("tkgd,tskd->tkgs", qg, keys[..., 0, :])
    key_pos = jnp.arange(pages * page_size, dtype=jnp.int32)
    visible = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] < kv_lens[seq][:, None])
    # Masked by where, at a finite value: unseen slots (the null page among them, where
    # padding writes) may hold anything, NaN included, and a padding token sees nothing.
    scores = jnp.where(visible[:, None, None, :], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1)
    values = jnp.where(visible[:, :, None, None], keys[..., 1, :], 0.0)
    out = jnp.einsum("tkgs,tskd->tkgd", probs, values)
    return out.reshape(tokens, nh, d).astype(q.dtype)
