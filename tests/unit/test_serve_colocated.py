"""ColocatedBackend without HTTP: fan-out to slow consumers, aborts, queue limit, page accounting;
and the HTTP layer's answers before the backend is ready."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

import httpx
import pytest
import trio
import trio.testing

from pd_fsm.io_trio.worker import colocated
from pd_fsm.io_trio.worker.app import WorkerApp
from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob
from pd_fsm.io_trio.worker.colocated import ColocatedBackend
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.spmd.frames import Command
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import FinishReason, RequestOutput, Scheduler, SchedulerArgs

ARGS = SchedulerArgs(model="tiny", num_pages=96, page_size=4, max_running=4,
                     max_batched_tokens=256, context_length=512)
CAPACITY = 4
N = CAPACITY * 3 + 2  # more outputs than one request's channel holds


def _job(rid: str, prompt: tuple[int, ...], n: int = N) -> GenerateJob:
    return GenerateJob(rid, prompt, SamplingParams(max_new_tokens=n, temperature=0.0,
                                                   ignore_eos=True))


@pytest.fixture
async def backend(nursery: trio.Nursery) -> ColocatedBackend:
    b = ColocatedBackend(ARGS, stream_capacity=CAPACITY, warmup="minimal")
    await nursery.start(b.serve)
    return b


def _reference(prompt: tuple[int, ...], n: int = N) -> list[int]:
    sched = Scheduler(ARGS)
    req = sched.make_request("ref", list(prompt), SamplingParams(max_new_tokens=n,
                                                                temperature=0.0,
                                                                ignore_eos=True))
    sched.add_request(req)
    sched.run_until_idle()
    return list(req.output_ids)


async def test_slow_consumer_blocks_nobody_and_loses_nothing(backend: ColocatedBackend) -> None:
    slow_prompt, fast_prompt = (5, 6, 7), (9, 10, 11, 12)
    slow_gen = backend.generate(_job("slow", slow_prompt))
    async with aclosing(slow_gen):
        first = await slow_gen.__anext__()  # admitted; then not read while "fast" runs
        fast: list[int] = []
        async with aclosing(backend.generate(_job("fast", fast_prompt))) as outs:
            async for out in outs:
                fast.extend(out.new_token_ids)
        assert fast == _reference(fast_prompt)
        # The slow request kept running; its outputs waited in its channel and overflow.
        slow = list(first.new_token_ids)
        async for out in slow_gen:
            slow.extend(out.new_token_ids)
        assert slow == _reference(slow_prompt)
    stats = backend.stats()
    assert stats["free_pages"] == stats["total_pages"]
    assert backend.outcomes["length"] == 2 and not backend.streams.live


async def test_leaving_early_aborts_and_frees_pages(backend: ColocatedBackend) -> None:
    async with aclosing(backend.generate(_job("gone", (1, 2, 3)))) as outs:
        async for _ in outs:
            break
    with trio.fail_after(10):
        while backend.streams.live:
            await trio.sleep(0.01)
    stats = backend.stats()
    assert stats["free_pages"] == stats["total_pages"] and stats["running"] == 0
    assert backend.outcomes["abort"] == 1


async def test_abort_by_rid_ends_stream_with_abort_reason(backend: ColocatedBackend) -> None:
    reasons: list[FinishReason | None] = []
    async with aclosing(backend.generate(_job("victim", (4, 4, 4)))) as outs:
        async for out in outs:
            if out.finish_reason is None:
                if not reasons:
                    assert backend.abort("victim")
                    reasons.append(None)
            else:
                reasons.append(out.finish_reason)
    assert [r.kind for r in reasons if r is not None] == ["abort"]
    assert not backend.abort("victim")  # gone now
    stats = backend.stats()
    assert stats["free_pages"] == stats["total_pages"]


async def test_refused_requests(backend: ColocatedBackend) -> None:
    # A request the scheduler can never serve (more pages than the pool holds).
    with pytest.raises(BackendError) as info:
        async with aclosing(backend.generate(_job("big", (1,) * 400, n=100))) as outs:
            async for _ in outs:
                pass
    assert info.value.status == 400 and "pages" in info.value.reason
    assert backend.outcomes["error"] == 1 and not backend.streams.live


async def test_queue_limit_is_503(nursery: trio.Nursery) -> None:
    # No loop runs: the first job sits in the channel (capacity 1), the second is refused.
    b = ColocatedBackend(ARGS, max_queued=1, warmup="minimal")
    b.health.ready = True
    g1 = b.generate(_job("q1", (1, 2)))

    async def wait_first() -> None:
        async with aclosing(g1):
            await g1.__anext__()

    nursery.start_soon(wait_first)
    await trio.testing.wait_all_tasks_blocked()
    assert b.stats()["queued"] == 1
    with pytest.raises(BackendError) as info:
        async with aclosing(b.generate(_job("q2", (1, 2)))) as g2:
            await g2.__anext__()
    assert info.value.status == 503
    nursery.cancel_scope.cancel()


async def test_http_before_ready_is_503() -> None:
    config = ServeConfig(model="tiny", num_pages=96, page_size=4)
    worker = WorkerApp(config, ColocatedBackend(config.scheduler_args(), warmup="minimal"))
    transport = httpx.ASGITransport(app=worker.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://w") as http:
        assert (await http.get("/health")).status_code == 503
        r = await http.post("/generate", json={"text": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == 503
        r = await http.post("/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503
        info = (await http.get("/server_info")).json()
        assert info["ready"] is False and info["disaggregation_mode"] == "null"


class _BreakingScheduler(Scheduler):
    """A scheduler whose step raises once ``broken`` (what a rank gone, or a bug, looks like
    from the backend's loop)."""

    broken = False

    def step(
        self, early: Callable[[list[RequestOutput]], None] | None = None
    ) -> list[RequestOutput]:
        if self.broken:
            raise RuntimeError("rank 1 is gone: simulated")
        return super().step(early)


async def test_a_failed_step_names_its_cause_in_flight_and_after() -> None:
    """The request in flight when a step fails gets a 500 naming the cause; one that arrives
    while the process is on its way out gets a 503 naming it too, not "still loading"."""
    sched = _BreakingScheduler(ARGS)
    b = ColocatedBackend(ARGS, scheduler=sched, warmup="minimal")

    async def serve(*, task_status: trio.TaskStatus[None]) -> None:
        with pytest.raises(RuntimeError, match="rank 1 is gone"):
            await b.serve(task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(serve)
        sched.broken = True
        with pytest.raises(BackendError) as in_flight:
            async with aclosing(b.generate(_job("a", (1, 2, 3)))) as outs:
                async for _ in outs:
                    pass
        with pytest.raises(BackendError) as after:
            async with aclosing(b.generate(_job("b", (4, 5)))) as outs:
                async for _ in outs:
                    pass
    assert in_flight.value.status == 500 and "rank 1 is gone" in in_flight.value.reason
    assert after.value.status == 503 and "the worker is exiting" in after.value.reason
    assert "rank 1 is gone" in after.value.reason
    assert not b.ready() and not b.streams.live and b.outcomes["error"] == 1


class _CountingBackend(ColocatedBackend):
    """Counts the step thread's calls and the steps they ran."""

    calls = 0

    def _steps(self, scheduler: Scheduler, commands: tuple[Command, ...], woken: trio.Event
               ) -> tuple[list[RequestOutput], float]:
        self.calls += 1
        return super()._steps(scheduler, commands, woken)


async def test_the_step_thread_steps_on_while_nothing_waits_for_the_loop(
        nursery: trio.Nursery) -> None:
    """One request alone: its steps run in fewer thread calls than steps (each step's outputs
    handed to the loop from the thread), and its tokens are the scheduler's own."""
    b = _CountingBackend(ARGS, stream_capacity=CAPACITY, warmup="minimal")
    await nursery.start(b.serve)
    steps_before = b.health.steps_total
    tokens: list[int] = []
    async with aclosing(b.generate(_job("alone", (3, 4, 5), n=40))) as outs:
        async for out in outs:
            tokens.extend(out.new_token_ids)
    assert tokens == _reference((3, 4, 5), n=40)
    assert b.calls < b.health.steps_total - steps_before


async def test_a_request_arriving_mid_burst_is_taken_at_the_next_step(
        backend: ColocatedBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long request keeps the thread stepping; a short one arriving meanwhile wakes the loop,
    which takes it after the step in flight: it ends while the long one still runs (the burst's
    time bound out of the way: only the wake can end it)."""
    monkeypatch.setattr(colocated, "STEP_BURST_S", 600.0)
    long_gen = backend.generate(_job("long", (1, 2, 3), n=300))
    async with aclosing(long_gen):
        await long_gen.__anext__()
        short: list[int] = []
        async with aclosing(backend.generate(_job("short", (7, 8), n=4))) as outs:
            async for out in outs:
                short.extend(out.new_token_ids)
        assert short == _reference((7, 8), n=4)
        assert "long" in backend.streams.live and not backend.streams.live["long"].done


async def test_a_delivery_that_fails_on_the_loop_fails_the_step() -> None:
    """An error in handing a step's outputs to the loop (run there, not in the thread) ends
    the backend as a failed step does: the request in flight gets a 500 naming it."""
    b = ColocatedBackend(ARGS, warmup="minimal")
    fan_out = b.streams.fan_out
    calls = 0

    def failing(outputs: list[RequestOutput]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("a stream table bug: simulated")
        fan_out(outputs)

    async def serve(*, task_status: trio.TaskStatus[None]) -> None:
        with pytest.raises(RuntimeError, match="stream table bug"):
            await b.serve(task_status=task_status)

    async with trio.open_nursery() as nursery:
        await nursery.start(serve)
        b.streams.fan_out = failing  # type: ignore[method-assign]
        with pytest.raises(BackendError) as in_flight:
            async with aclosing(b.generate(_job("a", (1, 2, 3), n=40))) as outs:
                async for _ in outs:
                    pass
    assert in_flight.value.status == 500 and "stream table bug" in in_flight.value.reason
