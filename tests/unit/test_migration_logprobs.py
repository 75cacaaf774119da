"""Output log-probs across a request migration (issue 32 §1), without processes: a worker's
answer (``worker.responses.Accumulator``) broken off after some events and resumed by another
worker (``resume``: the ids and text the client has), both read by the proxy's ``Progress`` as it
relays them. The client's log-probs (values, tokens, text offsets) equal an uninterrupted
answer's, for completions, chat and sglang's /generate, wherever the break falls."""

from __future__ import annotations

from typing import Any

import pytest

from pd_fsm.io_trio.proxy.migration import Progress, migratable
from pd_fsm.io_trio.worker.responses import Accumulator
from pd_fsm.io_trio.worker.schemas import ApiError, Kind, Limits, parse_completion, parse_generate
from pd_fsm.schedulers.request import FinishReason, LogprobSpec, RequestOutput

PATHS: dict[Kind, str] = {"generate": "/generate", "completion": "/v1/completions",
                          "chat": "/v1/chat/completions"}
TOKENS = list(range(11, 23))
# The text each output step reports: "" where it was held back (a possible stop string, an
# unfinished UTF-8 character) and comes with a later token's. A chat stream's first chunk, its
# role, goes out with the first token's id although its text is held back.
HELD = {0, 3, 4, 7}


def _texts(t: int) -> str:
    return f"<{t}>"


def _outputs() -> list[RequestOutput]:
    """One output a token; the last finishes the answer."""
    outs, pending = [], ""
    for i, t in enumerate(TOKENS):
        pending += _texts(t)
        last = i == len(TOKENS) - 1
        delta, pending = ("", pending) if i in HELD and not last else (pending, "")
        outs.append(RequestOutput(
            "r", (t,), (-0.125 * (i + 1),), delta,
            FinishReason("length") if last else None, prompt_tokens=5,
            completion_tokens=i + 1, new_top_logprobs=(((t, -0.125 * (i + 1)), (t + 100, -4.0)),)))
    return outs


def _acc(kind: Kind, resume: tuple[int, ...] = (), text: str = "") -> Accumulator:
    return Accumulator(kind, "r", "tiny", return_logprob=True, logprobs=LogprobSpec(top=2),
                       include_usage=True, token_text=_texts, resume=resume, resume_text=text,
                       token_ids=kind != "generate")


def _relay(p: Progress, acc: Accumulator, outs: list[RequestOutput]) -> list[dict[str, Any]]:
    """What the client gets of ``outs``, each event read (and edited) by the proxy."""
    events = []
    for out in outs:
        for event in acc.chunks(out):
            p.observe(event)
            events.append(event)
    return events


def _resumed_outputs(outs: list[RequestOutput], done: int, text_sent: str
                     ) -> list[RequestOutput]:
    """What a worker resumed after ``done`` tokens reports: the rest, its first output with the
    text the client did not get yet (replayed from the resumed tokens)."""
    full = "".join(o.text_delta for o in outs[:done])
    rest = [*outs[done:]]
    first = rest[0]
    rest[0] = RequestOutput(first.rid, first.new_token_ids, first.new_logprobs,
                            full[len(text_sent):] + first.text_delta, first.finish_reason,
                            first.prompt_tokens, first.completion_tokens,
                            new_top_logprobs=first.new_top_logprobs)
    return rest


def _client_logprobs(kind: Kind, events: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The log-probs a client folds out of a stream."""
    if kind == "generate":
        meta = events[-1]["meta_info"]
        return {k: meta[k] for k in ("output_token_logprobs", "output_top_logprobs")}
    out: dict[str, list[Any]] = {}
    for event in events:
        for choice in event["choices"]:
            lps = choice["logprobs"]
            if lps is None:
                continue
            if kind == "chat":
                out.setdefault("content", []).extend(lps["content"])
            else:
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    out.setdefault(key, []).extend(lps[key])
    return out


@pytest.mark.parametrize("handoff", [False, True], ids=["migration", "handoff"])
@pytest.mark.parametrize("kind", ["generate", "completion", "chat"])
@pytest.mark.parametrize("outputs_before_break", [1, 2, 4, 5, 8, 11])
def test_log_probs_continue_across_a_migration(kind: Kind, outputs_before_break: int,
                                               handoff: bool) -> None:
    """A migration resumes from the ids the client has (a held-back token is generated
    again); a hand-off from every token the draining D generated: before its ticket, it sends
    the ids (and log-probs) of the tokens whose text it held back."""
    outs = _outputs()
    whole = _relay(Progress(PATHS[kind], stream=True), _acc(kind), outs)
    p = Progress(PATHS[kind], stream=True)
    acc = _acc(kind)
    first = _relay(p, acc, outs[:outputs_before_break])
    if handoff:
        for event in acc.unsent_ids_chunks():
            p.observe(event)
            first.append(event)
        p.adopt_next_token({"next_token": TOKENS[outputs_before_break - 1]})
        assert p.output_ids == TOKENS[:outputs_before_break]  # nothing adopted unsent
    done = len(p.output_ids)
    assert done <= outputs_before_break  # a held-back token's id may not have gone out
    if not done:  # nothing went out yet (completions: the first token's text was held back)
        assert kind == "completion" and not first and "resume" not in p.leg_body({})
        return
    resume = p.leg_body({"stream": True})["resume"]
    assert isinstance(resume, dict) and resume["output_ids"] == TOKENS[:done]
    rest = _relay(p, _acc(kind, tuple(resume["output_ids"]), resume["text"]),
                  _resumed_outputs(outs, done, resume["text"]))
    assert _client_logprobs(kind, first + rest) == _client_logprobs(kind, whole)
    if kind == "generate":
        assert rest[-1]["output_ids"] == TOKENS and p.output_ids == TOKENS
    else:  # the proxy took the ids it asked for out of every chunk
        assert not any("token_ids" in c for e in first + rest for c in e["choices"])


def test_a_resumed_worker_reports_only_the_log_probs_it_computed() -> None:
    """Its /generate lists start at its first generated token (the proxy puts the rest in
    front); completions' offsets count the resumed tokens' text."""
    outs = _outputs()
    acc = _acc("generate", tuple(TOKENS[:4]), "<11><12>")
    meta = acc.chunks(_resumed_outputs(outs, 4, "<11><12>")[0])[0]["meta_info"]
    assert meta["completion_tokens"] == 5
    assert [e[1] for e in meta["output_token_logprobs"]] == [TOKENS[4]]
    comp = _acc("completion", tuple(TOKENS[:4]), "<11><12>")
    chunk = comp.chunks(_resumed_outputs(outs, 4, "<11><12>")[0])[0]
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [4 * 4]
    assert chunk["choices"][0]["token_ids"] == [TOKENS[4]]


def test_resume_takes_output_log_probs_and_refuses_prompt_log_probs_by_name() -> None:
    limits = Limits(context_length=256, vocab_size=1000)
    resume = {"resume": {"output_ids": [5, 7], "text": "ab"}}
    gen = {"text": "hi", "sampling_params": {"max_new_tokens": 20}, **resume}
    assert parse_generate({**gen, "return_logprob": True, "top_logprobs_num": 2},
                          limits).return_logprob
    comp = {"prompt": "hi", "max_tokens": 20, **resume}
    assert parse_completion({**comp, "logprobs": 2}, limits).return_logprob
    for parse, body, why in (
            (parse_generate, {**gen, "return_logprob": True, "logprob_start_len": 0},
             "prompt log-probs"),
            (parse_completion, {**comp, "echo": True}, "echo"),
            (parse_completion, {**comp, "n": 2}, "n > 1")):
        with pytest.raises(ApiError, match=f"resume cannot be combined with {why}"):
            parse(body, limits)


def test_which_answers_migrate() -> None:
    assert migratable("/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 2})
    assert not migratable("/generate", {"text": "hi", "return_logprob": True,
                                        "logprob_start_len": 0})
    assert migratable("/v1/completions", {"prompt": "hi", "logprobs": 3})
    assert not migratable("/v1/completions", {"prompt": "hi", "logprobs": 3, "echo": True})
    assert not migratable("/v1/completions", {"prompt": "hi", "echo": True})
    assert migratable("/v1/chat/completions", {"messages": [], "logprobs": True,
                                               "top_logprobs": 2})
    assert not migratable("/v1/chat/completions", {"messages": [], "n": 2})
