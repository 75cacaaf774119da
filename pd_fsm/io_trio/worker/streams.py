"""The live requests of a backend, as its loop sees them: ``StreamTable``.

Every backend (colocated, prefill, decode) takes jobs from the HTTP layer the same way: a bounded
memory channel of new streams, a set of aborts, and per-request channels its loop fans outputs out
to. A per-request channel is bounded; when a slow consumer lets it fill up, the outputs wait in
that request's own overflow deque (refilled by the consumer as it reads), so one slow client never
blocks the loop and no token is ever dropped. The table is touched only from the trio loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Protocol, runtime_checkable

import attrs
import trio

from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob, Moved
from pd_fsm.schedulers.request import FinishReason, RequestOutput

STREAM_CAPACITY = 64  # outputs buffered in a request's channel before its overflow deque

Item = RequestOutput | BackendError


@attrs.define(eq=False)
class JobStream:
    """One live request as the loop sees it."""

    job: GenerateJob
    send: trio.MemorySendChannel[Item]
    overflow: deque[Item] = attrs.field(factory=deque)
    in_scheduler: bool = False
    done: bool = False  # its last item (finish or error) has been handed over
    abort_requested: bool = False  # /abort_request named it (reported once)
    # time.monotonic() when the backend took the job: where a PD leg's first phase starts.
    accepted: float = attrs.field(factory=time.monotonic)
    answered: bool = False  # its first item (output, finish or error) was put
    generated: int = 0  # output tokens put so far (every sequence's)

    def put(self, item: Item) -> None:
        self.answered = True
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


class StreamTable:
    """New jobs, aborts and live streams of one backend, and its per-request outcome counts."""

    def __init__(self, max_queued: int, capacity: int = STREAM_CAPACITY) -> None:
        self._capacity = capacity
        self._jobs_send, self._jobs_recv = trio.open_memory_channel[JobStream](max_queued)
        self.live: dict[str, JobStream] = {}
        self._aborts: set[str] = set()
        # Requests aborted by ``fail_in_flight``: their client gets this error, not the abort.
        self._failing: dict[str, BackendError] = {}
        self.woken = trio.Event()  # set when a job, an abort or anything else wants the loop
        self.outcomes: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0,
                                         "handed_off": 0, "moved": 0}
        self.prompt_tokens_total = 0
        self.prompts_total = 0  # requests admitted to the scheduler: prompt_tokens_total's count
        # Their seconds from arrival to the scheduler (a wait for the step in flight): the part
        # of a TTFT before any work on it.
        self.intake_wait_seconds_total = 0.0
        self.generated_tokens_total = 0

    # -- the HTTP side ---

    def wake(self) -> None:
        self.woken.set()

    def rearm(self) -> trio.Event:
        """A fresh event before the loop's intake: a job or abort arriving after this wakes it."""
        self.woken = trio.Event()
        return self.woken

    async def generate(
        self, job: GenerateJob, refusal: Callable[[], BackendError | None]
    ) -> AsyncGenerator[RequestOutput, None]:
        """``job``'s outputs (the ``ServeBackend.generate`` contract); ``refusal``: why the backend
        takes no request now, asked when the consumer first reads."""
        error = refusal()
        if error is not None:
            raise error
        if job.rid in self.live:
            raise BackendError(400, f"request id {job.rid!r} is already in use")
        send, recv = trio.open_memory_channel[Item](self._capacity)
        stream = JobStream(job, send)
        try:
            self._jobs_send.send_nowait(stream)
        except trio.WouldBlock:
            raise BackendError(503, "too many queued requests; retry later") from None
        self.live[job.rid] = stream
        self.wake()
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
                self.wake()

    def abort(self, rid: str) -> bool:
        stream = self.live.get(rid)
        if stream is None or stream.done or stream.abort_requested:
            return False  # unknown, over, or already being aborted: nothing new to report
        stream.abort_requested = True
        self._aborts.add(rid)
        self.wake()
        return True

    def fail_in_flight(self, reason: str) -> int:
        """Abort every live request, its client answered 503 with ``reason``; how many."""
        live = [rid for rid, stream in self.live.items() if not stream.done]
        for rid in live:
            self._failing[rid] = BackendError(503, reason)
            self._aborts.add(rid)
        self.wake()
        return len(live)

    def move(self, max_context: int, reason: str) -> int:
        """Give up every running stream that allows it (``accept_move``) and whose prompt and
        output so far are at most ``max_context`` tokens: each is aborted here, its client
        answered with a move event (``Moved``) that the proxy continues elsewhere with a
        prefill of that many tokens. Only streams already answered: before its first output
        the HTTP layer has no stream to end with the event yet (moved then, its client would get
        no output at all). How many."""
        chosen = [rid for rid, s in self.live.items()
                  if s.job.accept_move and s.in_scheduler and s.answered and not s.done
                  and rid not in self._failing
                  and len(s.job.input_ids) + s.generated <= max_context]
        for rid in chosen:
            self._failing[rid] = Moved(reason)
            self._aborts.add(rid)
        self.wake()
        return len(chosen)

    def queued(self) -> int:
        return self._jobs_recv.statistics().current_buffer_used

    def oldest_unanswered(self) -> float:
        """Seconds the oldest live request has waited for its first item (0.0: none waits).
        The planner's leading sign of a prefill backlog: a TTFT histogram shows a wait only
        once it ended (measured: a P starved for 30 s showed no TTFT at all meanwhile)."""
        now = time.monotonic()
        return max((now - s.accepted for s in self.live.values() if not s.answered),
                   default=0.0)

    # -- the loop's side ---

    def next_job(self) -> JobStream | None:
        try:
            return self._jobs_recv.receive_nowait()
        except trio.WouldBlock:
            return None

    def take_jobs(self) -> list[JobStream]:
        jobs: list[JobStream] = []
        while (stream := self.next_job()) is not None:
            jobs.append(stream)
        return jobs

    def admitted(self, stream: JobStream) -> None:
        """``stream``'s request is in the scheduler now: counted, with its wait since arrival."""
        stream.in_scheduler = True
        self.prompt_tokens_total += len(stream.job.input_ids)
        self.prompts_total += 1
        self.intake_wait_seconds_total += time.monotonic() - stream.accepted

    def pop_abort(self, rid: str) -> bool:
        """Whether ``rid`` was aborted (forgetting it): a job aborted before it was taken."""
        if rid not in self._aborts:
            return False
        self._aborts.discard(rid)
        return True

    def take_aborts(self) -> list[str]:
        aborts = list(self._aborts)
        self._aborts.clear()
        return aborts

    def in_scheduler(self, rid: str) -> bool:
        stream = self.live.get(rid)
        return stream is not None and stream.in_scheduler

    def fan_out(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self.live.get(out.rid)
            self.generated_tokens_total += len(out.new_token_ids)
            if stream is None:
                continue  # the warm-up request, or one already failed
            stream.generated += len(out.new_token_ids)
            failing = self._failing.get(out.rid) if out.finished else None
            if failing is not None:  # the abort fail_in_flight asked for: its reason instead
                self.fail(stream, failing)
                continue
            stream.put(out)
            if out.finished:  # with n > 1: its last sequence
                assert out.finish_reason is not None
                self.finish(stream, out.finish_reason.kind)

    def abort_unstarted(self, stream: JobStream) -> None:
        """A job aborted before the scheduler saw it still gets its final (abort) output, so a
        client that is still waiting is answered like any other aborted request."""
        job = stream.job
        if job.rid in self._failing:
            self.fail(stream, self._failing[job.rid])
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
        self.finish(stream, "abort")

    def fail_all(self, error: BackendError) -> None:
        for stream in list(self.live.values()):
            self.fail(stream, error)

    def fail(self, stream: JobStream, error: BackendError) -> None:
        error = self._failing.pop(stream.job.rid, error)
        stream.put(error)
        self.finish(stream, "moved" if isinstance(error, Moved) else "error")

    def finish(self, stream: JobStream, outcome: str) -> None:
        # Exactly once per request: the stream leaves the table here and nowhere else.
        if stream.done:
            return
        stream.done = True
        self.outcomes[outcome] += 1
        # The send side stays open: the last item may still sit in the overflow deque, and the
        # consumer stops by itself at the final output or error.
        self.live.pop(stream.job.rid, None)


@runtime_checkable
class HoldsStreams(Protocol):
    """A backend whose live requests are a ``StreamTable`` (every real one: colocated, P, D)."""

    mode: str
    streams: StreamTable

