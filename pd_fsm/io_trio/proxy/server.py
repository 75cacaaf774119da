"""The PD proxy (RFC-2 §5.7): every client request becomes a room of the core's RoomRouter.

The router decides (room id uniform in [0, 2^63), which P and D by the routing policies of
``core.routing`` — or D alone, conditional disaggregation — what happens when a leg fails, times
out or the client leaves); this adapter only carries out its effects and feeds it what happened
(and, for the load-aware policies, the workers' ``/get_load`` polled every ``load_interval``):

* ``DispatchRoom`` -> post the same body to P and D concurrently (one pooled httpx client), with
  ``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` injected (and ``rid`` when the
  client gave none, so the legs can be aborted by name);
* ``DispatchLocal`` -> post the body to D alone, without bootstrap fields: D prefills it;
* ``RelayDecode`` -> the client gets D's status and body, SSE relayed chunk by chunk as it
  arrives; prompt log-probs, which only P computes, are put into D's answer from P's
  (``logprob_merge``: P's leg then goes unstreamed, and D's is relayed once P's is in). The room
  stays live (RELAYING) until the last byte is out (``RelayFinished``), so a client that leaves
  mid-stream still gets both legs aborted;
* ``AbortLeg`` -> ``POST /abort_request {"rid"}`` to that worker, and the leg's HTTP request is
  dropped;
* ``ReplyError`` -> the failing leg's status and JSON error (a timeout: 504).

P's leg runs in the proxy's own nursery: a client that got D's answer does not wait for P to be
drained. Workers come from the command line or, refreshed periodically, from the bootstrap
server's ``GET /list?role=prefill|decode``; ``GET /workers`` names the current ones (the bench
scrapes their ``/metrics``). ``/metrics`` has histograms of each leg and of D's first byte
(``pd_fsm.io_trio.worker.phases``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import uuid
from collections.abc import Callable
from typing import Any, assert_never
from urllib.parse import urlsplit

import attrs
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
from pd_fsm.io_trio.proxy.batch import BatchResponse
from pd_fsm.io_trio.proxy.logprob_merge import SseRewriter, merge, wants_prompt_logprobs
from pd_fsm.io_trio.proxy.migration import Progress, migratable
from pd_fsm.io_trio.proxy.prompt_key import prompt_of
from pd_fsm.io_trio.strict_json import loads as strict_loads
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.worker.metrics import StatsCollector
from pd_fsm.io_trio.worker.phases import PhaseHistograms
from pd_fsm.io_trio.worker.schemas import ApiError, split_batch
from pd_fsm.io_trio.worker.sse import Receive, Send

log = logging.getLogger("pd_fsm.io_trio.proxy.server")

GENERATION_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
INFO_PATHS = ("/v1/models", "/model_info", "/get_model_info", "/server_info", "/get_server_info")
FORWARD_HEADERS = ("authorization", "x-request-id")
ABORT_TIMEOUT = 5.0
HEALTH_PROBE_S = 2.0  # a worker that does not answer its /health within this is not healthy
LOAD_PROBE_S = 2.0  # a worker whose /get_load takes longer keeps no polled load this round
_SSE_DONE = b"data: [DONE]\n\n"  # the last event of an sglang / OpenAI stream
MAX_BODY = 8 * 1024 * 1024
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
_BREAKER_LEVEL = {"CLOSED": 0, "HALF_OPEN": 1, "PROBING": 1, "OPEN": 2}


@attrs.frozen
class PrefillTarget:
    """A P worker: its HTTP URL and the (host, port) routers inject as bootstrap_host/port."""

    url: str
    bootstrap_host: str
    bootstrap_port: int | None

    @classmethod
    def from_url(cls, url: str, port: int | None) -> PrefillTarget:
        return cls(url.rstrip("/"), urlsplit(url).hostname or "127.0.0.1", port)


# An HTTP status and the JSON body to answer with (Any: a JSON value, as _error_body builds it).
Failure = tuple[int, Any]


def _error_body(status: int, message: str, type_: str = "proxy_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": status}}


def _json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return _error_body(502, raw.decode("utf-8", "replace")[:2000])


def _reason(body: Any, status: int) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return f"HTTP {status}"


@attrs.frozen
class _Refusal:
    """Why a request got no room: no worker of a role (503), or every one full (429)."""

    status: int
    reason: str
    type: str
    retry_after: float | None = None

    def body(self) -> dict[str, Any]:
        return _error_body(self.status, self.reason, self.type)


@attrs.define(eq=False)
class _Session:
    request_id: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    stream: bool
    return_logprob: bool
    prompt_logprobs: bool = False  # P's answer has positions D's lacks (logprob_merge)
    room: int = -1
    prefill: str = ""  # "" when D prefills the room alone (DispatchLocal)
    decode: str = ""
    rid: str = ""
    relay: bool = False  # RelayDecode: D's answer goes to the client
    headers_sent: bool = False  # the client has a status line: errors go in-band from here
    client_gone: bool = False
    relay_finished: bool = False  # the answer (D's, or an error) is out or in the last send
    sse_done: bool = False  # D's "data: [DONE]" event is relayed: the client's stream is whole
    error: Failure | None = None  # ReplyError: status and body to answer with
    decided: trio.Event = attrs.field(factory=trio.Event)
    relay_done: trio.Event = attrs.field(factory=trio.Event)
    p_done: trio.Event = attrs.field(factory=trio.Event)
    p_body: Any = None
    d_posted: float = 0.0  # trio time D's leg was posted
    p_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    d_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # Across the request's rooms (a retry or a migration opens the next one, ReopenRoom).
    client_body: dict[str, Any] = attrs.field(factory=dict)  # the body as the client sent it
    migratable: bool = False
    progress: Progress | None = None  # what the client has of a migratable answer
    reopen: fx.ReopenRoom | None = None  # this room ended RETRIED, MIGRATED or HANDED_OFF
    redirect: bool = False  # RedirectDecode: post the decode leg again, to s.decode
    # A hand-off room (issue 32 §2): the ticket its D pulls from, and the draining D that
    # offers it (told to release it once pulled, or once the pull failed).
    ticket: dict[str, Any] | None = None
    handoff_from: str = ""

    def next_room(self) -> _Session:
        """The session of the request's next room: what belongs to the request carries over."""
        handoff = self.reopen is not None and self.reopen.cause == "handoff"
        ticket = self.progress.ticket if handoff and self.progress is not None else None
        if self.progress is not None:
            self.progress.ticket = None  # one room uses it
        return _Session(self.request_id, self.path, self.client_body, self.headers, self.stream,
                        self.return_logprob, self.prompt_logprobs, headers_sent=self.headers_sent,
                        client_body=self.client_body, migratable=self.migratable,
                        progress=self.progress, ticket=ticket,
                        handoff_from=self.decode if ticket is not None else "")


def _room_of(item: ev.RouterEvent | fx.RouterEffect) -> int | None:
    """The room an event or effect of the router is about; None for those about no room (a new
    request, the passing of time, a breaker, a shed request)."""
    match item:
        case ev.TimeAdvanced() | ev.RoomRequested() | fx.BreakerChanged() | fx.ShedRequest():
            return None
        case (ev.LegResponded() | ev.ClientDisconnected() | ev.RelayFinished() | fx.DispatchRoom()
              | fx.DispatchLocal() | fx.RelayDecode() | fx.AbortLeg() | fx.ReplyError()
              | fx.RedirectDecode() | fx.ReopenRoom()):
            return item.room
        case _:
            assert_never(item)


class Proxy:
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
    ) -> None:
        self.tls = tls  # serves HTTPS if it has a certificate; verifies workers against its CA
        self._targets = {p.url: p for p in prefill}
        # Sent to workers on every call (legs, aborts, info). Without it a leg carries the
        # client's own Authorization header, as sglang-router forwards it.
        self._worker_headers = bearer(worker_api_key) if worker_api_key else {}
        self.router = RoomRouter(
            [p.url for p in prefill],
            [d.rstrip("/") for d in decode],
            rng or random.Random(),
            RouterConfig(room_timeout=room_timeout, decode_recomputes=decode_recomputes,
                         retry_limit=retry_limit, migration_limit=migration_limit,
                         breaker_threshold=breaker_threshold,
                         breaker_cooldown=breaker_cooldown),
            routing,
        )
        self.load_interval = load_interval
        self.load_polls = {"ok": 0, "failed": 0}  # /get_load calls (load-aware routing)
        # Exceptions contained to one room (http_edge's count has the requests' own).
        self.contained = {"prefill_leg": 0, "room": 0}
        # Rooms reopened for their request (ReopenRoom), by cause: "retry", "migration",
        # "handoff"; and decode legs redirected within their room.
        self.reopened = {"retry": 0, "migration": 0, "redirect": 0, "handoff": 0}
        # Hand-off rooms by outcome: the new D pulled the KV and streams on ("taken"), or not,
        # and the request migrated by re-prefill ("fell_back") or failed ("failed").
        self.handoffs = {"taken": 0, "fell_back": 0, "failed": 0}
        self._polls_failing: set[str] = set()  # workers whose last poll failed (logged once)
        self.decode_urls = [d.rstrip("/") for d in decode]
        self.bootstrap_url = bootstrap_url.rstrip("/") if bootstrap_url else None
        self.refresh_interval = refresh_interval
        self.room_timeout = room_timeout
        self._client = client
        self._own_client = client is None
        self._sessions: dict[int, _Session] = {}
        self._dispatching: dict[str, _Session] = {}
        self._no_worker: _Refusal | None = None
        self._nursery: trio.Nursery | None = None
        self._timer_wake = trio.Event()
        self.aborts_sent: dict[str, int] = {"prefill": 0, "decode": 0}
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("pd_fsm_proxy_http_requests", "client requests by path and status",
                                ["path", "status"], registry=self.registry)
        self.registry.register(StatsCollector(self.stats, "pd_fsm_proxy"))
        self.phases = PhaseHistograms(self.registry, "proxy")
        routes = [Route(p, self._generation, methods=["POST"]) for p in GENERATION_PATHS]
        routes += [Route(p, self._info, methods=["GET"]) for p in INFO_PATHS]
        routes += [
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/workers", self._workers, methods=["GET"]),
        ]
        self.app: Starlette | ApiKeyGate = edge_app(
            routes, exception_handlers={HTTPException: self._on_http_exception})
        if api_key is not None:
            self.app = ApiKeyGate(self.app, api_key)

    # ------------------------------------------------------------------ lifecycle

    @property
    def client(self) -> httpx.AsyncClient:
        assert self._client is not None, "Proxy.run is not running"
        return self._client

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        if self._client is None:
            self._client = http_client(timeout=httpx.Timeout(10.0, read=None), tls=self.tls,
                                       max_connections=1024, max_keepalive=256)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timer)
                if self.bootstrap_url is not None:
                    await nursery.start(self._discover)
                if self.router.planner.wants_loads:
                    nursery.start_soon(self._poll_loads)
                task_status.started()
        finally:
            if self._own_client:
                with trio.CancelScope(shield=True):
                    await self._client.aclose()

    def stats(self) -> dict[str, Any]:
        return {
            "rooms_total": dict(self.router.outcomes),
            "rooms_live": len(self.router.rooms),
            "dropped_responses_total": self.router.dropped,
            "aborts_sent_total": dict(self.aborts_sent),
            "prefill_workers": len(self._targets),
            "decode_workers": len(self.decode_urls),
            # "prefill:cache_hit", "decode:round_robin", "local:short_prompt", ...
            "route_decisions_total": dict(self.router.planner.decisions),
            "shed_total": dict(self.router.shed),  # answered 429, by the full role
            "load_polls_total": dict(self.load_polls),
            "contained_failures_total": dict(self.contained),
            "rooms_reopened_total": dict(self.reopened),
            "handoffs_total": dict(self.handoffs),
            # Per worker: 0 closed, 1 half-open or probing, 2 open (table worker_breaker).
            "breaker_state": {w: _BREAKER_LEVEL[st]
                              for w, st in self.router.breakers.states().items()},
            "breaker_transitions_total": dict(self.router.breakers.changes),
            "request_failures_total": request_failures(),
        }

    # ------------------------------------------------------------------ the router

    def _feed(self, event: ev.RouterEvent, failure: Failure | None = None) -> None:
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
                self._sessions[effect.room] = started
                self._timer_wake.set()
            case fx.BreakerChanged():
                level = logging.WARNING if effect.new == "OPEN" else logging.INFO
                log.log(level, "worker %s: circuit breaker %s -> %s", effect.worker, effect.old,
                        effect.new)
            case fx.ReplyError(room=-1):
                self._no_worker = _Refusal(503, effect.reason, "no_workers")  # no P or no D
            case fx.ShedRequest():
                self._no_worker = _Refusal(
                    429, f"every {effect.role} worker is at its queue bound: retry later",
                    "overloaded", effect.retry_after)
            case (fx.RelayDecode() | fx.ReplyError() | fx.RedirectDecode() | fx.ReopenRoom()
                  | fx.AbortLeg()):
                s = self._sessions.get(effect.room)
                if s is not None:
                    self._apply_to_session(s, effect, failure)
            case _:
                assert_never(effect)

    def _apply_to_session(
        self, s: _Session,
        effect: fx.RelayDecode | fx.ReplyError | fx.RedirectDecode | fx.ReopenRoom | fx.AbortLeg,
        failure: Failure | None,
    ) -> None:
        if s.ticket is not None and isinstance(effect, fx.RelayDecode | fx.ReplyError
                                               | fx.ReopenRoom):
            self._handoff_over(s, "taken" if isinstance(effect, fx.RelayDecode)
                               else "failed" if isinstance(effect, fx.ReplyError)
                               else "fell_back")
        match effect:
            case fx.RelayDecode():
                s.relay = True
                s.decided.set()
            case fx.ReplyError():
                s.error = failure or (504, _error_body(504, effect.reason, "timeout"))
                s.decided.set()
            case fx.RedirectDecode():
                self.reopened["redirect"] += 1
                log.info("room %d: decode leg refused by %s, posted to %s", effect.room, s.decode,
                         effect.decode)
                # A scope of its own for the new leg (the old one is spent), armed now so that an
                # abort from here on reaches it.
                s.decode, s.redirect, s.d_scope = effect.decode, True, trio.CancelScope()
            case fx.ReopenRoom():
                self.reopened[effect.cause] += 1
                log.info("room %d: %s of request %s (%s) after %.3f s", effect.room, effect.cause,
                         s.request_id, "refused" if effect.cause == "retry" else s.decode,
                         effect.delay)
                s.reopen = effect
                s.decided.set()
            case fx.AbortLeg():
                (s.p_scope if effect.leg == "prefill" else s.d_scope).cancel()
                assert self._nursery is not None
                self._nursery.start_soon(self._post_abort, effect.leg, effect.url, s.rid)
            case _:
                assert_never(effect)

    def _handoff_over(self, s: _Session, outcome: str) -> None:
        """A hand-off room's leg answered: the KV was pulled (its 2xx comes after the pull) or
        will not be. Either way the draining D may drop the registration now."""
        assert s.ticket is not None
        self.handoffs[outcome] += 1
        log.info("room %d: hand-off from %s %s", s.room, s.handoff_from, outcome)
        uuid_, s.ticket = s.ticket.get("uuid"), None
        assert self._nursery is not None
        self._nursery.start_soon(self._post_release, s.handoff_from, uuid_)

    async def _post_release(self, url: str, uuid_: Any) -> None:
        try:
            with trio.fail_after(ABORT_TIMEOUT):
                await self.client.post(f"{url}/handoff_release", json={"uuid": uuid_},
                                       headers=self._worker_headers)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            # Its lease releases it (within the draining D's --drain-timeout).
            log.warning("hand-off release at %s failed: %r", url, exc)

    async def _post_abort(self, leg: str, url: str, rid: str) -> None:
        self.aborts_sent[leg] += 1
        try:
            with trio.fail_after(ABORT_TIMEOUT):
                await self.client.post(f"{url}/abort_request", json={"rid": rid},
                                       headers=self._worker_headers)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            log.warning("abort of %s leg %s at %s failed: %r", leg, rid, url, exc)

    async def _timer(self) -> None:
        while True:
            self._timer_wake = trio.Event()
            deadline = self.router.next_deadline()
            with trio.move_on_at(math.inf if deadline is None else deadline):
                await self._timer_wake.wait()
                continue
            self._feed(ev.TimeAdvanced())

    # ------------------------------------------------------------------ loads

    async def _poll_loads(self) -> None:
        """Every ``load_interval``, each worker's ``/get_load`` (its ``num_reqs``, all ranks) for
        the load-aware policies; a worker that does not answer keeps no polled load."""
        while True:
            loads: dict[str, int] = {}
            async with trio.open_nursery() as nursery:
                for url in {*self._targets, *self.decode_urls}:
                    nursery.start_soon(self._probe_load, url, loads)
            self.router.planner.set_loads(loads)
            await trio.sleep(self.load_interval)

    async def _probe_load(self, url: str, loads: dict[str, int]) -> None:
        try:
            with trio.fail_after(LOAD_PROBE_S):
                r = await self.client.get(f"{url}/get_load", headers=self._worker_headers)
            r.raise_for_status()
            loads[url] = sum(int(rank["num_reqs"]) for rank in r.json())
            self.load_polls["ok"] += 1
            if url in self._polls_failing:
                self._polls_failing.discard(url)
                log.info("load poll of %s answers again", url)
        except (httpx.HTTPError, trio.TooSlowError, ValueError, KeyError, TypeError) as exc:
            self.load_polls["failed"] += 1
            if url not in self._polls_failing:  # once per outage, not every interval
                self._polls_failing.add(url)
                log.warning("load poll of %s failed: %r", url, exc)

    # ------------------------------------------------------------------ discovery

    async def _discover(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                        ) -> None:
        started = False
        while True:
            try:
                with trio.fail_after(max(self.refresh_interval, 2.0)):
                    prefill = await self._list("prefill")
                    decode = await self._list("decode")
                self._set_workers(prefill, decode)
            except (httpx.HTTPError, trio.TooSlowError, ValueError, KeyError) as exc:
                log.warning("bootstrap %s: listing failed: %r", self.bootstrap_url, exc)
            if not started:
                task_status.started()
                started = True
            await trio.sleep(self.refresh_interval)

    async def _list(self, role: str) -> list[dict[str, Any]]:
        r = await self.client.get(f"{self.bootstrap_url}/list", params={"role": role})
        r.raise_for_status()
        answer = strict_loads(r.content, what="the registry's answer")
        records = answer["instances"] if isinstance(answer, dict) else None
        if not isinstance(records, list):
            raise ValueError("the registry's answer has no list of instances")
        # An instance spanning processes registers every P rank's transfer server; routers
        # send requests to its entry, rank 0 (the others serve no HTTP).
        return [rec for rec in records if isinstance(rec, dict) and rec.get("tp_rank", 0) == 0]

    def _set_workers(self, prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> None:
        targets: dict[str, PrefillTarget] = {}
        for rec in prefill:
            url = _worker_url(rec)
            if url is None or url in targets:
                continue
            host, port = _advertised(rec)
            targets[url] = PrefillTarget(url, host, port)
        decode_urls = sorted({u for u in map(_worker_url, decode) if u is not None})
        if sorted(targets) != sorted(self._targets) or decode_urls != self.decode_urls:
            log.info("workers: prefill %s, decode %s", sorted(targets), decode_urls)
        self._targets = dict(sorted(targets.items()))
        self.decode_urls = decode_urls
        self.router.set_workers(list(self._targets), decode_urls)

    # ------------------------------------------------------------------ HTTP

    async def _on_http_exception(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(_error_body(exc.status_code, str(exc.detail)),
                            status_code=exc.status_code)

    async def _health(self, request: Request) -> Response:
        """200 only while at least one prefill and one decode worker answer their own /health
        (probed now, concurrently, within HEALTH_PROBE_S): routers and load balancers poll this
        to decide whether to send traffic, and a proxy with a dead side can only fail it."""
        sides = {"prefill": list(self._targets), "decode": list(self.decode_urls)}
        healthy: dict[str, int] = {"prefill": 0, "decode": 0}

        async def probe(side: str, url: str) -> None:
            try:
                with trio.fail_after(HEALTH_PROBE_S):
                    r = await self.client.get(f"{url}/health", headers=self._worker_headers)
                if r.status_code == 200:
                    healthy[side] += 1
            except (httpx.HTTPError, trio.TooSlowError):
                pass

        async with trio.open_nursery() as nursery:
            for side, urls in sides.items():
                for url in urls:
                    nursery.start_soon(probe, side, url)
        missing = [side for side in sides if healthy[side] == 0]
        body: dict[str, Any] = {
            "status": "ok" if not missing else f"no healthy {' or '.join(missing)} worker",
            **{side: {"healthy": healthy[side], "configured": len(urls)}
               for side, urls in sides.items()},
        }
        if missing:
            body["missing"] = missing
        return JSONResponse(body, status_code=503 if missing else 200)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def _workers(self, request: Request) -> Response:
        """The workers routed to now, by role (their HTTP URLs), and each one's circuit breaker
        (CLOSED, OPEN, HALF_OPEN, PROBING)."""
        return JSONResponse({"prefill": list(self._targets), "decode": list(self.decode_urls),
                             "breakers": self.router.breakers.states()})

    async def _info(self, request: Request) -> Response:
        """Pass-through to the first decode worker (then prefill)."""
        for base in [*self.decode_urls, *self._targets]:
            try:
                r = await self.client.get(base + request.url.path, headers=self._worker_headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return JSONResponse(_error_body(503, "no worker reachable"), status_code=503)

    async def _generation(self, request: Request) -> Any:
        path = request.url.path
        try:
            body = await read_json(request, MAX_BODY)  # strict JSON: what the legs can carry
        except BodyError as exc:
            if exc.status == 499:  # a client leaving mid-body is normal: counted, no traceback
                log.info("%s: %s", path, exc.message)
            kind = {400: "invalid_request_error", 413: "request_too_large",
                    499: "client_closed_request"}.get(exc.status, "invalid_request_error")
            return self._reply_now(path, exc.status, _error_body(exc.status, exc.message, kind))
        if not isinstance(body, dict):
            return self._reply_now(path, 400, _error_body(400, "the body must be a JSON object",
                                                          "invalid_request_error"))
        headers = {"content-type": "application/json"}
        for name in FORWARD_HEADERS:
            if name in request.headers:
                headers[name] = request.headers[name]
        headers.update(self._worker_headers)
        try:
            items = _batch(path, body)
        except ApiError as exc:
            return self._reply_now(path, exc.status, exc.body())
        if items is not None:  # a room per prompt (proxy_batch)
            return BatchResponse(self, path, items, headers, stream=body.get("stream") is True)
        return self.open_room(path, body, headers)

    def open_room(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """A room for one prompt: its ASGI response (a :class:`RoomResponse`), or the error to
        answer with (no worker)."""
        s = _Session(
            request_id=uuid.uuid4().hex,
            path=path,
            body=body,
            headers=headers,
            stream=body.get("stream") is True,
            return_logprob=body.get("return_logprob") is True,
            prompt_logprobs=wants_prompt_logprobs(path, body),
            client_body=body,
            migratable=self.router.config.migration_limit > 0 and migratable(path, body),
        )
        if s.migratable:
            s.progress = Progress(path, s.stream, body.get("return_token_ids") is True)
        refusal = self._dispatch(s, Attempts())
        if refusal is not None:
            response = self._reply_now(path, refusal.status, refusal.body())
            if refusal.retry_after is not None:
                response.headers["retry-after"] = f"{math.ceil(refusal.retry_after)}"
            return response
        return RoomResponse(self, s)

    def _dispatch(self, s: _Session, attempts: Attempts) -> _Refusal | None:
        """Draw the session's room (its request's first, or a later one after a retry or a
        migration) and build its legs' body; why not when no worker can take it."""
        self._no_worker = None
        self._dispatching[s.request_id] = s
        self._feed(ev.RoomRequested(s.request_id, prompt_of(s.path, s.client_body), attempts,
                                    s.migratable, handoff=s.ticket is not None))
        if s.room < 0:
            self._dispatching.pop(s.request_id, None)
            return self._no_worker or _Refusal(503, "no workers available", "no_workers")
        body = s.progress.leg_body(s.client_body) if s.progress is not None else s.client_body
        rid = body.get("rid")
        s.rid = rid if isinstance(rid, str) and rid else f"pdfsm-{s.room:016x}"
        if attempts.retries or attempts.migrations:  # a name of its own on every worker
            s.rid = f"{s.rid}.{attempts.retries + attempts.migrations}"
        if not s.prefill:  # D prefills it: a plain request, D computes its prompt log-probs too
            s.body = {k: v for k, v in body.items() if k not in BOOTSTRAP_FIELDS}
            s.body["rid"] = s.rid
            if s.ticket is not None:  # D pulls the KV the draining D registered
                s.body["handoff"] = s.ticket
            s.prompt_logprobs = False
            s.p_done.set()
            return None
        target = self._targets.get(s.prefill)
        s.body = {
            **body,
            "rid": s.rid,
            "bootstrap_host": target.bootstrap_host if target else urlsplit(s.prefill).hostname,
            "bootstrap_port": target.bootstrap_port if target else None,
            "bootstrap_room": s.room,
        }
        return None

    async def reopen(self, s: _Session) -> _Session | _Refusal:
        """The request's next room after ``s`` ended RETRIED or MIGRATED (after the retry's
        backoff): its session, or why no worker could take it."""
        reopen = s.reopen
        assert reopen is not None
        await trio.sleep(reopen.delay)
        nxt = s.next_room()
        refusal = self._dispatch(nxt, reopen.attempts)
        return nxt if refusal is None else refusal

    @staticmethod
    def is_room(response: Any) -> bool:
        return isinstance(response, RoomResponse)

    def _reply_now(self, path: str, status: int, body: Any) -> Response:
        self.requests.labels(path, str(status)).inc()
        return JSONResponse(body, status_code=status)

    # ------------------------------------------------------------------ legs

    def _contain(self, where: str, s: _Session, exc: Exception) -> Failure:
        """An exception in one room's work: counted, logged, and the room failed in the router
        (its other leg aborted) if it is still live. Returns the answer the client should get."""
        self.contained[where] += 1
        # The prefill leg's traceback is logged here; a room's by the edge that answers it.
        log.error("room %d: contained a failure of its %s: %r", s.room, where, exc,
                  exc_info=exc if where == "prefill_leg" else None)
        failure = (500, _error_body(500, f"proxy: {where} failed: {describe(exc)}",
                                    "internal_server_error"))
        leg = "prefill" if where == "prefill_leg" else "decode"
        if s.room in self.router.rooms:
            try:
                self._feed(ev.LegResponded(s.room, leg, False, failure[1]["error"]["message"]),
                           failure)
            except Exception:  # the router itself failed: the deadline still ends the room
                log.exception("room %d: could not fail the room", s.room)
        return failure

    async def _prefill_leg(self, s: _Session) -> None:
        """P's leg, in the proxy's own nursery: nothing it raises may reach that nursery (it
        would end the proxy), so an unexpected exception fails this room alone."""
        try:
            await self._post_prefill(s)
        except Exception as exc:
            self._contain("prefill_leg", s, exc)
            s.p_done.set()

    async def _post_prefill(self, s: _Session) -> None:
        status, body, refused, lost = 0, None, False, False
        try:
            with s.p_scope:
                posted = trio.current_time()
                s.p_scope.deadline = posted + self.room_timeout
                # A leg whose body the relay needs is asked for one JSON answer.
                leg = {**s.body, "stream": False} if s.prompt_logprobs else s.body
                async with self.client.stream("POST", s.prefill + s.path, json=leg,
                                              headers=s.headers) as resp:
                    raw = await resp.aread()  # drains an SSE leg too
                    status = resp.status_code
                    ok = 200 <= status < 300
                    body = None if ok and leg.get("stream") is True else _json_or_text(raw)
                    if ok:
                        self.phases.observe("proxy_prefill_leg", trio.current_time() - posted)
        except httpx.HTTPError as exc:
            refused = isinstance(exc, httpx.ConnectError)  # else lost: P may have started
            lost = not refused
            status, body = 502, _error_body(502, f"prefill worker {s.prefill}: {exc!r}",
                                            "prefill_unreachable")
        finally:
            s.p_body = body
            s.p_done.set()
        if status == 0:
            return  # aborted by the router (AbortLeg): nothing to report
        if 200 <= status < 300:
            self._feed(ev.LegResponded(s.room, "prefill", True))
        else:
            failure = (status, body if body is not None else _error_body(status, "prefill failed"))
            self._feed(ev.LegResponded(s.room, "prefill", False, _reason(body, status),
                                       refused or status == 503, status >= 500, lost), failure)

    async def _decode_leg(self, s: _Session, send: Send) -> None:
        """D's leg; posted again to another D while the router redirects it (RedirectDecode:
        the D refused it before taking the room)."""
        try:
            while True:
                await self._post_decode(s, send)
                if not s.redirect:
                    return
                s.redirect = False
        finally:
            s.relay_done.set()

    async def _post_decode(self, s: _Session, send: Send) -> None:
        try:
            with s.d_scope:
                s.d_posted = trio.current_time()
                async with self.client.stream("POST", s.decode + s.path, json=s.body,
                                              headers=s.headers) as resp:
                    if not 200 <= resp.status_code < 300:
                        body = _json_or_text(await resp.aread())
                        self._feed(
                            ev.LegResponded(s.room, "decode", False,
                                            _reason(body, resp.status_code),
                                            resp.status_code == 503, resp.status_code >= 500),
                            (resp.status_code, body),
                        )
                        return
                    self._feed(ev.LegResponded(s.room, "decode", True))
                    if not s.relay:
                        return  # the room already failed; the client got that error
                    await self._relay(s, resp, send)
                    self.phases.observe("proxy_decode_leg", trio.current_time() - s.d_posted)
            if s.relay and s.d_scope.cancelled_caught and not s.client_gone:
                # The router ended the room mid-relay (its deadline): say so to the client.
                await self._relay_error(s, send, 504, "room deadline passed during the relay")
        except httpx.HTTPError as exc:
            if not s.decided.is_set():
                failure = (502, _error_body(502, f"decode worker {s.decode}: {exc!r}",
                                            "decode_unreachable"))
                # Unreachable: D never took the room. Lost: it may have (a new room, then).
                refused = isinstance(exc, httpx.ConnectError)
                self._feed(ev.LegResponded(s.room, "decode", False, repr(exc), refused, True,
                                           lost=not refused), failure)
            elif (s.relay and s.progress is not None and s.progress.finished and s.stream
                  and not s.sse_done):
                # D broke off after its finish event, before [DONE]: nothing is left to
                # generate; the client's stream is ended as D would have ended it.
                self._relay_finished(s)
                await send({"type": "http.response.body", "body": _SSE_DONE, "more_body": False})
            elif s.relay and s.sse_done and not s.relay_finished:
                # D broke off after its last event (killed before the chunked body's end): the
                # client has the whole stream; an error chunk after [DONE] would corrupt it.
                self._relay_finished(s)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            elif s.relay:
                # D broke off mid-relay: the request migrates to a new room (ReopenRoom), or
                # the room fails (P's leg is aborted) and the client is told, in-band when the
                # headers are already out.
                self._feed(ev.LegResponded(s.room, "decode", False, repr(exc), lost=True))
                if s.reopen is None:
                    await self._relay_error(s, send, 502, f"decode worker broke off: {exc!r}")

    async def _relay_error(self, s: _Session, send: Send, status: int, message: str) -> None:
        if s.headers_sent:
            await _send_stream_error(send, message, status)
        else:
            self.requests.labels(s.path, str(status)).inc()
            await _send_json(send, status, _error_body(status, message))

    async def _relay(self, s: _Session, resp: httpx.Response, send: Send) -> None:
        headers = [(b"content-type", resp.headers.get("content-type", "application/json")
                    .encode())]
        self.requests.labels(s.path, str(resp.status_code)).inc()
        if s.stream and resp.headers.get("content-type", "").startswith("text/event-stream"):
            headers.append((b"cache-control", b"no-cache"))
            if not s.headers_sent:  # a migrated request's stream goes on under its headers
                await send({"type": "http.response.start", "status": resp.status_code,
                            "headers": headers})
                s.headers_sent = True
            tail = b""
            first = True
            rewriter = None
            if s.prompt_logprobs:
                p_body = await self._prefill_body(s)
                rewriter = SseRewriter(lambda event: merge(s.path, p_body, event),
                                       once=s.path != "/generate")
            elif s.progress is not None:
                rewriter = SseRewriter(s.progress.observe, once=False,
                                       drop=s.progress.take_handoff)
            async for chunk in resp.aiter_raw():
                if first and chunk:
                    first = False
                    self._first_byte(s)
                if rewriter is not None:
                    chunk = rewriter.feed(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                tail = (tail + chunk)[-len(_SSE_DONE):]
                s.sse_done = tail == _SSE_DONE
            rest = rewriter.flush() if rewriter is not None else b""
            if s.progress is not None and s.progress.ticket is not None:
                # D is draining and handed the stream off: it goes on in the next room, under
                # the headers already sent (or, if the router will not, ends in an error chunk).
                self._feed(ev.LegResponded(s.room, "decode", False, "handed off", handoff=True))
                if s.reopen is None:
                    s.progress.ticket = None
                    await self._relay_error(s, send, 502, "decode worker drained mid-stream")
                return
            self._relay_finished(s)
            await send({"type": "http.response.body", "body": rest, "more_body": False})
            return
        raw = await resp.aread()
        self._first_byte(s)  # a plain answer is read whole: its first byte is its last
        if s.prefill and (s.return_logprob or s.prompt_logprobs):
            raw = await self._merge_logprobs(s, raw)
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": headers})
        s.headers_sent = True
        self._relay_finished(s)
        await send({"type": "http.response.body", "body": raw, "more_body": False})

    def _first_byte(self, s: _Session) -> None:
        self.phases.observe("proxy_decode_first_byte", trio.current_time() - s.d_posted)

    def _relay_finished(self, s: _Session) -> None:
        # Fed before the last send: once the response is complete the server reports the
        # connection's end as http.disconnect, which must not read as a client leaving early.
        s.relay_finished = True
        self._feed(ev.RelayFinished(s.room))

    async def _prefill_body(self, s: _Session) -> Any:
        """P's answer, once its leg is over (None if it never came within the room's time)."""
        with trio.move_on_at(s.p_scope.deadline):
            await s.p_done.wait()
        return s.p_body

    async def _merge_logprobs(self, s: _Session, raw: bytes) -> bytes:
        """D's body with P's prompt log-probs put in (``logprob_merge``)."""
        p_body = await self._prefill_body(s)
        try:
            d_body = json.loads(raw)
        except ValueError:
            return raw
        return json.dumps(d_body).encode() if merge(s.path, p_body, d_body) else raw


class RoomResponse:
    """The ASGI response of one room: both legs, the client's disconnect, and the one answer."""

    def __init__(self, proxy: Proxy, session: _Session) -> None:
        self.proxy = proxy
        self.s = session

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        proxy = self.proxy
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_client, receive, nursery.cancel_scope)
                while await self._room(send):  # a retry or a migration: the next room
                    nxt = await proxy.reopen(self.s)
                    if isinstance(nxt, _Refusal):
                        await self._answer_error(send, nxt.status, nxt.body())
                        break
                    self.s = nxt
                nursery.cancel_scope.cancel()
        except Exception as exc:
            # The room ends with this request: failed in the router (P's leg aborted); the
            # server's edge (http_edge.Contained) answers the client and keeps serving.
            proxy._contain("room", self.s, exc)
            raise
        finally:
            proxy._sessions.pop(self.s.room, None)

    async def _room(self, send: Send) -> bool:
        """Run the current room to its end: True when the request goes on in a new room."""
        proxy, s = self.proxy, self.s
        assert proxy._nursery is not None
        async with trio.open_nursery() as legs:
            if s.prefill:
                proxy._nursery.start_soon(proxy._prefill_leg, s)
            legs.start_soon(proxy._decode_leg, s, send)
            await s.decided.wait()
            if s.reopen is None and s.error is not None:
                await self._answer_error(send, *s.error)
            elif s.reopen is None:
                await s.relay_done.wait()  # a migration may end the relay (ReopenRoom)
            legs.cancel_scope.cancel()
        proxy._sessions.pop(s.room, None)
        return s.reopen is not None

    async def _answer_error(self, send: Send, status: int, body: Any) -> None:
        """The request's error: a JSON answer, or an error chunk in a stream already begun (a
        room after a migration)."""
        s = self.s
        # The answer is whole: the disconnect the server reports after it is its end, not a
        # client leaving (it was counted as "disconnected" too).
        s.relay_finished = True
        if s.headers_sent:
            await _send_stream_error(send, _reason(body, status), status)
            return
        self.proxy.requests.labels(s.path, str(status)).inc()
        await _send_json(send, status, body)

    async def _watch_client(self, receive: Receive, scope: trio.CancelScope) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                if self.s.relay_finished:
                    return  # the end of a complete response, not a client leaving
                self.s.client_gone = True
                self.proxy.requests.labels(self.s.path, "disconnected").inc()
                self.proxy._feed(ev.ClientDisconnected(self.s.room))
                scope.cancel()
                return


async def _send_json(send: Send, status: int, body: Any) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode(),
                "more_body": False})


async def _send_stream_error(send: Send, message: str, status: int = 502) -> None:
    chunk = {"error": {"message": message, "type": "stream_error", "code": status},
             "meta_info": {"finish_reason": {"type": "abort", "message": message}}}
    data = b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n"
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _batch(path: str, body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A batched request's bodies, one per prompt (``schemas.split_batch``)."""
    kind = {"/generate": "generate", "/v1/completions": "completion"}.get(path)
    return None if kind is None else split_batch(kind, body)  # type: ignore[arg-type]


def _worker_url(rec: dict[str, Any]) -> str | None:
    addr = rec.get("scheduler_addr")
    if not isinstance(addr, str) or not addr:
        return None
    return (addr if "://" in addr else f"http://{addr}").rstrip("/")


def _advertised(rec: dict[str, Any]) -> tuple[str, int | None]:
    zmq = str(rec.get("zmq_addr", "")).removeprefix("tcp://")
    zhost, _, zport = zmq.rpartition(":")
    host = rec.get("bootstrap_host") or zhost or "127.0.0.1"
    port = rec.get("bootstrap_port") or (int(zport) if zport.isdigit() else None)
    return str(host), port


async def serve_proxy(
    proxy: Proxy,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    shutdown_trigger: Callable[[], Any] | None = None,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the proxy's tasks and its HTTP server; ``started()`` with the base URL."""

    async def http(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                   ) -> None:
        await serve_app(proxy.app, host, port, tls=proxy.tls, shutdown_trigger=shutdown_trigger,
                        task_status=task_status)
        nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.run)
        binds: list[str] = await nursery.start(http)
        task_status.started(binds[0])
        log.info("proxy listening on %s", binds[0])
