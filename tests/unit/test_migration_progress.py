"""What the proxy keeps of a streamed answer for the next room (proxy/migration.py Progress),
here: a hand-off ticket whose newest token the client never got, and a worker failure D
reported in-band."""

from __future__ import annotations

import json

from pd_fsm.io_trio.proxy.migration import Progress, worker_failure


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
