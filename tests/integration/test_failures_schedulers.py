"""Regression tests, at the scheduler level with an injected clock, for bugs the process-level
failure tests (test_failures_pd.py) found: the same faults, made exact in time."""

from __future__ import annotations

from typing import Any

import pytest

from pd_fsm.core import events as ev
from pd_fsm.core.messages import Heartbeat
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import DisaggregationArgs
from tests.support.pd_pair import BOOT, PDPair, collect

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
IDS = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _args(mode: str, **kw: Any) -> DisaggregationArgs:
    return DisaggregationArgs(model="tiny", num_pages=64, page_size=4, max_running=8,
                              max_batched_tokens=256, disaggregation_mode=mode,
                              instance_id=f"{mode}-0", **kw)


def _colocated(model: LoadedModel) -> list[int]:
    colo = Scheduler(SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=8,
                                   max_batched_tokens=256), model=model)
    colo.add_request(Req("r", IDS, GREEDY))
    return list(collect(colo.run_until_idle())["r"]["ids"])


def test_heartbeat_received_during_a_long_forward_keeps_the_lease(tiny: LoadedModel) -> None:
    """P's forward takes 10 s (a compile, a long prompt); D's heartbeat arrived at t=4, inside
    the lease (initial 5 s), and waits in the worker's inbox until the step is over. The room
    must be handed off, not failed: its lease is judged only once that heartbeat is delivered.
    (Found end to end: a 100-token prefill compiling on a loaded P failed a room D kept
    alive, "KV hold lease expired ... no heartbeat from D".)"""
    now = [0.0]
    pair = PDPair(tiny, _args("prefill", lease_initial=5.0, lease_extension=20.0),
                  _args("decode"), clock=lambda: now[0])
    try:
        pair.d.role.add_pd_request(Req("r", IDS, GREEDY), BOOT, 51)
        pair.pump()  # D resolved P, reserved pages, said hello: the lease runs from t=0
        assert pair.p.role.link.core.state_of(51) == "EARLY_PEER"
        pair.p.role.add_pd_request(Req("r", IDS, GREEDY), 51)
        real_forward = pair.p.runner.forward_extend

        def slow_forward(*a: Any, **kw: Any) -> Any:
            out = real_forward(*a, **kw)
            now[0] = 10.0  # the forward "took" 10 s
            return out

        pair.p.runner.forward_extend = slow_forward  # type: ignore[method-assign]
        pair.p_outputs += pair.p.step()
        # The worker's next tick: the inbox first, each message at its arrival time, then time.
        pair.p.role.deliver(ev.MessageReceived(pair.d_id, Heartbeat(1, (51,))), now=4.0)
        pair.p.role.deliver(ev.TimeAdvanced())
        assert pair.p.role.link.core.state_of(51) == "TRANSFERRING"
        assert pair.p.role.link.failures.pop("r", None) is None
        pair.run(lambda: "r" in collect(pair.d_outputs)
                 and collect(pair.d_outputs)["r"]["reason"] is not None
                 and pair.books_balanced())
        got = collect(pair.d_outputs)["r"]
        assert got["reason"].kind == "length" and got["ids"] == _colocated(tiny)
    finally:
        pair.close()


def test_lease_still_expires_when_no_heartbeat_came(tiny: LoadedModel) -> None:
    """The other side of the fix: with no heartbeat during the long forward, the lease ends at
    the next tick and P reclaims the KV and the registration."""
    now = [0.0]
    pair = PDPair(tiny, _args("prefill", lease_initial=5.0), _args("decode"),
                  clock=lambda: now[0])
    try:
        pair.d.role.add_pd_request(Req("r", IDS, GREEDY), BOOT, 52)
        pair.pump()
        pair.p.role.add_pd_request(Req("r", IDS, GREEDY), 52)
        real_forward = pair.p.runner.forward_extend

        def slow_forward(*a: Any, **kw: Any) -> Any:
            out = real_forward(*a, **kw)
            now[0] = 10.0
            return out

        pair.p.runner.forward_extend = slow_forward  # type: ignore[method-assign]
        pair.p.step()
        pair.p.role.deliver(ev.TimeAdvanced())
        assert pair.p.role.link.core.state_of(52) is None
        assert not pair.p.role.engine.registrations()
        assert pair.p.page_budget.allocator.num_free == pair.p.page_budget.allocator.total
    finally:
        pair.close()


def test_local_abort_on_p_answers_499_not_500(tiny: LoadedModel) -> None:
    """``/abort_request`` (or a client gone) on P's leg is the client's doing: 499, as on D,
    not a 500 "internal server error". D's ABORT of the room stays a 500 on P's leg."""
    pair = PDPair(tiny, _args("prefill"), _args("decode"))
    try:
        pair.p.role.add_pd_request(Req("mine", IDS, GREEDY), 53)
        pair.p_outputs += pair.p.step()  # prefilled, KV registered, no D yet
        assert pair.p.role.link.core.state_of(53) == "PREFILLED_NO_PEER"
        assert pair.p.abort("mine", "aborted by request")
        assert pair.p.role.link.failures.pop("mine", None) == (499, "aborted by request")
        assert not pair.p.role.engine.registrations()
        assert pair.p.page_budget.allocator.num_free == pair.p.page_budget.allocator.total
    finally:
        pair.close()



def test_queued_pull_reports_within_its_deadline_from_submit() -> None:
    """D's pull deadline counts from the submit, not from when a worker thread takes the job:
    the core frees a failed room's pages by its own backstop counted from the submit
    (transfer_timeout > pull_deadline), so a pull queued behind hung ones (a dead P: each hangs
    to its deadline) must give up instead of writing into those pages later."""
    import time

    import jax.numpy as jnp

    from pd_fsm.jax_engine.kv.holder import KVCacheHolder
    from pd_fsm.jax_engine.kv.pool import KVPoolConfig
    from pd_fsm.jax_engine.kv.pool_spec import KVArgs, PoolTransferSpec
    from pd_fsm.jax_engine.transfer.base import PendingPull, PullTimeout
    from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest
    from tests.support.fake_engine import FakeEngine

    cfg = KVPoolConfig(num_layers=1, num_pages=8, page_size=2, num_kv_heads=1, head_dim=4)
    args = KVArgs([PoolTransferSpec.from_config("main_kv", cfg)])
    deadline = 0.6

    class _Hung(PendingPull):
        def __init__(self, seconds: float) -> None:
            self.seconds = seconds

        def wait(self) -> None:
            time.sleep(self.seconds)  # what a pull to a dead P does: nothing, to the deadline
            raise PullTimeout("no answer")

    engine = FakeEngine(_Hung)
    holder = KVCacheHolder({"main_kv": [jnp.zeros(cfg.layer_shape, jnp.float32)]})
    ex = PullExecutor(engine, holder, args, max_workers=1, deadline_s=deadline)
    try:
        submitted = time.monotonic()
        for room in (1, 2):
            ex.submit(PullRequest(room, room, "dead-p:1", [room], args.layout_hash))
        results = {}
        for _ in range(2):
            r = ex.get(timeout=5)
            assert r is not None
            results[r.room] = (r, time.monotonic() - submitted)
        queued, took = results[2]
        assert not queued.ok and "not started" in queued.reason, queued
        assert took < deadline + 0.4, took  # not 2 x deadline
        assert engine.pulls == 1
    finally:
        ex.close()


def test_lease_expiry_gives_up_shared_pages_once(tiny: LoadedModel) -> None:
    """Issue 16 §2: P with the prefix cache. A room whose prompt shares cached pages loses its
    lease (D never said hello): P gives up the room's share of each page exactly once — the
    cached pages stay, every other page is free, the registration is released — and the next
    room with the same prompt still reads the cached prefix, answering as colocated."""
    now = [0.0]
    pair = PDPair(tiny, _args("prefill", lease_initial=5.0, radix_cache=True),
                  _args("decode"), clock=lambda: now[0])
    try:
        pair.d.role.add_pd_request(Req("first", IDS, GREEDY), BOOT, 70)
        pair.p.role.add_pd_request(Req("first", IDS, GREEDY), 70)
        pair.run(lambda: collect(pair.d_outputs).get("first", {}).get("reason") is not None
                 and pair.books_balanced())
        assert pair.p.page_budget.cache is not None
        cached = pair.p.page_budget.cache.pages
        assert cached > 0
        pair.p.role.add_pd_request(Req("orphan", IDS, GREEDY), 71)  # no D leg ever comes
        pair.p.step()
        assert pair.p.role.engine.registrations()
        now[0] = 10.0
        pair.p.role.deliver(ev.TimeAdvanced())
        assert pair.p.role.link.core.state_of(71) is None and not pair.p.role.engine.registrations()
        stats = pair.p.stats()
        assert stats.free_pages + stats.cached_pages == stats.total_pages
        assert pair.p.page_budget.cache.pages == cached
        pair.d.role.add_pd_request(Req("again", IDS, GREEDY), BOOT, 72)
        pair.p.role.add_pd_request(Req("again", IDS, GREEDY), 72)
        pair.run(lambda: collect(pair.d_outputs).get("again", {}).get("reason") is not None
                 and pair.books_balanced())
        assert collect(pair.d_outputs)["again"]["ids"] == _colocated(tiny)
        assert max(o.cached_tokens for o in pair.p_outputs if o.rid == "again") > 0
    finally:
        pair.close()
