"""The runners' launcher: with ``pd-fsm cluster --max-workers N`` the runner (local
or ``--ray``) serves a small control endpoint through which the planner (``pd-fsm planner
--launcher-url``) or an operator adds and removes PD workers.

What a worker is belongs to a ``WorkerBackend``: here ``ProcessBackend``, a child process of the
local runner (``supervisor.Cluster``); on Ray ``ray_launcher.ActorBackend``, a worker actor placed
like its role's siblings. The endpoint, its answers and refusals, the proxy calls and the role
checks are this module's, the same on both runners.

- ``POST /scale_up {"role": "prefill"|"decode"}`` starts one more worker of that role with the
  flags its siblings got (``local.launched_worker``; on Ray an actor that picks its ports on its
  node), while the runner has
  fewer than ``max_workers`` PD workers (409 naming the bound otherwise). It answers **once the
  worker is healthy and the proxy routes it** (200 with its URL), not at once with a 202: the
  caller learns whether it got a worker (a worker that is not healthy within the start deadline,
  or exits first, is stopped and the request answered 504 or 502 with the reason and the
  worker's last log lines), the planner counts the outcome it really had (``launched``,
  ``failed``), and a worker it observes next is one that serves. A planner waiting on the answer
  decides nothing meanwhile, which is what it should do while the cluster changes (as it holds
  off while a switched worker drains).
- ``POST /scale_down {"worker": URL}`` removes one of the workers this runner started: first from
  the proxy (``POST /workers/remove``: no new leg reaches it once that answered), then SIGTERM to
  its process (on Ray through its actor, which is then killed without restart) —
  the worker drains (its rooms and streams finish, a D hands its streams to another D) and exits
  0 — killed only past its ``--drain-timeout`` and a grace. Refused (409) while it starts, stops
  or switches roles, and when it is the last worker serving its role (roles as each worker's
  ``/server_info`` says now: the planner moves them); 404 for a URL this runner did not start.
- ``GET /workers``: every PD worker the runner manages, its state (``starting``, ``serving``,
  ``stopping``) and the role it was started in; the planner observes the serving ones.

Each scale runs as a task of the launcher's nursery to its end, even if its caller leaves: a
worker half started or half stopped would be nobody's. Until every child of the cluster is
healthy both answer 503 with Retry-After. Every wait has a deadline: the worker's health
(``start_timeout``), the proxy (``PROXY_S``), the roles (``ROLE_PROBE_S``), the stop.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import httpx
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.io_trio.api_key import ApiKeyGate
from pd_fsm.io_trio.cli_common import DRAIN_TIMEOUT_S
from pd_fsm.io_trio.cluster.supervisor import STOP_GRACE, Child, Cluster, probe
from pd_fsm.io_trio.http_edge import BodyError, describe, edge_app, read_json
from pd_fsm.io_trio.http_server import http_client, serve_app
from pd_fsm.io_trio.strict_json import loads as strict_loads
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import UnixSocket, display, service_url

log = logging.getLogger("pd_fsm.io_trio.cluster.launcher")

PROXY_S = 5.0  # the proxy's /workers/add and /workers/remove answer at once
ROLE_PROBE_S = 2.0  # a worker whose /server_info takes longer counts as serving no role
PROBE_EVERY = 0.5  # a starting worker's /health
MAX_BODY = 4096  # {"role": ...} or {"worker": URL}
SCALE_ROLES = ("prefill", "decode")
Answer = tuple[int, dict[str, Any]]
# A role and a name to the child that would serve it, ports picked, not started yet.
NewWorker = Callable[[str, str], Child]
Stopped = tuple[int | None, bool]  # its exit status (None: not known) and whether it was killed


class WorkerBackend(Protocol):
    """What a PD worker is to the launcher: how it is made, started, watched and stopped. A
    worker is a ``Child`` either way (its name, role, URL once started, side-channel port)."""

    def present(self) -> list[Child]:
        """The PD workers the cluster started with (read again when it is ready)."""

    def new(self, role: str, name: str) -> Child:
        """One more worker of ``role``, not started yet."""

    async def start(self, child: Child) -> tuple[int, str] | None:
        """Start it (its ``url`` is set once this returned None); else (status, why)."""

    async def exited(self, child: Child) -> str | None:
        """Why a starting worker will not serve (it exited: how, its last lines), or None."""

    def serving(self, child: Child) -> None:
        """It serves: from now on its death is the cluster's, as its siblings'."""

    async def stop(self, child: Child, grace: float) -> Stopped:
        """Stop it for good (SIGTERM: a worker drains), killed past ``grace`` seconds."""


@attrs.define
class ProcessBackend:
    """The local runner's workers: child processes of its ``Cluster``."""

    cluster: Cluster
    new_worker: NewWorker

    def present(self) -> list[Child]:
        return [c for c in self.cluster.children if c.role and c.url]

    def new(self, role: str, name: str) -> Child:
        return self.new_worker(role, name)

    async def start(self, child: Child) -> tuple[int, str] | None:
        child.fatal = False  # until it serves, its exit is the scale-up's answer
        await self.cluster.spawn(child)  # raises OSError if it cannot start at all
        return None

    async def exited(self, child: Child) -> str | None:
        code = None if child.proc is None else child.proc.returncode
        if code is None:
            return None
        await trio.sleep(0.2)  # let the forwarder take its last lines
        return exited_before_healthy(code, list(child.tail)[-5:])

    def serving(self, child: Child) -> None:
        child.fatal = True

    async def stop(self, child: Child, grace: float) -> Stopped:
        if child.proc is None:  # it never started
            return None, False
        return await self.cluster.retire(child, grace)


def exited_before_healthy(code: int, tail: list[str]) -> str:
    """A scale-up's 502: how the worker's process ended, and its last lines."""
    return f"exited with status {code} before it was healthy: {' | '.join(tail)}"


def drain_timeout(args: argparse.Namespace) -> float:
    """The workers' ``--drain-timeout`` (from ``--worker-args``, else serve's default): how long
    a worker the launcher stops may take to drain."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--drain-timeout", type=float, default=DRAIN_TIMEOUT_S)
    known, _ = parser.parse_known_args(shlex.split(args.worker_args or ""))
    return float(known.drain_timeout)


def _as_url(value: str) -> str:
    """A worker's URL as the runner holds it (``unix:PATH`` as ``http://unix:PATH:``)."""
    try:
        return service_url(value, "body.worker")
    except ValueError:
        return value.rstrip("/")  # not a URL: it will match no worker (404)


def _error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "launcher_error", "code": status}}


@attrs.define(eq=False)
class Managed:
    """A PD worker of the runner's: ``starting`` until healthy and routed, ``serving``, then
    ``stopping`` from the moment a scale-down takes it."""

    child: Child
    state: str = "starting"

    def row(self) -> dict[str, Any]:
        return {"url": self.child.url, "name": self.child.name, "role": self.child.role,
                "state": self.state}


class Launcher:
    """The control endpoint; a ``ClusterService`` of the local runner's ``Cluster``, a thread of
    the Ray driver's (``ray_launcher``)."""

    name = "launcher"

    def __init__(self, backend: WorkerBackend, *, max_workers: int,
                 proxy_url: str, headers: dict[str, str], host: str, port: int | None,
                 start_timeout: float, stop_timeout: float, tls: TLS = NO_TLS,
                 api_key: str | None = None, uds: UnixSocket | None = None) -> None:
        """``headers``: what it sends to the proxy and the workers; ``api_key``: what its own
        callers must send (all but /health); ``uds``: its unix socket (``port`` None: on it
        alone)."""
        self.url: str | None = None
        self.extra = f"POST /scale_up, /scale_down; GET /workers (--max-workers {max_workers})"
        self._backend = backend
        self.max_workers = max_workers
        # Public: the Ray runner learns its proxy's URL once the proxy is placed (``ready``).
        self.proxy_url = proxy_url.rstrip("/")
        self._headers = headers
        self._host, self._port, self._uds = host, port, uds
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self._tls = tls
        self._api_key = api_key
        # By name (unique: names go on counting): a Ray worker has a URL only once started.
        self.workers: dict[str, Managed] = {}
        self._started = dict.fromkeys(SCALE_ROLES, 0)
        self._adopt()
        self._ready = False
        # One removal at a time: each judges the roles the last one left. Waiting for it is
        # bounded by the holder's own deadlines (roles, proxy, the stop).
        self._removing = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._client: httpx.AsyncClient | None = None

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """The HTTP server and the scales it runs, in one nursery; ``started()`` with the URL."""
        async with http_client(timeout=PROXY_S, tls=self._tls) as client, \
                trio.open_nursery() as nursery:
            self._client, self._nursery = client, nursery
            app = self.app()

            async def http(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await serve_app(app, self._host, self._port, tls=self._tls, uds=self._uds,
                                task_status=task_status)

            binds: list[str] = await nursery.start(http)
            task_status.started(binds[0])

    def _adopt(self) -> None:
        """The workers the cluster started with, those not known yet (on Ray: known once it is
        up). Names go on counting from them: a worker added after prefill-0 and prefill-1 is
        prefill-2, also once prefill-1 is gone (its log lines keep their meaning)."""
        for child in self._backend.present():
            self.workers.setdefault(child.name, Managed(child))
        for role in SCALE_ROLES:
            present = sum(m.child.role == role for m in self.workers.values())
            self._started[role] = max(self._started[role], present)

    def ready(self) -> None:
        self._adopt()
        for managed in self.workers.values():
            managed.state = "serving"
        self._ready = True

    def app(self) -> Any:
        async def health(request: Request) -> Response:
            return JSONResponse({"status": "ok" if self._ready else "starting"})

        async def listing(request: Request) -> Response:
            return JSONResponse({"workers": [m.row() for m in self.workers.values()],
                                 "max_workers": self.max_workers})

        app = edge_app([Route("/health", health, methods=["GET"]),
                        Route("/workers", listing, methods=["GET"]),
                        Route("/scale_up", self.scale_up, methods=["POST"]),
                        Route("/scale_down", self.scale_down, methods=["POST"])])
        # Scaling starts and stops processes: with a key, only its holders may.
        return app if self._api_key is None else ApiKeyGate(app, self._api_key)

    # ------------------------------------------------------------------ scale up

    async def scale_up(self, request: Request) -> Response:
        body = await _body(request, "role", '{"role": "prefill"|"decode"}')
        if isinstance(body, Response):
            return body
        role = body["role"]
        if role not in SCALE_ROLES:
            return _answer((400, _error(400, f'body.role must be "prefill" or "decode", got '
                                             f'{role!r}')))
        if not self._ready:
            return _not_ready()
        if len(self.workers) >= self.max_workers:
            return _answer((409, _error(409, f"max_workers: the runner has {len(self.workers)} "
                                             f"PD workers, its bound (--max-workers "
                                             f"{self.max_workers}): none started")))
        name = f"{role}-{self._started[role]}"
        self._started[role] += 1
        managed = Managed(self._backend.new(role, name))
        # Counted against the bound from now: two scale-ups at once cannot both pass it.
        self.workers[name] = managed
        return _answer(await self._to_the_end(lambda: self._launch(managed)))

    async def _launch(self, managed: Managed) -> Answer:
        child = managed.child
        start = trio.current_time()
        try:
            failure = await self._backend.start(child)
            if failure is None:
                failure = await self._wait_healthy(child)
            if failure is None:
                failure = await self._tell_proxy("add", {
                    "url": child.url, "role": child.role, "bootstrap_port": child.side_port})
        except BaseException:
            await self._drop(managed)
            raise
        if failure is not None:
            await self._drop(managed)
            status, why = failure
            log.warning("scale_up: %s: %s", child.name, why)
            return status, _error(status, f"{child.name} ({child.url}): {why}")
        self._backend.serving(child)
        managed.state = "serving"
        ready_s = trio.current_time() - start
        print(f"pd-fsm cluster: launched {child.name} {display(str(child.url))} ({child.role}) in "
              f"{ready_s:.1f} s", flush=True)
        return 200, {"worker": child.url, "name": child.name, "role": child.role,
                     "bootstrap_port": child.side_port, "ready_s": round(ready_s, 3)}

    async def _wait_healthy(self, child: Child) -> tuple[int, str] | None:
        with trio.move_on_after(self.start_timeout):
            while True:
                why = await self._backend.exited(child)
                if why is not None:
                    return 502, why
                await probe(self._http(), child)
                if child.healthy:
                    return None
                await trio.sleep(PROBE_EVERY)
        return 504, (f"not healthy within {self.start_timeout:g} s (last: {child.status}): "
                     "stopped")

    async def _drop(self, managed: Managed) -> None:
        """A worker that will not serve: out of the list, its process stopped."""
        self.workers.pop(managed.child.name, None)
        with trio.CancelScope(shield=True):
            await self._backend.stop(managed.child, STOP_GRACE)

    # ------------------------------------------------------------------ scale down

    async def scale_down(self, request: Request) -> Response:
        body = await _body(request, "worker", '{"worker": URL}')
        if isinstance(body, Response):
            return body
        url = body["worker"]
        if not isinstance(url, str):
            return _answer((400, _error(400, "body.worker must be a string: a worker's URL")))
        if not self._ready:
            return _not_ready()
        managed = next((m for m in self.workers.values() if m.child.url == _as_url(url)), None)
        if managed is None:
            return _answer((404, _error(404, f"body.worker: {url} is not a worker this runner "
                                             "started (GET /workers lists them)")))
        return _answer(await self._to_the_end(lambda: self._remove(managed)))

    async def _remove(self, managed: Managed) -> Answer:
        child, url = managed.child, str(managed.child.url)
        async with self._removing:
            if managed.state != "serving":
                return 409, _error(409, f"body.worker: {url} is {managed.state}")
            refusal = await self._last_of_its_role(managed)
            if refusal is not None:
                return 409, _error(409, f"body.worker: {refusal}: not stopped")
            managed.state = "stopping"
            # Out of the proxy first: once it answered, no new leg goes there; then the drain.
            failure = await self._tell_proxy("remove", {"url": url})
            if failure is not None:
                managed.state = "serving"
                return failure[0], _error(failure[0], f"{failure[1]}: {url} not stopped")
            start = trio.current_time()
            code, killed = await self._backend.stop(child, self.stop_timeout)
            self.workers.pop(child.name, None)
        stopped_s = trio.current_time() - start
        print(f"pd-fsm cluster: stopped {child.name} {url}: exit status {code}"
              f"{' (killed)' if killed else ''} after {stopped_s:.1f} s", flush=True)
        return 200, {"worker": url, "name": child.name, "exit_status": code, "killed": killed,
                     "stopped_s": round(stopped_s, 3)}

    async def _last_of_its_role(self, managed: Managed) -> str | None:
        """Why ``managed`` may not go (None: it may): it is switching roles, or no other
        worker would serve its role — prefill and decode each need one, and a colocated (null)
        worker's whole requests need another colocated worker or a P and a D."""
        roles: dict[str, tuple[str, bool]] = {}
        serving = [m for m in self.workers.values() if m.state == "serving"]
        async with trio.open_nursery() as nursery:
            for m in serving:
                nursery.start_soon(self._role_of, m, roles)
        url = str(managed.child.url)
        role, settled = roles.get(url, (str(managed.child.role), True))
        if not settled:
            return f"{url} is switching roles (to {role}): ask again when it serves"
        others = [r for u, (r, s) in roles.items() if s and u != url]
        if role in SCALE_ROLES and role not in others:
            return f"{url} is the last {role} worker serving"
        if role == "null" and "null" not in others and not set(SCALE_ROLES) <= set(others):
            return f"{url} is the last worker serving whole requests (no other colocated " \
                   "worker, nor a prefill and a decode worker)"
        return None

    async def _role_of(self, m: Managed, out: dict[str, tuple[str, bool]]) -> None:
        """``out[url]``: the role its ``/server_info`` reports and whether it serves in it;
        nothing when it does not answer within ``ROLE_PROBE_S``."""
        try:
            with trio.fail_after(ROLE_PROBE_S):
                r = await self._http().get(f"{m.child.url}/server_info", headers=self._headers)
            info = strict_loads(r.content, what="a worker's /server_info")
        except (httpx.HTTPError, trio.TooSlowError, ValueError):
            return
        if r.status_code == 200 and isinstance(info, dict):
            role = info.get("disaggregation_mode")
            if role in ("prefill", "decode", "null"):
                out[str(m.child.url)] = (str(role), info.get("role_state", "SERVING") ==
                                         "SERVING")

    # ------------------------------------------------------------------ shared

    async def _tell_proxy(self, what: str, body: dict[str, Any]) -> tuple[int, str] | None:
        """``POST /workers/{what}`` on the proxy; None once it answered 200, else (502, why)."""
        try:
            with trio.fail_after(PROXY_S):
                r = await self._http().post(f"{self.proxy_url}/workers/{what}", json=body,
                                            headers=self._headers)
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            return 502, f"the proxy's /workers/{what} failed: {describe(exc)}"
        if r.status_code != 200:
            return 502, f"the proxy's /workers/{what} answered {r.status_code}: {r.text[:300]}"
        return None

    async def _to_the_end(self, scale: Callable[[], Awaitable[Answer]]) -> Answer:
        """Run ``scale`` as a task of the launcher's nursery, to its end even if the caller
        leaves, and wait for its answer. A bug in it is this request's 500, not the cluster's
        end."""
        assert self._nursery is not None, "Launcher.serve is not running"
        done = trio.Event()
        out: list[Answer] = []

        async def task() -> None:
            try:
                out.append(await scale())
            except Exception as exc:
                log.exception("launcher: a scale failed")
                out.append((500, _error(500, f"the launcher failed: {describe(exc)}")))
            finally:
                done.set()

        self._nursery.start_soon(task)
        await done.wait()
        return out[0]

    def _http(self) -> httpx.AsyncClient:
        assert self._client is not None, "Launcher.serve is not running"
        return self._client


async def _body(request: Request, field: str, shape: str) -> dict[str, Any] | Response:
    """The body as ``{field: value}``, or the 4xx answer naming what is wrong with it."""
    try:
        body = await read_json(request, MAX_BODY)
    except BodyError as exc:
        return _answer((exc.status, _error(exc.status, exc.message)))
    if not isinstance(body, dict):
        return _answer((400, _error(400, f"the body must be a JSON object: {shape}")))
    unknown = sorted(set(body) - {field})
    if unknown:
        return _answer((400, _error(400, f"unknown field(s) {', '.join(unknown)} @ body: give "
                                         f"only {field}")))
    if field not in body:
        return _answer((400, _error(400, f"body.{field} is missing: {shape}")))
    return body


def _answer(answer: Answer) -> Response:
    return JSONResponse(answer[1], status_code=answer[0])


def _not_ready() -> Response:
    return JSONResponse(_error(503, "the cluster is not ready yet: every child must answer "
                                    "/health first"), status_code=503,
                        headers={"Retry-After": "5"})
