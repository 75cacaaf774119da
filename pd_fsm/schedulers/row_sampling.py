"""How each row of a step chooses its token, from its request's sampling: on the host after
the chain's logits (penalties, bans, grammar masks, top log-probs), or as the arrays a fused
step samples with on the device. The model runner asks; this knows requests, not devices."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from pd_fsm.jax_engine.sampling.grammar import bitmask_words
from pd_fsm.jax_engine.sampling.params import TopLogprobs
from pd_fsm.jax_engine.sampling.sampler import (
    Adjustment,
    sample,
    sampling_arrays,
    top_logprobs,
)
from pd_fsm.schedulers.request import Req


class RowSampling:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def sample(self, logits: jax.Array, reqs: Sequence[Req | None]
               ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's next token and its log-prob, as its request's sampling says (None rows:
        padding or unfinished chunks)."""
        return sample(
            logits,
            [None if r is None else r.sampling for r in reqs],
            [0 if r is None else r.seed for r in reqs],
            [0 if r is None else r.position for r in reqs],
            [None if r is None or not r.sampling.penalized else self.adjustment(r) for r in reqs],
            self.bitmask(logits.shape[0], reqs),
        )

    @staticmethod
    def top_logprobs(logits: jax.Array, reqs: Sequence[Req | None]) -> list[TopLogprobs]:
        """Each row's top alternatives under the raw distribution, as its request asks."""
        return top_logprobs(logits, [0 if r is None else r.logprobs.top for r in reqs])

    def on_device(self, rows: Sequence[Req | None], b_pad: int, ahead: np.ndarray
                  ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """The fused step's per-row sampling arrays for these rows (padded to ``b_pad``; greedy
        rows at temperature 0) and their grammar bitmask (None: no row has a grammar).
        ``ahead``: rows one token past what the host knows (their sampling key's step too)."""
        arrays = sampling_arrays(
            [None if r is None else r.sampling for r in rows],
            [0 if r is None else r.seed for r in rows],
            [0 if r is None else r.position + int(ahead[i]) for i, r in enumerate(rows)], b_pad)
        return arrays, self.bitmask(b_pad, rows)

    @staticmethod
    def on_device_alone(rows: Sequence[Req | None]) -> bool:
        """Whether the device can choose these rows' tokens: not where a row's choice needs its
        logits on the host (penalties, ``min_new_tokens``' bans) or asks for top
        alternatives."""
        return not any(r is not None and (r.sampling.penalized or r.logprobs.top
                                          or len(r.output_ids) < r.sampling.min_new_tokens)
                       for r in rows)

    def bitmask(self, rows: int, reqs: Sequence[Req | None]) -> np.ndarray | None:
        """The tokens each row's grammar allows next (None: no row has one)."""
        if not any(r is not None and r.matcher is not None for r in reqs):
            return None
        bitmask = np.full((rows, bitmask_words(self.vocab_size)), -1, np.int32)
        for i, r in enumerate(reqs):
            if r is not None and r.matcher is not None:
                r.matcher.fill(bitmask, i)
        return bitmask

    def adjustment(self, req: Req) -> Adjustment:
        """The penalties' history (this request's output so far: on D, P's first token too) and,
        below ``min_new_tokens``, the tokens that would end it."""
        sp = req.sampling
        banned: frozenset[int] = frozenset()
        if len(req.output_ids) < sp.min_new_tokens:
            ends = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                ends |= self.eos_token_ids
            banned = frozenset(ends)
        return Adjustment(req.history, banned)
