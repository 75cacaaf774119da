"""What the proxy keeps of a streamed answer for the next room (proxy/migration.py Progress),
here: a hand-off ticket whose newest token the client never got, and a worker failure D
reported in-band (OpenAI's error chunk, /generate's abort with its status); and how one
sequence continued alone after a break reaches the client (``merged_stream.Part``)."""

from __future__ import annotations

import json

from pd_fsm.io_trio.proxy.merged_stream import Part
from pd_fsm.io_trio.proxy.migration import Progress, worker_failure
from pd_fsm.io_trio.worker.responses import Accumulator
from pd_fsm.io_trio.worker.sse import moved_event, moved_reason
from pd_fsm.schedulers.request import RequestOutput


def test_a_ticket_s_unsent_token_joins_resume_and_a_sent_one_does_not() -> None:
    p = Progress("/generate", stream=True)
    body = {"text": "hi", "stream": True}
    p.adopt_next_token({"next_token": 7})  # handed off before its first event went out
    assert p.leg_body(body)["resume"] == {"output_ids": [7], "text": ""}
    p.observe({"output_ids": [7, 8], "text": "ab", "meta_info": {}})
    p.adopt_next_token({"next_token": 8})  # the client has it already
    assert p.leg_body(body)["resume"] == {"output_ids": [7, 8], "text": "ab"}
    p.adopt_next_token({"next_token": "x"})  # not a token: nothing changes
    assert p.output_ids == [7, 8]


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_worker_failure_reported_in_band_is_withheld_with_the_rest_of_the_stream() -> None:
    """D's 5xx error event (a drain deadline, a failed step) is not relayed, nor what follows
    it ([DONE]): the request migrates. A 4xx, or an error without a status, is relayed."""
    p = Progress("/v1/completions", stream=True)
    token = _event({"choices": [{"text": "a", "token_ids": [5], "finish_reason": None}]})
    assert not p.withhold(token)
    failure = _event({"choices": [{"text": "", "finish_reason": "abort"}], "error": {
        "message": "the worker switched its role", "type": "stream_error", "code": 503}})
    assert p.withhold(failure) and p.failed == (503, "the worker switched its role")
    assert p.withhold(b"data: [DONE]\n\n") and p.withhold(token)  # nothing more of this D
    assert not p.finished  # the abort's finish reason was never observed
    for relayed in ({"error": {"message": "bad", "code": 400}},
                    {"error": {"message": "no status"}}, {"error": "text"},
                    {"error": {"code": True, "message": "a bool is not a status"}}):
        q = Progress("/v1/completions", stream=True)
        assert not q.withhold(_event(relayed)) and q.failed is None
    assert worker_failure(b"data: {not json") is None
    assert worker_failure(_event({"error": {"code": 502}})) == (502, "worker failure")


def test_a_stream_the_worker_gave_up_is_withheld_and_every_stream_lets_it_move() -> None:
    """``POST /move_streams``: D ends a stream with a move event, which the proxy keeps (its
    reason) and never relays; it asks every streamed leg it can continue for that leave
    (``accept_move``), a plain answer's not."""
    p = Progress("/generate", stream=True)
    assert p.leg_body({"text": "hi", "stream": True})["accept_move"] is True
    assert "accept_move" not in Progress("/generate", stream=False).leg_body({"text": "hi"})
    assert not p.withhold(_event({"output_ids": [3], "text": "a", "meta_info": {}}))
    assert p.withhold(moved_event("moved by POST /move_streams"))
    assert p.moved == "moved by POST /move_streams" and p.failed is None and p.ticket is None
    # A move event whose body does not parse is a move all the same (never relayed).
    assert moved_reason(b"event: pd_fsm.moved\ndata: {not json\n\n") == "moved"
    assert moved_reason(b"event: pd_fsm.moved\ndata: {}\n\n") == "moved"
    assert moved_reason(_event({"reason": "x"})) is None  # a data-only event is output


def test_a_generate_stream_s_abort_with_a_5xx_status_is_a_worker_failure() -> None:
    """sglang's FINISH_ABORT carries ``status_code``: the worker's error event for a started
    /generate stream (``Accumulator.error_chunk``) does, with every other field of the event, and
    a 5xx there migrates the stream as an OpenAI chunk's ``error.code`` does."""
    acc = Accumulator("generate", "r", "tiny", token_text=str)
    acc.chunks(RequestOutput("r", (5,), (-0.5,), "a", None, prompt_tokens=3,
                             completion_tokens=1))
    event = acc.error_chunk(503, "the worker switched its role")
    assert event["text"] == "a" and event["output_ids"] == [5]
    meta = event["meta_info"]
    assert isinstance(meta, dict) and meta["completion_tokens"] == 1
    assert meta["finish_reason"] == {"type": "abort", "message": "the worker switched its role",
                                     "status_code": 503}
    p = Progress("/generate", stream=True)
    assert not p.withhold(_event(acc.generate_body()))  # (a stream's events carry no status)
    assert p.withhold(_event(event)) and p.failed == (503, "the worker switched its role")
    assert p.withhold(b"data: [DONE]\n\n") and not p.finished
    for relayed in ({"type": "abort", "message": "aborted by request"},  # the request's own
                    {"type": "abort", "message": "bad", "status_code": 400},
                    {"type": "abort", "status_code": "503"},
                    {"type": "length", "status_code": 503}):
        q = Progress("/generate", stream=True)
        raw = _event({"text": "", "output_ids": [], "meta_info": {"finish_reason": relayed}})
        assert not q.withhold(raw) and q.failed is None
    assert worker_failure(_event({"meta_info": {"finish_reason": {
        "type": "abort", "status_code": 500}}})) == (500, "worker failure")


def test_a_part_of_a_merged_stream_is_relayed_under_its_index() -> None:
    """One part of a merged stream (``merged_stream.Part``: a batch's prompt, an n > 1 answer's
    sequence continued alone): its events under its index however the bytes are split, its
    [DONE] and usage chunk held back; a part that answered an error status: its error, once."""
    part = Part(2)
    chunk = _event({"choices": [{"index": 0, "text": "a", "finish_reason": None}]})
    usage = _event({"choices": [], "usage": {"completion_tokens": 3}})
    body = chunk + _event({"text": "ab", "output_ids": [1, 2]}) + usage + b"data: [DONE]\n\n"
    out = []
    for lo, hi in ((0, 7), (7, len(chunk) + 3), (len(chunk) + 3, len(body))):
        out += part.feed({"type": "http.response.body", "body": body[lo:hi]})
    assert [json.loads(e.removeprefix(b"data: ")) for e in out] == [
        {"choices": [{"index": 2, "text": "a", "finish_reason": None}]},
        {"text": "ab", "output_ids": [1, 2], "index": 2}]
    assert part.usage == {"choices": [], "usage": {"completion_tokens": 3}}
    assert part.end() == []
    failed = Part(1)
    failed.feed({"type": "http.response.start", "status": 503, "headers": []})
    assert failed.feed({"type": "http.response.body",
                        "body": b'{"error": {"message": "no workers", "code": 503}}'}) == []
    assert [json.loads(e.removeprefix(b"data: ")) for e in failed.end()] == [
        {"error": {"message": "no workers", "code": 503}, "index": 1}]
