"""Response bodies: sglang's /generate shape and OpenAI's completion / chat shapes, whole and as
SSE chunks. One ``Accumulator`` per request folds the backend's incremental outputs together.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import attrs

from pd_fsm.io_trio.worker.schemas import JsonBody, JsonObject, Kind
from pd_fsm.io_trio.worker.tools import Tools, call_id
from pd_fsm.jax_engine.sampling.params import TopLogprobs
from pd_fsm.schedulers.request import (
    NO_LOGPROBS,
    FinishReason,
    LogprobSpec,
    PromptLogprobs,
    RequestOutput,
)

_OPENAI_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


@attrs.frozen
class _TokenEntry:
    """One reported position: its token's text, id and log-prob (None: nothing predicts it),
    and its top alternatives (None: not reported at this position)."""

    text: str
    token: int
    logprob: float | None
    top: TopLogprobs | None


class TokenTexts:
    """One token id's text, decoded alone (special tokens spelled out), once per id."""

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self._token_text = token_text
        self._texts: dict[int, str] = {}

    def of(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self._token_text(token)
        return text


@attrs.frozen
class _Triples:
    """sglang's (logprob, token_id, text) triples; text only with return_text_in_logprobs."""

    texts: TokenTexts
    with_text: bool

    def triple(self, logprob: float | None, token: int) -> list[JsonBody]:
        return [logprob, token, self.texts.of(token) if self.with_text else None]

    def top_triples(self, top: TopLogprobs | None) -> list[list[JsonBody]] | None:
        return None if top is None else [self.triple(lp, t) for t, lp in top]


class Accumulator:
    """Everything a request produced so far, and the bodies that report it."""

    def __init__(
        self,
        kind: Kind,
        rid: str,
        model: str,
        *,
        return_logprob: bool = False,
        logprobs: LogprobSpec = NO_LOGPROBS,
        include_usage: bool = False,
        token_text: Callable[[int], str] = str,
        prompt_ids: Sequence[int] = (),
        echo: str | None = None,
        text_in_logprobs: bool = False,
        tools: Tools | None = None,
        index: int = 0,
        resume: tuple[int, ...] = (),
        resume_text: str = "",
        token_ids: bool = False,
    ) -> None:
        self.kind = kind
        self.rid = rid
        self.model = model
        self.return_logprob = return_logprob
        self.spec = logprobs
        self.include_usage = include_usage
        self.created = int(time.time())
        self.text = ""
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[TopLogprobs] = []
        self.prompt: PromptLogprobs | None = None  # when this worker prefilled the prompt
        self.prompt_tokens = 0
        self.cached_tokens = 0  # of the prompt's, served from the prefix cache
        self.finish: FinishReason | None = None
        self._role_sent = False
        self._texts = TokenTexts(token_text)
        self._sglang = _Triples(self._texts, text_in_logprobs)
        self._prompt_ids = tuple(prompt_ids)
        self._echo = echo  # completions' echo: the prompt's text, sent before the output's
        self._echo_sent = False
        self._tools = tools  # chat: the answer may be a tool call (tools.py)
        self._call_id = call_id(rid, index)
        self._content_sent = 0  # chat with tools: the text streamed as content so far
        self._logprobs_sent = 0  # output tokens whose logprobs a stream chunk carried already
        # Completions' text_offset: output tokens start after the echoed prompt's tokens.
        self._base_offset = (
            sum(len(self._texts.of(t)) for t in self._prompt_ids)
            if echo is not None and return_logprob else 0
        )
        self._offsets: list[int] = [self._base_offset]
        self._token_ids = token_ids  # OpenAI choices carry their token ids (return_token_ids)
        self._ids_sent = 0  # output tokens whose ids a stream chunk carried already
        # Output tokens before this one have no log-probs here: a resumed answer's (the client
        # has them from the worker that generated them).
        self._logprobs_from = 0
        if resume:
            self._resume(resume, resume_text)

    def _resume(self, resume: tuple[int, ...], text: str) -> None:
        """A resumed answer (request migration): the client has the earlier tokens' stream
        (their text up to ``text``), its role chunk, its echo and their log-probs; usage
        counts them as this answer's output, and completions' ``text_offset`` counts their
        tokens' text as an uninterrupted answer's does."""
        self.output_ids = list(resume)
        self.text = text
        self._ids_sent = self._logprobs_sent = self._logprobs_from = len(resume)
        self._role_sent = self._echo_sent = True
        for t in resume:
            self._offsets.append(self._offsets[-1] + len(self._texts.of(t)))

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text_delta
        self.output_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.tops.extend(out.new_top_logprobs)
        if out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = max(self.cached_tokens, out.cached_tokens)
        if out.finish_reason is not None:
            self.finish = out.finish_reason

    def _output_entries(self, start: int, end: int) -> list[_TokenEntry]:
        """Output tokens ``start:end``, which have log-probs here (``start`` is at least
        ``_logprobs_from``: callers clamp it, so that their other lists stay aligned)."""
        lo, hi = start - self._logprobs_from, end - self._logprobs_from
        tops: Sequence[TopLogprobs | None] = (
            self.tops[lo:hi] if self.spec.top else [None] * (end - start)
        )
        return [
            _TokenEntry(self._texts.of(t), t, lp, top)
            for t, lp, top in zip(self.output_ids[start:end], self.logprobs[lo:hi], tops,
                                  strict=True)
        ]

    def _prompt_entries(self) -> list[_TokenEntry]:
        part = self.prompt
        if part is None:
            return []
        ids = self._prompt_ids[part.start : part.start + len(part.logprobs)]
        tops: Sequence[TopLogprobs | None] = part.top if self.spec.top else [None] * len(ids)
        return [
            _TokenEntry(self._texts.of(t), t, lp, top)
            for t, lp, top in zip(ids, part.logprobs, tops, strict=True)
        ]

    # ------------------------------------------------------------------ sglang /generate

    def _meta(self, finish: FinishReason | None, status: int | None = None) -> JsonObject:
        finish_json = None if finish is None else finish.to_json(self.completion_tokens)
        if finish_json is not None and status is not None:
            # sglang's FINISH_ABORT carries the failure's status: a proxy tells a worker's
            # failure (5xx: it migrates the stream) from a refused request (4xx) by it.
            finish_json["status_code"] = status
        meta: JsonObject = {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": finish_json,
        }
        if self.return_logprob:
            # A resumed answer's lists start at its first generated token: the proxy that
            # migrated the stream puts the client's earlier entries in front.
            entries = self._output_entries(self._logprobs_from, self.completion_tokens)
            triple = self._sglang.triple
            meta["output_token_logprobs"] = [triple(e.logprob, e.token) for e in entries]
            if self.spec.top:
                meta["output_top_logprobs"] = [self._sglang.top_triples(e.top) for e in entries]
            # Only the worker that prefilled has them. Under PD, D's lists are empty and a
            # router prepends P's (sglang-router does, for input_token_logprobs only when D's
            # answer has the key).
            if self.spec.prompt:
                prompt = self._prompt_entries()
                meta["input_token_logprobs"] = [triple(e.logprob, e.token) for e in prompt]
                if self.spec.top:
                    meta["input_top_logprobs"] = [self._sglang.top_triples(e.top) for e in prompt]
        return meta

    def generate_body(self, status: int | None = None) -> JsonObject:
        return {"text": self.text, "output_ids": list(self.output_ids),
                "meta_info": self._meta(self.finish, status)}

    # ------------------------------------------------------------------ OpenAI

    def _id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.rid

    def usage(self) -> JsonObject:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def _openai_logprobs(self, start: int, end: int, *, prompt: bool) -> JsonObject | None:
        """OpenAI's logprobs object for output tokens ``start:end`` (None unless asked), after
        the prompt's positions when ``prompt`` (completions' echo, where this worker has them).
        A token's text is its id decoded alone (a token that ends inside a UTF-8 character
        decodes to U+FFFD)."""
        if not self.return_logprob:
            return None
        start = max(start, self._logprobs_from)
        out = self._output_entries(start, end)
        if self.kind == "chat":
            return {"content": [
                {**_chat_entry(e.text, e.logprob),
                 "top_logprobs": [_chat_entry(self._texts.of(t), lp) for t, lp in e.top or ()]}
                for e in out
            ]}
        for e in self._output_entries(len(self._offsets) - 1, end):  # offsets once per token
            self._offsets.append(self._offsets[-1] + len(e.text))
        offsets = self._offsets[start:end]
        entries = out
        if prompt:
            head = self._prompt_entries()
            entries = head + out
            offsets = _cumulative(e.text for e in head) + offsets
        return {
            "tokens": [e.text for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": None if not self.spec.top else [
                None if e.top is None else {self._texts.of(t): lp for t, lp in e.top}
                for e in entries
            ],
            "text_offset": offsets,
        }

    def _finish_str(self) -> str | None:
        if self._tool_calls() is not None:
            return "tool_calls"
        return None if self.finish is None else _OPENAI_FINISH[self.finish.kind]

    def _tool_calls(self) -> list[JsonObject] | None:
        """The answer's tool calls, once it is complete and is one."""
        if self._tools is None or self.finish is None or self.finish.kind != "stop":
            return None
        return self._tools.calls_in(self.text, self._call_id)

    def openai_body(self) -> JsonObject:
        logprobs = self._openai_logprobs(0, self.completion_tokens, prompt=True)
        if self.kind == "chat":
            calls = self._tool_calls()
            message: JsonObject = {"role": "assistant", "content": self.text}
            if calls is not None:
                message = {"role": "assistant", "content": None, "tool_calls": calls}
            choice: JsonObject = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": self._finish_str(),
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": (self._echo or "") + self.text,
                      "logprobs": logprobs, "finish_reason": self._finish_str()}
            obj = "text_completion"
        if self.finish is not None and self.finish.kind == "stop":
            choice["matched_stop"] = self.finish.matched  # sglang's extension
        if self._token_ids:
            choice["token_ids"] = list(self.output_ids)
        return {"id": self._id(), "object": obj, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def _openai_chunk(
        self, delta_text: str, finish: str | None,
        tool_calls: list[JsonObject] | None = None,
    ) -> JsonObject:
        # A chunk carries the logprobs of the tokens since the previous chunk (text held back
        # for a possible stop string comes later; its tokens' logprobs ride with it).
        # Log-probs ride with the token ids too (return_token_ids: a proxy follows the stream by
        # them): a chat role chunk ahead of its first token's text then carries that token's,
        # and a stream resumed from the ids the client has owes it no earlier token's.
        logprobs = None
        echo = self._echo is not None and not self._echo_sent
        ids_due = self._token_ids and self._ids_sent < len(self.output_ids)
        if self.return_logprob and (delta_text or finish is not None or echo or ids_due):
            logprobs = self._openai_logprobs(self._logprobs_sent, self.completion_tokens,
                                             prompt=echo)
            self._logprobs_sent = self.completion_tokens
        if echo:
            self._echo_sent = True
            delta_text = (self._echo or "") + delta_text
        if self.kind == "chat":
            delta: JsonObject = {"content": delta_text}
            if tool_calls is not None:
                delta = {"content": None,
                         "tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls)]}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            choice: JsonObject = {"index": 0, "delta": delta, "logprobs": logprobs,
                                      "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_text, "logprobs": logprobs,
                      "finish_reason": finish}
            obj = "text_completion"
        if self._token_ids:
            choice["token_ids"] = self.output_ids[self._ids_sent :]
            self._ids_sent = len(self.output_ids)
        return {"id": self._id(), "object": obj, "created": self.created, "model": self.model,
                "choices": [choice]}

    # ------------------------------------------------------------------ streaming

    def chunks(self, out: RequestOutput) -> list[JsonObject]:
        """Fold ``out`` in and return the SSE events it produces (possibly none)."""
        self.add(out)
        if self.kind == "generate":
            # sglang streams cumulative text and ids (its default, non-incremental output).
            return [self.generate_body()]
        if self._tools is not None:
            return self._tool_chunks(out)
        events: list[JsonObject] = []
        first_echo = self._echo is not None and not self._echo_sent
        if out.text_delta or (self.kind == "chat" and not self._role_sent) or first_echo:
            events.append(self._openai_chunk(out.text_delta, None))
        if out.finish_reason is not None:
            events.append(self._openai_chunk("", self._finish_str()))
            if self.include_usage:
                events.append(self.usage_chunk(self.usage()))
        return events

    def _tool_chunks(self, out: RequestOutput) -> list[JsonObject]:
        """Chat with tools, streamed: text that may still turn out to be a call is held back
        (all of it with ``required`` or a named tool; with ``auto``, text starting with ``<``);
        a call goes out whole, in one ``tool_calls`` delta, when the answer is complete."""
        assert self._tools is not None
        may_be_call = self._tools.mode != "auto" or self.text[:1] in ("", "<")
        events: list[JsonObject] = []
        if out.finish_reason is None and may_be_call:
            if not self._role_sent:
                events.append(self._openai_chunk("", None))
            return events
        calls = self._tool_calls()
        pending = self.text[self._content_sent :]
        self._content_sent = len(self.text)
        if calls is not None:
            events.append(self._openai_chunk("", None, calls))
        elif pending or not self._role_sent:
            events.append(self._openai_chunk(pending, None))
        if out.finish_reason is not None:
            events.append(self._openai_chunk("", self._finish_str()))
            if self.include_usage:
                events.append(self.usage_chunk(self.usage()))
        return events

    def unsent_ids_chunks(self) -> list[JsonObject]:
        """An OpenAI stream that ends early with a hand-off ticket: a chunk with the ids (and
        log-probs) of the tokens whose text is held back, so that the proxy following the ids
        has every token the ticket covers, and the client their log-probs (the next D reports
        only what it generates; their text it sends). None for /generate (each event carries
        every id) or without ``return_token_ids``."""
        if self.kind == "generate" or not self._token_ids or self._ids_sent == len(
                self.output_ids):
            return []
        return [self._openai_chunk("", None)]

    def usage_chunk(self, usage: dict[str, int]) -> JsonObject:
        """The stream's last chunk with ``stream_options.include_usage``: no choices, ``usage``
        (a batch's is the sum of its requests')."""
        chunk = self._openai_chunk("", None)
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    def error_chunk(self, status: int, message: str) -> JsonObject:
        """The last event of a stream that failed after it started."""
        self.finish = FinishReason("abort", message=message)
        if self.kind == "generate":
            return self.generate_body(status)
        chunk = self._openai_chunk("", "abort")
        chunk["error"] = {"message": message, "type": "stream_error", "code": status}
        return chunk


def _chat_entry(text: str, logprob: float | None) -> JsonObject:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _cumulative(texts: Iterable[str]) -> list[int]:
    """Each text's start offset when they are laid end to end from 0."""
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return offsets


# ------------------------------------------------------------------ batches of prompts


def summed_usage(usages: Sequence[JsonObject]) -> JsonObject:
    """A batch's usage: its requests' added up (``prompt_tokens_details`` too)."""
    out: JsonObject = {}
    for key, first in usages[0].items():
        if isinstance(first, dict):
            out[key] = summed_usage([u.get(key) or {} for u in usages])
        else:
            out[key] = sum(u.get(key, 0) for u in usages)
    return out


def batch_body(kind: Kind, bodies: Sequence[JsonObject],
               usage: JsonObject | None = None) -> list[JsonObject] | JsonObject:
    """Several answers as one, in order (a batch's prompts, a prompt's n sequences): sglang's
    list of results, or one OpenAI answer whose ``choices`` carry their ``index``, with
    ``usage`` (default: the answers' own added up)."""
    if kind == "generate":
        return list(bodies)
    out = dict(bodies[0])
    choices = [choice for body in bodies for choice in body["choices"]]
    out["choices"] = [{**choice, "index": i} for i, choice in enumerate(choices)]
    out["usage"] = usage or summed_usage([body["usage"] for body in bodies])
    return out


def indexed(payload: JsonObject, index: int) -> JsonObject:
    """A batch's stream event, marked with its prompt's place: OpenAI's choices' ``index``,
    sglang's top-level ``index``."""
    choices = payload.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                choice["index"] = index
    else:
        payload["index"] = index
    return payload
