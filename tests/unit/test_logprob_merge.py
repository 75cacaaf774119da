"""The proxy's merge of P's prompt log-probs into D's answer, whole and as SSE events."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pd_fsm.io_trio.proxy.logprob_merge import SseRewriter, merge, wants_prompt_logprobs

P_COMPLETION = {
    "choices": [{"text": "ab!", "logprobs": {
        "tokens": ["a", "b", "!"], "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {"b": -1.0}, {"!": -0.5}], "text_offset": [0, 1, 2]}}],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1},
}


def _d_completion() -> dict[str, Any]:
    return {"choices": [{"text": "ab!?", "logprobs": {
        "tokens": ["!", "?"], "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"!": -0.5}, {"?": -0.25}], "text_offset": [2, 3]}}]}


def test_which_requests_need_p() -> None:
    assert wants_prompt_logprobs("/generate", {"return_logprob": True, "logprob_start_len": 0})
    assert not wants_prompt_logprobs("/generate", {"return_logprob": True})
    assert not wants_prompt_logprobs("/generate", {"logprob_start_len": 3})
    assert wants_prompt_logprobs("/v1/completions", {"echo": True, "logprobs": 0})
    assert not wants_prompt_logprobs("/v1/completions", {"echo": True})
    assert not wants_prompt_logprobs("/v1/chat/completions", {"echo": True, "logprobs": True})


def test_completion_prompt_positions_go_first() -> None:
    d = _d_completion()
    assert merge("/v1/completions", P_COMPLETION, d)
    lps = d["choices"][0]["logprobs"]
    assert lps["tokens"] == ["a", "b", "!", "?"]
    assert lps["token_logprobs"] == [None, -1.0, -0.5, -0.25]
    assert lps["top_logprobs"] == [None, {"b": -1.0}, {"!": -0.5}, {"?": -0.25}]
    assert lps["text_offset"] == [0, 1, 2, 3]


def test_generate_input_logprobs_prepended() -> None:
    p = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-2.0, 2, None]],
                       "input_top_logprobs": [None, [[-2.0, 2, None]]]}}
    d: dict[str, Any] = {"meta_info": {"input_token_logprobs": [], "input_top_logprobs": []}}
    assert merge("/generate", p, d)
    assert d["meta_info"] == p["meta_info"]


@pytest.mark.parametrize("p_body", [None, {"error": "x"}, {"choices": []}, "text"])
def test_nothing_to_merge_leaves_d_alone(p_body: Any) -> None:
    d = _d_completion()
    assert not merge("/v1/completions", p_body, d)
    assert d == _d_completion()


def test_sse_rewriter_across_chunk_boundaries_and_only_once() -> None:
    events = [_d_completion(), _d_completion()]
    raw = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
    raw += b"data: [DONE]\n\n"
    rewriter = SseRewriter(lambda event: merge("/v1/completions", P_COMPLETION, event), once=True)
    out = b"".join(rewriter.feed(raw[i : i + 7]) for i in range(0, len(raw), 7))
    out += rewriter.flush()
    blocks = [b for b in out.split(b"\n\n") if b]
    assert blocks[-1] == b"data: [DONE]"
    first, second = (json.loads(b[len(b"data: "):]) for b in blocks[:2])
    assert first["choices"][0]["logprobs"]["tokens"] == ["a", "b", "!", "?"]
    assert second == _d_completion()  # the prompt's positions come once
