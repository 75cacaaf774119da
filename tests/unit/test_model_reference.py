"""The JAX paged forward equals a plain numpy Llama (contiguous KV, no pages) on the tiny config."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.compilation.buckets import bucket
from pd_fsm.jax_engine.model import TINY, ModelConfig, decode, extend, new_kv_pool, prefill
from pd_fsm.jax_engine.model.params import random_params_np, to_device

PAGE_SIZE = 4
NUM_PAGES = 32


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    # x: [T, heads, D]; rotate-half convention, computed in float64.
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def reference_logits(p: dict, cfg: ModelConfig, tokens: list[int]) -> np.ndarray:
    """All-position logits of a causal Llama over ``tokens``, float64, no cache."""
    t = len(tokens)
    pos = np.arange(t, dtype=np.float64)
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    x = p["embed"][np.array(tokens)].astype(np.float64)
    causal = np.tril(np.ones((t, t), dtype=bool))
    for layer in p["layers"]:
        h = _rms(x, layer["attn_norm"], cfg.rms_eps)
        q = _rope((h @ layer["wq"]).reshape(t, nh, d), pos, cfg.rope_theta)
        k = _rope((h @ layer["wk"]).reshape(t, nkv, d), pos, cfg.rope_theta)
        v = (h @ layer["wv"]).reshape(t, nkv, d)
        out = np.zeros((t, nh, d))
        for head in range(nh):
            kh = head // (nh // nkv)
            s = q[:, head] @ k[:, kh].T / np.sqrt(d)
            s = np.where(causal, s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            w /= w.sum(-1, keepdims=True)
            out[:, head] = w @ v[:, kh]
        x = x + out.reshape(t, nh * d) @ layer["wo"]
        h = _rms(x, layer["mlp_norm"], cfg.rms_eps)
        gate = h @ layer["w_gate"]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ layer["w_up"])) @ layer["w_down"]
    x = _rms(x, p["final_norm"], cfg.rms_eps)
    head_w = p["embed"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head_w


@pytest.fixture(scope="module")
def tiny() -> tuple[dict, dict]:
    p_np = random_params_np(TINY, seed=0)
    return p_np, to_device(p_np, "float32")


def _page_row(pages: list[int], width: int) -> jnp.ndarray:
    return jnp.asarray(pages + [0] * (width - len(pages)), dtype=jnp.int32)


def test_prefill_then_decode_matches_numpy_over_scattered_pages(tiny: tuple[dict, dict]) -> None:
    p_np, params = tiny
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, TINY.vocab_size, size=7).tolist()
    steps = 6
    total = len(prompt) + steps
    # Non-contiguous, out of order pages, so any page-table indexing slip shows up.
    pages = [17, 3, 29, 8]
    assert len(pages) * PAGE_SIZE >= total
    width = bucket(len(pages))

    kv = new_kv_pool(TINY.kv_pool_config(NUM_PAGES, PAGE_SIZE))
    t_pad = bucket(len(prompt))
    toks = jnp.asarray(prompt + [0] * (t_pad - len(prompt)), dtype=jnp.int32)
    all_logits, kv = prefill(
        params, kv, toks, len(prompt), _page_row(pages, width), config=TINY, all_logits=True
    )
    seq = list(prompt)
    ref = reference_logits(p_np, TINY, seq)
    np.testing.assert_allclose(np.asarray(all_logits)[: len(prompt)], ref, atol=1e-4, rtol=1e-4)

    last, kv2 = prefill(
        params,
        new_kv_pool(TINY.kv_pool_config(NUM_PAGES, PAGE_SIZE)),
        toks,
        len(prompt),
        _page_row(pages, width),
        config=TINY,
    )
    np.testing.assert_allclose(np.asarray(last), ref[-1], atol=1e-4, rtol=1e-4)
    del kv2

    # Decode with batch 4: row 1 is the real request, the others are padding rows.
    for _ in range(steps):
        nxt = int(np.argmax(ref[-1]))
        pos = len(seq)
        seq.append(nxt)
        b = 4
        tokens = np.zeros(b, np.int32)
        positions = np.zeros(b, np.int32)
        lengths = np.zeros(b, np.int32)
        table = np.zeros((b, width), np.int32)
        tokens[1], positions[1], lengths[1] = nxt, pos, pos + 1
        table[1] = np.asarray(_page_row(pages, width))
        logits, kv = decode(
            params,
            kv,
            jnp.asarray(tokens),
            jnp.asarray(positions),
            jnp.asarray(table),
            jnp.asarray(lengths),
            config=TINY,
        )
        ref = reference_logits(p_np, TINY, seq)
        np.testing.assert_allclose(np.asarray(logits)[1], ref[-1], atol=1e-4, rtol=1e-4)
        assert np.all(np.isfinite(np.asarray(logits)))


def test_batched_extend_with_prefix_matches_numpy(tiny: tuple[dict, dict]) -> None:
    """Two prompts in one call; the second continues from a prefix already in its pages."""
    p_np, params = tiny
    rng = np.random.default_rng(2)
    a = rng.integers(0, TINY.vocab_size, size=5).tolist()
    b = rng.integers(0, TINY.vocab_size, size=11).tolist()
    pages_a, pages_b = [9, 2], [30, 12, 5]
    kv = new_kv_pool(TINY.kv_pool_config(NUM_PAGES, PAGE_SIZE))

    # First put b's first 6 tokens in its pages (as a chunked prefill / transferred prefix would).
    split = 6
    t_pad = 8
    toks = jnp.asarray(b[:split] + [0] * (t_pad - split), dtype=jnp.int32)
    _, kv = prefill(params, kv, toks, split, _page_row(pages_b, 4), config=TINY, )

    tokens = np.zeros((2, t_pad), np.int32)
    tokens[0, : len(a)] = a
    tokens[1, : len(b) - split] = b[split:]
    table = np.stack([np.asarray(_page_row(pages_a, 4)), np.asarray(_page_row(pages_b, 4))])
    logits, kv = extend(
        params,
        kv,
        jnp.asarray(tokens),
        jnp.asarray([0, split], jnp.int32),
        jnp.asarray([len(a), len(b) - split], jnp.int32),
        jnp.asarray(table),
        config=TINY,
        all_logits=True,
    )
    out = np.asarray(logits)
    np.testing.assert_allclose(out[0, : len(a)], reference_logits(p_np, TINY, a), atol=1e-4)
    np.testing.assert_allclose(
        out[1, : len(b) - split], reference_logits(p_np, TINY, b)[split:], atol=1e-4
    )
    # Pages of a hold exactly a's K/V: K of kv-head h at 2h, V at 2h+1 (the pool layout).
    layer0 = np.asarray(kv[0])
    x = p_np["embed"][np.array(a)]
    h = _rms(x, p_np["layers"][0]["attn_norm"], TINY.rms_eps)
    v = (h @ p_np["layers"][0]["wv"]).reshape(len(a), TINY.num_kv_heads, TINY.head_dim)
    got_v = np.concatenate([layer0[p] for p in pages_a])[: len(a), 1::2]
    np.testing.assert_allclose(got_v, v, atol=1e-5)
