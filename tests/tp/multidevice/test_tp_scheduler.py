"""Tensor parallelism inside one instance: the tiny model (4 kv-heads) at tp 2 and 4 against
tp 1 on the same prompts — token ids equal, first-step logits within a tolerance, the pool keeps
its kv-head sharding, and no step compiles after the warm-up."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES
from pd_fsm.jax_engine.model import extend
from pd_fsm.jax_engine.parallel.tensor_parallel import POOL_KV_AXIS, TensorParallelError, check_tp
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Scheduler, SchedulerArgs
from pd_fsm.schedulers.model_runner import MAIN_KV
from pd_fsm.schedulers.warm_up import warm_up

PROMPTS = ["The quick brown fox", "tensor parallel", "a" * 40, "KV heads split four ways!"]
# f32 logits of O(10): tp splits the reductions of the output and down projections into tp
# partial sums added by an all-reduce, which reorders float additions. Measured: 4e-6 at tp 2
# and 4; 1e-4 leaves room for other CPUs' vector widths and still fails on any real error
# (a wrong head or shard changes logits by O(1)).
LOGIT_ATOL = 1e-4


def _scheduler(tp: int) -> Scheduler:
    return Scheduler(SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=4,
                                   max_batched_tokens=64, tp_size=tp, radix_cache=False))


def _generate(sched: Scheduler) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        sched.add_request(sched.make_request(
            f"r{i}", prompt, SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)))
    out: dict[str, list[int]] = {}
    for o in sched.run_until_idle():
        out.setdefault(o.rid, []).extend(o.new_token_ids)
    return out


def _first_logits(sched: Scheduler, prompt: str) -> np.ndarray:
    ids = sched.tokenizer.encode(prompt)
    t = 1 << (len(ids) - 1).bit_length()
    tokens = np.zeros((1, t), np.int32)
    tokens[0, : len(ids)] = ids
    pages = sched.page_budget.allocator.allocate(sched.pool_config.pages_for(len(ids)))
    assert pages is not None
    table = np.zeros((1, sched.table_width), np.int32)
    table[0, : len(pages)] = pages

    def run(kv: list[jax.Array]) -> tuple[jax.Array, list[jax.Array]]:
        return extend(sched.runner.params, kv, jnp.asarray(tokens), jnp.zeros(1, jnp.int32),
                      jnp.asarray([len(ids)], jnp.int32), jnp.asarray(table), config=sched.config)

    logits = sched.runner.with_kv(run)
    sched.page_budget.allocator.free(pages)
    return np.asarray(logits)[0]


def test_tp_matches_tp1() -> None:
    ref = _scheduler(1)
    warm_up(ref)
    want = _generate(ref)
    want_logits = [_first_logits(ref, p) for p in PROMPTS]
    for tp in (2, 4):
        sched = _scheduler(tp)
        warm_up(sched)
        before = EXECUTABLES.stats().built
        assert _generate(sched) == want, f"tp={tp} generated other tokens than tp=1"
        assert EXECUTABLES.stats().built == before, "a step compiled after the warm-up"
        for prompt, logits in zip(PROMPTS, want_logits, strict=True):
            np.testing.assert_allclose(_first_logits(sched, prompt), logits, atol=LOGIT_ATOL)
        with sched.kv_holder.locked() as pools:
            layer = pools[MAIN_KV][0]
        assert isinstance(layer.sharding, NamedSharding)
        assert layer.sharding.spec[POOL_KV_AXIS] == "tp" and len(layer.sharding.device_set) == tp
        assert sched.stats().free_pages == sched.page_budget.allocator.total


def test_tp_refused_with_reason() -> None:
    config = _scheduler(1).config
    with pytest.raises(TensorParallelError, match="does not divide the model's 4 kv-heads"):
        check_tp(config, 3, 4)
    with pytest.raises(TensorParallelError, match="needs 8 devices"):
        check_tp(config, 8, 4)
