"""The step's KV write as whole pages then tokens (kv/token_write.py) against the XLA scatter of
one row per token: the same pool, bit for bit, on ragged steps, and the same step."""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.kv.pool import NULL_PAGE, allocate_kv_pool
from pd_fsm.jax_engine.model import TINY
from pd_fsm.jax_engine.model.params import random_params
from pd_fsm.jax_engine.step.program import (
    KVWrite,
    StepOptions,
    kv_write_fn,
    step,
)

INTERPRET = jax.default_backend() != "tpu"
ATTENTION = "interpret" if INTERPRET else "pallas"
PAGE = 16


def _write(kv_write: KVWrite, pool: jax.Array, entry: jax.Array, q_lens: np.ndarray,
           kv_lens: np.ndarray, table: np.ndarray) -> np.ndarray:
    options = StepOptions(TINY, attention=ATTENTION, kv_write=kv_write)

    @jax.jit
    def write(pool: jax.Array, entry: jax.Array, q: jax.Array, kv: jax.Array,
              pages: jax.Array) -> jax.Array:
        fn, _ = kv_write_fn(options, q, kv, pages, entry.shape[0], pool.shape[1])
        return fn(pool, entry)

    return np.asarray(write(pool, entry, jnp.asarray(q_lens), jnp.asarray(kv_lens),
                            jnp.asarray(table)))


# q_lens, kv_lens (the real sequences), padded sequences, padded tokens
CASES = {
    "prefill-from-a-page-boundary": ([48], [48], 1, 48),
    "chunk-starting-mid-page": ([29], [36], 1, 32),
    "decode-rows": ([1, 1, 1, 1], [1, 16, 17, 100], 4, 4),
    "mixed": ([1, 21, 1, 16], [70, 21, 32, 40], 4, 40),
    "padding-tokens-and-sequences": ([5, 1], [37, 16], 6, 24),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_write_equals_the_scatter(case: tuple) -> None:  # type: ignore[type-arg]
    q, kv, seqs, tokens = case
    rng = np.random.default_rng(len(q) * 7 + tokens)
    pages, lanes = 24, 256
    pool = jnp.asarray(rng.standard_normal((pages, PAGE, lanes)), jnp.bfloat16)
    q_lens, kv_lens = np.zeros(seqs, np.int32), np.zeros(seqs, np.int32)
    q_lens[: len(q)], kv_lens[: len(kv)] = q, kv
    table = np.zeros((seqs, 8), np.int32)
    free = list(rng.permutation(np.arange(1, pages)))
    for s, n in enumerate(kv):
        table[s, : -(-n // PAGE)] = [free.pop() for _ in range(-(-n // PAGE))]
    entry = jnp.asarray(rng.standard_normal((tokens, lanes)), jnp.bfloat16)
    scattered = _write("scatter", pool, entry, q_lens, kv_lens, table)
    written = _write("pages", pool, entry, q_lens, kv_lens, table)
    # Padding tokens (and the pages write's unused rows) land in the null page, which nothing
    # reads unmasked.
    keep = np.arange(pages) != NULL_PAGE
    np.testing.assert_array_equal(written[keep], scattered[keep])
    assert not np.array_equal(written, np.asarray(pool))


def test_the_pages_write_equals_the_scatter_on_random_steps() -> None:
    """Random ragged steps of 5 sequences and 208 tokens, as above: the pages write (XLA only,
    quick on a CPU) leaves the pool the token scatter does, the null page aside."""
    seqs, tokens, lanes = 5, 208, 128
    options = {w: StepOptions(TINY, attention=ATTENTION, kv_write=w)
               for w in ("scatter", "pages")}

    @jax.jit
    def both(pool: jax.Array, entry: jax.Array, q: jax.Array, kv: jax.Array,
             pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        out = [kv_write_fn(options[w], q, kv, pages, tokens, PAGE)[0](pool, entry)
               for w in ("scatter", "pages")]
        return out[0], out[1]

    rng = np.random.default_rng(6)
    pool = jnp.asarray(rng.standard_normal((64, PAGE, lanes)), jnp.float32)
    entry = jnp.asarray(rng.standard_normal((tokens, lanes)), jnp.float32)
    for _ in range(20):
        q = rng.integers(0, 42, seqs) * (rng.random(seqs) < 0.8)
        start = rng.integers(0, 50, seqs)
        pages = rng.permutation(np.arange(1, 64))[: seqs * 8].reshape(seqs, 8)
        a, b = both(pool, entry, jnp.asarray(q, jnp.int32), jnp.asarray(start + q, jnp.int32),
                    jnp.asarray(pages, jnp.int32))
        np.testing.assert_array_equal(np.asarray(b)[1:], np.asarray(a)[1:])


def test_a_step_writing_so_equals_the_scattering_one() -> None:
    """A tiny model's ragged prefill (two prompts, a padded sequence, padding tokens) and then
    a step of a decode row and a chunk starting mid-page: the same logits and pool."""
    kv_write = "pages"
    config = attrs.evolve(TINY, head_dim=64, num_heads=4, num_kv_heads=2)
    params = random_params(config, 0)
    pool_config = attrs.evolve(config.kv_pool_config(12, PAGE), lanes=True, bf16_bits=False)
    table = jnp.asarray([[3, 0, 0], [7, 1, 9], [0, 0, 0]], jnp.int32)
    rng = np.random.default_rng(2)
    steps = [(rng.integers(1, 256, 32), [5, 19, 0], [5, 19, 0]),
             (rng.integers(1, 256, 16), [1, 12, 0], [6, 31, 0])]
    kv = {w: allocate_kv_pool(pool_config) for w in ("scatter", kv_write)}
    for tokens, q_lens, kv_lens in steps:
        got = {}
        for w in ("scatter", kv_write):
            options = StepOptions(config, attention=ATTENTION, kv_write=w)  # type: ignore[arg-type]
            args = (jnp.asarray(tokens, jnp.int32), jnp.asarray(q_lens, jnp.int32),
                    jnp.asarray(kv_lens, jnp.int32), table, {})
            (logits,), kv[w] = step(params, kv[w], *args, options=options, sampler="logits")
            got[w] = np.asarray(logits)
        # The logits bit for bit: the tokens any sampler draws from them are the same.
        np.testing.assert_array_equal(got[kv_write], got["scatter"])
        for a, b in zip(kv[kv_write], kv["scatter"], strict=True):
            np.testing.assert_array_equal(np.asarray(a)[1:], np.asarray(b)[1:])
            assert np.any(np.asarray(a)[[3, 7, 1]])
