"""The colocated backend: one Scheduler, driven from one trio task.

The loop takes new jobs and aborts from its ``StreamTable`` (streams.py), runs
``scheduler.step`` in a worker thread while there is work, and fans each step's outputs out to
the requests' streams. The scheduler is touched only from this loop (it is not thread-safe) or,
during a step, from the one worker thread. ``Health`` (health.py) and ``common_stats`` are
what the PD backends (pd_backends.py) share with it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from pd_fsm.io_trio.worker.backend import (
    BackendError,
    GenerateJob,
    PhaseObserver,
    Stats,
    request_of,
)
from pd_fsm.io_trio.worker.health import Health
from pd_fsm.io_trio.worker.spmd.frames import Command, RequestAborted, RequestAdded
from pd_fsm.io_trio.worker.startup import Startup
from pd_fsm.io_trio.worker.streams import STREAM_CAPACITY, StreamTable
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.disaggregation.factory import make_scheduler
from pd_fsm.schedulers.request import RequestOutput
from pd_fsm.schedulers.scheduler import Scheduler

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader

log = logging.getLogger("pd_fsm.io_trio.worker.colocated")

# A multi-process instance's rank 0 pings the others this often while idle (they give up on a
# rank 0 silent for much longer: spmd/follower.py).
SPMD_PING_S = 5.0
SPMD_JOIN_TIMEOUT_S = 120.0
# The longest the step thread steps before it hands back to the loop with nothing waiting (its
# housekeeping: drain, role switch; a shutdown waits for it).
STEP_BURST_S = 0.25
# The longest the step thread waits for the loop to take a prompt's first token (_first_tokens):
# an idle loop takes it in a fraction of that; a busy one (a full worker) is not waited for
# longer. Where steps overlap the device is running the decode step just launched meanwhile (on
# the chip ~2.7 ms at the smallest model), so the wait costs it nothing.
FIRST_TOKEN_WAIT_S = 0.002
ABORTED_BY_REQUEST = "aborted by request"


def common_stats(streams: StreamTable, health: Health, startup: Startup, page_size: int,
                 spmd: SpmdLeader | None, scheduler: Scheduler | None) -> Stats:
    """What every backend's ``stats()`` holds: outcomes, tokens, steps, start-up, pages."""
    out: Stats = {
        "requests_total": dict(streams.outcomes),
        "prompt_tokens_total": streams.prompt_tokens_total,
        "prompts_total": streams.prompts_total,
        "intake_wait_seconds_total": streams.intake_wait_seconds_total,
        "generated_tokens_total": streams.generated_tokens_total,
        "steps_total": health.steps_total,
        "step_seconds_total": health.step_seconds_total,
        "queued": streams.queued(),
        "oldest_unanswered_seconds": streams.oldest_unanswered(),
        "live_requests": len(streams.live),
        # A multi-process instance (spmd/): ranks, joined, frames sent and dropped.
        **({} if spmd is None else {"spmd": attrs.asdict(spmd.stats)}),
        "page_size": page_size,
        **startup.stats(),
    }
    if scheduler is not None:
        s = scheduler.stats()
        out.update(
            free_pages=s.free_pages,
            cached_pages=s.cached_pages,
            total_pages=s.total_pages,
            waiting=s.waiting,
            prefilling=s.prefilling,
            running=s.running,
            forward_shapes=s.forward_shapes,
            # Prompt tokens a prefix cache served (whole pages) and pages it gave back.
            prefix_cache_hit_tokens_total=s.cache_hit_tokens,
            prefix_cache_evicted_pages_total=s.cache_evicted_pages,
        )
    return out


class ColocatedBackend:
    mode = "null"

    def __init__(
        self,
        args: SchedulerArgs,
        *,
        max_queued: int = 1024,
        scheduler: Scheduler | None = None,
        warmup: str = "full",
        stream_capacity: int = STREAM_CAPACITY,
        spmd: SpmdLeader | None = None,
    ) -> None:
        self.args = args
        # Rank 0 of a multi-process instance: every scheduler input goes to the other ranks too
        # (spmd/), batched until the next step.
        self._spmd = spmd
        self._spmd_pending: list[Command] = []
        self.scheduler: Scheduler | None = scheduler
        self.startup = Startup(warmup)
        self.streams = StreamTable(max_queued, stream_capacity)
        self.outcomes = self.streams.outcomes  # requests by outcome (the table's counts)
        self.health = Health()
        # One step at a time; the limiter keeps JAX work off trio's default thread pool.
        self._limiter = trio.CapacityLimiter(1)
        # What the step thread hands to the loop without waiting goes through these.
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_error: Exception | None = None
        # What RoleBackend asks of every backend: a colocated worker has no PD phases to
        # observe, and its registry epoch is nobody's business (it registers nowhere).
        self.role_epoch = 0
        self.phase_observer: PhaseObserver | None = None

    # ----------------------------------------------------------------- ServeBackend protocol

    def ready(self) -> bool:
        return self.health.ready

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.scheduler is None:
            self.scheduler = await trio.to_thread.run_sync(
                self.build_scheduler, limiter=self._limiter, abandon_on_cancel=True
            )
        else:
            await trio.to_thread.run_sync(self.startup.warm, self.scheduler,
                                          limiter=self._limiter)
        if self._spmd is not None:
            # The other ranks built and warmed the same scheduler in step with this one (the
            # warm-up's sharded computations ran on all of them); they connect once done.
            await trio.to_thread.run_sync(
                self._spmd.wait_for_ranks, SPMD_JOIN_TIMEOUT_S, limiter=self._limiter
            )
        self._token = trio.lowlevel.current_trio_token()
        self.health.ready = True
        task_status.started()
        log.info("colocated backend ready (%d pages of %d tokens)",
                 self.scheduler.page_budget.allocator.total, self.args.page_size)
        try:
            await self._loop(self.scheduler)
        finally:
            self.health.stopped(self.streams)
            if self._spmd is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._spmd.stop, limiter=self._limiter)

    def generate(self, job: GenerateJob) -> AsyncGenerator[RequestOutput, None]:
        return self.streams.generate(job, self.health.refusal)

    async def withdraw(self) -> None:
        """In no registry: nothing to leave."""

    def abort(self, rid: str) -> bool:
        return self.streams.abort(rid)

    def fail_in_flight(self, reason: str) -> int:
        """A role switch's drain deadline passed: abort every live request in the
        scheduler, as ``/abort_request`` does (its pages freed), and answer its client 503 with
        ``reason``. Returns how many."""
        return self.streams.fail_in_flight(reason)

    def precompile(self) -> None:
        """Build and warm a scheduler and drop it (worker/roles.py: a role compiled at start
        for a later switch); it holds nothing but memory."""
        self.build_scheduler()

    def side_port(self) -> int | None:
        return None  # no side channel: only P binds one

    def release_handoff(self, uuid: int) -> bool:
        return False  # a colocated worker hands no stream off (only a decode worker does)

    def stats(self) -> Stats:
        return common_stats(self.streams, self.health, self.startup, self.args.page_size,
                            self._spmd, self.scheduler)

    # ----------------------------------------------------------------- the loop

    def build_scheduler(self) -> Scheduler:
        """The scheduler this backend serves with, loaded and warmed as ``serve`` does (a
        multi-process instance's other ranks build their replicas with it)."""
        return self.startup.build(lambda: make_scheduler(self.args))

    async def _loop(self, scheduler: Scheduler) -> None:
        while True:
            # A fresh event before intake: a job or abort arriving after this point wakes us.
            woken = self.streams.rearm()
            self._intake(scheduler)
            if scheduler.has_work():
                commands, self._spmd_pending = tuple(self._spmd_pending), []
                try:
                    outputs, seconds = await trio.to_thread.run_sync(
                        self._steps, scheduler, commands, woken, limiter=self._limiter
                    )
                    self._raise_loop_error()  # the hand-offs ran before the thread's result
                except Exception as exc:
                    self.health.step_failed(exc, self.streams)
                    raise
                self._deliver(outputs, seconds)
            elif self._spmd is None:
                await woken.wait()
            else:
                with trio.move_on_after(SPMD_PING_S) as idle:
                    await woken.wait()
                if idle.cancelled_caught:
                    await trio.to_thread.run_sync(self._spmd.ping, limiter=self._limiter)

    def _steps(self, scheduler: Scheduler, commands: tuple[Command, ...], woken: trio.Event
               ) -> tuple[list[RequestOutput], float]:
        """In the step thread: steps while nothing waits for the loop (no job, abort or wake
        since ``woken`` was armed, work left, under ``STEP_BURST_S``), each step's outputs but
        the last handed to the trio thread without waiting for it. Returning to the loop after
        every step made the device's next step wait for this task's turn among the streams'
        writers (64 live streams: the server cost 6.7 % of the engine's throughput on the chip).
        A multi-process instance steps once a call: its commands go out per step. Returns the
        last step's outputs and seconds."""
        burst_ends = time.monotonic() + STEP_BURST_S
        while True:
            started = time.monotonic()
            if self._spmd is not None:
                self._spmd.step_started(commands)
            outputs = scheduler.step(self._first_tokens)
            seconds = time.monotonic() - started
            if (self._spmd is not None or woken.is_set() or not scheduler.has_work()
                    or started + seconds >= burst_ends):
                return outputs, seconds
            if not self._to_loop(self._deliver, outputs, seconds):
                return [], 0.0  # the worker is shutting down

    def _deliver(self, outputs: list[RequestOutput], seconds: float) -> None:
        self.health.stepped(seconds)
        self.streams.fan_out(outputs)

    def _first_tokens(self, outputs: list[RequestOutput]) -> None:
        """From the step's thread, once its decode forward is launched (before it where steps
        do not overlap): a prompt's first token goes to its client now rather than one
        inter-token interval later (``Scheduler.step``'s ``early``). The thread waits (up to
        ``FIRST_TOKEN_WAIT_S``, the GIL released) for the loop to take them: going straight on
        it would hold the GIL the loop needs to send them, for up to Python's switch interval
        (5 ms) at a time. Measured on the chip before the launch came first (run 8): 2.0 ms
        from the token on the host to its handler, the device idle for the wait."""
        taken = threading.Event()

        def hand(outs: list[RequestOutput]) -> None:
            self.streams.fan_out(outs)
            taken.set()

        if self._to_loop(hand, outputs):
            taken.wait(FIRST_TOKEN_WAIT_S)

    def _to_loop(self, fn: Callable[..., None], *args: object) -> bool:
        """Run ``fn(*args)`` on the trio thread soon, without waiting; calls run in the order
        given, and before the step thread's result reaches the loop (trio reports it the same
        way). An error there is raised in the step thread at its next call (one raised in a
        ``run_sync_soon`` callback would end trio's run). False: trio has stopped."""
        self._raise_loop_error()

        def call() -> None:
            try:
                fn(*args)
            except Exception as exc:
                self._loop_error = exc

        assert self._token is not None, "the loop runs only after serve() took trio's token"
        try:
            self._token.run_sync_soon(call)
        except trio.RunFinishedError:
            return False
        return True

    def _raise_loop_error(self) -> None:
        if self._loop_error is not None:
            error, self._loop_error = self._loop_error, None
            raise error

    def _intake(self, scheduler: Scheduler) -> None:
        streams = self.streams
        while (stream := streams.next_job()) is not None:
            job = stream.job
            if streams.pop_abort(job.rid):  # aborted (or the client left) before it was taken
                streams.abort_unstarted(stream)
                continue
            req = request_of(scheduler, job)
            try:
                scheduler.add_request(req)
            except ValueError as exc:
                streams.fail(stream, BackendError(400, str(exc)))
                continue
            streams.admitted(stream)
            if self._spmd is not None:
                self._spmd_pending.append(
                    RequestAdded(job.rid, tuple(job.input_ids), job.sampling, req.logprobs)
                )
        aborted = False
        for rid in streams.take_aborts():
            if streams.in_scheduler(rid):
                # Frees the request's pages now; its final (abort) output is drained below.
                aborted |= scheduler.abort(rid, ABORTED_BY_REQUEST)
                if self._spmd is not None:
                    self._spmd_pending.append(RequestAborted(rid, ABORTED_BY_REQUEST))
        if aborted:
            streams.fan_out(scheduler.drain_outputs())
