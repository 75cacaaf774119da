"""The worker's generation endpoints (``/generate``, ``/v1/completions``,
``/v1/chat/completions``): bodies become ``GenerateJob``s (``JobMaker``), the backend's outputs
sglang / OpenAI bodies or SSE streams (``GenerationRoutes``). Every generation wait races the
client's disconnect, so a client that goes away aborts its request (and frees its pages) at once.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing

import attrs
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_fsm.io_trio.worker import schemas
from pd_fsm.io_trio.worker.app_state import ModelMeta, WorkerState
from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob, HandedOff, Moved
from pd_fsm.io_trio.worker.metrics import WorkerMetrics
from pd_fsm.io_trio.worker.responses import Accumulator, batch_body, indexed
from pd_fsm.io_trio.worker.schemas import ApiError, JsonBody, JsonObject, Limits, ParsedRequest
from pd_fsm.io_trio.worker.sse import (
    DONE,
    SSEResponse,
    event,
    handoff_event,
    moved_event,
    until_disconnect,
)
from pd_fsm.jax_engine.sampling.grammar import Constraint, GrammarError, compiler_for
from pd_fsm.schedulers.request import RequestOutput
from pd_fsm.text.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "default"
# Above this size, tokenization moves off the event loop (JSON: http_edge.THREAD_JSON_BYTES).
THREAD_TOKENIZE_CHARS = 8 * 1024

_PARSERS: dict[str, Callable[[JsonBody, Limits], ParsedRequest]] = {
    "generate": schemas.parse_generate,
    "completion": schemas.parse_completion,
    "chat": schemas.parse_chat,
}

Unit = tuple[ParsedRequest, GenerateJob, list[Accumulator]]


class JobMaker:
    """A request body made a ``GenerateJob``: parsed, its model and grammar checked, its prompt
    tokenized (raises ApiError naming what is wrong)."""

    def __init__(self, state: WorkerState) -> None:
        self._state = state

    async def _check_grammar(self, meta: ModelMeta, constraint: Constraint) -> None:
        """A 400 naming the problem for a grammar the engine refuses. In a thread: the first
        one builds the engine's view of the tokenizer (0.5 s for SmolLM2)."""
        def check() -> str | None:
            try:
                compiler_for(meta.model.tokenizer, meta.model.config.vocab_size).check(constraint)
            except GrammarError as exc:
                return str(exc)
            return None

        error = await trio.to_thread.run_sync(check)
        if error is not None:
            raise ApiError(400, f"the structured-output constraint is refused: {error}")

    async def _prompt_ids(self, meta: ModelMeta, parsed: ParsedRequest) -> tuple[int, ...]:
        tok = meta.model.tokenizer
        if parsed.input_ids is not None:
            ids: tuple[int, ...] = parsed.input_ids
        else:
            if parsed.messages is not None:
                try:
                    tools = None if parsed.tools is None else list(parsed.tools.definitions)
                    text = tok.apply_chat_template(parsed.messages, tools=tools)
                except ValueError as exc:
                    raise ApiError(400, str(exc)) from None
            else:
                assert parsed.text is not None
                text = parsed.text
            if len(text) > THREAD_TOKENIZE_CHARS:
                ids = tuple(await trio.to_thread.run_sync(tok.encode, text))
            else:
                ids = tuple(tok.encode(text))
        if not ids:
            raise ApiError(400, "the prompt is empty")
        if len(ids) >= meta.context_length:
            raise ApiError(
                413,
                f"prompt of {len(ids)} tokens does not fit the context length "
                f"{meta.context_length}",
            )
        return ids

    async def job(self, body: JsonBody, kind: str) -> tuple[ParsedRequest, GenerateJob]:
        meta = self._state.require_ready()
        parsed = _PARSERS[kind](body, meta.limits)
        # "default" is what sglang's documentation sends everywhere; any other name must be ours.
        if parsed.model not in (None, DEFAULT_MODEL_NAME, meta.served_name):
            raise ApiError(
                404,
                f"model {parsed.model!r} is not served here (serving {meta.served_name!r}, "
                f"also known as {DEFAULT_MODEL_NAME!r})",
                "model_not_found",
            )
        constraint = parsed.sampling.constraint
        if constraint is not None:
            await self._check_grammar(meta, constraint)
        if parsed.handoff is not None and self._state.backend.mode != "decode":
            raise ApiError(400, "only a decode worker takes a hand-off (handoff)")
        rid = parsed.rid or uuid.uuid4().hex
        if rid in self._state.live:
            raise ApiError(400, f"request id {rid!r} is already in use")
        ids = await self._prompt_ids(meta, parsed)
        job = GenerateJob(
            rid=rid,
            input_ids=ids,
            sampling=parsed.sampling,
            bootstrap=parsed.bootstrap,
            return_logprob=parsed.return_logprob,
            logprobs=parsed.logprobs,
            resume=parsed.resume,
            handoff=parsed.handoff,
            # Only a single stream can end with a ticket the proxy continues elsewhere.
            accept_handoff=parsed.accept_handoff and parsed.stream and parsed.n == 1,
            accept_move=parsed.accept_move and parsed.stream and parsed.n == 1,
        )
        return parsed, job



class GenerationRoutes:
    def __init__(self, state: WorkerState) -> None:
        self._state = state
        self._jobs = JobMaker(state)

    async def outputs(self, job: GenerateJob, epoch: int | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """The backend's outputs, with the request counted as live while they flow. ``epoch``:
        the role epoch the request was checked against when it arrived; a switch that began
        while it was read (a role switch's drain counts only live requests) answers it 503
        rather than serve it in a role it was not addressed to."""
        if self._state.roles.refusing is not None or epoch not in (None, self._state.roles.epoch):
            raise BackendError(503, "the worker switched its role while this request was read: "
                                    "send it again (to another worker)")
        self._state.live.add(job.rid)
        try:
            async with aclosing(self._state.backend.generate(job)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self._state.live.discard(job.rid)

    async def generate(self, request: Request) -> Response | SSEResponse:
        return await self._serve(request, "generate")

    async def completions(self, request: Request) -> Response | SSEResponse:
        return await self._serve(request, "completion")

    async def chat(self, request: Request) -> Response | SSEResponse:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, kind: str) -> Response | SSEResponse:
        endpoint = request.url.path
        start = trio.current_time()
        epoch = self._state.roles.epoch
        try:
            self._state.refuse_if_draining()
            self._state.refuse_stale_role(request)
            self._state.require_ready()
            body = await self._state.read_json(request)
            batch = schemas.split_batch(kind, body)  # type: ignore[arg-type]  # kind: a Kind
            if batch is not None:
                jobs = [await self._jobs.job(item, kind) for item in batch]
            else:
                body = schemas.single_bootstrap(kind, body)  # type: ignore[arg-type]
                parsed, job = await self._jobs.job(body, kind)
        except ApiError as exc:
            raise self._state.bad(endpoint, exc) from None
        if batch is None:
            jobs = [(parsed, job)]
        if len(jobs) > 1 or jobs[0][1].sampling.n > 1:
            if jobs[0][0].stream:
                return self._stream_many(endpoint, jobs, start, epoch)
            return await self._serve_whole(request, endpoint, jobs, start, epoch, many=True)
        if not parsed.stream:
            return await self._serve_whole(request, endpoint, jobs, start, epoch, many=False)
        (acc,) = self._accumulators(parsed, job)
        outputs = self.outputs(job, epoch)
        timing = Timing(self._state.metrics, start)

        # Streaming: wait for the first output before answering, so that a request the backend
        # refuses at once still gets its proper HTTP status instead of a 200 stream.
        async def first() -> RequestOutput | ApiError | None:
            try:
                return await outputs.__anext__()
            except BackendError as exc:
                return ApiError(exc.status, exc.reason)
            except StopAsyncIteration:
                return None

        connected, head = await until_disconnect(request.receive, first)
        if not connected or isinstance(head, ApiError) or head is None:
            with trio.CancelScope(shield=True):
                await outputs.aclose()
            if not connected:
                self._state.metrics.requests.labels(endpoint, "disconnected").inc()
                return Response(status_code=499)
            if isinstance(head, ApiError):
                raise self._state.bad(endpoint, head)
            raise self._state.bad(endpoint, ApiError(500, "the backend produced no output"))

        def gone() -> None:
            self._state.metrics.requests.labels(endpoint, "disconnected").inc()

        return SSEResponse(self._events(endpoint, head, outputs, acc, timing), on_disconnect=gone)

    def _accumulators(self, parsed: ParsedRequest, job: GenerateJob) -> list[Accumulator]:
        """One per sequence the job samples (``n``; ``best_of`` when larger)."""
        self._state.metrics.prompt_tokens.inc(len(job.input_ids))
        return [self._accumulator(parsed, job, i) for i in range(job.sampling.n)]

    def _accumulator(self, parsed: ParsedRequest, job: GenerateJob, index: int = 0
                     ) -> Accumulator:
        assert self._state.meta is not None
        tokenizer = self._state.meta.model.tokenizer
        echo = None
        if parsed.echo:  # the prompt as given, or its ids decoded
            echo = parsed.text if parsed.text is not None else tokenizer.decode(
                list(job.input_ids), skip_special_tokens=False)
        return Accumulator(
            parsed.kind,
            job.rid,
            self._state.meta.served_name,
            return_logprob=parsed.return_logprob,
            logprobs=parsed.logprobs,
            include_usage=parsed.include_usage,
            token_text=functools.partial(_token_text, tokenizer),
            prompt_ids=job.input_ids,
            echo=echo,
            text_in_logprobs=parsed.return_text_in_logprobs,
            tools=parsed.tools,
            index=index,
            resume=parsed.resume.output_ids if parsed.resume else (),
            resume_text=parsed.resume_text,
            token_ids=parsed.return_token_ids,
        )

    async def _serve_whole(
        self,
        request: Request,
        endpoint: str,
        jobs: list[tuple[ParsedRequest, GenerateJob]],
        start: float,
        epoch: int,
        *,
        many: bool,
    ) -> Response:
        """One answer once every job is done (not streamed). Several answers in one — a batch of
        prompts (``schemas.split_batch``: a request per prompt, all in the scheduler at once) or
        n > 1 sequences of a prompt — come in order (sglang's list of results; OpenAI's choices
        with their index); the first failure fails the request and aborts the rest."""
        units = [(parsed, job, self._accumulators(parsed, job)) for parsed, job in jobs]
        failures: list[ApiError] = []

        async def one(job: GenerateJob, accs: list[Accumulator],
                      scope: trio.CancelScope) -> None:
            timing = Timing(self._state.metrics, start)
            try:
                async with aclosing(self.outputs(job, epoch)) as outputs:
                    async for out in outputs:
                        timing.output(out)
                        accs[out.index].add(out)
            except BackendError as exc:
                failures.append(ApiError(exc.status, exc.reason))
                scope.cancel()

        async def collect() -> ApiError | None:
            async with trio.open_nursery() as nursery:
                for _, job, accs in units:
                    nursery.start_soon(one, job, accs, nursery.cancel_scope)
            return failures[0] if failures else None

        connected, failure = await until_disconnect(request.receive, collect)
        if not connected:
            self._state.metrics.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)
        if failure is not None:
            raise self._state.bad(endpoint, failure)
        kind = jobs[0][0].kind
        chosen: list[Accumulator] = []
        for parsed, _, accs in units:
            for acc in accs:
                self._count_done(endpoint, acc)
            chosen += _best(accs, parsed.n)
        bodies = [acc.generate_body() if kind == "generate" else acc.openai_body()
                  for acc in chosen]
        if not many:
            return JSONResponse(bodies[0])
        return JSONResponse(batch_body(kind, bodies, _usage(units)))

    def _stream_many(
        self, endpoint: str, jobs: list[tuple[ParsedRequest, GenerateJob]], start: float,
        epoch: int,
    ) -> SSEResponse:
        """Several answers streamed (a batch of prompts, n > 1): every sequence's chunks as
        they come, each marked with its ``index`` (OpenAI's choices; sglang's top-level
        ``index``); one usage chunk and one ``[DONE]`` at the end. A request that fails ends
        with its own error chunk; the others go on."""
        units = [(parsed, job, self._accumulators(parsed, job)) for parsed, job in jobs]
        include_usage = jobs[0][0].include_usage
        firsts: list[int] = []  # each job's first index in the answer
        for _, _, accs in units:
            firsts.append(sum(len(u[2]) for u in units[: len(firsts)]))
            for acc in accs:
                acc.include_usage = False  # one usage chunk for the whole answer
        send_ch, recv_ch = trio.open_memory_channel[bytes](len(jobs))

        async def item(first: int, job: GenerateJob, accs: list[Accumulator],
                       out: trio.MemorySendChannel[bytes]) -> None:
            timing = Timing(self._state.metrics, start)
            async with out:
                try:
                    async with aclosing(self.outputs(job, epoch)) as outputs:
                        async for output in outputs:
                            timing.output(output)
                            for payload in accs[output.index].chunks(output):
                                await out.send(event(indexed(payload, first + output.index)))
                except BackendError as exc:
                    self._state.metrics.requests.labels(endpoint, "server_error").inc()
                    await out.send(event(indexed(accs[0].error_chunk(exc.status, exc.reason),
                                                 first)))
                    return
                for acc in accs:
                    self._count_done(endpoint, acc)

        def start_items(nursery: trio.Nursery) -> None:
            for first, (_, job, accs) in zip(firsts, units, strict=True):
                nursery.start_soon(item, first, job, accs, send_ch.clone())
            send_ch.close()

        async def events() -> AsyncIterator[bytes]:
            async with recv_ch:
                async for chunk in recv_ch:
                    yield chunk
            if include_usage:
                yield event(units[0][2][0].usage_chunk(_usage(units)))
            yield DONE

        def gone() -> None:
            self._state.metrics.requests.labels(endpoint, "disconnected").inc()

        return SSEResponse(events(), on_disconnect=gone, background=start_items)

    async def _events(
        self,
        endpoint: str,
        head: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
        acc: Accumulator,
        timing: Timing,
    ) -> AsyncIterator[bytes]:
        async with aclosing(outputs):
            timing.output(head)
            for payload in acc.chunks(head):
                yield event(payload)
            try:
                async for out in outputs:
                    timing.output(out)
                    for payload in acc.chunks(out):
                        yield event(payload)
            except (HandedOff, Moved) as ended:
                # For the proxy, which asked for it (accept_handoff, accept_move) and does not
                # relay it: the stream goes on on another worker, from the KV of a hand-off or
                # by a prefill of these tokens. No [DONE]: this answer is not whole.
                if isinstance(ended, HandedOff):
                    outcome, last = "handed_off", handoff_event(ended.ticket)
                else:
                    outcome, last = "moved", moved_event(ended.reason)
                self._state.metrics.requests.labels(endpoint, outcome).inc()
                for payload in acc.unsent_ids_chunks():
                    yield event(payload)
                yield last
                return
            except BackendError as exc:
                # Headers are out: say so in a final chunk (sglang: finish_reason abort).
                self._state.metrics.requests.labels(endpoint, "server_error").inc()
                yield event(acc.error_chunk(exc.status, exc.reason))
                yield DONE
                return
        self._count_done(endpoint, acc)
        yield DONE

    def _count_done(self, endpoint: str, acc: Accumulator) -> None:
        kind = acc.finish.kind if acc.finish is not None else "none"
        self._state.metrics.requests.labels(endpoint, "aborted" if kind == "abort" else "ok").inc()
        self._state.metrics.completion_tokens.inc(acc.completion_tokens)

    # ----------------------------------------------------------------- control endpoints


@attrs.define
class Timing:
    """One sequence's latencies as its outputs leave the scheduler: TTFT, each inter-token
    interval, end to end, and whether it met the SLO (TTFT and mean inter-token latency)."""

    metrics: WorkerMetrics
    start: float  # trio.current_time() at arrival
    first_at: float | None = None
    last_at: float = 0.0
    tokens: int = 0
    # The arrival on time.monotonic(), the scheduler's clock (the parts of a TTFT).
    arrived: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.arrived = time.monotonic() - (trio.current_time() - self.start)

    def output(self, out: RequestOutput) -> None:
        now = trio.current_time()
        n = len(out.new_token_ids)
        if n and self.first_at is None:
            self.first_at = self.last_at = now
            self.metrics.ttft.observe(now - self.start)
            if out.first_token_times is not None:
                began, first = out.first_token_times
                parts = self.metrics.ttft_parts
                parts.labels("queue").observe(max(0.0, began - self.arrived))
                parts.labels("prefill").observe(first - began)
                parts.labels("delivery").observe(max(0.0, time.monotonic() - first))
            n -= 1  # the first token has no interval before it
        for _ in range(n):  # tokens that come out together share their interval
            self.metrics.itl.observe((now - self.last_at) / n)
        if out.new_token_ids:
            self.last_at = now
            self.tokens += len(out.new_token_ids)
        if out.finished:
            self.metrics.e2e.observe(now - self.start)
            self._count_slo(now)

    def _count_slo(self, now: float) -> None:
        m = self.metrics
        if self.first_at is None:  # nothing generated (max_tokens 0, an error): not goodput
            m.slo.labels("false").inc()
            return
        itl = (now - self.first_at) / (self.tokens - 1) if self.tokens > 1 else 0.0
        met = self.first_at - self.start <= m.slo_ttft and itl <= m.slo_itl
        m.slo.labels("true" if met else "false").inc()


def _best(accs: list[Accumulator], n: int) -> list[Accumulator]:
    """``best_of``: the ``n`` sequences of highest log-probability (sum over their tokens), in
    the order they were sampled; all of them without it."""
    if len(accs) == n:
        return accs
    ranked = sorted(range(len(accs)), key=lambda i: -sum(accs[i].logprobs))[:n]
    return [accs[i] for i in sorted(ranked)]


def _usage(units: list[Unit]) -> JsonObject:
    """Usage of several answers in one: each prompt counted once, every sequence's tokens."""
    prompt = sum(len(job.input_ids) for _, job, _ in units)
    completion = sum(acc.completion_tokens for _, _, accs in units for acc in accs)
    cached = sum(accs[0].cached_tokens for _, _, accs in units)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token's text for the logprobs: the id decoded alone, special tokens
    spelled out (the client asked for every token it was charged for)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)

