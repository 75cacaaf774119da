"""The batched sampler: greedy limits, truncation, per-row seeds."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pd_fsm.jax_engine.sampling import SamplingParams, sample


@pytest.fixture(scope="module")
def logits() -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32) * 3)


def test_truncations_that_leave_one_token_are_greedy(logits: jnp.ndarray) -> None:
    greedy = np.argmax(np.asarray(logits), axis=-1)
    rows = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        None,
    ]
    tokens, logprobs = sample(logits, rows, [1, 2, 3, 0], [0, 0, 0, 0])
    assert tokens.tolist() == greedy.tolist()
    raw = np.asarray(logits, np.float64)
    ref = raw - np.log(np.exp(raw).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprobs, ref[np.arange(4), greedy], atol=1e-5)


def test_top_k_and_top_p_keep_sampling_inside_the_allowed_set(logits: jnp.ndarray) -> None:
    top5 = set(np.argsort(-np.asarray(logits)[0])[:5].tolist())
    sp = SamplingParams(temperature=1.5, top_k=5)
    seen = {int(sample(logits[:1], [sp], [s], [0])[0][0]) for s in range(40)}
    assert seen <= top5 and len(seen) > 1
    probs = np.exp(np.asarray(logits)[1]) / np.exp(np.asarray(logits)[1]).sum()
    order = np.argsort(-probs)
    nucleus = set(order[: int(np.searchsorted(np.cumsum(probs[order]), 0.5)) + 1].tolist())
    sp = SamplingParams(temperature=1.0, top_p=0.5)
    seen = {int(sample(logits[1:2], [sp], [s], [0])[0][0]) for s in range(40)}
    assert seen <= nucleus


def test_rows_draw_from_their_own_seed_and_step(logits: jnp.ndarray) -> None:
    sp = SamplingParams(temperature=1.0)
    a = sample(logits, [sp] * 4, [7, 8, 9, 10], [3, 3, 3, 3])[0]
    b = sample(logits, [None, sp, None, sp], [0, 8, 0, 10], [0, 3, 0, 3])[0]
    assert a[1] == b[1] and a[3] == b[3]
    draws = {tuple(sample(logits, [sp] * 4, [7] * 4, [n] * 4)[0].tolist()) for n in range(8)}
    assert len(draws) > 1  # the step index changes the draw


def test_invalid_params_are_rejected() -> None:
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    assert SamplingParams(stop="x").stop == ("x",)
