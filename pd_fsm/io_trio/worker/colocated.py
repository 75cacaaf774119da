"""The colocated backend: one Scheduler, driven from one trio task.

The loop takes new jobs from a bounded memory channel and aborts from a set, runs
``scheduler.step`` in a worker thread while there is work, and fans each step's outputs out to
per-request channels. A per-request channel is bounded; when a slow consumer lets it fill up, the
outputs wait in that request's own overflow deque (refilled by the consumer as it reads), so one
slow client never blocks the loop and no token is ever dropped. The scheduler is touched only
from this loop (it is not thread-safe) or, during a step, from the one worker thread.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio

from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob, request_of
from pd_fsm.io_trio.worker.flags import WARMUP_MODES
from pd_fsm.io_trio.worker.spmd.frames import Command, RequestAborted, RequestAdded
from pd_fsm.jax_engine.compilation import cache as compilation_cache
from pd_fsm.jax_engine.kv.tiered import total_compiles
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.factory import make_scheduler
from pd_fsm.schedulers.request import FinishReason, RequestOutput
from pd_fsm.schedulers.scheduler import Scheduler

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader

log = logging.getLogger("pd_fsm.io_trio.worker.colocated")

STREAM_CAPACITY = 64  # outputs buffered in a request's channel before its overflow deque
# A multi-process instance's rank 0 pings the others this often while idle (they give up on a
# rank 0 silent for much longer: spmd/follower.py).
SPMD_PING_S = 5.0
SPMD_JOIN_TIMEOUT_S = 120.0
ABORTED_BY_REQUEST = "aborted by request"
WARMUP_PROMPT = (1, 2, 3, 4)

Item = RequestOutput | BackendError
R = TypeVar("R")


@attrs.define(eq=False)
class _Stream:
    """One live request as the loop sees it."""

    job: GenerateJob
    send: trio.MemorySendChannel[Item]
    overflow: deque[Item] = attrs.field(factory=deque)
    in_scheduler: bool = False
    done: bool = False  # its last item (finish or error) has been handed over
    abort_requested: bool = False  # /abort_request named it (reported once)
    # time.monotonic() when the backend took the job: where a PD leg's first phase starts.
    accepted: float = attrs.field(factory=time.monotonic)

    def put(self, item: Item) -> None:
        # Order: everything in the channel precedes everything in the overflow.
        if not self.overflow:
            try:
                self.send.send_nowait(item)
                return
            except trio.WouldBlock:
                pass
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return  # the consumer is gone; its abort is already queued
        self.overflow.append(item)

    def refill(self) -> None:
        while self.overflow:
            try:
                self.send.send_nowait(self.overflow[0])
            except trio.WouldBlock:
                return
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self.overflow.clear()
                return
            self.overflow.popleft()


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
        if warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {warmup!r}")
        # "full": compile every shape before ready; "minimal": one short request only.
        self._warmup = warmup
        # Seconds each start-up phase took (model_load, forward_compile, kv_copy_compile,
        # first_request), and the compile count when ready: compiles after it are a request's.
        self.ready_seconds: dict[str, float] = {}
        self._compiles_at_ready: int | None = None
        self._cache_at_ready: dict[str, int] = {}
        self._stream_capacity = stream_capacity
        self._ready = False
        # Why a scheduler step failed, once one did: the process is on its way out, and a
        # request arriving meanwhile is told that reason, not "loading" or "shutting down".
        self._failure: str | None = None
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[_Stream](max_queued)
        self._streams: dict[str, _Stream] = {}
        self._aborts: set[str] = set()
        # Requests aborted by ``fail_in_flight``: their client gets this error, not the abort.
        self._failing: dict[str, BackendError] = {}
        self._wake = trio.Event()
        # One step at a time; the limiter keeps JAX work off trio's default thread pool.
        self._limiter = trio.CapacityLimiter(1)
        self.outcomes: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0,
                                         "handed_off": 0}
        self.prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self.steps_total = 0
        self.step_seconds_total = 0.0

    # ----------------------------------------------------------------- Backend protocol

    def ready(self) -> bool:
        return self._ready

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self.scheduler is None:
            self.scheduler = await trio.to_thread.run_sync(
                self._build, limiter=self._limiter, abandon_on_cancel=True
            )
        else:
            await trio.to_thread.run_sync(self._warm, self.scheduler, limiter=self._limiter)
        if self._spmd is not None:
            # The other ranks built and warmed the same scheduler in step with this one (the
            # warm-up's sharded computations ran on all of them); they connect once done.
            await trio.to_thread.run_sync(
                self._spmd.wait_for_ranks, SPMD_JOIN_TIMEOUT_S, limiter=self._limiter
            )
        self._ready = True
        task_status.started()
        log.info("colocated backend ready (%d pages of %d tokens)",
                 self.scheduler.page_budget.allocator.total, self.args.page_size)
        try:
            await self._loop(self.scheduler)
        finally:
            self._stopped()
            if self._spmd is not None:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self._spmd.stop, limiter=self._limiter)

    async def generate(self, job: GenerateJob) -> AsyncGenerator[RequestOutput, None]:
        if self._failure is not None:
            raise BackendError(503, f"the worker is exiting: {self._failure}")
        if not self._ready:
            raise BackendError(503, "the model is still loading")
        if job.rid in self._streams:
            raise BackendError(400, f"request id {job.rid!r} is already in use")
        send, recv = trio.open_memory_channel[Item](self._stream_capacity)
        stream = _Stream(job, send)
        try:
            self._jobs_send.send_nowait(stream)
        except trio.WouldBlock:
            raise BackendError(503, "too many queued requests; retry later") from None
        self._streams[job.rid] = stream
        self._wake.set()
        finished = False
        try:
            with recv:
                while True:
                    item = await recv.receive()
                    stream.refill()
                    if isinstance(item, BackendError):
                        finished = True
                        raise item
                    finished = item.finished
                    yield item
                    if finished:
                        return
        finally:
            if not finished:
                # The consumer left early (client gone, cancelled): abort from the loop. No
                # await here: this runs inside a cancelled scope too.
                self._aborts.add(job.rid)
                self._wake.set()

    async def withdraw(self) -> None:
        """In no registry: nothing to leave."""

    def abort(self, rid: str) -> bool:
        stream = self._streams.get(rid)
        if stream is None or stream.done or stream.abort_requested:
            return False  # unknown, over, or already being aborted: nothing new to report
        stream.abort_requested = True
        self._aborts.add(rid)
        self._wake.set()
        return True

    def fail_in_flight(self, reason: str) -> int:
        """A role switch's drain deadline passed (issue 30 §1): abort every live request in the
        scheduler, as ``/abort_request`` does (its pages freed; under PD its peer told), and
        answer its client 503 with ``reason``. Returns how many."""
        live = [rid for rid, stream in self._streams.items() if not stream.done]
        for rid in live:
            self._failing[rid] = BackendError(503, reason)
            self._aborts.add(rid)
        self._wake.set()
        return len(live)

    def close_scheduler(self, scheduler: Scheduler) -> None:
        """Free what a scheduler from ``build_scheduler`` holds besides memory, once it is not
        served (a role compiled at start and dropped: worker/roles.py). Nothing, colocated."""

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "requests_total": dict(self.outcomes),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generated_tokens_total": self.generated_tokens_total,
            "steps_total": self.steps_total,
            "step_seconds_total": self.step_seconds_total,
            "queued": self._jobs_recv.statistics().current_buffer_used,
            "live_requests": len(self._streams),
            # A multi-process instance (spmd/): ranks, joined, frames sent and dropped.
            **({} if self._spmd is None else {"spmd": attrs.asdict(self._spmd.stats)}),
            "page_size": self.args.page_size,
            "ready_seconds": dict(self.ready_seconds),
            **self._compile_stats(),
        }
        if self.scheduler is not None:
            s = self.scheduler.stats()
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

    # ----------------------------------------------------------------- the loop

    def build_scheduler(self) -> Scheduler:
        """The scheduler this backend serves with, loaded and warmed as ``serve`` does (a
        multi-process instance's other ranks build their replicas with it)."""
        return self._build()

    def _build(self) -> Scheduler:
        scheduler = self._timed("model_load", lambda: make_scheduler(self.args))
        self._warm(scheduler)
        return scheduler

    def _timed(self, phase: str, fn: Callable[[], R]) -> R:
        start = time.perf_counter()
        out = fn()
        self.ready_seconds[phase] = time.perf_counter() - start
        return out

    def _warm(self, scheduler: Scheduler) -> None:
        """Before ready (in the scheduler's thread): with ``full``, compile every shape the
        scheduler can run (``Scheduler.warm_up``) and whatever the role adds (``_warm_role``);
        then one short request through the whole path, which also proves it works."""
        if self._warmup == "full":
            report = self._timed("forward_compile", scheduler.warm_up)
            log.info("compiled %d executables for %d forward shapes in %.1f s",
                     report.executables, len(report.shapes), report.seconds)
            self._warm_role(scheduler)
        req = scheduler.make_request(
            "__warmup__", WARMUP_PROMPT, SamplingParams(max_new_tokens=2, temperature=0.0)
        )
        scheduler.add_request(req)
        self._timed("first_request", scheduler.run_until_idle)
        self._compiles_at_ready = sum(total_compiles())
        self._cache_at_ready = compilation_cache.counts()
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.ready_seconds.items())
        log.info("ready after %s", phases)

    def _warm_role(self, scheduler: Scheduler) -> None:
        """What a role compiles besides the forward (the PD roles: their KV copies)."""

    def _compile_stats(self) -> dict[str, int]:
        compiled, loaded = total_compiles()
        at_ready = self._compiles_at_ready
        # Before ready every compile or load is the warm-up's; after, each made a request wait.
        cache = compilation_cache.counts()
        return {
            "compiles_total": compiled,
            "compiles_after_ready_total": (
                0 if at_ready is None else compiled + loaded - at_ready
            ),
            # The compilation cache (``executable_store``): executables loaded, not found,
            # written, and files that failed to load (removed and compiled afresh).
            "compilation_cache_writes_total": cache["writes"],
            "compilation_cache_corrupt_total": cache["corrupt"],
            "compilation_cache_write_errors_total": cache["write_errors"],
            # Executables loaded from the cache / compiled for want of an entry, and of those
            # the start-up's own.
            "compilation_cache_hits_total": cache["hits"],
            "compilation_cache_misses_total": cache["misses"],
            "compilation_cache_hits_before_ready": self._cache_at_ready.get("hits", 0),
            "compilation_cache_misses_before_ready": self._cache_at_ready.get("misses", 0),
        }

    async def _loop(self, scheduler: Scheduler) -> None:
        while True:
            # A fresh event before intake: a job or abort arriving after this point wakes us.
            self._wake = trio.Event()
            self._intake(scheduler)
            if scheduler.has_work():
                start = trio.current_time()
                commands, self._spmd_pending = tuple(self._spmd_pending), []
                try:
                    outputs = await trio.to_thread.run_sync(
                        self._step, scheduler, commands, limiter=self._limiter
                    )
                except Exception as exc:
                    self._step_failed(exc)
                    raise
                self.steps_total += 1
                self.step_seconds_total += trio.current_time() - start
                self._fan_out(outputs)
            elif self._spmd is None:
                await self._wake.wait()
            else:
                with trio.move_on_after(SPMD_PING_S) as idle:
                    await self._wake.wait()
                if idle.cancelled_caught:
                    await trio.to_thread.run_sync(self._spmd.ping, limiter=self._limiter)

    def _step(self, scheduler: Scheduler, commands: tuple[Command, ...]) -> list[RequestOutput]:
        if self._spmd is not None:
            self._spmd.step_started(commands)
        return scheduler.step()

    def _intake(self, scheduler: Scheduler) -> None:
        while True:
            try:
                stream = self._jobs_recv.receive_nowait()
            except trio.WouldBlock:
                break
            rid = stream.job.rid
            if rid in self._aborts:  # aborted (or the client left) before its job was taken
                self._aborts.discard(rid)
                self._abort_unstarted(stream)
                continue
            job = stream.job
            req = request_of(scheduler, job)
            try:
                scheduler.add_request(req)
            except ValueError as exc:
                self._fail(stream, BackendError(400, str(exc)))
                continue
            stream.in_scheduler = True
            self.prompt_tokens_total += len(job.input_ids)
            if self._spmd is not None:
                self._spmd_pending.append(
                    RequestAdded(job.rid, tuple(job.input_ids), job.sampling, req.logprobs)
                )
        aborted = False
        for rid in list(self._aborts):
            self._aborts.discard(rid)
            stream_or_none = self._streams.get(rid)
            if stream_or_none is not None and stream_or_none.in_scheduler:
                # Frees the request's pages now; its final (abort) output is drained below.
                aborted |= scheduler.abort(rid, ABORTED_BY_REQUEST)
                if self._spmd is not None:
                    self._spmd_pending.append(RequestAborted(rid, ABORTED_BY_REQUEST))
        if aborted:
            self._fan_out(scheduler.drain_outputs())

    def _fan_out(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.rid)
            self.generated_tokens_total += len(out.new_token_ids)
            if stream is None:
                continue  # the warm-up request, or one already failed
            failing = self._failing.get(out.rid) if out.finished else None
            if failing is not None:  # the abort fail_in_flight asked for: its reason instead
                self._fail(stream, failing)
                continue
            stream.put(out)
            if out.finished:  # with n > 1: its last sequence
                assert out.finish_reason is not None
                self._finish(stream, out.finish_reason.kind)

    def _abort_unstarted(self, stream: _Stream) -> None:
        """A job aborted before the scheduler saw it still gets its final (abort) output, so a
        client that is still waiting is answered like any other aborted request."""
        job = stream.job
        if job.rid in self._failing:
            self._fail(stream, self._failing[job.rid])
            return
        stream.put(
            RequestOutput(
                rid=job.rid,
                new_token_ids=(),
                new_logprobs=(),
                text_delta="",
                finish_reason=FinishReason("abort", message="aborted before it started"),
                prompt_tokens=len(job.input_ids),
                completion_tokens=0,
            )
        )
        self._finish(stream, "abort")

    def _step_failed(self, exc: Exception) -> None:
        """The scheduler's state is unknown now: stop taking requests, fail everyone in flight
        with the reason (a 500), and let the process die (serve_worker first lets the HTTP
        server send those answers)."""
        self._ready = False
        self._failure = f"scheduler step failed: {exc!r}"
        for stream in list(self._streams.values()):
            self._fail(stream, BackendError(500, self._failure))

    def _stopped(self) -> None:
        """The loop ended (a failure, or the worker stopping): no more requests, and the ones
        still held (those that arrived after a failure, too) get a 503 naming why."""
        self._ready = False
        reason = ("worker shutting down" if self._failure is None
                  else f"the worker is exiting: {self._failure}")
        for stream in list(self._streams.values()):
            self._fail(stream, BackendError(503, reason))

    def _fail(self, stream: _Stream, error: BackendError) -> None:
        stream.put(self._failing.pop(stream.job.rid, error))
        self._finish(stream, "error")

    def _finish(self, stream: _Stream, outcome: str) -> None:
        # Exactly once per request: the stream leaves the table here and nowhere else.
        if stream.done:
            return
        stream.done = True
        self.outcomes[outcome] += 1
        # The send side stays open: the last item may still sit in the overflow deque, and the
        # consumer stops by itself at the final output or error.
        self._streams.pop(stream.job.rid, None)
