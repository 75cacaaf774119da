"""Sampling n > 1: the sequences 1..n-1 of a request that has just been prefilled (here, or on P
and then transferred).

They share the prompt's pages before the one holding its last token; each gets its own copy of
that page (copy-on-write: it rewrites that position's KV with its first step, which samples its
first token from the prompt's last logits with its own seed). The pages were reserved with the
request (``PageBudget.pages_needed``), so a fork never waits for them.
"""

from __future__ import annotations

import attrs
import numpy as np

from pd_fsm.schedulers.model_runner import ModelRunner
from pd_fsm.schedulers.output_processor import OutputProcessor
from pd_fsm.schedulers.page_budget import PageBudget
from pd_fsm.schedulers.request import Req, ReqState, fork_seed


def fork_sequences(
    req: Req, pages: PageBudget, runner: ModelRunner, outputs: OutputProcessor
) -> list[Req]:
    """``req``'s forks, running, with their pages (none when n == 1 or it was forked before);
    ``req.family`` then lists all n sequences."""
    n = req.sampling.n
    if n == 1 or req.family:
        return []
    split = pages.fork(req)
    assert req.pages is not None
    forks: list[Req] = []
    for i, own in enumerate(split.forks, start=1):
        fork = Req(req.rid, req.input_ids, req.sampling, req.metadata,
                   attrs.evolve(req.logprobs, prompt_from=-1))
        fork.index, fork.parent = i, req
        fork.pages = own
        fork.prefilled = len(req.input_ids)
        fork.state = ReqState.RUNNING
        fork.seed = fork_seed(req.seed, i)
        fork.detokenizer = outputs.detokenizer(req.sampling)
        fork.matcher = None if req.matcher is None else req.matcher.fork()
        forks.append(fork)
    src = np.full(n - 1, req.pages[split.copied], np.int32)
    dst = np.array([own[split.copied] for own in split.forks], np.int32)
    runner.copy_pages(src, dst)
    req.family = [req, *forks]
    return forks
