"""The worker's HTTP API (starlette, served by hypercorn's trio worker) over any Backend.

Mode-independent: the same routes and schemas whether the backend is colocated, prefill or
decode. The app owns the tokenizer and the chat template (loaded once; the backend's scheduler
shares the memoised weights), turns bodies into ``GenerateJob``s and the backend's outputs into
sglang / OpenAI bodies or SSE streams. Every generation wait races the client's disconnect, so a
client that goes away aborts its request (and frees its pages) at once.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.core.role_switch import EPOCH_HEADER, ROLE_HEADER, ROLES
from pd_fsm.io_trio.api_key import ApiKeyGate
from pd_fsm.io_trio.http_edge import BodyError, edge_app, read_json, request_failures
from pd_fsm.io_trio.http_server import connection_failures, serve_app
from pd_fsm.io_trio.worker import schemas
from pd_fsm.io_trio.worker.backend import (
    Backend,
    BackendError,
    GenerateJob,
    HandedOff,
    in_flight,
)
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.drain_gate import DrainDecision, drain_streams
from pd_fsm.io_trio.worker.metrics import WorkerMetrics
from pd_fsm.io_trio.worker.responses import Accumulator, batch_body, indexed
from pd_fsm.io_trio.worker.roles import RoleHost
from pd_fsm.io_trio.worker.schemas import ApiError, Limits, ParsedRequest
from pd_fsm.io_trio.worker.sse import (
    DONE,
    SSEResponse,
    event,
    handoff_event,
    until_disconnect,
)
from pd_fsm.jax_engine.model.registry import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.grammar import Constraint, GrammarError, compiler_for
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.request import RequestOutput
from pd_fsm.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pd_fsm.jax_engine.transfer.base import KVTransferEngine

log = logging.getLogger("pd_fsm.io_trio.worker.app")

DEFAULT_MODEL_NAME = "default"

# A failed backend ends the process after the HTTP server stopped gracefully, or after this.
FAILED_ANSWERS_GRACE_S = 5.0
DRAIN_RETRY_AFTER_S = 1  # a draining worker's Retry-After: another worker can take it now
DRAIN_POLL_S = 0.05  # how often a draining worker looks whether its work is over
# Above this size, tokenization moves off the event loop (JSON: http_edge.THREAD_JSON_BYTES).
THREAD_TOKENIZE_CHARS = 8 * 1024

_PARSERS: dict[str, Callable[[Any, Limits], ParsedRequest]] = {
    "generate": schemas.parse_generate,
    "completion": schemas.parse_completion,
    "chat": schemas.parse_chat,
}


def _version() -> str:
    try:
        return metadata.version("pd_fsm")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def model_path(name: str) -> str:
    """A LOCAL path for /server_info's ``model_path``: routers try to download anything that
    looks like a hub id. The tiny random model has no file: the package that defines it."""
    if name == "smollm2":
        from pd_fsm.jax_engine.model.gguf_loader import find_smollm2_gguf

        return str(find_smollm2_gguf())
    if name == "tiny":
        from pd_fsm.jax_engine.model import config as model_config

        return str(Path(model_config.__file__).resolve().parent)
    return str(Path(name).resolve())  # an HF checkpoint directory


@attrs.frozen(eq=False)
class ModelMeta:
    served_name: str
    model: LoadedModel
    context_length: int
    path: str

    @classmethod
    def of(cls, model: LoadedModel, config: ServeConfig) -> ModelMeta:
        limit = config.context_length or model.config.max_position
        if config.chat_template is not None:  # --chat-template replaces the model's own
            tokenizer = model.tokenizer.with_chat_template(config.chat_template)
            model = attrs.evolve(model, tokenizer=tokenizer)
        return cls(
            served_name=config.model_name,
            model=model,
            context_length=min(limit, model.config.max_position),
            path=model_path(config.model),
        )

    @property
    def limits(self) -> Limits:
        return Limits(self.context_length, self.model.config.vocab_size)


def _error(exc: ApiError) -> JSONResponse:
    response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
    if exc.retry_after is not None:
        response.headers["retry-after"] = str(exc.retry_after)
    if exc.status == 413:
        # The rest of an oversized body may still be on the wire: the connection cannot be reused.
        response.headers["connection"] = "close"
    return response


class WorkerApp:
    def __init__(
        self, config: ServeConfig, backend: Backend, *, model: LoadedModel | None = None,
        engine: KVTransferEngine | None = None,
    ) -> None:
        """``engine``: the transfer engine every PD role of a worker that switches roles runs
        on (``roles.shared_engine``), or None."""
        self.config = config
        self.meta: ModelMeta | None = None if model is None else ModelMeta.of(model, config)
        self.metrics = WorkerMetrics(self._stats, config.role_list,
                                     (config.slo_ttft, config.slo_itl))
        self._live: set[str] = set()
        # The role is state that changes at runtime (issue 30 §1): the host owns the backend.
        self.roles = RoleHost(config, backend, engine=engine, live=lambda: len(self._live),
                              configure=self._configure_backend, drained=self._count_drain)
        self.metrics.add_roles(self.roles.snapshot)
        self.draining = False  # SIGTERM: new requests get 503 + Retry-After (drain())
        self.bad_requests = 0
        self.app: Starlette | ApiKeyGate = edge_app(
            routes=[
                Route("/generate", self._generate, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/health_generate", self._health_generate, methods=["GET"]),
                Route("/server_info", self._server_info, methods=["GET"]),
                Route("/get_server_info", self._server_info, methods=["GET"]),
                Route("/model_info", self._model_info, methods=["GET"]),
                Route("/get_model_info", self._model_info, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/get_load", self._get_load, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/abort_request", self._abort_request, methods=["POST"]),
                Route("/handoff_release", self._handoff_release, methods=["POST"]),
                Route("/switch_role", self._switch_role, methods=["POST"]),
            ],
            exception_handlers={
                ApiError: self._on_api_error,
                HTTPException: self._on_http_exception,
            },
        )
        if config.api_key is not None:
            self.app = ApiKeyGate(self.app, config.api_key)

    # ----------------------------------------------------------------- lifecycle

    @property
    def backend(self) -> Backend:
        """The backend of the role served now (a switch replaces it: ``roles``)."""
        return self.roles.backend

    def _configure_backend(self, backend: Backend) -> None:
        if hasattr(backend, "phase_observer"):  # a PD backend: its per-phase histograms
            backend.phase_observer = self.metrics.phases.observe

    def _count_drain(self, decision: DrainDecision) -> None:
        self.metrics.drains.labels(decision.outcome, decision.reason).inc()

    def ready(self) -> bool:
        return self.meta is not None and self.backend.ready()

    async def load(self) -> None:
        """Load (and memoise) the model off the event loop; the backend reuses the weights."""
        if self.meta is None:
            c = self.config
            model = await trio.to_thread.run_sync(
                load_model, c.model, c.dtype, c.model_seed, abandon_on_cancel=True
            )
            self.meta = ModelMeta.of(model, c)

    def _stats(self) -> dict[str, Any]:
        stats = dict(self.backend.stats())
        stats.setdefault("live_requests", len(self._live))
        stats["ready"] = self.ready()
        # Connections a protocol error closed (http_server.py): the server kept serving.
        stats["http_connection_failures_total"] = connection_failures()
        # Requests whose handler raised (http_edge.Contained): answered 500, the server lives.
        stats["request_failures_total"] = request_failures()
        return stats

    # ----------------------------------------------------------------- errors

    async def _on_api_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return _error(exc)

    async def _on_http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _error(ApiError(exc.status_code, str(exc.detail)))

    def _bad(self, endpoint: str, exc: ApiError) -> ApiError:
        if exc.status == 499:
            log.info("%s: %s", endpoint, exc.message)
            self.metrics.requests.labels(endpoint, "disconnected").inc()
            return exc
        self.bad_requests += 1
        outcome = "client_error" if exc.status < 500 else "server_error"
        self.metrics.requests.labels(endpoint, outcome).inc()
        return exc

    # ----------------------------------------------------------------- request plumbing

    async def _read_json(self, request: Request) -> Any:
        """The body as strict JSON (``http_edge``): one parse for every pd_fsm server."""
        try:
            return await read_json(request, self.config.max_body)
        except BodyError as exc:
            raise ApiError(exc.status, exc.message) from None

    def _refuse_if_draining(self) -> None:
        if self.draining:
            # 503 with Retry-After: a router retries it elsewhere (pd-fsm proxy does, at once).
            raise ApiError(503, "the worker is draining (shutting down): send the request to "
                                "another worker", retry_after=DRAIN_RETRY_AFTER_S)
        if self.roles.refusing is not None:  # a role switch: the same answer, its own reason
            raise ApiError(503, self.roles.refusing, retry_after=DRAIN_RETRY_AFTER_S)

    def _refuse_stale_role(self, request: Request) -> None:
        """A leg addressed to a role (``X-PD-Role``) this worker no longer has: 409 naming the
        current role and epoch, also in headers, so the router re-reads the registry. Without
        the header nothing is checked (sglang-router sends none)."""
        asked = request.headers.get(ROLE_HEADER)
        if asked is None:
            return
        if asked not in ROLES:
            raise ApiError(400, f"header {ROLE_HEADER} must be one of {', '.join(ROLES)}, "
                                f"got {asked!r}")
        role, epoch = self.roles.role, self.roles.epoch
        if asked != role:
            raise ApiError(409, f"this worker serves as {role} (role epoch {epoch}), not as "
                                f"{asked}: look it up again in the registry",
                           headers={ROLE_HEADER: role, EPOCH_HEADER: str(epoch)})

    async def drain(self) -> None:
        """SIGTERM's graceful part (issue 32 §3): out of the registry first, new requests
        refused, then wait until the requests in flight are over (the caller's deadline bounds
        it: ``--drain-timeout``)."""
        self.draining = True
        started = time.monotonic()
        await self.backend.withdraw()
        log.info("draining: %d requests in flight", len(self._live))
        self._count_drain(await drain_streams(self.backend, self.config, started, "draining"))
        while self._live or in_flight(self.backend.stats()):
            await trio.sleep(DRAIN_POLL_S)
        log.info("drained: nothing in flight")

    def _require_ready(self) -> ModelMeta:
        if self.meta is None:
            raise ApiError(503, "the worker is not ready (model loading)")
        if not self.backend.ready():
            # A PD worker is ready only while the registry acknowledges it (a partition from
            # the bootstrap server makes it unready too).
            raise ApiError(503, "the worker is not ready (warming up, or not registered with "
                                "the bootstrap server)")
        return self.meta

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

    async def _job(self, body: Any, kind: str) -> tuple[ParsedRequest, GenerateJob]:
        meta = self._require_ready()
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
        if parsed.handoff is not None and self.backend.mode != "decode":
            raise ApiError(400, "only a decode worker takes a hand-off (handoff)")
        rid = parsed.rid or uuid.uuid4().hex
        if rid in self._live:
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
        )
        return parsed, job

    async def _outputs(self, job: GenerateJob, epoch: int | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """The backend's outputs, with the request counted as live while they flow. ``epoch``:
        the role epoch the request was checked against when it arrived; a switch that began
        while it was read (a role switch's drain counts only live requests) answers it 503
        rather than serve it in a role it was not addressed to."""
        if self.roles.refusing is not None or epoch not in (None, self.roles.epoch):
            raise BackendError(503, "the worker switched its role while this request was read: "
                                    "send it again (to another worker)")
        self._live.add(job.rid)
        try:
            async with aclosing(self.backend.generate(job)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            self._live.discard(job.rid)

    # ----------------------------------------------------------------- generation endpoints

    async def _generate(self, request: Request) -> Any:
        return await self._serve(request, "generate")

    async def _completions(self, request: Request) -> Any:
        return await self._serve(request, "completion")

    async def _chat(self, request: Request) -> Any:
        return await self._serve(request, "chat")

    async def _serve(self, request: Request, kind: str) -> Any:
        endpoint = request.url.path
        start = trio.current_time()
        epoch = self.roles.epoch
        try:
            self._refuse_if_draining()
            self._refuse_stale_role(request)
            self._require_ready()
            body = await self._read_json(request)
            batch = schemas.split_batch(kind, body)  # type: ignore[arg-type]  # kind: a Kind
            if batch is not None:
                jobs = [await self._job(item, kind) for item in batch]
            else:
                body = schemas.single_bootstrap(kind, body)  # type: ignore[arg-type]
                parsed, job = await self._job(body, kind)
        except ApiError as exc:
            raise self._bad(endpoint, exc) from None
        if batch is None:
            jobs = [(parsed, job)]
        if len(jobs) > 1 or jobs[0][1].sampling.n > 1:
            if jobs[0][0].stream:
                return self._stream_many(endpoint, jobs, start, epoch)
            return await self._serve_whole(request, endpoint, jobs, start, epoch, many=True)
        if not parsed.stream:
            return await self._serve_whole(request, endpoint, jobs, start, epoch, many=False)
        (acc,) = self._accumulators(parsed, job)
        outputs = self._outputs(job, epoch)
        timing = _Timing(self.metrics, start)

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
                self.metrics.requests.labels(endpoint, "disconnected").inc()
                return Response(status_code=499)
            if isinstance(head, ApiError):
                raise self._bad(endpoint, head)
            raise self._bad(endpoint, ApiError(500, "the backend produced no output"))

        def gone() -> None:
            self.metrics.requests.labels(endpoint, "disconnected").inc()

        return SSEResponse(self._events(endpoint, head, outputs, acc, timing), on_disconnect=gone)

    def _accumulators(self, parsed: ParsedRequest, job: GenerateJob) -> list[Accumulator]:
        """One per sequence the job samples (``n``; ``best_of`` when larger)."""
        self.metrics.prompt_tokens.inc(len(job.input_ids))
        return [self._accumulator(parsed, job, i) for i in range(job.sampling.n)]

    def _accumulator(self, parsed: ParsedRequest, job: GenerateJob, index: int = 0
                     ) -> Accumulator:
        assert self.meta is not None
        tokenizer = self.meta.model.tokenizer
        echo = None
        if parsed.echo:  # the prompt as given, or its ids decoded
            echo = parsed.text if parsed.text is not None else tokenizer.decode(
                list(job.input_ids), skip_special_tokens=False)
        return Accumulator(
            parsed.kind,
            job.rid,
            self.meta.served_name,
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
            timing = _Timing(self.metrics, start)
            try:
                async with aclosing(self._outputs(job, epoch)) as outputs:
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
            self.metrics.requests.labels(endpoint, "disconnected").inc()
            return Response(status_code=499)
        if failure is not None:
            raise self._bad(endpoint, failure)
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
            timing = _Timing(self.metrics, start)
            async with out:
                try:
                    async with aclosing(self._outputs(job, epoch)) as outputs:
                        async for output in outputs:
                            timing.output(output)
                            for payload in accs[output.index].chunks(output):
                                await out.send(event(indexed(payload, first + output.index)))
                except BackendError as exc:
                    self.metrics.requests.labels(endpoint, "server_error").inc()
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
            self.metrics.requests.labels(endpoint, "disconnected").inc()

        return SSEResponse(events(), on_disconnect=gone, background=start_items)

    async def _events(
        self,
        endpoint: str,
        head: RequestOutput,
        outputs: AsyncGenerator[RequestOutput, None],
        acc: Accumulator,
        timing: _Timing,
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
            except HandedOff as handed:
                # For the proxy, which asked for it (accept_handoff) and does not relay it: the
                # stream goes on on another D. No [DONE]: this answer is not whole.
                self.metrics.requests.labels(endpoint, "handed_off").inc()
                yield handoff_event(handed.ticket)
                return
            except BackendError as exc:
                # Headers are out: say so in a final chunk (sglang: finish_reason abort).
                self.metrics.requests.labels(endpoint, "server_error").inc()
                yield event(acc.error_chunk(exc.status, exc.reason))
                yield DONE
                return
        self._count_done(endpoint, acc)
        yield DONE

    def _count_done(self, endpoint: str, acc: Accumulator) -> None:
        kind = acc.finish.kind if acc.finish is not None else "none"
        self.metrics.requests.labels(endpoint, "aborted" if kind == "abort" else "ok").inc()
        self.metrics.completion_tokens.inc(acc.completion_tokens)

    # ----------------------------------------------------------------- control endpoints

    async def _handoff_release(self, request: Request) -> Response:
        """The KV of a stream this worker handed off was pulled (or never will be): drop its
        registration now rather than at its lease's end (the proxy posts it; issue 32 §2)."""
        body = await self._read_json(request)
        uuid_ = body.get("uuid") if isinstance(body, dict) else None
        if isinstance(uuid_, bool) or not isinstance(uuid_, int):
            raise ApiError(400, "give uuid (an integer): the hand-off ticket's")
        release = getattr(self.backend, "release_handoff", None)
        queued = release is not None and release(uuid_)
        return JSONResponse({"queued": queued})

    async def _switch_role(self, request: Request) -> Response:
        """Switch the worker's role at runtime (issue 30 §1): 202 at once, the switch runs on
        (``/server_info``'s ``role_state`` and ``role_epoch`` say when it serves)."""
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, 'the body must be a JSON object: {"role": "prefill"|"decode"|'
                                '"null"}')
        unknown = sorted(set(body) - {"role"})
        if unknown:
            raise ApiError(400, f"unknown field(s) {', '.join(unknown)} @ body: give only role")
        role = body.get("role")
        if not isinstance(role, str):
            raise ApiError(400, f"body.role must be a string, one of {', '.join(ROLES)}")
        if self.config.nnodes > 1:
            raise ApiError(400, "an instance spanning processes (--nnodes > 1) cannot switch "
                                "its role: restart it in the new role")
        if self.draining:
            raise ApiError(503, "the worker is draining (shutting down)",
                           retry_after=DRAIN_RETRY_AFTER_S)
        answer = self.roles.request(role)
        if answer.error is not None:
            raise ApiError(answer.status, answer.error, "conflict" if answer.status == 409
                           else None)
        return JSONResponse(answer.body, status_code=answer.status)

    async def _abort_request(self, request: Request) -> Response:
        body = await self._read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        if body.get("abort_all") is True:
            rids = sorted(self._live)
        else:
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                raise ApiError(400, "give rid (a string) or abort_all: true")
            rids = [rid]
        aborted = [rid for rid in rids if self.backend.abort(rid)]
        return JSONResponse({"aborted": aborted})

    async def _health(self, request: Request) -> Response:
        if self.draining:  # load balancers stop sending here
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"retry-after": str(DRAIN_RETRY_AFTER_S)})
        if self.roles.refusing is not None:  # and while the role changes
            return JSONResponse({"status": "switching_role", "role_state": self.roles.state},
                                status_code=503,
                                headers={"retry-after": str(DRAIN_RETRY_AFTER_S)})
        if not self.ready():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def _health_generate(self, request: Request) -> Response:
        meta = self._require_ready()
        if self.backend.mode != "null":
            # A PD leg cannot run alone: it needs a room and its peer (the proxy's job).
            return JSONResponse({"status": "ok", "generated": False, "mode": self.backend.mode})
        job = GenerateJob(
            rid=f"health-{uuid.uuid4().hex}",
            input_ids=tuple(meta.model.tokenizer.encode("ping")) or (1,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )

        async def run() -> ApiError | int:
            n = 0
            try:
                async with aclosing(self._outputs(job)) as outputs:
                    async for out in outputs:
                        n += len(out.new_token_ids)
            except BackendError as exc:
                return ApiError(503, f"generation check failed: {exc.reason}")
            return n

        connected, result = await until_disconnect(request.receive, run)
        if not connected:
            return Response(status_code=499)
        if isinstance(result, ApiError):
            raise result
        return JSONResponse({"status": "ok", "generated": True, "tokens": result})

    def _info_common(self) -> dict[str, Any]:
        meta = self.meta
        c = self.config
        info: dict[str, Any] = {
            "model_path": meta.path if meta else model_path(c.model),
            "tokenizer_path": meta.path if meta else model_path(c.model),
            "served_model_name": c.model_name,
        }
        return info

    async def _server_info(self, request: Request) -> Response:
        c = self.config
        info = self._info_common()
        info.update(
            version=_version(),
            # The role now and its epoch, the roles it may take, the switch's state and P's
            # bootstrap port (its side channel's) while it is P (issue 30 §1).
            **self.roles.info(),
            disaggregation_transfer_backend=c.disaggregation_transfer_backend,
            disaggregation_bootstrap_host=c.disaggregation_bootstrap_host,
            disaggregation_bootstrap_port=c.disaggregation_bootstrap_port,
            page_size=c.page_size,
            max_total_num_tokens=(c.num_pages - 1) * c.page_size,
            max_running_requests=c.max_running,
            chunked_prefill_size=c.max_batched_tokens,
            context_length=self.meta.context_length if self.meta else None,
            dtype=c.dtype,
            host=c.host,
            port=c.port,
            ready=self.ready(),
            internal_states=[self._stats()],
        )
        return JSONResponse(info)

    async def _model_info(self, request: Request) -> Response:
        info = self._info_common()
        info.update(
            is_generation=True,
            preferred_sampling_params=None,
            weight_version="default",
            has_image_understanding=False,
            has_audio_understanding=False,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
        )
        return JSONResponse(info)

    async def _models(self, request: Request) -> Response:
        entry: dict[str, Any] = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pd_fsm",
            "root": self.config.model_name,
        }
        if self.meta is not None:
            entry["max_model_len"] = self.meta.context_length
        return JSONResponse({"object": "list", "data": [entry]})

    async def _get_load(self, request: Request) -> Response:
        s = self.backend.stats()
        total = int(s.get("total_pages", 0))
        free = int(s.get("free_pages", total))
        waiting = int(s.get("waiting", 0)) + int(s.get("queued", 0))
        reqs = waiting + int(s.get("prefilling", 0)) + int(s.get("running", 0))
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": reqs,
                    "num_waiting_reqs": waiting,
                    # KV tokens reserved right now (pages are reserved for the whole sequence).
                    "num_tokens": (total - free) * self.config.page_size,
                    "num_pages_free": free,
                    # Held by the prefix cache alone (--radix-cache): evicted when wanted.
                    "num_pages_cached": int(s.get("cached_pages", 0)),
                    "num_pages_total": total,
                }
            ]
        )

    async def _metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")


@attrs.define
class _Timing:
    """One sequence's latencies as its outputs leave the scheduler: TTFT, each inter-token
    interval, end to end, and whether it met the SLO (TTFT and mean inter-token latency)."""

    metrics: WorkerMetrics
    start: float
    first_at: float | None = None
    last_at: float = 0.0
    tokens: int = 0

    def output(self, out: RequestOutput) -> None:
        now = trio.current_time()
        n = len(out.new_token_ids)
        if n and self.first_at is None:
            self.first_at = self.last_at = now
            self.metrics.ttft.observe(now - self.start)
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


def _usage(units: list[tuple[ParsedRequest, GenerateJob, list[Accumulator]]]) -> dict[str, Any]:
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


async def serve_worker(
    worker: WorkerApp,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    shutdown_trigger: Any = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP at once (``/health`` answers 503 while loading), then load the model and run
    the backend; ``started()`` with the base URL as soon as the socket listens. A backend that
    fails (a scheduler step raised; a rank of the instance is gone) ends the process with its
    error, after the HTTP server shut down gracefully: the requests it failed get their 500."""
    backend_failed = trio.Event()
    http_stopped = trio.Event()

    async def stop_http() -> None:  # hypercorn's shutdown trigger: the caller's, or a failure
        async with trio.open_nursery() as first:
            for trigger in (shutdown_trigger, backend_failed.wait):
                if trigger is not None:
                    first.start_soon(_then_cancel, trigger, first.cancel_scope)

    async def run_backend(*, task_status: trio.TaskStatus[None]) -> None:
        try:
            await worker.roles.run(task_status=task_status)
        except Exception:
            backend_failed.set()
            # Shielded: the HTTP task cancels this nursery once it stopped, and the error
            # must still reach the caller (a non-zero exit), not a silent cancellation.
            with trio.CancelScope(shield=True), trio.move_on_after(FAILED_ANSWERS_GRACE_S):
                await http_stopped.wait()
            raise

    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(
            _serve_http, worker, host, port, stop_http, nursery.cancel_scope, http_stopped
        )
        task_status.started(binds[0])
        log.info("worker (%s) listening on %s; loading %s", worker.backend.mode, binds[0],
                 worker.config.model)
        await worker.load()
        await nursery.start(run_backend)
        log.info("worker ready on %s", binds[0])


async def _then_cancel(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()


async def _serve_http(
    worker: WorkerApp,
    host: str,
    port: int,
    shutdown_trigger: Any,
    scope: trio.CancelScope,
    stopped: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve_app(worker.app, host, port, tls=worker.config.tls,
                    shutdown_trigger=shutdown_trigger, task_status=task_status)
    stopped.set()
    scope.cancel()  # HTTP shut down gracefully: nobody is left to serve
