"""What a request's sampled tokens become: its text, why it stops, and the outputs a caller drains
("plan apart from run").

The scheduler hands each sampled token to ``append_token``, which appends it (and its log-probs),
moves the request's grammar on, detokenizes, looks for stop tokens and stop strings and the length
limit, and answers with the reason the request ends, if it does: the scheduler owns the queues
and the pages a finish releases, this only says why. Every request with news since the last
``drain`` (a token, a finish) is remembered, in order, and ``drain`` turns each into one
``RequestOutput``.

One thread uses it: the scheduler's.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import jax
import numpy as np

from pd_fsm.jax_engine.sampling.grammar import GrammarError
from pd_fsm.jax_engine.sampling.params import SamplingParams, TopLogprobs
from pd_fsm.jax_engine.sampling.sampler import prompt_logprobs
from pd_fsm.schedulers.plan import PrefillBatch
from pd_fsm.schedulers.request import FinishReason, PromptLogprobs, Req, RequestOutput
from pd_fsm.text.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    """Tokens in, text and finish reasons out; the outputs not drained yet."""

    def __init__(
        self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], context_length: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.context_length = context_length
        # Requests with unreported progress, in order (an ordered set keyed by identity, not rid: a
        # rejected duplicate must not hide the live request of the same rid).
        self._news: dict[Req, None] = {}

    # ----------------------------------------------------------------- a request's text

    def detokenizer(self, sampling: SamplingParams) -> IncrementalDetokenizer:
        """A fresh detokenizer for a sequence sampled with ``sampling``."""
        return IncrementalDetokenizer(self.tokenizer, sampling.skip_special_tokens)

    def replay(self, req: Req) -> None:
        """A resumed request's earlier tokens, as if generated here: their text (so a stop
        string spanning the break is found, and text the client has not seen yet is sent) and
        its grammar's place (a GrammarError if they break it)."""
        detok = req.detokenizer
        assert detok is not None
        done = req.history
        req.text = "".join(detok.push(t) for t in done)
        req.text_sent = min(req.text_sent, len(req.text))
        if req.matcher is not None:
            for token in done:
                req.matcher.consume(token)

    @staticmethod
    def record_token(req: Req, token: int, logprob: float, top: TopLogprobs = ()) -> None:
        """Append a sampled token and its log-probs to ``req``'s output, and nothing else: no
        text, no stop check, no output (P records a room's first token so: it goes to D with
        READY, and D decodes on from it)."""
        req.output_ids.append(token)
        req.output_logprobs.append(logprob)
        if req.logprobs.top:
            req.output_top.append(top)

    def append_token(
        self, req: Req, token: int, logprob: float, top: TopLogprobs = ()
    ) -> FinishReason | None:
        """Append a sampled token to ``req``; why ``req`` ends with it (the caller finishes it),
        or None while it goes on."""
        self.record_token(req, token, logprob, top)
        if req.matcher is not None:
            try:
                req.matcher.consume(token)  # on D, P's first token too
            except GrammarError as exc:
                return FinishReason("abort", message=str(exc))
        self._news[req] = None
        sp = req.sampling
        detok = req.detokenizer
        assert detok is not None
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            # The stop token's own text is not part of the output.
            req.text += detok.flush()
            return FinishReason("stop", matched=token)
        scanned = len(req.text)
        req.text += detok.push(token)
        if sp.stop and (stopped := self._trim_stop_string(req, scanned)) is not None:
            return stopped
        if len(req.output_ids) >= sp.max_new_tokens or req.seq_len >= self.context_length:
            req.text += detok.flush()
            if sp.stop and (stopped := self._trim_stop_string(req, scanned)) is not None:
                return stopped
            return FinishReason("length")
        if req.matcher is not None and req.matcher.done:
            # The grammar is complete (its end was sampled, EOS ignored or not): nothing more
            # may follow.
            req.text += detok.flush()
            return FinishReason("stop")
        return None

    @staticmethod
    def _trim_stop_string(req: Req, scanned: int) -> FinishReason | None:
        """If a stop string appears in ``req``'s text (only text beyond ``scanned`` can complete
        one), cut the text where the earliest one begins and say so."""
        longest = max(len(s) for s in req.sampling.stop)
        from_pos = max(0, scanned - longest + 1)
        hits = [
            (idx, s) for s in req.sampling.stop if (idx := req.text.find(s, from_pos)) >= 0
        ]
        if not hits:
            return None
        idx, matched = min(hits)
        req.text = req.text[:idx]
        return FinishReason("stop", matched=matched)

    @staticmethod
    def record_prompt_logprobs(batch: PrefillBatch, logits: jax.Array) -> None:
        """Append, for each row of ``batch`` that asks, the log-prob of every prompt token this
        chunk predicts (position ``p`` predicts token ``p + 1``) from ``logprobs.prompt_from``
        on; ``logits``: every position's, as the runner's prefill returns them then."""
        next_ids = np.zeros((batch.n_pad, batch.t_pad), np.int32)
        for i, row in enumerate(batch.rows):
            ids = row.req.input_ids[row.start + 1 : row.start + row.length + 1]
            next_ids[i, : len(ids)] = ids
        top = any(row.req.logprobs.top for row in batch.rows if row.req.logprobs.prompt)
        chosen, top_ids, top_values = prompt_logprobs(logits, next_ids, top)
        for i, row in enumerate(batch.rows):
            req, spec = row.req, row.req.logprobs
            if not spec.prompt:
                continue
            if row.start == 0 and spec.prompt_from == 0:
                req.prompt_logprobs.append(None)  # nothing predicts the first token
                if spec.top:
                    req.prompt_top.append(None)
            for j in range(row.length):
                position = row.start + j + 1
                if position >= len(req.input_ids):
                    break  # the last position predicts the first output token
                if position < spec.prompt_from:
                    continue
                req.prompt_logprobs.append(float(chosen[i, j]))
                if spec.top:
                    req.prompt_top.append(tuple(zip(top_ids[i, j, : spec.top].tolist(),
                                                    top_values[i, j, : spec.top].tolist(),
                                                    strict=True)))
            if row.start + row.length == len(req.input_ids):
                req.prompt_logprobs_ready = True

    # ----------------------------------------------------------------- outputs

    def mark(self, req: Req) -> None:
        """``req`` has news (it finished, or was refused): it gets an output at the next drain."""
        self._news[req] = None

    def forget(self, req: Req) -> None:
        """No output for what ``req`` did since the last drain (D: a sequence handed off, or one
        taken over whose client has its newest token already)."""
        self._news.pop(req, None)

    @property
    def pending(self) -> bool:
        """Whether a drain would return anything."""
        return bool(self._news)

    def drain(self, live: Mapping[str, Req]) -> list[RequestOutput]:
        """One output per request with news since the last drain, in order. ``live``: the
        scheduler's unfinished requests by rid (with sampling n > 1, a sequence's final output
        says ``more`` while its request is live)."""
        outputs = [_make_output(req) for req in self._news]
        self._news.clear()
        if any(out.index for out in outputs) or any(r.family for r in live.values()):
            outputs = _mark_more(outputs, live)
        return outputs


def _make_output(req: Req) -> RequestOutput:
    """What ``req`` did since its last output (and moves its sent marks on)."""
    if req.finished:
        end = len(req.text)
    else:
        # Hold back text that could still turn out to be the start of a stop string.
        hold = max((len(s) for s in req.sampling.stop), default=1) - 1
        end = max(len(req.text) - hold, req.text_sent)
    delta = req.text[req.text_sent : end]
    new_ids = tuple(req.output_ids[req.tokens_sent :])
    new_lps = tuple(req.output_logprobs[req.tokens_sent :])
    new_tops = tuple(req.output_top[req.tokens_sent :])
    prompt = None
    if req.prompt_logprobs_ready and not req.prompt_logprobs_sent:
        req.prompt_logprobs_sent = True
        start = req.logprobs.prompt_from
        prompt = PromptLogprobs(start, tuple(req.prompt_logprobs), tuple(req.prompt_top))
    times = None
    if not req.tokens_sent and new_ids and req.prefill_started is not None \
            and req.first_token_at is not None:
        times = (req.prefill_started, req.first_token_at)
    req.text_sent, req.tokens_sent = end, len(req.output_ids)
    return RequestOutput(
        rid=req.rid,
        new_token_ids=new_ids,
        new_logprobs=new_lps,
        text_delta=delta,
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.input_ids) - req.resumed,
        completion_tokens=req.position,
        cached_tokens=req.cached_tokens,
        new_top_logprobs=new_tops,
        prompt_logprobs=prompt,
        index=req.index,
        first_token_times=times,
    )


def _mark_more(outputs: list[RequestOutput], live: Mapping[str, Req]) -> list[RequestOutput]:
    """Sampling n > 1: a sequence's final output says ``more`` unless it ends the request (the
    last final output of a request no longer live), so a consumer waits for all n."""
    out = list(outputs)
    ended: set[str] = set()
    for i in range(len(out) - 1, -1, -1):
        o = out[i]
        if o.finish_reason is None:
            continue
        if o.rid in live or o.rid in ended:
            out[i] = attrs.evolve(o, more=True)
        else:
            ended.add(o.rid)
    return out
