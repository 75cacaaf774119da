"""The proxy's own error answers (``proxy/answers.py``)."""

from __future__ import annotations

import json

import trio

from pd_fsm.io_trio.proxy.answers import send_stream_error


def test_a_stream_error_carries_its_status_in_band_as_the_workers_do() -> None:
    """A streamed answer the proxy ends itself says its status twice: OpenAI's ``error.code`` and
    sglang's ``meta_info.finish_reason.status_code`` (the worker's abort event's shape), then
    ``[DONE]``, and closes the body."""
    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    trio.run(send_stream_error, send, "no decode worker answered", 503)
    [message] = sent
    assert message["more_body"] is False
    body = message["body"]
    assert isinstance(body, bytes)
    event, done = body.decode().strip().split("\n\n")
    assert done == "data: [DONE]"
    chunk = json.loads(event.removeprefix("data: "))
    assert chunk["error"]["code"] == 503
    assert chunk["meta_info"]["finish_reason"] == {
        "type": "abort", "message": "no decode worker answered", "status_code": 503}
