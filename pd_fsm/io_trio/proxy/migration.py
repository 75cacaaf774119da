"""Request migration: what a client already has of a streamed answer, so that when
its decode worker breaks off a new room can go on from there.

The proxy reads each relayed SSE event: sglang's ``/generate`` events carry the cumulative
``output_ids`` and ``text``; OpenAI chunks carry their text delta and, because the proxy asks D
for them (vLLM's ``return_token_ids``), their token ids, which it strips again unless the client
asked for them too. The next room's body carries ``resume: {output_ids, text}``: the worker
prefills the prompt plus those tokens and streams only what follows, so the client's stream goes
on with no token repeated or missing (``schedulers.request.Resume``).

An n > 1 answer's sequences are followed each by its ``index`` (:class:`Choice`). After a break
the unfinished ones go on each as a request of its own — n = 1, the seed the worker drew that
sequence with (``schedulers.request.fork_seed``), ``resume`` from its tokens — whose streams the
proxy relays as one, each event under its sequence's index (``merged_stream``), with one usage
chunk (the prompt once, every sequence's tokens once) and one ``[DONE]``. Why not one room for
them all: ``Progress.sequences``. Each such request migrates on its own after that, with the
request's migrations so far counted against ``--migration-limit``.

Output log-probs continue too: the new worker computes those of the tokens it generates, and
counts completions' ``text_offset`` from the start of the answer (the resumed tokens' text
included). OpenAI chunks carry their own tokens' entries, so nothing is missing; a ``/generate``
event's lists are cumulative, and the proxy puts the entries the client has of the resumed
tokens in front of the new worker's. Prompt log-probs and ``echo`` are not migratable: the
prefill that computed them is not run again.

A draining D (``pd-fsm serve``'s default ``--drain-handoff``) may instead end a stream it was
allowed to (``accept_handoff``: asked only while the proxy routes another D) with a hand-off
ticket: the KV it registered for the stream.
The proxy keeps the ticket, never relays the event, and posts the next room to another D alone
with ``resume`` and ``handoff``: that D pulls the KV, no prefill runs.

A worker told to give its streams up (``POST /move_streams``: the planner's standby D after a
merge) ends each one the proxy let it (``accept_move``, asked on every stream it can
continue) with a move event: a hand-off with no KV. The next room, routed around that worker,
prefills the prompt and the tokens so far (``resume``) wherever the router sends it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeGuard

import attrs

from pd_fsm.io_trio.proxy.logprob_merge import wants_prompt_logprobs
from pd_fsm.io_trio.worker.sse import handoff_ticket, moved_reason
from pd_fsm.schedulers.request import fork_seed

_OPENAI = ("/v1/completions", "/v1/chat/completions")
# /generate's cumulative lists of the output tokens' log-probs, one entry a token: a resumed
# worker's start at the first token it generated (worker/responses.py).
_GENERATE_LOGPROBS = ("output_token_logprobs", "output_top_logprobs")


def migratable(path: str, body: Mapping[str, object]) -> bool:
    """Whether an answer to ``body`` can be continued exactly by another worker: one prompt,
    no echo, no prompt log-probs (the prefill that computed them is not run again), no
    ``best_of``. The output tokens' log-probs continue: the new worker reports its own tokens';
    so does each of n > 1 sequences (``Progress.sequences``)."""
    if wants_prompt_logprobs(path, body):
        return False
    if path == "/generate":
        single = isinstance(body.get("text"), str) or _flat_ids(body.get("input_ids"))
        return bool(single) and sequences_asked(path, body) > 0
    if path not in _OPENAI:
        return False
    if body.get("best_of") not in (1, None):
        return False
    return sequences_asked(path, body) > 0 and not body.get("echo")


def sequences_asked(path: str, body: Mapping[str, object]) -> int:
    """The answer's sequences (``n``: OpenAI's, /generate's ``sampling_params.n``), 1 when
    absent; 0 when not a number (the worker refuses it)."""
    where = body.get("sampling_params") if path == "/generate" else body
    n = where.get("n") if isinstance(where, dict) else None
    if n is None:
        return 1
    return n if type(n) is int and n >= 1 else 0


def _sampling(path: str, body: dict[str, object]) -> dict[str, object]:
    """Where ``body`` keeps ``n`` and ``seed`` (a copy of it, put in ``body``)."""
    if path != "/generate":
        return body
    sp = body.get("sampling_params")
    body["sampling_params"] = sp = dict(sp) if isinstance(sp, dict) else {}
    return sp


def _flat_ids(v: object) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(isinstance(t, int) for t in v)


@attrs.define
class Choice:
    """What the client has of one sequence of the answer (its ``index``): its tokens and their
    text, and whether it is complete (its finish reason was relayed: nothing is left of it)."""

    output_ids: list[int] = attrs.field(factory=list)
    text: str = ""
    # /generate: the client's latest cumulative log-prob lists (``_GENERATE_LOGPROBS``), whose
    # entries for the resumed tokens go in front of a later room's.
    logprobs: dict[str, list[object]] = attrs.field(factory=dict)
    finished: bool = False

    def continue_logprobs(self, meta: dict[str, object], tokens: int) -> None:
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


@attrs.define
class Progress:
    """What the client has of one answer: each of its sequences' (:class:`Choice`, by index),
    whether D handed it off or failed it in-band."""

    path: str
    stream: bool
    client_wants_ids: bool = False  # the client asked for return_token_ids itself
    n: int = 1  # sequences in the answer (``sequences_asked``)
    # By index. A sequence continued in a request of its own (``sequences``) is that request's
    # index 0, and the same object as its index's here: what it relays, the client has.
    choices: dict[int, Choice] = attrs.field(factory=dict)
    # A draining D ended the stream with this hand-off ticket: the next room's D
    # pulls the KV it names. Cleared when a room is opened without it.
    ticket: dict[str, object] | None = None
    # A worker failure D reported in-band, (status, message): a 5xx error event (a drain's
    # deadline, a failed step). Neither it nor the rest of D's stream reaches the client: the
    # request migrates as after a break.
    failed: tuple[int, str] | None = None
    # D gave the stream up (``POST /move_streams``: a standby D after the planner's merge) with
    # this reason: the next room re-prefills it elsewhere, as a hand-off without KV.
    moved: str | None = None

    def choice(self, index: int = 0) -> Choice:
        if index not in self.choices:
            self.choices[index] = Choice()
        return self.choices[index]

    @property
    def output_ids(self) -> list[int]:
        """A single sequence's tokens so far (n = 1: what ``resume`` carries)."""
        return self.choices[0].output_ids if 0 in self.choices else []

    @property
    def finished(self) -> bool:
        """Every sequence is complete: nothing is left to continue."""
        return len(self.choices) >= self.n and all(c.finished for c in self.choices.values())

    @property
    def apart(self) -> bool:
        """After a break, the answer goes on as its unfinished sequences, each in a request of
        its own (``sequences``): n > 1, and the client has some of it."""
        return self.n > 1 and bool(self.choices)

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
        if self.stream:
            # D may end this stream with a move event (not relayed): the next room prefills
            # the prompt and the tokens so far on another worker and goes on.
            out["accept_move"] = True
        done = self.choices.get(0)
        if self.n == 1 and done is not None and done.output_ids:
            out["resume"] = {"output_ids": list(done.output_ids), "text": done.text}
        return out

    def sequences(self, body: Mapping[str, object]
                  ) -> list[tuple[int, dict[str, object], Progress]]:
        """After a break (``apart``), the unfinished sequences, each as a request of its own:
        its index, its body and its Progress (whose index 0 is this one's Choice, so its next
        room resumes from what the client has of it).

        Why not one room for them all: a room's worker resumes one token list (its prefill is
        the prompt plus those tokens, one sequence's KV), and n sequences that broke off at n
        places are n such lists. Each goes on alone: ``body`` with n = 1 and the seed the worker
        sampled that sequence with (``fork_seed``: the sampler keys a token by seed and
        position), so a greedy or seeded sequence goes on as it would have uninterrupted."""
        out = []
        for index in range(self.n):
            done = self.choice(index)
            if done.finished:
                continue
            one = dict(body)
            where = _sampling(self.path, one)
            where["n"] = 1
            for key in ("seed", "sampling_seed"):
                seed = where.get(key)
                if type(seed) is int:
                    where[key] = fork_seed(seed, index)
            rid = one.get("rid")
            if isinstance(rid, str) and rid:
                one["rid"] = f"{rid}.n{index}"  # each a request of its own on the workers
            out.append((index, one, Progress(self.path, self.stream, self.client_wants_ids,
                                             choices={0: done})))
        return out

    def usage_chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The usage chunk of one sequence continued alone (``sequences``) made the answer's,
        as a worker's n > 1 stream counts it: the prompt once, every sequence's tokens (those
        the client has, each once)."""
        usage = dict(chunk["usage"])
        prompt = usage.get("prompt_tokens")
        completion = sum(len(done.output_ids) for done in self.choices.values())
        usage["completion_tokens"] = completion
        usage["total_tokens"] = (prompt if type(prompt) is int else 0) + completion
        return {**chunk, "usage": usage}

    def adopt_next_token(self, ticket: Mapping[str, object]) -> None:
        """Defensive: should the client not have the ticket's ``next_token`` (the draining D's
        newest token, whose event the worker sends before the ticket), count it as generated,
        its text not yet sent, so that the next D streams it too. A ticket covering positions
        other than the prompt and these tokens is refused by that D, and the request
        re-prefills."""
        nxt = ticket.get("next_token")
        ids = self.choice().output_ids
        if isinstance(nxt, int) and (not ids or ids[-1] != nxt):
            ids.append(nxt)

    def withhold(self, raw: bytes) -> bool:
        """One SSE event's bytes: True for the events the client never sees (``SseRewriter``'s
        ``drop``): D's hand-off event (its ticket kept), its move event (its reason kept), and
        a worker failure's error event and everything after it (kept in ``failed``)."""
        if self.failed is not None:
            return True
        ticket = handoff_ticket(raw)
        if ticket is not None:
            self.ticket = ticket
            return True
        moved = moved_reason(raw)
        if moved is not None:
            self.moved = moved
            return True
        self.failed = worker_failure(raw)
        return self.failed is not None

    def observe(self, event: object) -> bool:
        """One relayed SSE event (edited in place: ids the client did not ask for are taken
        out). Returns False: every event is read (``SseRewriter`` contract)."""
        if not isinstance(event, dict):
            return False
        if self.path == "/generate":
            done = self.choice(_index(event))  # n > 1: the event's top-level index
            ids, text = event.get("output_ids"), event.get("text")
            meta = event.get("meta_info")
            if _flat_ids(ids) and isinstance(text, str):
                done.output_ids, done.text = list(ids), text
                if isinstance(meta, dict):
                    done.continue_logprobs(meta, len(ids))
            if isinstance(meta, dict) and meta.get("finish_reason") is not None:
                done.finished = True
            return False
        choices = event.get("choices")
        if not isinstance(choices, list):
            return False  # the usage chunk
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            done = self.choice(_index(choice))
            ids = choice.get("token_ids") if self.client_wants_ids else choice.pop(
                "token_ids", None)
            if _flat_ids(ids):
                done.output_ids.extend(ids)
            delta = choice.get("delta")
            piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(piece, str):
                done.text += piece
            if choice.get("finish_reason") is not None:
                done.finished = True
        return False


def _index(obj: dict[str, object]) -> int:
    index = obj.get("index", 0)
    return index if type(index) is int else 0


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
