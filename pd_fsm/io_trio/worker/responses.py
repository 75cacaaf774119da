"""Response bodies: sglang's /generate shape and OpenAI's completion / chat shapes, whole and as
SSE chunks. One ``Accumulator`` per request folds the backend's incremental outputs together.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pd_fsm.io_trio.worker.schemas import Kind
from pd_fsm.schedulers.request import FinishReason, RequestOutput

_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class Accumulator:
    """Everything a request produced so far, and the bodies that report it."""

    def __init__(
        self,
        kind: Kind,
        rid: str,
        model: str,
        *,
        return_logprob: bool = False,
        include_usage: bool = False,
        token_text: Callable[[int], str] = str,
    ) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.return_logprob = return_logprob
        self.include_usage = include_usage
        self.created = int(time.time())
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.prompt_tokens = 0
        self.finish: FinishReason | None = None
        self._role_sent = False
        self._token_text = token_text  # one token id -> its text, for the OpenAI logprobs
        self._logprobs_sent = 0  # output tokens whose logprobs a stream chunk carried already
        self._texts: list[str] = []  # output tokens' texts so far, and where each starts
        self._offsets: list[int] = [0]

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text_delta
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.prompt_tokens = out.prompt_tokens
        if out.finish_reason is not None:
            self.finish = out.finish_reason

    # ------------------------------------------------------------------ sglang /generate

    def _meta(self, finish: FinishReason | None) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": 0,
            "finish_reason": None if finish is None else finish.to_json(self.completion_tokens),
        }
        if self.return_logprob:
            # sglang's (logprob, token_id, text) triples; text only with return_text_in_logprobs.
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(self.logprobs, self.output_ids, strict=True)
            ]
        return meta

    def generate_body(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids),
                "meta_info": self._meta(self.finish)}

    # ------------------------------------------------------------------ OpenAI

    def _id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.rid

    def _usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def _openai_logprobs(self, start: int, end: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object for output tokens ``start:end`` (None unless asked): the
        sampled tokens' own logprobs, no alternatives. A token's text is its id decoded alone
        (a token that ends inside a UTF-8 character decodes to U+FFFD)."""
        if not self.return_logprob:
            return None
        for tid in self.output_ids[len(self._texts):end]:  # each token decoded once
            self._texts.append(self._token_text(tid))
            self._offsets.append(self._offsets[-1] + len(self._texts[-1]))
        texts, lps = self._texts[start:end], self.logprobs[start:end]
        if self.kind == "chat":
            return {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")), "top_logprobs": []}
                for t, lp in zip(texts, lps, strict=True)
            ]}
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": None,
                "text_offset": self._offsets[start:end]}

    def _finish_str(self) -> str | None:
        return None if self.finish is None else _OPENAI_FINISH[self.finish.kind]

    def openai_body(self) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
                "logprobs": self._openai_logprobs(0, self.completion_tokens),
                "finish_reason": self._finish_str(),
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text,
                      "logprobs": self._openai_logprobs(0, self.completion_tokens),
                      "finish_reason": self._finish_str()}
            obj = "text_completion"
        if self.finish is not None and self.finish.kind == "stop":
            choice["matched_stop"] = self.finish.matched  # sglang's extension
        return {"id": self._id(), "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self._usage()}

    def _openai_chunk(self, delta_text: str, finish: str | None) -> dict[str, Any]:
        # A chunk carries the logprobs of the tokens since the previous chunk (text held back
        # for a possible stop string comes later; its tokens' logprobs ride with it).
        logprobs = None
        if self.return_logprob and (delta_text or finish is not None):
            logprobs = self._openai_logprobs(self._logprobs_sent, self.completion_tokens)
            self._logprobs_sent = self.completion_tokens
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": delta_text}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_text, "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "text_completion"
        return {"id": self._id(), "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    # ------------------------------------------------------------------ streaming

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]:
        """Fold ``out`` in and return the SSE events it produces (possibly none)."""
        self.add(out)
        if self.kind == "generate":
            # sglang streams cumulative text and ids (its default, non-incremental output).
            return [self.generate_body()]
        events: list[dict[str, Any]] = []
        if out.text_delta or not self._role_sent:
            events.append(self._openai_chunk(out.text_delta, None))
        if out.finish_reason is not None:
            events.append(self._openai_chunk("", self._finish_str()))
            if self.include_usage:
                usage = self._openai_chunk("", None)
                usage["choices"] = []
                usage["usage"] = self._usage()
                events.append(usage)
        return events

    def error_chunk(self, status: int, message: str) -> dict[str, Any]:
        """The last event of a stream that failed after it started."""
        self.finish = FinishReason("abort", message=message)
        if self.kind == "generate":
            return self.generate_body()
        chunk = self._openai_chunk("", "abort")
        chunk["error"] = {"message": message, "type": "stream_error", "code": status}
        return chunk
