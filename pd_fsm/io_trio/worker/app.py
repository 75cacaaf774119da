"""The worker's HTTP API (starlette, served by hypercorn's trio worker) over any ServeBackend.

Mode-independent: the same routes and schemas whether the backend is colocated, prefill or
decode. The app owns the tokenizer and the chat template (loaded once; the backend's scheduler
shares the memoised weights); its routes come in two groups over the state they share
(app_state.py): generation (generation.py: bodies into ``GenerateJob``s, outputs into sglang /
OpenAI bodies or SSE streams) and admin (admin_routes.py: health, info, load, metrics, aborts,
role switches).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.io_trio.api_key import ApiKeyGate
from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.http_edge import edge_app, request_failures
from pd_fsm.io_trio.http_server import connection_failures, serve_app
from pd_fsm.io_trio.unix_sockets import display
from pd_fsm.io_trio.worker.admin_routes import AdminRoutes
from pd_fsm.io_trio.worker.app_state import ModelMeta, WorkerState
from pd_fsm.io_trio.worker.backend import RoleBackend, ServeBackend, Stats, in_flight
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.drain_gate import DrainDecision, drain_streams
from pd_fsm.io_trio.worker.generation import GenerationRoutes
from pd_fsm.io_trio.worker.metrics import WorkerMetrics
from pd_fsm.io_trio.worker.roles import RoleHost
from pd_fsm.io_trio.worker.schemas import ApiError
from pd_fsm.jax_engine.model.registry import LoadedModel, load_model
from pd_fsm.schedulers.args import weights_dtype

if TYPE_CHECKING:
    from pd_fsm.jax_engine.transfer.base import KVTransferEngine

log = logging.getLogger("pd_fsm.io_trio.worker.app")

# A failed backend ends the process after the HTTP server stopped gracefully, or after this.
FAILED_ANSWERS_GRACE_S = 5.0
DRAIN_POLL_S = 0.05  # how often a draining worker looks whether its work is over


class WorkerApp:
    """The routes (generation, admin) over the state they share (``app_state.WorkerState``)."""

    def __init__(
        self, config: ServeConfig, backend: ServeBackend, *, model: LoadedModel | None = None,
        engine: KVTransferEngine | None = None,
    ) -> None:
        """``engine``: the transfer engine every PD role of a worker that switches roles runs
        on (``roles.shared_engine``), or None."""
        self.config = config
        metrics = WorkerMetrics(self._stats, config.role_list, (config.slo_ttft, config.slo_itl))
        live: set[str] = set()
        # The role is state that changes at runtime: the host owns the backend.
        roles = RoleHost(config, backend, engine=engine, live=lambda: len(live),
                         configure=lambda b: _observe_phases(b, metrics),
                         drained=lambda decision: _count_drain(metrics, decision))
        self.state = WorkerState(config, metrics, roles, live,
                                 None if model is None else ModelMeta.of(model, config))
        metrics.add_roles(roles.snapshot)
        gen = GenerationRoutes(self.state)
        admin = AdminRoutes(self.state, gen, self._stats)
        self.app: Starlette | ApiKeyGate = edge_app(
            routes=[
                Route("/generate", gen.generate, methods=["POST"]),
                Route("/v1/completions", gen.completions, methods=["POST"]),
                Route("/v1/chat/completions", gen.chat, methods=["POST"]),
                Route("/health", admin.health, methods=["GET"]),
                Route("/health_generate", admin.health_generate, methods=["GET"]),
                Route("/server_info", admin.server_info, methods=["GET"]),
                Route("/get_server_info", admin.server_info, methods=["GET"]),
                Route("/model_info", admin.model_info, methods=["GET"]),
                Route("/get_model_info", admin.model_info, methods=["GET"]),
                Route("/v1/models", admin.models, methods=["GET"]),
                Route("/get_load", admin.get_load, methods=["GET"]),
                Route("/metrics", admin.metrics, methods=["GET"]),
                Route("/abort_request", admin.abort_request, methods=["POST"]),
                Route("/handoff_release", admin.handoff_release, methods=["POST"]),
                Route("/move_streams", admin.move_streams, methods=["POST"]),
                Route("/switch_role", admin.switch_role, methods=["POST"]),
                Route("/set_nice", admin.set_nice, methods=["POST"]),
                Route("/set_cpus", admin.set_cpus, methods=["POST"]),
            ],
            exception_handlers={
                ApiError: _on_api_error,
                HTTPException: _on_http_exception,
            },
        )
        if config.api_key is not None:
            self.app = ApiKeyGate(self.app, config.api_key)

    # ----------------------------------------------------------------- what callers read

    @property
    def metrics(self) -> WorkerMetrics:
        return self.state.metrics

    @property
    def roles(self) -> RoleHost:
        return self.state.roles

    @property
    def backend(self) -> ServeBackend:
        """The backend of the role served now (a switch replaces it: ``roles``)."""
        return self.state.backend

    @property
    def draining(self) -> bool:
        return self.state.draining

    @property
    def bad_requests(self) -> int:
        return self.state.bad_requests

    def ready(self) -> bool:
        return self.state.ready()

    # ----------------------------------------------------------------- lifecycle

    async def load(self) -> None:
        """Load (and memoise) the model off the event loop; the backend reuses the weights."""
        if self.state.meta is None:
            c = self.config
            model = await trio.to_thread.run_sync(
                load_model, c.model, weights_dtype(c.dtype), c.model_seed, c.load_format,
                abandon_on_cancel=True
            )
            self.state.meta = ModelMeta.of(model, c)

    def _stats(self) -> Stats:
        stats = dict(self.backend.stats())
        stats.setdefault("live_requests", len(self.state.live))
        stats["ready"] = self.ready()
        # Connections a protocol error closed (http_server.py): the server kept serving.
        stats["http_connection_failures_total"] = connection_failures()
        # Requests whose handler raised (http_edge.Contained): answered 500, the server lives.
        stats["request_failures_total"] = request_failures()
        return stats

    async def drain(self) -> None:
        """SIGTERM's graceful part: out of the registry first, new requests
        refused, then wait until the requests in flight are over (the caller's deadline bounds
        it: ``--drain-timeout``)."""
        self.state.draining = True
        started = time.monotonic()
        await self.backend.withdraw()
        log.info("draining: %d requests in flight", len(self.state.live))
        _count_drain(self.metrics,
                     await drain_streams(self.backend, self.config, started, "draining"))
        while self.state.live or in_flight(self.backend.stats()):
            await trio.sleep(DRAIN_POLL_S)
        log.info("drained: nothing in flight")


def _observe_phases(backend: ServeBackend, metrics: WorkerMetrics) -> None:
    """What the worker sets on each backend it serves with."""
    if isinstance(backend, RoleBackend):  # a PD backend observes its per-phase histograms
        backend.phase_observer = metrics.phases.observe


def _count_drain(metrics: WorkerMetrics, decision: DrainDecision) -> None:
    metrics.drains.labels(decision.outcome, decision.reason).inc()


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _error(exc)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return _error(ApiError(exc.status_code, str(exc.detail)))


def _error(exc: ApiError) -> JSONResponse:
    response = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
    if exc.retry_after is not None:
        response.headers["retry-after"] = str(exc.retry_after)
    if exc.status == 413:
        # The rest of an oversized body may still be on the wire: the connection cannot be reused.
        response.headers["connection"] = "close"
    return response


async def serve_worker(
    worker: WorkerApp,
    host: str = "127.0.0.1",
    port: int | None = 0,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve HTTP at once (``/health`` answers 503 while loading), then load the model and run
    the backend; ``started()`` with the base URL as soon as the socket listens (also on the
    config's unix socket, if any; ``port`` None: on it alone). A backend that
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
        log.info("worker (%s) listening on %s; loading %s", worker.backend.mode,
                 " and ".join(map(display, binds)), worker.config.model)
        await worker.load()
        c = worker.config
        if c.cpus_after_pools:  # the pools exist now: to --cpus
            assert c.cpus is not None
            worker.roles.cores.move_to(parse_cpus(c.cpus), "--cpus once the pools exist")
        await nursery.start(run_backend)
        log.info("worker ready on %s", display(binds[0]))


async def _then_cancel(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()


async def _serve_http(
    worker: WorkerApp,
    host: str,
    port: int | None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None,
    scope: trio.CancelScope,
    stopped: trio.Event,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve_app(worker.app, host, port, tls=worker.config.tls, uds=worker.config.unix_socket,
                    shutdown_trigger=shutdown_trigger, task_status=task_status)
    stopped.set()
    scope.cancel()  # HTTP shut down gracefully: nobody is left to serve
