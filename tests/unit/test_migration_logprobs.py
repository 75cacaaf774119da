"""Output log-probs across a request migration (issue 32 §1), without processes: a worker's
answer (``worker.responses.Accumulator``) broken off after some events and resumed by another
worker (``resume``: the ids and text the client has), both read by the proxy's ``Progress`` as it
relays them. The client's log-probs (values, tokens, text offsets) equal an uninterrupted
answer's, for completions, chat and sglang's /generate, wherever the break falls."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from pd_fsm.io_trio.proxy.merged_stream import Part
from pd_fsm.io_trio.proxy.migration import Progress, migratable
from pd_fsm.io_trio.worker.responses import Accumulator, indexed
from pd_fsm.io_trio.worker.schemas import ApiError, Kind, Limits, parse_completion, parse_generate
from pd_fsm.schedulers.request import FinishReason, LogprobSpec, RequestOutput, fork_seed

PATHS: dict[Kind, str] = {"generate": "/generate", "completion": "/v1/completions",
                          "chat": "/v1/chat/completions"}
TOKENS = list(range(11, 23))
# The text each output step reports: "" where it was held back (a possible stop string, an
# unfinished UTF-8 character) and comes with a later token's. A chat stream's first chunk, its
# role, goes out with the first token's id although its text is held back.
HELD = {0, 3, 4, 7}


def _texts(t: int) -> str:
    return f"<{t}>"


def _outputs(tokens: list[int] = TOKENS, index: int = 0) -> list[RequestOutput]:
    """One output a token; the last finishes the answer (sequence ``index`` of it)."""
    outs, pending = [], ""
    for i, t in enumerate(tokens):
        pending += _texts(t)
        last = i == len(tokens) - 1
        delta, pending = ("", pending) if i in HELD and not last else (pending, "")
        outs.append(RequestOutput(
            "r", (t,), (-0.125 * (i + 1),), delta,
            FinishReason("length") if last else None, prompt_tokens=5,
            completion_tokens=i + 1, new_top_logprobs=(((t, -0.125 * (i + 1)), (t + 100, -4.0)),),
            index=index))
    return outs


def _acc(kind: Kind, resume: tuple[int, ...] = (), text: str = "", *,
         include_usage: bool = True) -> Accumulator:
    return Accumulator(kind, "r", "tiny", return_logprob=True, logprobs=LogprobSpec(top=2),
                       include_usage=include_usage, token_text=_texts, resume=resume,
                       resume_text=text, token_ids=kind != "generate")


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
    """What a worker resumed after ``done`` tokens reports, as a request of its own (index 0):
    the rest, its first output with the text the client did not get yet (replayed from the
    resumed tokens)."""
    full = "".join(o.text_delta for o in outs[:done])
    rest = [attrs.evolve(o, index=0) for o in outs[done:]]
    rest[0] = attrs.evolve(rest[0], text_delta=full[len(text_sent):] + rest[0].text_delta)
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
    assert migratable("/v1/chat/completions", {"messages": [], "n": 2})  # by sequence
    assert migratable("/generate", {"text": "hi", "sampling_params": {"n": 3}})
    assert not migratable("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3})
    assert not migratable("/v1/completions", {"prompt": "hi", "n": "2"})


# Sequences of an n = 3 answer: different lengths, so that one finishes before the others.
SEQUENCES = [TOKENS, [t + 40 for t in TOKENS[:7]], [t + 80 for t in TOKENS[:10]]]


def _interleaved() -> list[RequestOutput]:
    """The outputs of an n = 3 request as its worker reports them: one of each sequence's in
    turn, while it has any."""
    each = [_outputs(tokens, i) for i, tokens in enumerate(SEQUENCES)]
    return [o for step in range(len(TOKENS)) for outs in each for o in outs[step:step + 1]]


def _n_stream(kind: Kind, outs: list[RequestOutput], p: Progress) -> list[dict[str, Any]]:
    """A worker's n > 1 stream of ``outs`` (``GenerationRoutes._stream_many``: each event with
    its sequence's index, one usage chunk at the end when whole), read by the proxy."""
    accs = [_acc(kind, include_usage=False) for _ in SEQUENCES]
    events = []
    for out in outs:
        for payload in accs[out.index].chunks(out):
            event = indexed(payload, out.index)
            p.observe(event)
            events.append(event)
    if kind != "generate" and len(outs) == len(_interleaved()):
        completion = sum(a.completion_tokens for a in accs)
        events.append(accs[0].usage_chunk({
            "prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion,
            "prompt_tokens_details": {"cached_tokens": 0}}))
    return events


def _by_sequence(kind: Kind, events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """What a client folds out of an n > 1 stream, by index: text, finish reasons, log-probs,
    role chunks (chat); /generate's last event of each index."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        if kind == "generate":
            meta = event["meta_info"]
            out[event["index"]] = {"text": event["text"], "ids": event["output_ids"],
                                   "finish": meta["finish_reason"],
                                   "tokens": meta["completion_tokens"],
                                   "logprobs": [meta["output_token_logprobs"],
                                                meta["output_top_logprobs"]]}
            continue
        for choice in event["choices"]:
            seq = out.setdefault(choice["index"], {"text": "", "finish": [], "roles": 0,
                                                   "logprobs": []})
            delta = choice.get("delta") or {}
            seq["text"] += (delta.get("content") if kind == "chat" else choice["text"]) or ""
            seq["roles"] += delta.get("role") == "assistant"
            if choice["finish_reason"] is not None:
                seq["finish"].append(choice["finish_reason"])
            lps = choice["logprobs"]
            if lps is not None:
                seq["logprobs"].append(lps["content"] if kind == "chat" else
                                       [lps[k] for k in ("tokens", "token_logprobs",
                                                         "top_logprobs", "text_offset")])
            assert "token_ids" not in choice  # the proxy asked for them, the client did not
    for seq in out.values():  # OpenAI: entries laid end to end, however the chunks split them
        if seq.get("logprobs") and kind == "chat":
            seq["logprobs"] = [e for lps in seq["logprobs"] for e in lps]
        elif seq.get("logprobs"):
            seq["logprobs"] = [[v for lps in seq["logprobs"] for v in lps[k]] for k in range(4)]
    return out


def _continued(kind: Kind, body: dict[str, Any], one: Progress, index: int
               ) -> tuple[list[dict[str, Any]], Part]:
    """Sequence ``index`` continued as a request of its own: its worker's stream (resumed from
    what the client has of the sequence), read by its own Progress, relayed re-indexed: the
    events the client gets, and the relay's part."""
    part = Part(index)
    leg = one.leg_body(body)
    resume = leg.get("resume")
    done = len(resume["output_ids"]) if isinstance(resume, dict) else 0
    text = resume["text"] if isinstance(resume, dict) else ""
    acc = _acc(kind, tuple(SEQUENCES[index][:done]), text)
    outs = _outputs(SEQUENCES[index], index)
    events = []
    for out in _resumed_outputs(outs, done, text):
        for payload in acc.chunks(out):
            one.observe(payload)
            sse = b"data: " + json.dumps(payload).encode() + b"\n\n"
            events += part.feed({"type": "http.response.body", "body": sse, "more_body": True})
    part.feed({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    return [json.loads(e.removeprefix(b"data: ")) for e in events], part


@pytest.mark.parametrize("kind", ["generate", "completion", "chat"])
@pytest.mark.parametrize("outputs_before_break", [1, 2, 4, 14, 22, 25, 27])
def test_an_n_3_stream_goes_on_as_its_unfinished_sequences(
        kind: Kind, outputs_before_break: int) -> None:
    """The proxy keeps each sequence's progress; after a break each unfinished one goes on as a
    request of its own (n = 1, its fork's seed, resumed from its tokens), relayed with its
    index. The client gets every sequence's text, log-probs and finish reason once, as from an
    uninterrupted stream, and usage counting each token once."""
    path = PATHS[kind]
    outs = _interleaved()
    whole = _n_stream(kind, outs, Progress(path, stream=True, n=3))
    p = Progress(path, stream=True, n=3)
    first = _n_stream(kind, outs[:outputs_before_break], p)
    assert not p.finished
    if not first:  # nothing went out yet: the next room takes the request as it came
        assert kind == "completion" and not p.apart and "resume" not in p.leg_body({})
        return
    assert p.apart
    body: dict[str, Any] = ({"text": "hi", "sampling_params": {"n": 3, "seed": 7}, "rid": "x"}
                            if kind == "generate" else {"prompt": "hi", "n": 3, "seed": 7})
    sequences = p.sequences(body)
    finished_before = {o.index for o in outs[:outputs_before_break]
                       if o.finish_reason is not None}
    assert [i for i, _, _ in sequences] == [i for i in range(3) if i not in finished_before]
    parts, rest = [], []
    for index, one_body, one in sequences:
        where = one_body["sampling_params"] if kind == "generate" else one_body
        assert (where["n"], where["seed"]) == (1, fork_seed(7, index))
        assert one_body.get("rid") == (f"x.n{index}" if kind == "generate" else None)
        events, part = _continued(kind, body, one, index)
        parts.append(part)
        rest += events
    if kind != "generate":
        usage = [part.usage for part in parts if part.usage is not None]
        rest.append(p.usage_chunk(usage[-1]))
        assert rest[-1]["usage"] == whole[-1]["usage"]  # each token counted once
    assert p.finished
    assert _by_sequence(kind, first + rest) == _by_sequence(kind, whole)
    assert {i: c.output_ids for i, c in p.choices.items()} == dict(enumerate(SEQUENCES))
