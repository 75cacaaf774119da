"""Prefill + decode schedulers through the core and real transfer servers equal the colocated one.

Greedy tokens of a batch of varied prompts (1 token to more than two pages) are identical, the
logits of the first decode step agree to float tolerance, and afterwards every page is free on
both sides and the transfer server holds no registration.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from pd_fsm.core import events as ev
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import (
    DecodeScheduler,
    DisaggregationArgs,
    DuplicateRoomError,
    PrefillScheduler,
)
from pd_fsm.text.tokenizer import ChatMessage
from tests.support.pd_pair import BOOT, PDPair, collect

PAGE = 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
LENGTHS = [1, 2, 3, 4, 5, 7, 9, 11, 13, 17]  # up to more than four pages of 4 tokens


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _args(mode: str, **kw: Any) -> DisaggregationArgs:
    base: dict[str, Any] = {
        "model": "tiny",
        "num_pages": 96,
        "page_size": PAGE,
        "max_running": 16,
        "max_batched_tokens": 256,
        "disaggregation_mode": mode,
        "instance_id": f"{mode}-0",
    }
    base.update(kw)
    return DisaggregationArgs(**base)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, 256, size=n).tolist() for n in LENGTHS]


class _FirstDecodeLogits:
    """Mixin recording, per request, the logits of its first decode-phase forward."""

    first_logits: dict[str, np.ndarray]

    def _on_logits(self, phase: str, reqs: Any, logits: Any) -> None:
        if phase != "decode":
            return
        host = np.asarray(logits)
        for i, req in enumerate(reqs):
            if req is not None and req.rid not in self.first_logits:
                self.first_logits[req.rid] = host[i].copy()


class RecordingScheduler(_FirstDecodeLogits, Scheduler):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.first_logits = {}


class RecordingDecode(_FirstDecodeLogits, DecodeScheduler):
    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.first_logits = {}


def _real_prompts(model: LoadedModel) -> list[list[int]]:
    """Varied real prompts: one token, a word, sentences, a chat turn over two pages."""
    texts = [
        "The",
        "Paris is",
        "1 2 3 4 5 6",
        "def fibonacci(n):",
        "The quick brown fox jumps over the lazy dog.",
        "Water boils at a temperature of",
        "In 1969, the first humans landed on",
    ]
    ids = [model.tokenizer.encode(t) for t in texts]
    chat = model.tokenizer.encode(
        model.tokenizer.apply_chat_template(
            [ChatMessage("user", "What is the capital of France? Answer in one word.")]
        )
    )
    return [*ids, chat]


@pytest.mark.parametrize(("model_name", "kv_dtype"),
                         [("tiny", None), ("tiny", "bfloat16"), ("smollm2", None)])
def test_pd_equals_colocated(model_name: str, kv_dtype: str | None) -> None:
    """The same with the KV in bf16 (``--kv-dtype``): both sides' pools and every pull are bf16,
    and PD equals the colocated bf16 worker."""
    model = load_model(model_name)
    prompts = _prompts() if model_name == "tiny" else _real_prompts(model)
    assert len(prompts) >= 8 and max(map(len, prompts)) > 2 * PAGE and min(map(len, prompts)) == 1
    colo = RecordingScheduler(
        SchedulerArgs(
            model=model_name, num_pages=96, page_size=PAGE, max_running=16, max_batched_tokens=256,
            kv_dtype=kv_dtype,
        ),
        model=model,
    )
    for i, ids in enumerate(prompts):
        colo.add_request(Req(f"r{i}", ids, GREEDY))
    expected = collect(colo.run_until_idle())

    pair = PDPair(
        model,
        # P and D step in turn here, never at once: while P compiles a new shape (tens of
        # seconds for SmolLM2 on a loaded machine) D cannot heartbeat, which a real D would.
        # This test is about equivalence, so P's lease outlasts any compile.
        _args("prefill", model=model_name, lease_initial=600.0, lease_extension=600.0,
              kv_dtype=kv_dtype),
        _args("decode", model=model_name, kv_dtype=kv_dtype),
        decode_cls=RecordingDecode,
    )
    # bf16 KV is kept as its bits (uint16: XLA:CPU updates those in place, kv/pool.py).
    storage = {"bfloat16": "uint16"}.get(kv_dtype or "float32", "float32")
    dtypes = set()
    for sched in (colo, pair.p, pair.d):
        assert sched.pool_config.dtype == (kv_dtype or "float32")
        with sched.kv_holder.locked() as held:
            dtypes |= {str(a.dtype) for name in held.names() for a in held[name]}
    assert dtypes == {storage}
    assert {p.dtype for p in pair.d.role.kv_args.pools} == {storage}
    try:
        for i, ids in enumerate(prompts):
            room = 1000 + i
            # The router posts both legs at once; alternate which arrives first.
            legs = [
                lambda i=i, ids=ids, room=room: pair.d.role.add_pd_request(
                    Req(f"r{i}", ids, GREEDY), BOOT, room
                ),
                lambda i=i, ids=ids, room=room: pair.p.role.add_pd_request(
                    Req(f"r{i}", ids, GREEDY), room
                ),
            ]
            for leg in legs if i % 2 else legs[::-1]:
                leg()
        pair.run(
            lambda: (
                len(collect(pair.d_outputs)) == len(prompts)
                and all(v["reason"] for v in collect(pair.d_outputs).values())
                and pair.books_balanced()
            )
        )
        got = collect(pair.d_outputs)
        for rid, exp in expected.items():
            assert got[rid]["ids"] == exp["ids"], (rid, pair.d.role.link.failures.get(rid))
            assert got[rid]["reason"].kind == "length"
            np.testing.assert_allclose(
                pair.d.first_logits[rid], colo.first_logits[rid], atol=1e-4, rtol=0
            )
        # P answered each leg with exactly the first token D continued from.
        p_got = collect(pair.p_outputs)
        for rid, exp in expected.items():
            assert p_got[rid]["ids"] == exp["ids"][:1]
        assert pair.d.role.transfer_stats["pulls_ok"] == len(prompts)
        # The bytes pulled are the pools' packed pages at the pools' dtype (bf16: half of f32).
        assert pair.d.role.transfer_stats["bytes"] == sum(
            spec.packed_nbytes(-(-len(ids) // PAGE)) for ids in prompts
            for spec in pair.d.role.kv_args.pools)
        assert pair.books_balanced()
    finally:
        pair.close()


PENALIZED = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True,
                           repetition_penalty=1.6, frequency_penalty=0.8, presence_penalty=0.3,
                           min_new_tokens=4)


def test_penalties_and_min_tokens_pd_equals_colocated(tiny: LoadedModel) -> None:
    """Issue 17 §6: the penalties see each request's output so far (on D, P's first token
    too): PD's tokens are the colocated ones, and differ from plain greedy's. (The bans of
    ``min_new_tokens`` are checked in tests/unit/test_model_sampling.py.)"""
    prompts = _prompts()[:6]
    args = SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=16,
                         max_batched_tokens=256)
    outputs = {}
    plain = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    for name, sp in (("plain", plain), ("penalized", PENALIZED)):
        colo = Scheduler(args, model=tiny)
        for i, ids in enumerate(prompts):
            colo.add_request(Req(f"r{i}", ids, sp))
        outputs[name] = collect(colo.run_until_idle())
    assert any(outputs["plain"][r]["ids"] != outputs["penalized"][r]["ids"]
               for r in outputs["plain"])
    pair = PDPair(tiny, _args("prefill", lease_initial=600.0), _args("decode"))
    try:
        for i, ids in enumerate(prompts):
            pair.p.role.add_pd_request(Req(f"r{i}", ids, PENALIZED), 2000 + i)
            pair.d.role.add_pd_request(Req(f"r{i}", ids, PENALIZED), BOOT, 2000 + i)
        pair.run(lambda: len(collect(pair.d_outputs)) == len(prompts) and pair.books_balanced())
        got = collect(pair.d_outputs)
        for rid, exp in outputs["penalized"].items():
            assert got[rid]["ids"] == exp["ids"], rid
    finally:
        pair.close()


def test_duplicate_live_room_rejected_first_unaffected(tiny: LoadedModel) -> None:
    pair = PDPair(tiny, _args("prefill"), _args("decode"))
    try:
        ids = _prompts()[5]
        pair.p.role.add_pd_request(Req("a", ids, GREEDY), 7)
        pair.d.role.add_pd_request(Req("a", ids, GREEDY), BOOT, 7)
        with pytest.raises(DuplicateRoomError):
            pair.p.role.add_pd_request(Req("b", ids, GREEDY), 7)
        with pytest.raises(DuplicateRoomError):
            pair.d.role.add_pd_request(Req("b", ids, GREEDY), BOOT, 7)
        assert "b" not in pair.p.reqs and "b" not in pair.d.reqs
        pair.run(
            lambda: (
                "a" in collect(pair.d_outputs)
                and collect(pair.d_outputs)["a"]["reason"] is not None
                and pair.books_balanced()
            )
        )
        assert collect(pair.d_outputs)["a"]["reason"].kind == "length"
    finally:
        pair.close()


def test_every_phase_is_sampled_once_per_room_on_its_side(tiny: LoadedModel) -> None:
    """The phase samples the worker turns into histograms (phases.py): each of a role's phases
    once per room, on that role only, and nothing left stamped once the rooms are over."""
    from pd_fsm.io_trio.phases import PHASE_BY_KEY, role_phases

    pair = PDPair(tiny, _args("prefill"), _args("decode"))
    try:
        for room, ids in ((31, _prompts()[4]), (32, _prompts()[9])):
            pair.d.role.add_pd_request(Req(f"r{room}", ids, GREEDY), BOOT, room)
            pair.p.role.add_pd_request(Req(f"r{room}", ids, GREEDY), room)
        pair.run(lambda: len(collect(pair.d_outputs)) == 2 and pair.books_balanced())
        for sched, role in ((pair.p, "prefill"), (pair.d, "decode")):
            samples = sched.role.link.phases.take()
            keys = sorted(key for key, _ in samples)
            assert keys == sorted(2 * [p.key for p in role_phases(role)])
            assert all(PHASE_BY_KEY[k].role == role for k in keys)
            assert all(v >= 0 for _, v in samples)
            # A scatter waits for the step in flight at most (issue 13 §2): it happens at the
            # start of the loop's next iteration.
            assert all(v in (0, 1) for k, v in samples if k == "kv_scatter_steps"), samples
            assert sched.role.link.phases.take() == []
            assert not sched.role.link.phases.stamps
    finally:
        pair.close()


def test_decode_batch_stays_within_max_running(tiny: LoadedModel) -> None:
    """D's rooms take batch slots as its plain requests do: with ``max_running`` 3, ten rooms at
    once never make a decode batch over 3 (a batch shape the warm-up did not compile); the rest
    wait in ALLOCATING, heartbeating P, and join as slots free. The answers equal colocated's
    and every page and registration is released."""
    prompts = _prompts()
    colo = Scheduler(SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=16,
                                   max_batched_tokens=256), model=tiny)
    for i, ids in enumerate(prompts):
        colo.add_request(Req(f"r{i}", ids, GREEDY))
    expected = collect(colo.run_until_idle())
    pair = PDPair(tiny, _args("prefill", lease_initial=600.0, lease_extension=600.0),
                  _args("decode", max_running=3))
    seen = {"batch": 0, "slots_taken": 0, "queued": 0}

    def done() -> bool:
        queues = pair.d.queues
        seen["batch"] = max(seen["batch"], len(queues.running) + len(queues.prefilling))
        seen["slots_taken"] = max(seen["slots_taken"], 3 - pair.d.role.slots_free())
        seen["queued"] = max(seen["queued"], len(pair.d.role.alloc_queue))
        out = collect(pair.d_outputs)
        return (len(out) == len(prompts) and all(v["reason"] for v in out.values())
                and pair.books_balanced())

    try:
        for i, ids in enumerate(prompts):
            pair.d.role.add_pd_request(Req(f"r{i}", ids, GREEDY), BOOT, 70 + i)
            pair.p.role.add_pd_request(Req(f"r{i}", ids, GREEDY), 70 + i)
        pair.run(done)
        got = collect(pair.d_outputs)
        assert {r: v["ids"] for r, v in got.items()} == {r: v["ids"] for r, v in expected.items()}
        assert seen["batch"] == 3 and seen["slots_taken"] == 3, seen
        assert seen["queued"] >= len(prompts) - 3, seen
        assert not pair.d.role.link.failures
        assert pair.d.role.transfer_stats["pulls_ok"] >= len(prompts)
    finally:
        pair.close()


def test_unresolvable_prefill_fails_fast_and_frees_everything(tiny: LoadedModel) -> None:
    pair = PDPair(tiny, _args("prefill"), _args("decode"))
    pair.resolvable = False
    try:
        pair.d.role.add_pd_request(Req("x", [1, 2, 3], GREEDY), BOOT, 9)
        pair.pump()
        out = collect(pair.d.drain_outputs())
        assert out["x"]["reason"].kind == "abort"
        status, reason = pair.d.role.link.failures.pop("x", None)
        assert status == 502 and "cannot resolve prefill" in reason
        assert pair.d.page_budget.allocator.num_free == pair.d.page_budget.allocator.total
    finally:
        pair.close()


def test_abort_on_either_side_releases_both(tiny: LoadedModel) -> None:
    pair = PDPair(tiny, _args("prefill"), _args("decode"))
    try:
        ids = _prompts()[8]
        pair.d.role.add_pd_request(Req("a", ids, GREEDY), BOOT, 11)
        pair.p.role.add_pd_request(Req("a", ids, GREEDY), 11)
        pair.pump()
        assert pair.d.abort("a", "client gone")
        pair.pump()
        pair.run(lambda: pair.books_balanced())
        assert pair.d.role.link.failures.pop("a", None)[0] == 499
        status, reason = pair.p.role.link.failures.pop("a", None)
        assert status == 500 and "client gone" in reason
    finally:
        pair.close()


def test_silent_prefill_fails_the_room_within_the_window(tiny: LoadedModel) -> None:
    now = [0.0]
    pair = PDPair(
        tiny,
        _args("prefill"),
        _args("decode", heartbeat_interval=1.0, peer_timeout=3.0),
        clock=lambda: now[0],
    )
    try:
        pair.d.role.add_pd_request(Req("a", [5, 6, 7, 8, 9], GREEDY), BOOT, 12)
        pair.pump()
        pair.drop_to_p = True  # P hears nothing more and is never stepped: it is "dead"
        for t in range(1, 5):
            now[0] = float(t)
            pair.d_outputs += pair.d.step()
            pair.pump()
        out = collect(pair.d_outputs)
        assert out["a"]["reason"].kind == "abort"
        status, reason = pair.d.role.link.failures.pop("a", None)
        assert status == 502 and "silent" in reason
        assert pair.d.page_budget.allocator.num_free == pair.d.page_budget.allocator.total
    finally:
        pair.close()


def test_make_scheduler_builds_the_pd_schedulers(tiny: LoadedModel) -> None:
    from pd_fsm.schedulers import make_scheduler

    p = make_scheduler(SchedulerArgs(model="tiny", disaggregation_mode="prefill"), model=tiny)
    d = make_scheduler(_args("decode"), model=tiny)
    try:
        assert isinstance(p, PrefillScheduler) and isinstance(d, DecodeScheduler)
        assert (p.role.kv_args.layout_hash == d.role.kv_args.layout_hash
                or p.pool_config != d.pool_config)
    finally:
        assert isinstance(d, DecodeScheduler)
        d.role.close()
        p.role.engine.close()
        d.role.engine.close()


def test_room_failing_during_prefill_forward_is_skipped(tiny: LoadedModel) -> None:
    """A lease that expires while a batch's forward runs: the finished leg is not handed off."""
    now = [0.0]
    pair = PDPair(tiny, _args("prefill", lease_initial=5.0), _args("decode"), clock=lambda: now[0])
    try:
        ids = _prompts()[6]
        pair.p.role.add_pd_request(Req("a", ids, GREEDY), 21)
        pair.p.role.add_pd_request(Req("b", ids, GREEDY), 22)
        real_forward = pair.p.runner.forward_extend

        def slow_forward(*a: Any, **kw: Any) -> Any:
            out = real_forward(*a, **kw)
            now[0] = 10.0  # the forward "took" 10 s: both leases are past expiry
            pair.p.role.deliver(ev.TimeAdvanced())
            return out

        pair.p.runner.forward_extend = slow_forward  # type: ignore[method-assign]
        outputs = pair.p.step()
        reasons = {o.rid: o.finish_reason for o in outputs if o.finished}
        assert reasons["a"].kind == reasons["b"].kind == "abort"
        assert "lease expired" in pair.p.role.link.failures.pop("a", None)[1]
        assert pair.p.page_budget.allocator.num_free == pair.p.page_budget.allocator.total
        assert not pair.p.role.engine.registrations() and not pair.p.role.send_queue
    finally:
        pair.close()


def test_recompute_policy_answers_correctly_when_prefill_is_gone(tiny: LoadedModel) -> None:
    """P unreachable: with failure_policy=recompute, D prefills itself and the tokens are right."""
    ids = _prompts()[7]
    colo = Scheduler(
        SchedulerArgs(
            model="tiny", num_pages=96, page_size=PAGE, max_running=16, max_batched_tokens=256
        ),
        model=tiny,
    )
    colo.add_request(Req("r", ids, GREEDY))
    expected = collect(colo.run_until_idle())["r"]["ids"]
    pair = PDPair(tiny, _args("prefill"), _args("decode", failure_policy="recompute"))
    pair.resolvable = False  # the bootstrap server knows no such P
    try:
        pair.d.role.add_pd_request(Req("r", ids, GREEDY), BOOT, 31)
        pair.run(
            lambda: (
                "r" in collect(pair.d_outputs)
                and collect(pair.d_outputs)["r"]["reason"] is not None
                and pair.books_balanced()
            )
        )
        got = collect(pair.d_outputs)["r"]
        assert got["ids"] == expected and got["reason"].kind == "length"
        assert pair.d.role.recomputed == 1 and pair.d.role.link.failures.pop("r", None) is None
    finally:
        pair.close()


def _shared_prefix(tiny: LoadedModel, *, seed: int, system: int, suffix: int, n: int
                   ) -> tuple[list[list[int]], dict[str, Any]]:
    """``n`` prompts sharing a ``system``-token prefix, and the colocated scheduler's answers
    to them (prompt i's suffix drawn from seed 20 * seed + i)."""
    head = np.random.default_rng(seed).integers(1, 256, size=system).tolist()
    prompts = [head + np.random.default_rng(20 * seed + i).integers(1, 256, size=suffix).tolist()
               for i in range(n)]
    colo = Scheduler(SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=16,
                                   max_batched_tokens=256), model=tiny)
    for i, ids in enumerate(prompts):
        colo.add_request(Req(f"r{i}", ids, GREEDY))
    return prompts, collect(colo.run_until_idle())


def test_prefill_prefix_cache_pd_equals_colocated_and_books_balance(tiny: LoadedModel) -> None:
    """Issue 16 §2: P with the prefix cache prefills only each room's uncached suffix and
    gathers the whole prompt for D; D's tokens equal colocated's. A room aborted while P holds
    shared pages gives up its share only: the accounting closes with the cache's pages."""
    prompts, expected = _shared_prefix(tiny, seed=1, system=22, suffix=5, n=4)
    pair = PDPair(tiny, _args("prefill", radix_cache=True), _args("decode"))
    try:
        cached = []
        for i, ids in enumerate(prompts):  # one room after another: each finds the last
            pair.d.role.add_pd_request(Req(f"r{i}", ids, GREEDY), BOOT, 500 + i)
            pair.p.role.add_pd_request(Req(f"r{i}", ids, GREEDY), 500 + i)
            pair.run(lambda i=i: collect(pair.d_outputs).get(f"r{i}", {}).get("reason")
                     is not None and pair.books_balanced())
            cached.append(max(o.cached_tokens for o in pair.p_outputs if o.rid == f"r{i}"))
        got = collect(pair.d_outputs)
        assert {rid: v["ids"] for rid, v in got.items()} == {
            rid: v["ids"] for rid, v in expected.items()}
        assert cached[0] == 0 and all(c == 20 for c in cached[1:]), cached  # 5 whole pages
        # Abort a room while P holds its (partly shared) pages and waits for D.
        pair.p.role.add_pd_request(Req("x", prompts[0], GREEDY), 600)
        pair.p.step()
        assert pair.p.abort("x")
        pair.run(pair.books_balanced)
        assert pair.p.page_budget.cache is not None and pair.p.page_budget.cache.pages >= 5
    finally:
        pair.close()


@pytest.mark.parametrize(("p_cache", "p_first"), [(False, False), (True, False), (True, True)])
def test_decode_prefix_cache_pulls_only_the_delta(
    tiny: LoadedModel, p_cache: bool, p_first: bool
) -> None:
    """Issue 16 §3: D with the prefix cache tells P in RECV_INIT how many leading pages it
    holds; P registers only the rest, D pulls them after its cached pages and puts the finished
    sequence into its cache. Tokens equal colocated's, with or without P's own cache, and the
    bytes pulled shrink to the uncached pages. ``p_first``: P prefilled and registered the whole
    prompt before D's hello came: it narrows the registration to what D lacks (NarrowKV)."""
    prompts, expected = _shared_prefix(tiny, seed=2, system=30, suffix=6, n=3)
    pair = PDPair(tiny, _args("prefill", radix_cache=p_cache), _args("decode", radix_cache=True))
    try:
        pulled = []
        for i, ids in enumerate(prompts):
            before = pair.d.role.transfer_stats["bytes"]
            if p_first:
                pair.p.role.add_pd_request(Req(f"r{i}", ids, GREEDY), 800 + i)
                pair.p_outputs += pair.p.step()  # prefilled, whole prompt registered
                assert pair.p.role.link.core.state_of(800 + i) == "PREFILLED_NO_PEER"
            pair.d.role.add_pd_request(Req(f"r{i}", ids, GREEDY), BOOT, 800 + i)
            if not p_first:
                pair.p.role.add_pd_request(Req(f"r{i}", ids, GREEDY), 800 + i)
            pair.run(lambda i=i: collect(pair.d_outputs).get(f"r{i}", {}).get("reason")
                     is not None and pair.books_balanced())
            pulled.append(pair.d.role.transfer_stats["bytes"] - before)
        got = collect(pair.d_outputs)
        assert {r: v["ids"] for r, v in got.items()} == {r: v["ids"] for r, v in expected.items()}
        # The first room pulls its whole 36-token prompt (9 pages); the later ones share 30
        # tokens, 7 whole pages cached on D, and pull the other 2.
        cfg = tiny.config
        page_bytes = cfg.num_layers * PAGE * 2 * cfg.num_kv_heads * cfg.head_dim * 4
        assert pulled[1] == pulled[2] == 2 * page_bytes < pulled[0] / 4, pulled
        assert pair.d.page_budget.cache is not None and pair.d.page_budget.cache.hits >= 14
    finally:
        pair.close()


def test_pd_on_the_accelerators_choices_equals_the_colocated_chain(tiny: LoadedModel) -> None:
    """P and D on the accelerator's backend choices (the fused step over a lanes pool, bf16 kept
    as bf16, D's decode steps overlapped; attention by the XLA reference on this CPU), with real
    transfers of lanes-layout pages: D's greedy tokens equal the colocated chain's, and every
    page and registration is back on both sides. Two requests are penalized, each of which
    would repeat its first token later: P chose that token, so D must count it (its history
    seeds the request's counts on D's first step) to answer as the colocated chain."""
    from pd_fsm.jax_engine import backend

    prompts = _prompts()
    penalized = attrs.evolve(GREEDY, frequency_penalty=1.0, repetition_penalty=1.5)

    def sampling(i: int) -> SamplingParams:
        return penalized if i in (0, 2) else GREEDY

    colo = Scheduler(SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=16,
                                   max_batched_tokens=256), model=tiny)
    for i, ids in enumerate(prompts):
        colo.add_request(Req(f"r{i}", ids, sampling(i)))
    expected = collect(colo.run_until_idle())
    plain = Scheduler(SchedulerArgs(model="tiny", num_pages=96, page_size=PAGE, max_running=16,
                                    max_batched_tokens=256), model=tiny)
    for i in (0, 2):
        plain.add_request(Req(f"r{i}", prompts[i], GREEDY))
    unpenalized = collect(plain.run_until_idle())
    # Both would repeat their first token (P's) later: penalized, they do not.
    for r in ("r0", "r2"):
        ids = unpenalized[r]["ids"]
        assert ids[0] in ids[1:] and expected[r]["ids"][0] not in expected[r]["ids"][1:]
    with backend.using(backend.accelerator_on_cpu("reference")):
        pair = PDPair(tiny, _args("prefill", lease_initial=600.0, lease_extension=600.0),
                      _args("decode"))
        try:
            assert pair.p.pool_config.lanes and pair.d.pool_config.lanes
            for i, ids in enumerate(prompts):
                pair.d.role.add_pd_request(Req(f"r{i}", ids, sampling(i)), BOOT, 1000 + i)
                pair.p.role.add_pd_request(Req(f"r{i}", ids, sampling(i)), 1000 + i)
            pair.run(lambda: len(collect(pair.d_outputs)) == len(prompts)
                     and all(v["reason"] for v in collect(pair.d_outputs).values())
                     and pair.books_balanced())
            got = collect(pair.d_outputs)
            assert {rid: v["ids"] for rid, v in got.items()} == {
                rid: v["ids"] for rid, v in expected.items()}
            assert pair.books_balanced()
            for side in (pair.p, pair.d):  # every step fused: no row took the chain
                assert all(shape[0] == "step" for shape in side.runner.forward_shapes)
        finally:
            pair.close()
