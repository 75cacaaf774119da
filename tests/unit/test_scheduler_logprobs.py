"""Log-probs a request can ask for: prompt tokens' (computed by the prefill, chunk by chunk) and
each position's top alternatives, checked against a plain numpy Llama on the tiny model."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from pd_fsm.jax_engine.model import TINY, LoadedModel, load_model
from pd_fsm.jax_engine.model.params import random_params_np
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, RequestOutput, Scheduler, SchedulerArgs
from pd_fsm.schedulers.request import LogprobSpec, PromptLogprobs
from tests.unit.test_model_reference import reference_logits

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
PROMPT = np.random.default_rng(7).integers(1, 256, size=30).tolist()
# float32 paged forward against float64 numpy: the reference test's tolerance on logits.
ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")  # random_params_np(TINY, seed=0), as below


@pytest.fixture(scope="module")
def ref_logprobs() -> np.ndarray:
    logits = reference_logits(random_params_np(TINY, seed=0), TINY, PROMPT)
    top = logits.max(axis=-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def _run(tiny: LoadedModel, req: Req, max_batched_tokens: int = 256) -> list[RequestOutput]:
    args = SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=4,
                         max_batched_tokens=max_batched_tokens)
    sched = Scheduler(args, model=tiny)
    sched.add_request(req)
    outputs = sched.run_until_idle()
    stats = sched.stats()
    assert stats.free_pages == stats.total_pages
    return outputs


def _prompt_part(outputs: list[RequestOutput]) -> PromptLogprobs:
    parts = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    assert len(parts) == 1, "prompt log-probs come once, in one output"
    return parts[0]


@pytest.mark.parametrize("max_batched_tokens", [256, 8])  # 8: the prompt in four chunks
@pytest.mark.parametrize("prompt_from", [0, 5])
def test_prompt_logprobs_match_reference(
    tiny: LoadedModel, ref_logprobs: np.ndarray, max_batched_tokens: int, prompt_from: int
) -> None:
    spec = LogprobSpec(top=3, prompt_from=prompt_from)
    outputs = _run(tiny, Req("a", PROMPT, GREEDY, logprobs=spec), max_batched_tokens)
    part = _prompt_part(outputs)
    assert part.start == prompt_from
    assert len(part.logprobs) == len(part.top) == len(PROMPT) - prompt_from
    for i, (lp, top) in enumerate(zip(part.logprobs, part.top, strict=True)):
        pos = prompt_from + i
        if pos == 0:
            assert lp is None and top is None
            continue
        row = ref_logprobs[pos - 1]  # position pos-1 predicts token pos
        assert lp == pytest.approx(row[PROMPT[pos]], abs=ATOL)
        assert top is not None and len(top) == 3
        assert [t for t, _ in top] == np.argsort(-row)[:3].tolist()
        assert [v for _, v in top] == pytest.approx(np.sort(row)[::-1][:3], abs=ATOL)


def test_output_top_logprobs_agree_with_the_sampled_tokens(tiny: LoadedModel) -> None:
    plain = _run(tiny, Req("a", PROMPT, GREEDY))
    outputs = _run(tiny, Req("a", PROMPT, GREEDY, logprobs=LogprobSpec(top=5)))
    ids = [t for o in outputs for t in o.new_token_ids]
    assert ids == [t for o in plain for t in o.new_token_ids], "log-probs change no token"
    lps = [lp for o in outputs for lp in o.new_logprobs]
    tops = [top for o in outputs for top in o.new_top_logprobs]
    assert len(tops) == len(ids) == GREEDY.max_new_tokens
    for token, lp, top in zip(ids, lps, tops, strict=True):
        assert len(top) == 5
        assert top[0][0] == token  # greedy: the most likely token is the one sampled
        assert top[0][1] == pytest.approx(lp, abs=1e-5)
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
    assert all(o.prompt_logprobs is None for o in outputs), "not asked for"


def test_prompt_logprobs_without_new_tokens(tiny: LoadedModel, ref_logprobs: np.ndarray) -> None:
    """The evaluation-harness call (echo, max_tokens=0): the prompt's log-probs, no token."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=0)
    outputs = _run(tiny, Req("a", PROMPT, sp, logprobs=LogprobSpec(prompt_from=0)))
    assert [t for o in outputs for t in o.new_token_ids] == []
    assert outputs[-1].finish_reason is not None and outputs[-1].finish_reason.kind == "length"
    part = _prompt_part(outputs)
    assert part.top == ()
    assert part.logprobs[0] is None
    expected = [ref_logprobs[p - 1][PROMPT[p]] for p in range(1, len(PROMPT))]
    assert list(part.logprobs[1:]) == pytest.approx(expected, abs=ATOL)


def test_top_is_bounded() -> None:
    with pytest.raises(ValueError, match="top must be in"):
        LogprobSpec(top=21)


# ----------------------------------------------------------------------------- n > 1: forks


def _sequences(outputs: list[RequestOutput]) -> dict[int, list[int]]:
    seqs: dict[int, list[int]] = {}
    for o in outputs:
        seqs.setdefault(o.index, []).extend(o.new_token_ids)
    return seqs


@pytest.mark.parametrize("prompt_len", [29, 28])  # the last prompt page partial, and full
def test_n_sequences_fork_from_one_prefill(tiny: LoadedModel, prompt_len: int) -> None:
    """n sequences share the prompt's pages (one prefill); each samples with its own seed, and
    sequence i equals a plain request with seed + i. Every page comes back once (``_run``)."""
    prompt = PROMPT[:prompt_len]
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=11, n=3)
    outputs = _run(tiny, Req("a", prompt, sp))
    finals = [o for o in outputs if o.finish_reason is not None]
    assert len(finals) == 3 and [o.finished for o in finals] == [False, False, True]
    seqs = _sequences(outputs)
    assert sorted(seqs) == [0, 1, 2]
    for i in range(3):
        alone = attrs.evolve(sp, n=1, seed=11 + i)
        assert seqs[i] == _sequences(_run(tiny, Req("b", prompt, alone)))[0], i
    assert len({tuple(s) for s in seqs.values()}) > 1, "seeds differ: so do the samples"


def test_n_sequences_abort_frees_every_page(tiny: LoadedModel) -> None:
    args = SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=4,
                         max_batched_tokens=256)
    sched = Scheduler(args, model=tiny)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True, n=4)
    sched.add_request(Req("a", PROMPT, sp))
    for _ in range(3):
        sched.step()
    assert sched.stats().running == 4
    shared = (len(PROMPT) - 1) // 4
    assert sched.page_budget.allocator.holders(sched.reqs["a"].pages[0]) == 4
    assert sched.abort("a")
    finals = [o for o in sched.drain_outputs() if o.finish_reason is not None]
    assert {o.index for o in finals} == {0, 1, 2, 3} and sum(o.finished for o in finals) == 1
    stats = sched.stats()
    assert stats.free_pages == stats.total_pages and stats.running == 0
    assert shared > 0
