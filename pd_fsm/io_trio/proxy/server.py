"""The PD proxy (RFC-2 §5.7): every client request becomes a room of the core's RoomRouter.

The router decides (room id uniform in [0, 2^63), which P and D by the routing policies of
``core.routing`` — or D alone, conditional disaggregation — what happens when a leg fails, times
out or the client leaves); this adapter only carries out its effects and feeds it what happened
(and, for the load-aware policies, the workers' ``/get_load`` polled every ``load_interval``):

* ``DispatchRoom`` -> post the same body to P and D concurrently (one pooled httpx client), with
  ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` injected (and ``rid`` when the
  client gave none, so the legs can be aborted by name);
* ``DispatchLocal`` -> post the body to D alone, without bootstrap fields: D prefills it; or, the
  same way, to a colocated worker (role "null", ``--colocated`` or probed), which serves the
  whole request (its leg's X-PD-Role says "null");
* ``RelayDecode`` -> the client gets D's status and body, SSE relayed chunk by chunk as it
  arrives; prompt log-probs, which only P computes, are put into D's answer from P's
  (``logprob_merge``: P's leg then goes unstreamed, and D's is relayed once P's is in). The room
  stays live (RELAYING) until the last byte is out (``RelayFinished``), so a client that leaves
  mid-stream still gets both legs aborted;
* ``AbortLeg`` -> ``POST /abort_request {"rid"}`` to that worker, and the leg's HTTP request is
  dropped;
* ``ReplyError`` -> the failing leg's status and JSON error (a timeout: 504);
* ``NoWorkers`` / ``ShedRequest`` -> no room: 503 (no worker of a role) or 429 (every one full).

P's leg runs in the proxy's own nursery: a client that got D's answer does not wait for P to be
drained. A request's rooms, their legs and the relay are ``room.py`` (:class:`RoomResponse`, which
reaches this class only through ``room.RoomHost``: ``feed``, ``count``, ``contain``,
``start_soon``, ``reopen``, ``room_over``); what the client has of its answer across the rooms is
the core's ``ProxySession`` (table proxy_session). Workers (``workers.py``) come from the command
line or, refreshed periodically, from the bootstrap server's ``GET /list?role=prefill|decode``;
``GET /workers`` names the current ones (the bench scrapes their ``/metrics``). ``/metrics`` has
histograms of each leg and of D's first byte (``pd_fsm.io_trio.phases``).
"""

from __future__ import annotations

import logging
import math
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, assert_never
from urllib.parse import urlsplit

import httpx
import trio
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import RouterConfig
from pd_fsm.core.drive import drive
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.routing import Attempts, RoutingConfig
from pd_fsm.io_trio.api_key import ApiKeyGate, bearer
from pd_fsm.io_trio.http_edge import (
    BodyError,
    describe,
    edge_app,
    read_json,
    request_failures,
)
from pd_fsm.io_trio.http_server import http_client, serve_app
from pd_fsm.io_trio.phases import PhaseHistograms
from pd_fsm.io_trio.proxy.answers import Failure, Refusal, error_body
from pd_fsm.io_trio.proxy.batch import BatchResponse
from pd_fsm.io_trio.proxy.logprob_merge import wants_prompt_logprobs
from pd_fsm.io_trio.proxy.migration import Progress, migratable, sequences_asked
from pd_fsm.io_trio.proxy.prompt_key import prompt_of
from pd_fsm.io_trio.proxy.room import ClientRequest, Reply, Room, RoomResponse
from pd_fsm.io_trio.proxy.workers import PrefillTarget as PrefillTarget  # callers' name for it
from pd_fsm.io_trio.proxy.workers import Workers
from pd_fsm.io_trio.stats_metrics import StatsCollector
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import UnixSocket, display
from pd_fsm.io_trio.worker.schemas import ApiError, split_batch

log = logging.getLogger("pd_fsm.io_trio.proxy.server")

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
INFO_PATHS = ("/v1/models", "/model_info", "/get_model_info", "/server_info", "/get_server_info")
FORWARD_HEADERS = ("authorization", "x-request-id")
ABORT_TIMEOUT = 5.0
MAX_BODY = 8 * 1024 * 1024
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_BREAKER_LEVEL = {"CLOSED": 0, "HALF_OPEN": 1, "PROBING": 1, "OPEN": 2}


def _room_of(item: ev.RouterEvent | fx.RouterEffect) -> int | None:
    """The room an event or effect of the router is about; None for those about no room (a new
    request, the passing of time, a breaker, a request shed or without workers)."""
    match item:
        case (ev.TimeAdvanced() | ev.RoomRequested() | fx.BreakerChanged() | fx.ShedRequest()
              | fx.NoWorkers()):
            return None
        case (ev.LegResponded() | ev.ClientDisconnected() | ev.RelayFinished() | fx.DispatchRoom()
              | fx.DispatchLocal() | fx.RelayDecode() | fx.AbortLeg() | fx.ReplyError()
              | fx.RedirectDecode() | fx.ReopenRoom()):
            return item.room
        case _:
            assert_never(item)


class ProxyServer:
    def __init__(
        self,
        prefill: list[PrefillTarget],
        decode: list[str],
        *,
        bootstrap_url: str | None = None,
        refresh_interval: float = 5.0,
        room_timeout: float = RouterConfig().room_timeout,
        rng: random.Random | None = None,
        client: httpx.AsyncClient | None = None,
        api_key: str | None = None,
        worker_api_key: str | None = None,
        tls: TLS = NO_TLS,
        routing: RoutingConfig | None = None,
        load_interval: float = 1.0,
        decode_recomputes: bool = False,
        retry_limit: int = RouterConfig().retry_limit,
        migration_limit: int = RouterConfig().migration_limit,
        breaker_threshold: int = RouterConfig().breaker_threshold,
        breaker_cooldown: float = RouterConfig().breaker_cooldown,
        role_probe_interval: float = 2.0,
        colocated: list[str] | None = None,
    ) -> None:
        colocated = [c.rstrip("/") for c in colocated or []]
        self.tls = tls  # serves HTTPS if it has a certificate; verifies workers against its CA
        config = RouterConfig(room_timeout=room_timeout, decode_recomputes=decode_recomputes,
                              retry_limit=retry_limit, migration_limit=migration_limit,
                              breaker_threshold=breaker_threshold,
                              breaker_cooldown=breaker_cooldown)
        self.router = RoomRouter([p.url for p in prefill], [d.rstrip("/") for d in decode],
                                 rng or random.Random(), config, routing, colocated)
        self.workers = Workers(
            self.router, lambda: self.client, prefill, decode,
            headers=bearer(worker_api_key) if worker_api_key else {},
            bootstrap_url=bootstrap_url, refresh_interval=refresh_interval,
            load_interval=load_interval, role_probe_interval=role_probe_interval,
            colocated=colocated)
        # What the proxy counts beyond the router (stats() says what each is).
        self.contained = {"prefill_leg": 0, "room": 0}
        self.reopened = {"retry": 0, "migration": 0, "redirect": 0, "handoff": 0}
        self.handoffs = {"taken": 0, "fell_back": 0, "failed": 0}
        self.moved = 0  # streams a worker gave up (/move_streams), continued in a new room
        self.aborts_sent = {"prefill": 0, "decode": 0}
        self.room_timeout = room_timeout
        self._client = client
        self._own_client = client is None
        self._rooms: dict[int, Room] = {}  # live rooms, for the router's effects
        self._dispatching: dict[str, Room] = {}  # the room being drawn, by request id
        self._no_worker: Refusal | None = None
        self._nursery: trio.Nursery | None = None
        self._timer_wake = trio.Event()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(self.stats, "pd_fsm_proxy"))
        self.requests = Counter("pd_fsm_proxy_http_requests", "client requests by path and status",
                                ["path", "status"], registry=self.registry)
        self.phases = PhaseHistograms(self.registry, "proxy")
        self.app = _app(self, api_key)

    # ------------------------------------------------------------------ lifecycle

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "ProxyServer.run is not running"
        return self._client

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._client is None:
            self._client = http_client(timeout=httpx.Timeout(10.0, read=None), tls=self.tls,
                                       max_connections=1024, max_keepalive=256)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timer)
                if self.workers.bootstrap_url is not None:
                    await nursery.start(self.workers.discover)
                elif self.workers.probes_roles:
                    await nursery.start(self.workers.probe_roles)
                if self.router.planner.wants_loads:
                    nursery.start_soon(self.workers.poll_loads)
                task_status.started()
        finally:
            if self._own_client:
                with trio.CancelScope(shield=True):
                    await self._client.aclose()

    def stats(self) -> dict[str, object]:
        return {
            "rooms_total": dict(self.router.outcomes),
            "rooms_live": len(self.router.rooms),
            "dropped_responses_total": self.router.dropped,
            "aborts_sent_total": dict(self.aborts_sent),
            "prefill_workers": len(self.workers.targets),
            "decode_workers": len(self.workers.decode_urls),
            "colocated_workers": len(self.workers.colocated_urls),
            # Rooms by the path their request took: "pd", "decode_alone", "colocated",
            # "handoff" (a retried or migrated request's every room counts).
            "rooms_routed_total": dict(self.router.routed),
            # Static lists: /server_info probes of the workers' roles, and workers routed as
            # another role than before (a role switch seen).
            "role_probes_total": dict(self.workers.role_probes),
            "role_changes_total": self.workers.role_changes,
            # "prefill:cache_hit", "decode:round_robin", "local:short_prompt", ...
            "route_decisions_total": dict(self.router.planner.decisions),
            "shed_total": dict(self.router.shed),  # answered 429, by the full role
            "load_polls_total": dict(self.workers.load_polls),
            # Exceptions contained to one room (http_edge's count has the requests' own).
            "contained_failures_total": dict(self.contained),
            # Rooms reopened for their request (ReopenRoom), by cause: "retry", "migration",
            # "handoff"; and decode legs redirected within their room ("redirect").
            "rooms_reopened_total": dict(self.reopened),
            # Hand-off rooms by outcome: the new D pulled the KV and streams on ("taken"), or
            # not, and the request migrated by re-prefill ("fell_back") or failed ("failed").
            "handoffs_total": dict(self.handoffs),
            # Streams a worker gave up (POST /move_streams): each re-prefilled elsewhere, a
            # "handoff" room reopened (no KV pulled: not among handoffs_total).
            "streams_moved_total": self.moved,
            # Per worker: 0 closed, 1 half-open or probing, 2 open (table worker_breaker).
            "breaker_state": {w: _BREAKER_LEVEL[st]
                              for w, st in self.router.breakers.states().items()},
            "breaker_transitions_total": dict(self.router.breakers.changes),
            "request_failures_total": request_failures(),
        }

    # ------------------------------------------------------------------ the router

    def feed(self, event: ev.RouterEvent, failure: Failure | None = None) -> None:
        """Hand ``event`` to the router and carry out every effect it returns. ``failure`` is the
        answer to give if this event fails its own room."""
        room = _room_of(event)

        def carry_out(effect: fx.RouterEffect) -> tuple[()]:
            # Room effects carry their room; a breaker's or a shed request's do not.
            mine = _room_of(effect) == room
            self._apply(effect, failure if mine else None)
            return ()

        drive(self.router.handle, event, trio.current_time(), carry_out)

    def _apply(self, effect: fx.RouterEffect, failure: Failure | None) -> None:
        match effect:
            case fx.DispatchRoom() | fx.DispatchLocal():
                started = self._dispatching.pop(effect.request_id)
                started.room, started.decode = effect.room, effect.decode
                started.prefill = effect.prefill if isinstance(effect, fx.DispatchRoom) else ""
                if isinstance(effect, fx.DispatchLocal):
                    started.decode_role = effect.role
                self._rooms[effect.room] = started
                self._timer_wake.set()
            case fx.BreakerChanged():
                level = logging.WARNING if effect.new == "OPEN" else logging.INFO
                log.log(level, "worker %s: circuit breaker %s -> %s", effect.worker, effect.old,
                        effect.new)
            case fx.NoWorkers():
                self._no_worker = Refusal(503, effect.reason, "no_workers")
            case fx.ShedRequest():
                self._no_worker = Refusal(
                    429, f"every {effect.role} worker is at its queue bound: retry later",
                    "overloaded", effect.retry_after)
            case (fx.RelayDecode() | fx.ReplyError() | fx.RedirectDecode() | fx.ReopenRoom()
                  | fx.AbortLeg()):
                s = self._rooms.get(effect.room)
                if s is not None:
                    self._apply_to_room(s, effect, failure)
            case _:
                assert_never(effect)

    def _apply_to_room(
        self, s: Room,
        effect: fx.RelayDecode | fx.ReplyError | fx.RedirectDecode | fx.ReopenRoom | fx.AbortLeg,
        failure: Failure | None,
    ) -> None:
        match effect:
            case fx.RelayDecode():
                self._handoff_over(s, "taken")
                s.decide(effect)
            case fx.ReplyError():
                self._handoff_over(s, "failed")
                s.decide(Reply(*(failure or (504, error_body(504, effect.reason, "timeout")))))
            case fx.RedirectDecode():
                self.reopened["redirect"] += 1
                # A hand-off room's leg keeps its ticket (in its body): the draining D keeps the
                # registration until the room's leg answers (``_handoff_over``) or its lease.
                log.info("room %d: %s leg refused by %s, posted to %s", effect.room,
                         "hand-off" if s.ticket is not None else "decode", s.decode,
                         effect.decode)
                # A scope of its own for the new leg (the old one is spent), armed now so that an
                # abort from here on reaches it; the decode leg posts again in it.
                s.decode, s.d_scope = effect.decode, trio.CancelScope()
            case fx.ReopenRoom():
                self._handoff_over(s, "fell_back")
                self.reopened[effect.cause] += 1
                log.info("room %d: %s of request %s (%s) after %.3f s", effect.room, effect.cause,
                         s.request.request_id,
                         "refused" if effect.cause == "retry" else s.decode, effect.delay)
                s.decide(effect)
            case fx.AbortLeg():
                (s.p_scope if effect.leg == "prefill" else s.d_scope).cancel()
                self.aborts_sent[effect.leg] += 1
                self._tell_worker(effect.url, "/abort_request", {"rid": s.rid},
                                  f"abort of {effect.leg} leg {s.rid}")
            case _:
                assert_never(effect)

    def _handoff_over(self, s: Room, outcome: str) -> None:
        """If ``s`` is a hand-off room, its leg answered: the KV was pulled (its 2xx comes after
        the pull) or will not be. Either way the draining D may drop the registration now."""
        if s.ticket is None:
            return
        self.handoffs[outcome] += 1
        log.info("room %d: hand-off from %s %s", s.room, s.handoff_from, outcome)
        # If this post fails, its lease releases it (within the draining D's --drain-timeout).
        uuid_, s.ticket = s.ticket.get("uuid"), None
        self._tell_worker(s.handoff_from, "/handoff_release", {"uuid": uuid_}, "hand-off release")

    def _tell_worker(self, url: str, path: str, body: dict[str, object], what: str) -> None:
        """POST ``body`` to a worker in the proxy's nursery, within ABORT_TIMEOUT: best effort,
        a failure is logged (the worker's own deadlines end what it was told to)."""
        assert self._nursery is not None, "ProxyServer.run is not running"
        self._nursery.start_soon(_post_quietly, self.client, url, path, body,
                                 self.workers.headers, what)

    async def _timer(self) -> None:
        while True:
            self._timer_wake = trio.Event()
            deadline = self.router.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timer_wake.wait()
                continue
            self.feed(ev.TimeAdvanced())

    # ------------------------------------------------------------------ HTTP

    async def generation(self, request: Request) -> Response | RoomResponse | BatchResponse:
        path = request.url.path
        try:
            body = await read_json(request, MAX_BODY)  # strict JSON: what the legs can carry
        except BodyError as exc:
            if exc.status == 499:  # a client leaving mid-body is normal: counted, no traceback
                log.info("%s: %s", path, exc.message)
            kind = {400: "invalid_request_error", 413: "request_too_large",
                    499: "client_closed_request"}.get(exc.status, "invalid_request_error")
            return self._reply_now(path, exc.status, error_body(exc.status, exc.message, kind))
        if not isinstance(body, dict):
            return self._reply_now(path, 400, error_body(400, "the body must be a JSON object",
                                                          "invalid_request_error"))
        headers = {"content-type": "application/json"}
        for name in FORWARD_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        headers.update(self.workers.headers)
        try:
            items = _batch(path, body)
        except ApiError as exc:
            return self._reply_now(path, exc.status, exc.body())
        if items is not None:  # a room per prompt (proxy_batch)
            return BatchResponse(self, path, items, headers, stream=body.get("stream") is True)
        return self.open_room(path, body, headers)

    def open_room(self, path: str, body: Mapping[str, object],
                  headers: dict[str, str]) -> RoomResponse | Response:
        """A room for one prompt: its ASGI response (a :class:`RoomResponse`), or the error to
        answer with (no worker)."""
        stream = body.get("stream") is True
        q = ClientRequest(
            request_id=uuid.uuid4().hex,
            path=path,
            client_body=body,
            headers=headers,
            stream=stream,
            return_logprob=body.get("return_logprob") is True,
            migratable=self.router.config.migration_limit > 0 and migratable(path, body),
            prompt_logprobs=wants_prompt_logprobs(path, body),
        )
        if q.migratable:
            q.progress = Progress(path, stream, body.get("return_token_ids") is True,
                                  sequences_asked(path, body))
        s = Room(q)
        refusal = self._dispatch(s, Attempts())
        if refusal is not None:
            response = self._reply_now(path, refusal.status, refusal.body())
            if refusal.retry_after is not None:
                response.headers["retry-after"] = f"{math.ceil(refusal.retry_after)}"
            return response
        return RoomResponse(self, s)

    def _dispatch(self, s: Room, attempts: Attempts) -> Refusal | None:
        """Draw the room (its request's first, or a later one after a retry or a migration) and
        build its legs' body; why not when no worker can take it."""
        q = s.request
        self._no_worker = None
        self._dispatching[q.request_id] = s
        self.feed(ev.RoomRequested(q.request_id, prompt_of(q.path, q.client_body), attempts,
                                   q.migratable, handoff=s.ticket is not None))
        if s.room < 0:
            self._dispatching.pop(q.request_id, None)
            return self._no_worker or Refusal(503, "no workers available", "no_workers")
        # A D that drains hands this stream off only if we route another D to continue it on;
        # a colocated worker cannot hand one off (nothing of it is registered for a pull).
        body = (q.progress.leg_body(q.client_body, handoff=s.decode_role == "decode" and any(
                    d != s.decode for d in self.workers.decode_urls))
                if q.progress is not None else q.client_body)
        rid = body.get("rid")
        s.rid = rid if isinstance(rid, str) and rid else f"pdfsm-{s.room:016x}"
        if attempts.retries or attempts.migrations:  # a name of its own on every worker
            s.rid = f"{s.rid}.{attempts.retries + attempts.migrations}"
        # D alone or a colocated worker prefills it: a plain request; it computes its prompt
        # log-probs too.
        if not s.prefill:
            s.body = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
            s.body["rid"] = s.rid
            if s.ticket is not None:  # D pulls the KV the draining D registered
                s.body["handoff"] = s.ticket
            q.prompt_logprobs = False
            s.p_done.set()
            return None
        target = self.workers.targets.get(s.prefill)
        s.body = {
            **body,
            "rid": s.rid,
            "bootstrap_host": target.bootstrap_host if target else urlsplit(s.prefill).hostname,
            "bootstrap_port": target.bootstrap_port if target else None,
            "bootstrap_room": s.room,
        }
        return None

    def _reply_now(self, path: str, status: int, body: object) -> Response:
        self.count(path, str(status))
        return JSONResponse(body, status_code=status)

    # ------------------------------------------------------------------ for rooms (RoomHost)

    async def reopen(self, s: Room) -> Room | Refusal | list[tuple[int, Room | Refusal]]:
        """The request's next room after ``s`` ended RETRIED, MIGRATED or HANDED_OFF (after
        the retry's backoff), or why no worker could take it; an n > 1 answer the client has
        some of goes on as its unfinished sequences, each in a room of its own (by index)."""
        reopen = s.reopen
        assert reopen is not None
        await trio.sleep(reopen.delay)
        progress = s.request.progress
        if progress is not None and progress.apart:
            # Each with the request's attempts so far: --migration-limit bounds how many times
            # any of its sequences moves, as it bounds a single one's.
            parts: list[tuple[int, Room | Refusal]] = []
            for index, body, own in progress.sequences(s.request.client_body):
                one = Room(s.request.sequence(index, body, own))
                parts.append((index, self._dispatch(one, reopen.attempts) or one))
            return parts
        nxt = Room(s.request)
        if progress is not None:
            if reopen.cause == "handoff" and progress.ticket is not None:
                nxt.ticket, nxt.handoff_from = progress.ticket, s.decode
                progress.adopt_next_token(progress.ticket)
            elif progress.moved:  # a hand-off with no KV (/move_streams): re-prefilled
                self.moved += 1
                log.info("room %d: %s gave the stream of request %s up (%s)", s.room, s.decode,
                         s.request.request_id, progress.moved)
            progress.ticket = progress.moved = None  # one room uses it
        refusal = self._dispatch(nxt, reopen.attempts)
        return nxt if refusal is None else refusal

    def count(self, path: str, status: str) -> None:
        self.requests.labels(path, status).inc()

    def start_soon(self, fn: Callable[[Room], Awaitable[None]], s: Room) -> None:
        assert self._nursery is not None, "ProxyServer.run is not running"
        self._nursery.start_soon(fn, s)

    def room_over(self, s: Room) -> None:
        self._rooms.pop(s.room, None)

    def leg_refused(self, url: str, status: int) -> None:
        self.workers.leg_refused(url, status)

    def contain(self, where: str, s: Room, exc: Exception) -> Failure:
        """An exception in one room's work: counted, logged, and the room failed in the router
        (its other leg aborted) if it is still live. Returns the answer the client should get."""
        self.contained[where] += 1
        # The prefill leg's traceback is logged here; a room's by the edge that answers it.
        log.error("room %d: contained a failure of its %s: %r", s.room, where, exc,
                  exc_info=exc if where == "prefill_leg" else None)
        message = f"proxy: {where} failed: {describe(exc)}"
        failure = (500, error_body(500, message, "internal_server_error"))
        leg = "prefill" if where == "prefill_leg" else "decode"
        if s.room in self.router.rooms:
            try:
                self.feed(ev.LegResponded(s.room, leg, False, message), failure)
            except Exception:  # the router itself failed: the deadline still ends the room
                log.exception("room %d: could not fail the room", s.room)
        return failure


async def _post_quietly(client: httpx.AsyncClient, url: str, path: str, body: dict[str, object],
                        headers: dict[str, str], what: str) -> None:
    try:
        with trio.fail_after(ABORT_TIMEOUT):
            await client.post(f"{url}{path}", json=body, headers=headers)
    except (httpx.HTTPError, trio.TooSlowError) as exc:
        log.warning("%s at %s failed: %r", what, url, exc)


def _app(proxy: ProxyServer, api_key: str | None) -> Starlette | ApiKeyGate:
    """The proxy's HTTP routes: generation (a room per prompt), the workers' own, /metrics."""

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(proxy.registry), media_type="text/plain; version=0.0.4")

    w = proxy.workers
    routes = [Route(p, proxy.generation, methods=["POST"]) for p in GENERATION_PATHS]
    routes += [Route(p, w.info, methods=["GET"]) for p in INFO_PATHS]
    routes += [
        Route("/health", w.health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/workers", w.listing, methods=["GET"]),
        # A launcher's workers (`pd-fsm cluster --max-workers`): behind the key, like every
        # route but /health and /metrics.
        Route("/workers/add", w.add, methods=["POST"]),
        Route("/workers/remove", w.remove, methods=["POST"]),
    ]
    app = edge_app(routes, exception_handlers={HTTPException: _on_http_exception})
    return app if api_key is None else ApiKeyGate(app, api_key)


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)),
                        status_code=exc.status_code)


def _batch(path: str, body: Mapping[str, object]) -> list[dict[str, Any]] | None:
    """A batched request's bodies, one per prompt (``schemas.split_batch``, whose type for a JSON
    object, dict[str, Any], this keeps)."""
    kind = {"/generate": "generate", "/v1/completions": "completion"}.get(path)
    return None if kind is None else split_batch(kind, body)  # type: ignore[arg-type]


async def serve_proxy(
    proxy: ProxyServer,
    host: str = "127.0.0.1",
    port: int | None = 0,
    *,
    uds: UnixSocket | None = None,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy's tasks and its HTTP server (on ``uds`` too, or alone with ``port``
    None); ``started()`` with the base URL."""

    async def http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                   ) -> None:
        await serve_app(proxy.app, host, port, tls=proxy.tls, uds=uds,
                        shutdown_trigger=shutdown_trigger, task_status=task_status)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.run)
        binds: list[str] = await nursery.start(http)
        task_status.started(binds[0])
        log.info("proxy listening on %s", " and ".join(map(display, binds)))
