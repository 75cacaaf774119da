"""Resumed requests (request migration, issue 32): a request given the tokens it generated on a
worker that failed goes on exactly as the uninterrupted run would have, on the tiny model."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import FinishReason, RequestOutput, Scheduler, SchedulerArgs
from pd_fsm.schedulers.request import LogprobSpec, Resume, fork_seed

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42, max_new_tokens=14,
                        ignore_eos=True)
PENALIZED = attrs.evolve(SEEDED, frequency_penalty=0.8, presence_penalty=0.5)


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _sched(tiny: LoadedModel) -> Scheduler:
    return Scheduler(SchedulerArgs(model="tiny", num_pages=128, page_size=4, max_running=8,
                                   max_batched_tokens=256), model=tiny)


def _prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(1, 256, size=n).tolist()


def _run(tiny: LoadedModel, prompt: list[int], sp: SamplingParams,
         resume: Resume | None = None, logprobs: LogprobSpec | None = None
         ) -> tuple[list[RequestOutput], Scheduler]:
    sched = _sched(tiny)
    sched.add_request(sched.make_request("r", prompt, sp, logprobs=logprobs, resume=resume))
    outputs = sched.run_until_idle()
    stats = sched.stats()
    assert stats.free_pages == stats.total_pages  # nothing held after the request
    return outputs, sched


def _ids(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.text_delta for o in outputs)


@pytest.mark.parametrize("sp", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
@pytest.mark.parametrize("cut", [1, 5, 13])
def test_a_resumed_request_continues_the_uninterrupted_one(
    tiny: LoadedModel, sp: SamplingParams, cut: int
) -> None:
    prompt = _prompt(3, 9)
    whole, _ = _run(tiny, prompt, sp)
    ids, text = _ids(whole), _text(whole)
    done = Resume(tuple(ids[:cut]), text_sent=cut)  # the char tokenizer: a token is a character
    rest, _ = _run(tiny, prompt, sp, done)
    assert _ids(rest) == ids[cut:]
    assert _text(rest) == text[cut:]
    last = rest[-1]
    # Usage counts the prompt once and every output token once, wherever it was generated.
    assert (last.prompt_tokens, last.completion_tokens) == (len(prompt), len(ids))
    assert last.finish_reason == FinishReason("length")


@pytest.mark.parametrize("sp", [GREEDY, SEEDED, PENALIZED], ids=["greedy", "seeded", "penalized"])
@pytest.mark.parametrize("cut", [0, 1, 6])
def test_one_sequence_of_n_continues_alone_with_its_fork_seed(
    tiny: LoadedModel, sp: SamplingParams, cut: int
) -> None:
    """A proxy continues each unfinished sequence of a broken n > 1 stream as a request of its
    own (n = 1, seed ``fork_seed``, resume from its tokens): it goes on as the sequence would
    have, wherever it broke off (``cut`` 0: it had sent nothing yet)."""
    prompt = _prompt(7, 8)
    whole, _ = _run(tiny, prompt, attrs.evolve(sp, n=3))
    for index in range(3):
        seq = [o for o in whole if o.index == index]
        ids, text = _ids(seq), _text(seq)
        assert len(ids) == sp.max_new_tokens
        alone = attrs.evolve(sp, seed=None if sp.seed is None else fork_seed(sp.seed, index))
        rest, _ = _run(tiny, prompt, alone, Resume(tuple(ids[:cut]), text_sent=cut)
                       if cut else None)
        assert (_ids(rest), _text(rest)) == (ids[cut:], text[cut:]), index
    if sp.seed is not None:  # the sequences differ: each was drawn with a seed of its own
        assert len({tuple(_ids([o for o in whole if o.index == i])) for i in range(3)}) == 3


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_request_s_log_probs_are_the_uninterrupted_one_s_from_the_break(
    tiny: LoadedModel, sp: SamplingParams
) -> None:
    """It computes those of the tokens it generates (and none of the resumed ones, which are
    part of its prefill): equal to the uninterrupted run's, alternatives included."""
    prompt, cut, spec = _prompt(6, 9), 5, LogprobSpec(top=3)
    whole, _ = _run(tiny, prompt, sp, logprobs=spec)
    ids = _ids(whole)
    rest, _ = _run(tiny, prompt, sp, Resume(tuple(ids[:cut]), text_sent=cut), spec)
    assert _ids(rest) == ids[cut:]
    assert all(o.prompt_logprobs is None for o in rest)
    lps = [lp for o in whole for lp in o.new_logprobs][cut:]
    assert [lp for o in rest for lp in o.new_logprobs] == pytest.approx(lps, abs=1e-5)
    tops = [t for o in whole for t in o.new_top_logprobs][cut:]
    got = [t for o in rest for t in o.new_top_logprobs]
    assert [[tok for tok, _ in t] for t in got] == [[tok for tok, _ in t] for t in tops]
    assert [lp for t in got for _, lp in t] == pytest.approx(
        [lp for t in tops for _, lp in t], abs=1e-5)


def test_text_the_client_has_not_seen_yet_is_sent_by_the_new_worker(tiny: LoadedModel) -> None:
    prompt = _prompt(4, 7)
    whole, _ = _run(tiny, prompt, GREEDY)
    ids, text = _ids(whole), _text(whole)
    # The first worker held the text of tokens 4 and 5 back (a possible stop string) when it
    # died: the client has 4 characters of 6 tokens.
    rest, _ = _run(tiny, prompt, GREEDY, Resume(tuple(ids[:6]), text_sent=4))
    assert _ids(rest) == ids[6:]
    assert _text(rest) == text[4:]


def test_a_stop_string_spanning_the_break_is_found(tiny: LoadedModel) -> None:
    prompt = _prompt(8, 6)
    whole, _ = _run(tiny, prompt, GREEDY)
    ids, text = _ids(whole), _text(whole)
    stop = text[5:8]  # starts in what the first worker generated, ends after the break
    cut = text.find(stop)
    sp = attrs.evolve(GREEDY, stop=(stop,))
    plain, _ = _run(tiny, prompt, sp)
    rest, _ = _run(tiny, prompt, sp, Resume(tuple(ids[:cut + 1]), text_sent=cut))
    assert rest[-1].finish_reason == plain[-1].finish_reason == FinishReason("stop", matched=stop)
    assert _text(rest) == ""  # the text before the stop was all sent before the break
    assert _ids(plain)[cut + 1:] == _ids(rest)


def test_resume_is_refused_when_it_leaves_nothing_to_generate(tiny: LoadedModel) -> None:
    sched = _sched(tiny)
    with pytest.raises(ValueError, match="resume has 14 tokens"):
        sched.make_request("r", _prompt(1, 5), GREEDY, resume=Resume(tuple(range(1, 15))))


def test_a_resumed_request_keeps_its_grammar_place(tiny: LoadedModel) -> None:
    from pd_fsm.jax_engine.sampling.grammar import Constraint

    sp = attrs.evolve(SEEDED, max_new_tokens=40, ignore_eos=False,
                      constraint=Constraint("regex", "[a-c]{6,12}x"))
    prompt = _prompt(5, 6)
    whole, _ = _run(tiny, prompt, sp)
    ids, text = _ids(whole), _text(whole)
    assert text[-1] == "x" and set(text[:-1]) <= set("abc")  # the grammar held
    rest, _ = _run(tiny, prompt, sp, Resume(tuple(ids[:4]), text_sent=4))
    assert _ids(rest) == ids[4:] and text[:4] + _text(rest) == text
    # Tokens that break the grammar cannot be resumed: refused when the request is queued.
    sched = _sched(tiny)
    bad = sched.make_request("r", prompt, sp, resume=Resume((ord("z"),)))
    with pytest.raises(ValueError):
        sched.add_request(bad)
