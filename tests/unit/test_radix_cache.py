"""The prefix cache's tree (property tests against a model of it) and the scheduler with it:
outputs equal without it, the hit reported, and the page accounting exact."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_fsm.jax_engine.kv.pool import PageAllocator
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, RequestOutput, Scheduler, SchedulerArgs
from pd_fsm.schedulers.radix_cache import RadixCache

PS = 2
tokens = st.lists(st.integers(0, 2), min_size=0, max_size=8)  # small alphabet: many shared prefixes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "evict"]), tokens, st.integers(0, 6)),
                max_size=25))
def test_tree_never_frees_a_page_a_request_holds(ops: list[tuple[str, list[int], int]]) -> None:
    """Requests match, run (holding their pages), insert and release in any order, with
    evictions between: a page a live request holds is never freed, a match returns pages whose
    KV is the prefix asked for, and the accounting closes (everything freed at the end)."""
    alloc = PageAllocator(64)
    cache = RadixCache(alloc, PS)
    content: dict[int, tuple[int, ...]] = {}  # page -> the prefix its KV is of
    live: list[tuple[list[int], list[int]]] = []  # (tokens, pages) of running requests
    for op, toks, n in ops:
        if op == "evict":
            cache.evict(n)
        else:
            matched = cache.match(toks)
            for i, page in enumerate(matched):
                assert content[page] == tuple(toks[: (i + 1) * PS])
            fresh = alloc.allocate(max(0, len(toks) // PS - len(matched)))
            if fresh is None:
                alloc.free(matched)
                continue
            held = {page for _, other in live for page in other}
            assert not held & set(fresh), "a page a live request holds was handed out again"
            pages = matched + fresh
            for i, page in enumerate(fresh, start=len(matched)):
                content[page] = tuple(toks[: (i + 1) * PS])
            live.append((toks, pages))
        if live and n % 2:  # a request ends: its pages go in, then its shares are given up
            toks, pages = live.pop(0)
            cache.insert(toks, pages)
            alloc.free(pages)
        for _, pages in live:  # still in use: held, and not on the free list
            assert all(alloc.holders(p) >= 1 for p in pages)
    for toks, pages in live:
        cache.insert(toks, pages)
        alloc.free(pages)
    cached = cache.pages
    assert cache.evictable() == cached  # nobody else holds any of them now
    assert cache.evict(10**6) == cached
    assert alloc.num_free == alloc.total and cache.pages == 0


def test_a_page_a_live_request_holds_is_not_evicted() -> None:
    alloc = PageAllocator(8)
    cache = RadixCache(alloc, PS)
    pages = alloc.allocate(3)
    assert pages is not None
    cache.insert([1, 2, 3, 4, 5, 6], pages)
    alloc.free(pages)  # the request that computed them ended: the tree alone holds them
    held = cache.match([1, 2, 3, 4])  # a new request holds the first two
    assert held == pages[:2]
    assert cache.evict(10) == 1  # only the third page (a leaf nobody else holds)
    assert alloc.num_free == alloc.total - 2
    alloc.free(held)
    assert cache.evict(10) == 2 and alloc.num_free == alloc.total


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _run(sched: Scheduler, reqs: list[Req]) -> dict[str, tuple[list[int], int]]:
    for req in reqs:
        sched.add_request(req)
    outputs: list[RequestOutput] = sched.run_until_idle()
    out: dict[str, tuple[list[int], int]] = {}
    for o in outputs:
        ids, _ = out.get(o.rid, ([], 0))
        out[o.rid] = (ids + list(o.new_token_ids), o.cached_tokens)
    return out


def test_shared_prefixes_prefill_only_their_suffix(tiny: LoadedModel) -> None:
    system = np.random.default_rng(3).integers(1, 256, size=37).tolist()
    questions = [np.random.default_rng(10 + i).integers(1, 256, size=9).tolist()
                 for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    def args(cache: bool) -> SchedulerArgs:
        return SchedulerArgs(model="tiny", num_pages=40, page_size=4, max_running=2,
                             max_batched_tokens=64, radix_cache=cache)

    plain = Scheduler(args(False), model=tiny)
    cached = Scheduler(args(True), model=tiny)
    for i, q in enumerate(questions):  # one after another: each finds the ones before
        reqs = [Req(f"q{i}", system + q, sp)]
        want = _run(plain, reqs)
        got = _run(cached, [Req(f"q{i}", system + q, sp)])
        assert got[f"q{i}"][0] == want[f"q{i}"][0], "the cache changes no token"
        assert got[f"q{i}"][1] == (0 if i == 0 else 36), got  # 9 whole pages of the system
    again = _run(cached, [Req("again", system + questions[0], sp)])
    assert again["again"][1] == 44  # the whole prompt but its last token's page
    stats = cached.stats()
    assert stats.free_pages + stats.cached_pages == stats.total_pages
    # Pressure: a request that needs more than the free pages evicts what nobody uses.
    big = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)
    long_prompt = np.random.default_rng(99).integers(1, 256, size=40).tolist()
    assert _run(cached, [Req("big", long_prompt, big)])["big"][1] == 0
    stats = cached.stats()
    assert stats.free_pages + stats.cached_pages == stats.total_pages
    assert cached.page_budget.cache is not None and cached.page_budget.cache.evicted > 0


def test_prompt_logprobs_are_computed_not_cached(tiny: LoadedModel) -> None:
    from pd_fsm.schedulers.request import LogprobSpec

    args = SchedulerArgs(model="tiny", num_pages=40, page_size=4, max_running=2,
                         max_batched_tokens=64, radix_cache=True)
    sched = Scheduler(args, model=tiny)
    prompt = np.random.default_rng(5).integers(1, 256, size=30).tolist()
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    _run(sched, [Req("warm", prompt, sp)])
    for start, cached in ((0, 0), (9, 8)):
        sched.add_request(Req(f"lp{start}", prompt, sp, logprobs=LogprobSpec(prompt_from=start)))
        outs = sched.run_until_idle()
        part = next(o.prompt_logprobs for o in outs if o.prompt_logprobs is not None)
        assert len(part.logprobs) == len(prompt) - start
        assert outs[-1].cached_tokens == cached
