"""What the proxy answers a client with when it is not D's answer: errors (JSON, or an error event
in a stream already begun) and refusals (no worker, every worker full)."""

from __future__ import annotations

import json

import attrs

from pd_fsm.io_trio.worker.sse import Send

# An HTTP status and the JSON value to answer with (a worker's, or one error_body builds).
Failure = tuple[int, object]
ErrorBody = dict[str, dict[str, str | int]]  # {"error": {"message", "type", "code"}}


def error_body(status: int, message: str, type_: str = "proxy_error") -> ErrorBody:
    return {"error": {"message": message, "type": type_, "code": status}}


def json_or_text(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return error_body(502, raw.decode("utf-8", "replace")[:2000])


def reason(body: object, status: int) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return f"HTTP {status}"


@attrs.frozen
class Refusal:
    """Why a request got no room: no worker of a role (503), or every one full (429)."""

    status: int
    reason: str
    type: str
    retry_after: float | None = None

    def body(self) -> ErrorBody:
        return error_body(self.status, self.reason, self.type)


async def send_json(send: Send, status: int, body: object) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode(),
                "more_body": False})


async def send_stream_error(send: Send, message: str, status: int = 502) -> None:
    chunk = {"error": {"message": message, "type": "stream_error", "code": status},
             # sglang's /generate shape, as the worker's own abort event has it
             # (worker/responses.py): a client reads the status in-band.
             "meta_info": {"finish_reason": {"type": "abort", "message": message,
                                             "status_code": status}}}
    data = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": False})
