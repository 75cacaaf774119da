"""The planner as a service: every ``interval`` it scrapes each worker's
``/server_info`` and ``/metrics``, hands the snapshots to the core's sans-IO ``Planner`` and acts
on what it decides — a role switch is ``POST /switch_role`` on that worker, to whatever role the
core names (``"null"``, colocated, too once its ``Role`` has it); a priority change
(``--prefill-nices``) is ``POST /set_nice``, a cores move (``--cores``) ``POST /set_cpus``. Asking
for one more worker, or giving one back, goes to a launcher (``--launcher-url``: ``pd-fsm cluster
--max-workers``' control endpoint) as ``POST /scale_up {"role"}`` or ``POST /scale_down
{"worker"}``, which answer once the worker serves or has drained and exited (outcome ``launched``
or ``stopped``; a 4xx is ``refused``, anything else ``failed``); the workers it observes are then
the launcher's ``GET /workers`` (those serving), with any ``--worker`` and the registry's. Without
a launcher such a decision is logged and counted ``not_actionable``.

One nursery: the HTTP server (``/metrics``, ``/health``, ``/decisions``, ``POST /pause`` and
``POST /resume``) and the loop. Every wait has a deadline: a scrape ``SCRAPE_S``, a switch
request ``SWITCH_S``, the launcher ``launcher_timeout`` (a scale-up waits for a worker's start).
While it waits for the launcher the planner observes nothing: the cluster is changing, as after
any decision's cooldown.

Paused (``--paused`` at start, or ``POST /pause``), the planner scrapes, observes and decides
nothing: an operator holds the split while working on the cluster, or a benchmark warms every
shape up without the warm-up's load moving roles. ``POST /resume`` starts it from a policy with
no memory (patience counts, remembered pressures, cooldowns): what it saw before the pause is
not the load it will act on.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from typing import Any

import httpx
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.core.planner import (
    Decision,
    MoveStreams,
    Planner,
    ScaleDown,
    ScaleUp,
    SetCpus,
    SetNice,
    SwitchRole,
    WorkerSnapshot,
)
from pd_fsm.io_trio.api_key import ApiKeyGate
from pd_fsm.io_trio.bootstrap.listing import list_role, worker_url
from pd_fsm.io_trio.cluster.cpu_placement import cpu_list
from pd_fsm.io_trio.http_edge import edge_app
from pd_fsm.io_trio.http_server import http_client, serve_app
from pd_fsm.io_trio.planner.scrape import Scrape, parse
from pd_fsm.io_trio.strict_json import loads as strict_loads
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import UnixSocket

log = logging.getLogger("pd_fsm.io_trio.planner")

SCRAPE_S = 2.0  # a worker that does not answer within this is left out of this observation
SWITCH_S = 5.0  # /switch_role answers at once (202) and switches in the background
# The launcher answers a scale-up once the worker serves: a model load and warm-up (the cluster
# passes its own bound plus a margin; 600 s is `pd-fsm cluster --startup-timeout`'s default).
LAUNCHER_S = 630.0
RECENT = 100  # decisions kept for /decisions
# pd_fsm_planner_workers' sides: "null" counts the colocated workers the planner sees.
WORKER_SIDES = ("prefill", "decode", "null")


class PlannerService:
    def __init__(self, planner: Planner, *, workers: list[str], bootstrap_url: str | None,
                 interval: float, headers: dict[str, str] | None = None, tls: TLS = NO_TLS,
                 dry_run: bool = False, paused: bool = False, api_key: str | None = None,
                 launcher_url: str | None = None, launcher_timeout: float = LAUNCHER_S
                 ) -> None:
        """``api_key``: what callers of this planner's own endpoints must send (all but
        /health and /metrics); ``headers``: what it sends to the workers and the launcher."""
        if not workers and bootstrap_url is None and launcher_url is None:
            raise ValueError("give --worker URLs, --bootstrap-url or --launcher-url")
        self.planner = planner
        self.static = [w.rstrip("/") for w in workers]
        self.bootstrap_url = bootstrap_url.rstrip("/") if bootstrap_url else None
        self.launcher_url = launcher_url.rstrip("/") if launcher_url else None
        self.launcher_timeout = launcher_timeout
        self._launched: list[str] = []  # the launcher's serving workers, as last listed
        self.interval = interval
        self.headers = headers or {}
        self.tls = tls
        self.dry_run = dry_run  # decide and log, never act
        self.paused = paused  # observe nothing, decide nothing (POST /pause, /resume)
        self.api_key = api_key
        self._last: dict[str, Scrape] = {}
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT)
        self.registry = CollectorRegistry(auto_describe=False)
        self.decisions = Counter(
            "pd_fsm_planner_decisions", "decisions by kind, target role, the cluster's pressure "
            "class that led to it, and what acting on it gave", ["kind", "to", "pressure",
                                                                 "outcome"],
            registry=self.registry)
        self.observations = Counter("pd_fsm_planner_observations", "observations by the "
                                    "pressure class the planner saw", ["pressure"],
                                    registry=self.registry)
        self.scrapes = Counter("pd_fsm_planner_scrapes", "worker scrapes by outcome",
                               ["outcome"], registry=self.registry)
        self.pressure = Gauge("pd_fsm_planner_pressure", "each side's pressure (1.0: at its "
                              "target)", ["side"], registry=self.registry)
        # Labelled "side", not "role": Prometheus targets carry a role label of their own.
        self.workers = Gauge("pd_fsm_planner_workers", "workers serving each role as last "
                             "scraped", ["side"], registry=self.registry)
        self.paused_gauge = Gauge("pd_fsm_planner_paused", "1 while the planner is paused "
                                  "(POST /pause): it observes and decides nothing",
                                  registry=self.registry)
        self.paused_gauge.set(int(paused))
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        async with http_client(timeout=SCRAPE_S, tls=self.tls) as client:
            self._client = client
            task_status.started()
            while True:
                if not self.paused:
                    await self.observe_once(trio.current_time())
                await trio.sleep(self.interval)

    def pause(self) -> None:
        if not self.paused:
            log.warning("planner: paused (it decides nothing until POST /resume)")
        self.paused = True
        self.paused_gauge.set(1)

    def resume(self) -> None:
        """Observe again, from a policy with no memory of what it saw before the pause."""
        if self.paused:
            self.planner = Planner(self.planner.config)
            self._last = {}
            log.warning("planner: resumed")
        self.paused = False
        self.paused_gauge.set(0)

    async def observe_once(self, now: float) -> list[Decision]:
        urls = await self._worker_urls()
        scrapes: dict[str, Scrape] = {}
        async with trio.open_nursery() as nursery:
            for url in urls:
                nursery.start_soon(self._scrape, url, scrapes)
        snapshots: list[WorkerSnapshot] = []
        for url, scrape in sorted(scrapes.items()):
            snap = scrape.snapshot(url, self._last.get(url))
            if snap is not None:
                snapshots.append(snap)
        self._last = scrapes
        for role in WORKER_SIDES:
            self.workers.labels(role).set(sum(s.role == role and not s.switching
                                              for s in snapshots))
        p_load, d_load = self.planner.pressures(snapshots)
        self.pressure.labels("prefill").set(p_load)
        self.pressure.labels("decode").set(d_load)
        pressure = self.planner.classify(snapshots)
        self.observations.labels(pressure).inc()
        decisions = self.planner.observe(snapshots, now)
        for decision in decisions:
            outcome = await self.act(decision)
            to = _target(decision)
            self.decisions.labels(type(decision).__name__, to, pressure, outcome).inc()
            # "at": this process's clock (what cooldowns count in); "wall": for lining decisions
            # up with other processes' logs and a benchmark's phases.
            entry = {"at": now, "wall": time.time(), "kind": type(decision).__name__, "to": to,
                     "worker": getattr(decision, "worker", ""), "reason": decision.reason,
                     "pressure": pressure, "outcome": outcome}
            self.recent.append(entry)
            log.warning("planner: %s", json.dumps(entry))
        return decisions

    async def _worker_urls(self) -> list[str]:
        urls = set(self.static)
        if self.launcher_url is not None:
            urls.update(await self._launcher_workers())
        if self.bootstrap_url is None:
            return sorted(urls)
        for role in ("prefill", "decode"):
            try:
                records = await list_role(self._http(), self.bootstrap_url, role)
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("bootstrap %s: listing failed: %r", self.bootstrap_url, exc)
                continue
            urls.update(u for u in map(worker_url, records) if u is not None)
        # A worker that is switching is in no list: the last ones seen stay observed.
        return sorted(urls | set(self._last))

    async def _launcher_workers(self) -> list[str]:
        """The launcher's serving workers (``GET /workers``); those of its last answer when it
        does not answer (its workers did not go with it)."""
        assert self.launcher_url is not None
        try:
            with trio.fail_after(SCRAPE_S):
                r = await self._http().get(f"{self.launcher_url}/workers", headers=self.headers)
            r.raise_for_status()
            listed = strict_loads(r.content, what=f"{self.launcher_url}/workers")
            rows = listed.get("workers") if isinstance(listed, dict) else None
            if not isinstance(rows, list):
                raise ValueError('no "workers" list')
            self._launched = [str(w["url"]) for w in rows
                              if isinstance(w, dict) and w.get("state") == "serving"]
        except (httpx.HTTPError, trio.TooSlowError, ValueError, KeyError) as exc:
            log.warning("launcher %s: listing failed: %r", self.launcher_url, exc)
        return self._launched

    async def _scrape(self, url: str, out: dict[str, Scrape]) -> None:
        try:
            with trio.fail_after(SCRAPE_S):
                info = await self._http().get(f"{url}/server_info", headers=self.headers)
                metrics = await self._http().get(f"{url}/metrics", headers=self.headers)
            info.raise_for_status()
            metrics.raise_for_status()
            parsed = strict_loads(info.content, what=f"{url}/server_info")
            if not isinstance(parsed, dict):
                raise ValueError("/server_info is not an object")
            out[url] = parse(parsed, metrics.text, trio.current_time())
            self.scrapes.labels("ok").inc()
        except (httpx.HTTPError, trio.TooSlowError, ValueError) as exc:
            self.scrapes.labels("failed").inc()
            log.info("scrape of %s failed: %r", url, exc)

    async def act(self, decision: Decision) -> str:
        """Carry ``decision`` out on its worker (or the launcher): what came of it, the
        decisions counter's ``outcome`` ("switching", "set", "moved", "refused", ...)."""
        if self.dry_run:
            return "dry_run"
        if isinstance(decision, ScaleUp | ScaleDown):
            return await self._scale(decision)
        body: dict[str, object]
        if isinstance(decision, SetNice):
            what, path, body = f"nice {decision.nice}", "set_nice", {"nice": decision.nice}
        elif isinstance(decision, SetCpus):
            cores = cpu_list(decision.cpus)
            what, path, body = f"cores {cores}", "set_cpus", {"cpus": cores}
        elif isinstance(decision, MoveStreams):
            what, path = "streams", "move_streams"
            body = {"max_context": decision.max_context}
        else:
            what, path, body = f"role {decision.to}", "switch_role", {"role": decision.to}
        try:
            with trio.fail_after(SWITCH_S):
                r = await self._http().post(f"{decision.worker}/{path}", json=body,
                                            headers=self.headers)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            log.warning("%s of %s failed: %r", what, decision.worker, exc)
            return "failed"
        if r.status_code == 202:
            return "switching"
        if r.status_code == 200 and isinstance(decision, MoveStreams):
            # The count is the worker's answer (a label value per count would grow without end).
            log.warning("%s of %s: %s", what, decision.worker, r.text[:100])
            return "moved"
        if r.status_code == 200:
            return "set" if isinstance(decision, SetNice | SetCpus) else "already"
        log.warning("%s of %s refused (%d): %s", what, decision.worker, r.status_code,
                    r.text[:300])
        return "refused"

    async def _scale(self, decision: ScaleUp | ScaleDown) -> str:
        """A scale through the launcher: ``launched`` / ``stopped`` once it answered 200."""
        if self.launcher_url is None:
            return "not_actionable"  # no launcher: see the module's docstring
        body: dict[str, str]
        if isinstance(decision, ScaleUp):
            path, body, done = "scale_up", {"role": decision.role}, "launched"
        else:
            path, body, done = "scale_down", {"worker": decision.worker}, "stopped"
        try:
            with trio.fail_after(self.launcher_timeout):
                r = await self._http().post(f"{self.launcher_url}/{path}", json=body,
                                            headers=self.headers, timeout=self.launcher_timeout)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            log.warning("%s %s at %s failed: %r", path, body, self.launcher_url, exc)
            return "failed"
        if r.status_code == 200:
            log.warning("%s %s: %s", path, body, r.text[:300])
            return done
        log.warning("%s %s refused (%d): %s", path, body, r.status_code, r.text[:300])
        return "refused" if 400 <= r.status_code < 500 else "failed"

    def _http(self) -> httpx.AsyncClient:
        assert self._client is not None, "PlannerService.run is not running"
        return self._client

    # ------------------------------------------------------------------ HTTP

    def app(self) -> Any:
        async def metrics(request: Request) -> Response:
            return Response(generate_latest(self.registry),
                            media_type="text/plain; version=0.0.4")

        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok"})

        async def decisions(request: Request) -> Response:
            return JSONResponse({"decisions": list(self.recent)})

        async def pause(request: Request) -> Response:
            self.pause()
            return JSONResponse({"paused": True})

        async def resume(request: Request) -> Response:
            self.resume()
            return JSONResponse({"paused": False})

        app = edge_app([Route("/metrics", metrics, methods=["GET"]),
                        Route("/health", health, methods=["GET"]),
                        Route("/decisions", decisions, methods=["GET"]),
                        Route("/pause", pause, methods=["POST"]),
                        Route("/resume", resume, methods=["POST"])])
        # /pause and /resume change what the cluster does: with a key, only its holders may.
        return app if self.api_key is None else ApiKeyGate(app, self.api_key)


def _target(decision: Decision) -> str:
    """What a decision moves the worker to, as the decisions counter's ``to`` label."""
    if isinstance(decision, SwitchRole):
        return decision.to
    if isinstance(decision, ScaleUp):
        return decision.role
    if isinstance(decision, SetCpus):
        return cpu_list(decision.cpus)
    if isinstance(decision, MoveStreams):
        return f"<= {decision.max_context} tokens"
    return str(decision.nice) if isinstance(decision, SetNice) else ""


async def serve_planner(service: PlannerService, host: str = "127.0.0.1",
                        port: int | None = 0, *, uds: UnixSocket | None = None,
                        shutdown_trigger: Any = None,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """The loop and its HTTP server (on ``uds`` too, or alone with ``port`` None) in one
    nursery; ``started()`` with the base URL."""
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)

        async def http(*, task_status: trio.TaskStatus[list[str]]) -> None:
            await serve_app(service.app(), host, port, tls=service.tls, uds=uds,
                            shutdown_trigger=shutdown_trigger, task_status=task_status)
            nursery.cancel_scope.cancel()

        binds: list[str] = await nursery.start(http)
        task_status.started(binds[0])
