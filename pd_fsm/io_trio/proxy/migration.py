"""Request migration (issue 32 §1): what a client already has of a streamed answer, so that when
its decode worker breaks off a new room can go on from there.

The proxy reads each relayed SSE event: sglang's ``/generate`` events carry the cumulative
``output_ids`` and ``text``; OpenAI chunks carry their text delta and, because the proxy asks D
for them (vLLM's ``return_token_ids``), their token ids, which it strips again unless the client
asked for them too. The next room's body carries ``resume: {output_ids, text}``: the worker
prefills the prompt plus those tokens and streams only what follows, so the client's stream goes
on with no token repeated or missing (``schedulers.request.Resume``).

Output log-probs continue too: the new worker computes those of the tokens it generates, and
counts completions' ``text_offset`` from the start of the answer (the resumed tokens' text
included). OpenAI chunks carry their own tokens' entries, so nothing is missing; a ``/generate``
event's lists are cumulative, and the proxy puts the entries the client has of the resumed
tokens in front of the new worker's. Prompt log-probs and ``echo`` are not migratable: the
prefill that computed them is not run again.

A draining D (``pd-fsm serve``'s default ``--drain-handoff``) may instead end a stream it was
allowed to (``accept_handoff``: asked only while the proxy routes another D) with a hand-off
ticket (issue 32 §2): the KV it registered for the stream.
The proxy keeps the ticket, never relays the event, and posts the next room to another D alone
with ``resume`` and ``handoff``: that D pulls the KV, no prefill runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TypeGuard

import attrs

from pd_fsm.io_trio.proxy.logprob_merge import wants_prompt_logprobs
from pd_fsm.io_trio.worker.sse import handoff_ticket

_OPENAI = ("/v1/completions", "/v1/chat/completions")
# /generate's cumulative lists of the output tokens' log-probs, one entry a token: a resumed
# worker's start at the first token it generated (worker/responses.py).
_GENERATE_LOGPROBS = ("output_token_logprobs", "output_top_logprobs")


def migratable(path: str, body: Mapping[str, object]) -> bool:
    """Whether an answer to ``body`` can be continued exactly by another worker: one sequence,
    no echo, no prompt log-probs (the prefill that computed them is not run again), not a
    batch. The output tokens' log-probs continue: the new worker reports its own tokens'."""
    if wants_prompt_logprobs(path, body):
        return False
    if path == "/generate":
        sp = body.get("sampling_params")
        n = sp.get("n", 1) if isinstance(sp, dict) else 1
        single = isinstance(body.get("text"), str) or _flat_ids(body.get("input_ids"))
        return bool(single) and n in (1, None)
    if path not in _OPENAI:
        return False
    if body.get("n") not in (1, None) or body.get("best_of") not in (1, None):
        return False
    return not body.get("echo")


def _flat_ids(v: object) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(isinstance(t, int) for t in v)


@attrs.define
class Progress:
    """What the client has of one answer: its tokens and their text, and whether the answer is
    complete (a finish reason was relayed: nothing is left to continue)."""

    path: str
    stream: bool
    client_wants_ids: bool = False  # the client asked for return_token_ids itself
    output_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    # /generate: the client's latest cumulative log-prob lists (``_GENERATE_LOGPROBS``), whose
    # entries for the resumed tokens go in front of a later room's.
    logprobs: dict[str, list[object]] = attrs.field(factory=dict)
    finished: bool = False
    # A draining D ended the stream with this hand-off ticket (issue 32 §2): the next room's D
    # pulls the KV it names. Cleared when a room is opened without it.
    ticket: dict[str, object] | None = None
    # A worker failure D reported in-band, (status, message): a 5xx error event (a drain's
    # deadline, a failed step). Neither it nor the rest of D's stream reaches the client: the
    # request migrates as after a break (issue 32 §1).
    failed: tuple[int, str] | None = None

    def leg_body(self, body: Mapping[str, object], *, handoff: bool = True
                 ) -> dict[str, object]:
        """The body a decode leg gets: with ``return_token_ids`` on OpenAI streams (so the ids
        can be followed) and, after a break, ``resume`` with what the client has. ``handoff``:
        whether the proxy routes another decode worker that could take the stream from this
        leg's D."""
        out = dict(body)
        if self.stream and self.path in _OPENAI:
            out["return_token_ids"] = True
        if self.stream and handoff:
            # A draining D may end this stream with a hand-off ticket (not relayed) rather than
            # finish it: another D goes on from its KV.
            out["accept_handoff"] = True
        if self.output_ids:
            out["resume"] = {"output_ids": list(self.output_ids), "text": self.text}
        return out

    def adopt_next_token(self, ticket: Mapping[str, object]) -> None:
        """Defensive: should the client not have the ticket's ``next_token`` (the draining D's
        newest token, whose event the worker sends before the ticket), count it as generated,
        its text not yet sent, so that the next D streams it too. A ticket covering positions
        other than the prompt and these tokens is refused by that D, and the request
        re-prefills."""
        nxt = ticket.get("next_token")
        if isinstance(nxt, int) and (not self.output_ids or self.output_ids[-1] != nxt):
            self.output_ids.append(nxt)

    def withhold(self, raw: bytes) -> bool:
        """One SSE event's bytes: True for the events the client never sees (``SseRewriter``'s
        ``drop``): D's hand-off event (its ticket kept), and a worker failure's error event and
        everything after it (kept in ``failed``)."""
        if self.failed is not None:
            return True
        ticket = handoff_ticket(raw)
        if ticket is not None:
            self.ticket = ticket
            return True
        self.failed = worker_failure(raw)
        return self.failed is not None

    def observe(self, event: object) -> bool:
        """One relayed SSE event (edited in place: ids the client did not ask for are taken
        out). Returns False: every event is read (``SseRewriter`` contract)."""
        if not isinstance(event, dict):
            return False
        if self.path == "/generate":
            ids, text = event.get("output_ids"), event.get("text")
            meta = event.get("meta_info")
            if _flat_ids(ids) and isinstance(text, str):
                self.output_ids, self.text = list(ids), text
                if isinstance(meta, dict):
                    self._continue_logprobs(meta, len(ids))
            if isinstance(meta, dict) and meta.get("finish_reason") is not None:
                self.finished = True
            return False
        choices = event.get("choices")
        if not isinstance(choices, list):
            return False  # the usage chunk
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids") if self.client_wants_ids else choice.pop(
                "token_ids", None)
            if _flat_ids(ids):
                self.output_ids.extend(ids)
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str):
                self.text += piece
            if choice.get("finish_reason") is not None:
                self.finished = True
        return False

    def _continue_logprobs(self, meta: dict[str, object], tokens: int) -> None:
        """A /generate event's log-prob lists, as the client gets them: a resumed worker's
        lack the entries of the tokens it resumed (of ``tokens``, the event's output ids), which
        the client has; those go in front, so that each event's lists cover its output, as an
        uninterrupted stream's do."""
        for key in _GENERATE_LOGPROBS:
            theirs = meta.get(key)
            if not isinstance(theirs, list):
                continue
            ours = self.logprobs.get(key, [])
            missing = tokens - len(theirs)
            if 0 < missing <= len(ours):
                theirs = meta[key] = ours[:missing] + theirs
            self.logprobs[key] = theirs


def worker_failure(raw: bytes) -> tuple[int, str] | None:
    """(status, message) of a stream's error event that reports a worker failure (a 5xx: the
    worker's drain deadline, a failed step), else None: an OpenAI chunk's ``error`` with its
    ``code``, or a /generate event whose ``meta_info.finish_reason`` is an abort with its
    ``status_code`` (sglang's FINISH_ABORT). A 4xx is about the request, and an abort without a
    status (the request's own: a client's abort, a grammar broken) is no failure: relayed."""
    if not raw.startswith(b"data: {"):
        return None
    try:
        event = json.loads(raw[len(b"data: "):])
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    error, meta = event.get("error"), event.get("meta_info")
    if isinstance(error, dict):
        code, message = error.get("code"), error.get("message")
    elif isinstance(meta, dict) and isinstance(finish := meta.get("finish_reason"), dict) \
            and finish.get("type") == "abort":
        code, message = finish.get("status_code"), finish.get("message")
    else:
        return None
    if type(code) is not int or not 500 <= code <= 599:
        return None
    return code, message if isinstance(message, str) else "worker failure"
