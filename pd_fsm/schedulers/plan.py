"""What one step runs, decided apart from running it (the shape of vLLM v1's
scheduler, which only decides and returns a plan): plain, frozen data, and the pure functions that
build it from the scheduler's queues.

A ``PrefillBatch`` is the prompt chunks one prefill forward takes, padded to a compiled shape
``(n_pad, t_pad)``; a ``DecodeBatch`` the running sequences one decode forward takes, padded to
``b_pad`` rows. The scheduler plans; the ``ModelRunner`` runs a plan (``run_prefill``,
``run_decode``); the scheduler then applies what came back. ``shape_plan`` lists every padded
shape the planning rules can produce, for warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from pd_fsm.jax_engine.compilation.buckets import bucket
from pd_fsm.schedulers.request import Req

# Smallest padded prompt length: tiny prompts share one compiled shape.
MIN_PREFILL_BUCKET = 8


@attrs.frozen
class PrefillRow:
    req: Req
    start: int  # first prompt position fed in this forward
    length: int  # prompt tokens fed in this forward


@attrs.frozen
class PrefillBatch:
    rows: tuple[PrefillRow, ...]
    n_pad: int
    t_pad: int

    def num_new(self) -> np.ndarray:
        """Tokens each padded row feeds (0 for padding rows)."""
        num_new = np.zeros(self.n_pad, np.int32)
        for i, row in enumerate(self.rows):
            num_new[i] = row.length
        return num_new


@attrs.frozen
class DecodeBatch:
    reqs: tuple[Req, ...]
    b_pad: int


def t_bucket(n: int) -> int:
    """The padded prompt length of a chunk of ``n`` tokens."""
    return bucket(n, MIN_PREFILL_BUCKET)


def plan_prefill(
    prefilling: Sequence[Req], budget: int, chunk_cap: Callable[[Req], int | None]
) -> PrefillBatch | None:
    """The next prefill forward over ``prefilling`` (FIFO): each row takes what is left of its
    prompt (at most ``chunk_cap(req)`` tokens where that says), as long as the padded batch
    stays within ``budget`` tokens; the first row alone is cut to the budget."""
    rows: list[PrefillRow] = []
    t_max = 0
    for req in prefilling:
        remaining = len(req.input_ids) - req.prefilled
        cap = chunk_cap(req)
        if cap is not None:
            remaining = min(remaining, cap)
        if not rows:
            n = min(remaining, budget)
        else:
            n_pad = bucket(len(rows) + 1)
            if n_pad * t_bucket(max(t_max, remaining)) <= budget:
                n = remaining
            elif n_pad * t_bucket(t_max) <= budget:
                n = min(remaining, t_bucket(t_max))
            else:
                break
        rows.append(PrefillRow(req, req.prefilled, n))
        t_max = max(t_max, n)
    if not rows:
        return None
    return PrefillBatch(tuple(rows), bucket(len(rows)), t_bucket(t_max))


def plan_decode(running: Sequence[Req]) -> DecodeBatch | None:
    """The next decode forward: every running sequence, one token each."""
    if not running:
        return None
    reqs = tuple(running)
    return DecodeBatch(reqs, bucket(len(reqs)))


def shape_plan(max_running: int, max_batched_tokens: int, longest: int) -> list[tuple[int, int]]:
    """Every padded forward shape ``(rows, tokens)`` the rules above can produce: decode
    ``(b, 1)`` for each batch bucket up to ``max_running``; prefill ``(1, t)`` for each length
    bucket a first row can take (up to ``longest`` tokens), and ``(n, t)`` with ``n * t`` within
    ``max_batched_tokens`` for batches of several rows."""
    row_buckets = sorted({bucket(n) for n in range(1, max_running + 1)})
    top = t_bucket(min(max_batched_tokens, longest))
    t_buckets = [t for t in (1 << i for i in range(32)) if MIN_PREFILL_BUCKET <= t <= top]
    plan = [(b, 1) for b in row_buckets]
    plan += [(1, t) for t in t_buckets]
    plan += [(n, t) for n in row_buckets if n > 1 for t in t_buckets
             if n * t <= max_batched_tokens]
    return plan
