"""What the proxy keeps of a streamed answer for the next room (proxy/migration.py Progress),
here: a hand-off ticket whose newest token the client never got."""

from __future__ import annotations

from pd_fsm.io_trio.proxy.migration import Progress


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
