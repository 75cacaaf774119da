"""The step's KV write by DMAs of token runs and by whole pages then tokens (kv/token_write.py)
against the XLA scatter they may replace: the same pool, bit for bit, on ragged steps (the DMAs
in Pallas TPU interpret mode on a CPU), and the same step."""

from __future__ import annotations

import attrs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.kv.pool import NULL_PAGE, allocate_kv_pool
from pd_fsm.jax_engine.kv.token_write import max_runs, token_runs, write_runs
from pd_fsm.jax_engine.model import TINY
from pd_fsm.jax_engine.model.params import random_params
from pd_fsm.jax_engine.step.program import (
    KVWrite,
    StepOptions,
    kv_write_fn,
    step,
    token_slots,
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
@pytest.mark.parametrize("kv_write", ["dma", "pages"])
def test_the_write_equals_the_scatter(case: tuple, kv_write: KVWrite) -> None:  # type: ignore[type-arg]
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
    written = _write(kv_write, pool, entry, q_lens, kv_lens, table)
    # Padding tokens (and the pages write's unused rows) land in the null page, which nothing
    # reads unmasked; the DMA write leaves it as it was.
    keep = np.arange(pages) != NULL_PAGE
    np.testing.assert_array_equal(written[keep], scattered[keep])
    if kv_write == "dma":
        np.testing.assert_array_equal(written[NULL_PAGE], np.asarray(pool)[NULL_PAGE])
    assert not np.array_equal(written, np.asarray(pool))


def test_a_page_aligned_prefill_is_a_run_a_page() -> None:
    t = jnp.arange(1024, dtype=jnp.int32)
    table, n_runs = token_runs(t // PAGE + 1, t % PAGE, t == 0, t < 1024, PAGE,
                               max_runs(1024, 1, PAGE))
    assert int(n_runs) == 64 and table.shape == (3, 66)
    np.testing.assert_array_equal(np.asarray(table)[:, :64], [np.arange(0, 1024, PAGE),
                                                              np.arange(1, 65) * PAGE, [16] * 64])


def test_the_runs_cover_every_real_token_once_within_the_bound() -> None:
    """Random ragged steps of 5 sequences and 208 tokens (sequences starting anywhere in a
    page, padding tokens, padded sequences): the runs, at most ``max_runs``, stay inside a page
    and name each real token's row once."""
    seqs, tokens, bound = 5, 208, max_runs(208, 5, PAGE)

    @jax.jit
    def runs(q: jax.Array, kv: jax.Array, pages: jax.Array) -> tuple[jax.Array, jax.Array]:
        _, page, off, first, real = token_slots(q, kv, pages, tokens, PAGE)
        return token_runs(page, off, first, real, PAGE, bound)

    rng = np.random.default_rng(5)
    for _ in range(40):
        q = rng.integers(0, 42, seqs) * (rng.random(seqs) < 0.8)
        start = rng.integers(0, 50, seqs)
        pages = rng.permutation(np.arange(1, 200))[: seqs * 8].reshape(seqs, 8)
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(start, q, strict=True)])
        seq = np.repeat(np.arange(seqs), q)
        want = sorted(pages[seq, positions // PAGE] * PAGE + positions % PAGE)
        table, n_runs = runs(jnp.asarray(q, jnp.int32), jnp.asarray(start + q, jnp.int32),
                             jnp.asarray(pages, jnp.int32))
        n = int(n_runs)
        assert 0 < n <= bound == table.shape[1]
        s, d, m = np.asarray(table)[:, :n]
        assert np.all(m >= 1) and np.all(d % PAGE + m <= PAGE)
        assert sorted(np.concatenate([np.arange(a, a + k) for a, k in zip(d, m, strict=True)])
                      ) == want
        assert list(np.concatenate([np.arange(a, a + k) for a, k in zip(s, m, strict=True)])
                    ) == list(range(int(q.sum())))


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


@pytest.mark.parametrize("kv_write", ["dma", "pages"])
def test_a_step_writing_so_equals_the_scattering_one(kv_write: KVWrite) -> None:
    """A tiny model's ragged prefill (two prompts, a padded sequence, padding tokens) and then
    a step of a decode row and a chunk starting mid-page: the same logits and pool."""
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


def test_the_write_lowers_to_a_mosaic_kernel_for_the_chip() -> None:
    """Lowered for a TPU (Mosaic's Python lowering, which runs on any host; the chip's own
    compile of it is not run here): a 1,024-token bf16 write of Qwen3-0.6B's lanes."""
    pool = jax.ShapeDtypeStruct((80, PAGE, 2048), jnp.bfloat16)
    entry = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((3, max_runs(1024, 1, PAGE)), jnp.int32)
    n_runs = jax.ShapeDtypeStruct((), jnp.int32)
    lowered = write_runs.trace(pool, entry, table, n_runs, interpret=False).lower(
        lowering_platforms=("tpu",))
    assert "tpu_custom_call" in lowered.as_text()
