"""Prompt log-probs under PD: P computes them (it runs the prefill), D answers the client; the
proxy puts P's into D's answer, whole or streamed.

D's answer has everything else: the output tokens' log-probs and their alternatives (the first
token's came from P with the KV, in READY), and with ``echo`` the prompt's text and the output's
``text_offset`` counted after the prompt's tokens. What D lacks is the prompt positions:

* ``/generate``: P's ``meta_info.input_token_logprobs`` (and ``input_top_logprobs``) go before
  D's own (D has none; sglang-router does the same prepend for the first key);
* ``/v1/completions`` with ``echo``: P's ``choices[0].logprobs`` starts with the prompt's
  positions (as many as P's entries minus its ``completion_tokens``); those go before D's
  entries, in the first event that carries a logprobs object.

Which requests need it is decided from the client's body alone (:func:`wants_prompt_logprobs`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

_INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs")
_COMPLETION_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
_EVENT_END = b"\n\n"
_DATA = b"data: "


def wants_prompt_logprobs(path: str, body: Mapping[str, object]) -> bool:
    """Whether the client asked for the prompt's log-probs (which only P computes)."""
    if path == "/generate":
        start = body.get("logprob_start_len")
        return body.get("return_logprob") is True and type(start) is int and start >= 0
    if path == "/v1/completions":
        return body.get("echo") is True and body.get("logprobs") is not None
    return False


def _field(obj: object, key: str) -> dict[str, object] | None:
    """``obj[key]`` when both are JSON objects."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, dict) else None


def _first_choice_logprobs(body: object) -> dict[str, object] | None:
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices:
        return None
    return _field(choices[0], "logprobs")


def merge(path: str, p_body: object, d_body: object) -> bool:
    """Put P's prompt positions into ``d_body`` (one whole answer or one stream event), in place;
    True when it did (a completions stream takes them once)."""
    if path == "/generate":
        p_meta, d_meta = _field(p_body, "meta_info"), _field(d_body, "meta_info")
        if p_meta is None or d_meta is None:
            return False
        for key in _INPUT_KEYS:
            ours = p_meta.get(key)
            if isinstance(ours, list):
                theirs = d_meta.get(key)
                d_meta[key] = ours + (theirs if isinstance(theirs, list) else [])
        return True
    p_lps, d_lps = _first_choice_logprobs(p_body), _first_choice_logprobs(d_body)
    if p_lps is None or d_lps is None:
        return False
    usage = _field(p_body, "usage") or {}
    tokens = p_lps.get("tokens")
    p_outputs = usage.get("completion_tokens")
    if not isinstance(tokens, list) or type(p_outputs) is not int:
        return False
    n_prompt = len(tokens) - p_outputs
    for key in _COMPLETION_KEYS:
        ours, theirs = p_lps.get(key), d_lps.get(key)
        if isinstance(ours, list) and isinstance(theirs, list):
            d_lps[key] = ours[:n_prompt] + theirs
    return True


def split_events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The whole SSE events at the start of ``buffer`` (each with its blank line) and the rest."""
    events = []
    while (end := buffer.find(_EVENT_END)) >= 0:
        events.append(buffer[: end + 2])
        buffer = buffer[end + 2 :]
    return events, buffer


class SseRewriter:
    """Rewrites the JSON ``data:`` events of an SSE byte stream through ``rewrite`` (which edits an
    event in place and says whether it is done: later events pass untouched) until it is done.
    Bytes are held only up to the end of the event they belong to."""

    def __init__(self, rewrite: Callable[[object], bool], *, once: bool,
                 drop: Callable[[bytes], bool] | None = None) -> None:
        self._rewrite = rewrite
        self._drop = drop  # events it returns True for are read by it and not passed on
        self._once = once
        self._done = False
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if self._done:
            return chunk
        events, self._pending = split_events(self._pending + chunk)
        out = []
        for i, event in enumerate(events):
            out.append(self._event(event))
            if self._done:  # the rest passes untouched
                out.extend(events[i + 1 :])
                out.append(self._pending)
                self._pending = b""
                break
        return b"".join(out)

    def flush(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _event(self, event: bytes) -> bytes:
        if self._drop is not None and self._drop(event):
            return b""
        if not event.startswith(_DATA) or event.startswith(_DATA + b"[DONE]"):
            return event
        try:
            obj = json.loads(event[len(_DATA) :])
        except ValueError:
            return event
        if self._rewrite(obj) and self._once:
            self._done = True
        return _DATA + json.dumps(obj).encode() + _EVENT_END
