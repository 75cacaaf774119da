"""The bootstrap server: an ASGI app (starlette) over the core's BootstrapRegistry, served by
hypercorn's trio worker.

Every write goes through the registry's driver task (one task owns the registry; TTL expiry is
that task waking at ``next_deadline()``). Reads look at the registry directly, after letting the
driver fire any expiry that is already due, so a read never lists an instance the core would have
dropped by now. No persistence: after a restart, heartbeats get 404 and the instances register
again.

With a cluster secret, writes must be signed with the registry key derived from it
(:mod:`pd_fsm.core.request_auth`): a request with a bad or missing signature, one sent again
(replayed), one sent outside the replay window, or one sent before this server started (a replay
across a restart; instances' clocks must agree with ours, NTP) is answered 401 with the reason and
counted in ``bad_requests_total``. So is any ``Authorization`` header: a client that sends the
cluster secret itself as a bearer token is refused, not trusted. Reads are open.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, assert_never

import trio
from hypercorn.config import Config as HypercornConfig
from prometheus_client import CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import RegistryConfig
from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.keys import registry_key
from pd_fsm.core.registry import (
    Acknowledged,
    BootstrapRegistry,
    RegistrationRequired,
    RegistryEffect,
)
from pd_fsm.core.replay import DEFAULT_WINDOW_S, ReplayGuard
from pd_fsm.core.request_auth import verify_request
from pd_fsm.io_trio.bootstrap.records import (
    RANK_AXES,
    ROLES,
    InstanceKey,
    InstanceRecord,
    RecordError,
    parse_key,
    parse_record,
    to_json,
    unreachable_fields,
)
from pd_fsm.io_trio.driver import EndpointDriver
from pd_fsm.io_trio.http_edge import BodyError, edge_app, parse_json, read_body, request_failures
from pd_fsm.io_trio.http_server import SERVER_KEEP_ALIVE_S, hypercorn_config, serve_app
from pd_fsm.io_trio.stats_metrics import StatsCollector
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import IPC_PREFIX, UnixSocket, display

log = logging.getLogger("pd_fsm.io_trio.bootstrap.server")

DEFAULT_MAX_BODY = 64 * 1024  # a registration is well under 2 KiB; mesh_meta leaves headroom
CALL_TIMEOUT = 5.0


class _Busy(Exception):
    """The registry's driver did not answer in time (overload): 503, retry later."""


def _error(status: int, error: str, problems: list[str] | None = None) -> JSONResponse:
    body: dict[str, Any] = {"error": error}
    if problems:
        body["problems"] = problems
    return JSONResponse(body, status_code=status)


async def _busy(request: Request, exc: Exception) -> JSONResponse:
    return _error(503, "registry busy; retry")


class _RegistrySink:
    """Carries out the registry's effects that no HTTP caller waits for: TTL expiries."""

    def __init__(self, keep: int = 1024) -> None:
        self.expired: deque[tuple[float, tuple[Any, ...]]] = deque(maxlen=keep)

    def apply(self, effect: RegistryEffect[InstanceRecord], now: float) -> tuple[()]:
        match effect:
            case fx.InstanceExpired():
                self.expired.append((now, effect.key))
                log.info("instance %s expired (no heartbeat within the TTL)", effect.key)
            case RegistrationRequired() | Acknowledged():
                pass  # a write's answer: EndpointDriver.call hands it to the HTTP handler
            case _:
                assert_never(effect)
        return ()


class BootstrapServer:
    """Registry + driver + ASGI app. ``run`` drives the registry; serve ``app`` with any ASGI
    server on trio (``serve_bootstrap`` uses hypercorn).

    ``secret`` is the cluster secret: only the registry key derived from it is kept. ``wall_clock``
    is read when the server is created (the replay guard's floor) and for each signed write."""

    def __init__(
        self,
        config: RegistryConfig | None = None,
        *,
        secret: bytes | None = None,
        max_body: int = DEFAULT_MAX_BODY,
        replay_window_s: float = DEFAULT_WINDOW_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.registry: BootstrapRegistry[InstanceRecord] = BootstrapRegistry(config)
        self.sink = _RegistrySink()
        self.driver = EndpointDriver(self.registry, self.sink, name="bootstrap")
        self._key = registry_key(secret) if secret else None
        self._wall_clock = wall_clock
        self.started_at = wall_clock()
        # Floor at our start: requests captured before a restart cannot be replayed to us.
        self._guard = (
            ReplayGuard(replay_window_s, not_before=self.started_at, what="request")
            if self._key is not None
            else None
        )
        self.max_body = max_body
        self.bad_requests = 0
        self.client_disconnects = 0
        self.writes = {"registered": 0, "heartbeat": 0, "deregistered": 0, "not_registered": 0}
        self.metrics = CollectorRegistry(auto_describe=False)
        self.metrics.register(StatsCollector(self.stats, "pd_fsm_bootstrap"))
        self.app = edge_app(
            exception_handlers={_Busy: _busy},
            routes=[
                Route("/route", self._put_route, methods=["PUT"]),
                Route("/route", self._get_route, methods=["GET"]),
                Route("/route", self._delete_route, methods=["DELETE"]),
                Route("/list", self._list, methods=["GET"]),
                Route("/heartbeat", self._heartbeat, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
            ],
        )

    @property
    def expired(self) -> deque[tuple[float, tuple[Any, ...]]]:
        """(time, key) of the latest TTL expiries, oldest first."""
        return self.sink.expired

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.driver.run(task_status=task_status)

    # -- request plumbing ---------------------------------------------------------------------

    @property
    def signed_writes(self) -> bool:
        """Whether writes must be signed (a cluster secret is configured)."""
        return self._key is not None

    def _refusal(self, request: Request, body: bytes) -> str | None:
        """Why this write is not authenticated, or None when it is (or no secret is set)."""
        if self._key is None:
            return None
        try:
            verify_request(
                self._key,
                request.method,
                request.url.path,
                body,
                request.headers,
                guard=self._guard,
                now=self._wall_clock(),
            )
        except RemoteProtocolError as exc:  # bad MAC, stale, replayed, Authorization header
            return str(exc)
        return None

    async def _write_body(self, request: Request) -> Any | JSONResponse:
        """The decoded JSON body of a write, or the error response to send instead."""
        # The whole body first (bounded by max_body): the signature covers its exact bytes.
        try:
            raw = await read_body(request, self.max_body)
        except BodyError as exc:
            if exc.status == 499:
                # A client leaving mid-body is normal (a worker stopping): counted, no traceback.
                self.client_disconnects += 1
                return _error(499, "client closed the request")
            self.bad_requests += 1
            response = _error(exc.status, exc.message)
            # The rest of the body is still on the wire: the connection cannot be reused.
            response.headers["connection"] = "close"
            return response
        refusal = self._refusal(request, raw)
        if refusal is not None:
            self.bad_requests += 1
            log.debug("refused %s %s: %s", request.method, request.url.path, refusal)
            return _error(401, refusal)
        try:
            return await parse_json(raw)  # strict: what is stored must be served back
        except BodyError as exc:
            self.bad_requests += 1
            return _error(exc.status, exc.message)

    def _invalid(self, exc: RecordError) -> JSONResponse:
        self.bad_requests += 1
        return _error(422, "invalid body", exc.problems)

    async def _call(self, event: Any, timeout: float) -> list[Any]:
        try:
            return await self.driver.call(event, timeout)
        except trio.TooSlowError:
            raise _Busy from None

    async def _sync(self) -> None:
        """Let the driver fire expiries that are due, so reads agree with the core's clock."""
        deadline = self.registry.next_deadline()
        if deadline is not None and deadline <= trio.current_time():
            await self._call(ev.TimeAdvanced(), CALL_TIMEOUT)

    # -- endpoints ----------------------------------------------------------------------------

    async def _put_route(self, request: Request) -> JSONResponse:
        body = await self._write_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            record = parse_record(body)
        except RecordError as exc:
            return self._invalid(exc)
        client = request.client.host if request.client is not None else None
        unreachable = unreachable_fields(record, client)
        if unreachable:
            return self._invalid(RecordError([f"{why} @ body.{name}" for name, why in unreachable]))
        event = ev.InstanceRegistered(record.key, record, record.advertised,
                                      record.heartbeat_ttl)
        effects = await self._call(event, CALL_TIMEOUT)
        log.debug("registered %s as %s", record.key, record.advertised)
        return self._answer(effects, record.key, "registered")

    async def _heartbeat(self, request: Request) -> JSONResponse:
        body = await self._write_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            key = parse_key(body)
        except RecordError as exc:
            return self._invalid(exc)
        effects = await self._call(ev.InstanceHeartbeat(key.key), CALL_TIMEOUT)
        return self._answer(effects, key.key, "heartbeat")

    async def _delete_route(self, request: Request) -> JSONResponse:
        body = await self._write_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            key = parse_key(body)
        except RecordError as exc:
            return self._invalid(exc)
        effects = await self._call(ev.InstanceDeregistered(key.key), CALL_TIMEOUT)
        if any(isinstance(e, RegistrationRequired) for e in effects):
            self.writes["not_registered"] += 1
            return _error(404, f"instance {list(key.key)} is not registered")
        self.writes["deregistered"] += 1
        log.info("instance %s deregistered", key.key)
        return JSONResponse({"ok": True, "key": list(key.key)})

    def _answer(self, effects: list[Any], key: tuple[Any, ...], write: str) -> JSONResponse:
        for effect in effects:
            if isinstance(effect, RegistrationRequired) and effect.key == key:
                self.writes["not_registered"] += 1
                return _error(404, f"instance {list(key)} is not registered; PUT /route again")
            if isinstance(effect, Acknowledged) and effect.key == key:
                self.writes[write] += 1
                ttl = self.registry.ttl_of(key)  # the instance's own, if it named one
                return JSONResponse({"ok": True, "key": list(key), "ttl": ttl})
        raise RuntimeError(f"registry gave no answer for {key}: {effects!r}")

    async def _list(self, request: Request) -> JSONResponse:
        role = request.query_params.get("role")
        if role is not None and role not in ROLES:
            self.bad_requests += 1
            return _error(422, f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        await self._sync()
        records: list[InstanceRecord] = self.registry.instances(role)
        return JSONResponse({"instances": [to_json(r) for r in records]})

    async def _get_route(self, request: Request) -> JSONResponse:
        q = request.query_params
        role = q.get("role", "prefill")
        if role not in ROLES:
            self.bad_requests += 1
            return _error(422, f"unknown role {role!r} (expected one of {', '.join(ROLES)})")
        problems: list[str] = []
        ranks: dict[str, int] = {}
        for axis in RANK_AXES:
            text = q.get(f"{axis}_rank")
            if text is None:
                continue
            if not text.isdigit():
                problems.append(f"{axis}_rank must be a non-negative integer, got {text!r}")
            else:
                ranks[f"{axis}_rank"] = int(text)
        by_addr = "host" in q or "port" in q
        if by_addr:
            host, port = q.get("host", ""), q.get("port", "")
            if not host:
                problems.append("host is required with port")
            # A side channel on a unix socket is known by its ipc:// endpoint alone.
            elif host.startswith(IPC_PREFIX) and "port" not in q:
                pass
            elif not port.isdigit() or not 0 < int(port) < 65536:
                problems.append(f"port must be an integer in 1..65535, got {port!r}")
        elif "instance_id" not in q:
            problems.append("give either host and port, or instance_id and the four ranks")
        else:
            missing = [f"{a}_rank" for a in RANK_AXES if f"{a}_rank" not in q]
            if missing:
                problems.append(f"missing {', '.join(missing)} (lookup by key needs all four)")
        if problems:
            self.bad_requests += 1
            return _error(422, "invalid query", problems)
        await self._sync()
        if by_addr:
            advertised = f"{host}:{int(port)}" if port else host
            found = [
                r
                for _, r in self.registry.resolve(advertised, role)
                if all(getattr(r, name) == value for name, value in ranks.items())
            ]
            if not found:
                return _error(404, f"no live {role} instance known as {advertised}")
            return JSONResponse({"instances": [to_json(r) for r in found]})
        tp, cp, dp, pp = (ranks[f"{a}_rank"] for a in RANK_AXES)
        key: InstanceKey = (role, q["instance_id"], tp, cp, dp, pp)
        record = self.registry.lookup(key)
        if record is None:
            return _error(404, f"instance {list(key)} is not registered")
        return JSONResponse(to_json(record))

    def stats(self) -> dict[str, Any]:
        """What ``/health`` and ``/metrics`` report (``pd_fsm_bootstrap_<key>``)."""
        by_role = {role: 0 for role in ROLES}
        for record in self.registry.instances(None):
            by_role[record.role] = by_role.get(record.role, 0) + 1
        return {
            "instances": len(self.registry),
            "instances_by_role": by_role,
            "expired_total": self.registry.expired_total,
            # Writes answered, by what they did (not_registered: a heartbeat or DELETE for an
            # instance the registry does not know, answered 404: PUT /route again).
            "writes_total": dict(self.writes),
            # Refused writes (unsigned, forged, stale or replayed; bad bodies): visible.
            "bad_requests_total": self.bad_requests,
            "client_disconnects_total": self.client_disconnects,
            # Requests whose handler raised: answered 500, the registry kept serving.
            "request_failures_total": request_failures(),
        }

    async def _health(self, request: Request) -> JSONResponse:
        await self._sync()
        stats = self.stats()
        del stats["instances_by_role"]
        return JSONResponse({"status": "ok", **stats})

    async def _metrics(self, request: Request) -> Response:
        await self._sync()
        return Response(generate_latest(self.metrics), media_type="text/plain; version=0.0.4")


async def serve_bootstrap(
    server: BootstrapServer,
    host: str = "127.0.0.1",
    port: int | None = 0,
    *,
    shutdown_trigger: Any = None,
    keep_alive: float = SERVER_KEEP_ALIVE_S,
    tls: TLS = NO_TLS,
    uds: UnixSocket | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the registry driver and hypercorn; ``started()`` with the base URL once listening.

    ``port=0`` picks a free port (tests); None: no TCP listener, the unix socket ``uds`` alone.
    ``shutdown_trigger`` (an async callable) stops the HTTP server gracefully when it returns;
    cancellation stops everything. ``keep_alive`` is the idle-connection timeout (see
    ``http_server.py``; tests shorten it to race clients).
    """
    async with trio.open_nursery() as nursery:
        await nursery.start(server.run)
        binds: list[str] = await nursery.start(
            _serve_http,
            server,
            hypercorn_config(host, port, keep_alive=keep_alive, tls=tls),
            shutdown_trigger,
            nursery.cancel_scope,
            uds,
        )
        task_status.started(binds[0])
        log.info("bootstrap server listening on %s (ttl %g s)", " and ".join(map(display, binds)),
                 server.registry.config.ttl)


async def _serve_http(
    server: BootstrapServer,
    config: HypercornConfig,
    shutdown_trigger: Any,
    scope: trio.CancelScope,
    uds: UnixSocket | None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    await serve_app(
        server.app, "", 0, config=config, uds=uds, shutdown_trigger=shutdown_trigger,
        task_status=task_status,
    )
    scope.cancel()  # hypercorn shut down gracefully: the registry's driver has no one to serve
