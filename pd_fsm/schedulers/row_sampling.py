"""How each row of a step chooses its token, from its request's sampling: on the host after
the chain's logits (penalties, bans, grammar masks, top log-probs), or as the arrays a fused
step samples with on the device. The model runner asks; this knows requests, not devices."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from pd_fsm.jax_engine.sampling.grammar import allow_every_token, forbid
from pd_fsm.jax_engine.sampling.params import SamplingParams, TopLogprobs
from pd_fsm.jax_engine.sampling.sampler import (
    TOP_LOGPROBS,
    Adjustment,
    penalty_arrays,
    sample,
    sampling_arrays,
    top_logprobs,
)
from pd_fsm.schedulers.penalty_slots import PenaltySlots
from pd_fsm.schedulers.request import Req


class RowSampling:
    """``slots``: the penalties' counts on the device, where a fused step samples (None: every
    penalized row's choice is made on the host, after the chain's logits)."""

    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int],
                 slots: PenaltySlots | None = None) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.slots = slots

    def sample(self, logits: jax.Array, reqs: Sequence[Req | None]
               ) -> tuple[np.ndarray, np.ndarray]:
        """Each row's next token and its log-prob, as its request's sampling says (None rows:
        padding or unfinished chunks)."""
        if self.slots is not None:
            self.slots.forget(reqs)
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
        return top_logprobs(logits, RowSampling.tops_asked(reqs))

    def on_device(self, rows: Sequence[Req | None], b_pad: int, ahead: np.ndarray
                  ) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """The fused step's per-row sampling arrays for these rows (padded to ``b_pad``; greedy
        rows at temperature 0; a penalized row's counts slot, taken here) and their bitmask: a
        grammar's allowed tokens, and the tokens that would end a row still short of its
        ``min_new_tokens`` cleared (None: no row has either). ``ahead``: rows one token past
        what the host knows (their sampling key's step, and their output's length, too)."""
        params = [None if r is None else r.sampling for r in rows]
        arrays = sampling_arrays(
            params, [0 if r is None else r.seed for r in rows],
            [0 if r is None else r.position + int(ahead[i]) for i, r in enumerate(rows)], b_pad)
        slots = self.slots.slots_for(rows) if self.slots is not None else []
        arrays.update(penalty_arrays(params, slots, b_pad))
        arrays[TOP_LOGPROBS] = np.zeros(b_pad, np.int32)
        arrays[TOP_LOGPROBS][: len(rows)] = self.tops_asked(rows)
        bitmask = self.bitmask(b_pad, rows)
        for i, r in enumerate(rows):
            if r is None or len(r.output_ids) + int(ahead[i]) >= r.sampling.min_new_tokens:
                continue
            if bitmask is None:
                bitmask = allow_every_token(b_pad, self.vocab_size)
            forbid(bitmask, i, self.ends(r.sampling))
        return arrays, bitmask

    def on_device_alone(self, rows: Sequence[Req | None]) -> bool:
        """Whether the device can choose these rows' tokens: not where a row is penalized with
        no counts slot for it (none free, or no counts on this backend: there top
        alternatives are the chain's too)."""
        if self.slots is None:
            return not any(r is not None and (r.sampling.penalized or r.logprobs.top)
                           for r in rows)
        return self.slots.fit(rows)

    @staticmethod
    def tops_asked(rows: Sequence[Req | None]) -> list[int]:
        """How many top alternatives each row asks for."""
        return [0 if r is None else r.logprobs.top for r in rows]

    def bitmask(self, rows: int, reqs: Sequence[Req | None]) -> np.ndarray | None:
        """The tokens each row's grammar allows next (None: no row has one)."""
        if not any(r is not None and r.matcher is not None for r in reqs):
            return None
        bitmask = allow_every_token(rows, self.vocab_size)
        for i, r in enumerate(reqs):
            if r is not None and r.matcher is not None:
                r.matcher.fill(bitmask, i)
        return bitmask

    def adjustment(self, req: Req) -> Adjustment:
        """The penalties' history (this request's output so far: on D, P's first token too) and,
        below ``min_new_tokens``, the tokens that would end it."""
        sp = req.sampling
        short = len(req.output_ids) < sp.min_new_tokens
        return Adjustment(req.history, self.ends(sp) if short else frozenset())

    def ends(self, sp: SamplingParams) -> frozenset[int]:
        """The tokens that would end a request sampled as ``sp``."""
        return frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos
                                                else self.eos_token_ids)
