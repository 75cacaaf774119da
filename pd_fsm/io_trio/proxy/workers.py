"""The workers the proxy routes to (``proxy.server.ProxyServer`` holds one :class:`Workers`).

They come from the command line or, refreshed every ``refresh_interval``, from the bootstrap
server's ``GET /list?role=prefill|decode``; for the load-aware policies each one's ``/get_load``
is polled every ``load_interval``. A worker's role can change at runtime (``POST
/switch_role``): with a registry, its record is withdrawn and comes back under the new role; with
static lists, each worker's ``/server_info`` is probed every ``role_probe_interval`` and the
worker is routed by the role it reports (a worker that reports none, such as an sglang worker,
keeps the role it was given on the command line). A worker in role ``null`` (``--colocated``, or
probed as such) is a colocated target: the router sends it whole requests. The bootstrap
registry lists P and D only (a worker switched to null leaves it): with ``--bootstrap-url`` the
colocated workers are the ``--colocated`` ones that the registry does not list under another
role. The proxy's routes about them are here too:
``/health`` (a prefill and a decode worker answer theirs), ``/workers`` (who is routed to, each
breaker, each probed role) and the pass-through of the model-info paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_fsm.core.router import RoomRouter
from pd_fsm.io_trio.bootstrap.listing import list_role, worker_url
from pd_fsm.io_trio.http_edge import BodyError, read_json
from pd_fsm.io_trio.proxy.answers import error_body
from pd_fsm.io_trio.strict_json import loads as strict_loads
from pd_fsm.io_trio.unix_sockets import (
    IPC_PREFIX,
    service_url,
    side_channel_endpoint,
    socket_path_of,
)

log = logging.getLogger("pd_fsm.io_trio.proxy.server")  # one log for the whole proxy

HEALTH_PROBE_S = 2.0  # a worker that does not answer its /health within this is not healthy
LOAD_PROBE_S = 2.0  # a worker whose /get_load takes longer keeps no polled load this round
ROLE_PROBE_S = 2.0  # a worker whose /server_info takes longer keeps its last known role
CHANGE_BODY_MAX = 4096  # /workers/add and /workers/remove: a URL, a role, a port


@attrs.frozen
class ProbedRole:
    """What a worker's ``/server_info`` said of its role at the last probe."""

    role: str  # "prefill" | "decode" | "null"
    epoch: int
    serving: bool  # False while it drains or switches: routed as neither role
    bootstrap_port: int | None
    # P's side channel's ipc:// endpoint when it serves on a unix socket alone (None: TCP).
    bootstrap_host: str | None = None


@attrs.frozen
class PrefillTarget:
    """A P worker: its HTTP URL and the (host, port) routers inject as bootstrap_host/port (a
    P on a unix socket alone: its side channel's ``ipc://`` endpoint, and no port)."""

    url: str
    bootstrap_host: str
    bootstrap_port: int | None

    @classmethod
    def from_url(cls, url: str, port: int | None, host: str | None = None) -> PrefillTarget:
        """``host``: what routers know P by, when not its URL's host: an ``ipc://`` endpoint.
        A P given by its unix socket and no port is known by the side channel a worker on its
        socket alone binds (``PATH.zmq``); with a port, its side channel is on loopback."""
        url = url.rstrip("/")
        path = socket_path_of(url)
        if host is None and path is not None:
            host = side_channel_endpoint(Path(path)) if port is None else "127.0.0.1"
        return cls(url, host or urlsplit(url).hostname or "127.0.0.1", port)


class Workers:
    def __init__(
        self,
        router: RoomRouter,
        client: Callable[[], httpx.AsyncClient],
        prefill: list[PrefillTarget],
        decode: list[str],
        *,
        headers: dict[str, str],
        bootstrap_url: str | None,
        refresh_interval: float,
        load_interval: float,
        role_probe_interval: float = 2.0,
        colocated: list[str] | None = None,
    ) -> None:
        self._router = router
        self._client = client  # the proxy's (made when it runs)
        self.targets = {p.url: p for p in prefill}
        self.decode_urls = [d.rstrip("/") for d in decode]
        # Workers serving whole requests (role "null"); with a registry, the static ones.
        self.static_colocated = [c.rstrip("/") for c in colocated or []]
        self.colocated_urls = list(self.static_colocated)
        # Sent to workers on every call (legs, aborts, info). Without it a leg carries the
        # client's own Authorization header, as sglang-router forwards it.
        self.headers = headers
        self.bootstrap_url = bootstrap_url.rstrip("/") if bootstrap_url else None
        self.refresh_interval = refresh_interval
        self.load_interval = load_interval
        # Static lists: each URL's role as given on the command line (and P's bootstrap port,
        # and its ipc:// endpoint if given), and as its last /server_info said,
        # which wins when it says one.
        self._configured: dict[str, tuple[str, int | None, str | None]] = {
            p.url: ("prefill", p.bootstrap_port, _ipc_host(p.bootstrap_host)) for p in prefill}
        for d in self.decode_urls:  # in the command line's order: round robin follows it
            self._configured.setdefault(d, ("decode", None, None))
        for c in self.colocated_urls:
            self._configured.setdefault(c, ("null", None, None))
        self.role_probe_interval = role_probe_interval
        self.probed: dict[str, ProbedRole] = {}
        self.role_probes = {"ok": 0, "failed": 0}
        # Workers routed as another role than before, or newly as none or as one.
        self.role_changes = 0
        self._reprobe = trio.Event()
        self.load_polls = {"ok": 0, "failed": 0}  # /get_load calls (load-aware routing)
        self._polls_failing: set[str] = set()  # workers whose last poll failed (logged once)

    # ------------------------------------------------------------------ loads

    async def poll_loads(self) -> None:
        """Every ``load_interval``, each worker's ``/get_load`` (its ``num_reqs``, all ranks) for
        the load-aware policies; a worker that does not answer keeps no polled load."""
        while True:
            loads: dict[str, int] = {}
            async with trio.open_nursery() as nursery:
                for url in {*self.targets, *self.decode_urls, *self.colocated_urls}:
                    nursery.start_soon(self._probe_load, url, loads)
            self._router.planner.set_loads(loads)
            await trio.sleep(self.load_interval)

    async def _probe_load(self, url: str, loads: dict[str, int]) -> None:
        try:
            with trio.fail_after(LOAD_PROBE_S):
                r = await self._client().get(f"{url}/get_load", headers=self.headers)
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

    # ------------------------------------------------------------------ roles (static lists)

    @property
    def probes_roles(self) -> bool:
        return self.bootstrap_url is None and self.role_probe_interval > 0

    def leg_refused(self, url: str, status: int) -> None:
        """A leg to ``url`` got 409 (it is in another role now) or 503 (draining: for a
        role switch, the proxy learns it a probe interval early): probe the roles at once."""
        if not self._reprobe.is_set():  # once per probe round, not once per refused leg
            log.info("%s refused a leg (%d): probing the workers' roles now", url, status)
        self._reprobe.set()

    async def probe_roles(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                          ) -> None:
        """Every ``role_probe_interval`` (or at once after a 409), each configured worker's
        role from its ``/server_info``; the routed lists follow. ``started()`` after the first
        round, so that a proxy starting beside a switched worker routes it right at once."""
        while True:
            async with trio.open_nursery() as nursery:
                for url in self._configured:
                    nursery.start_soon(self._probe_role, url)
            self._route_by_role()
            task_status.started()
            task_status = trio.TASK_STATUS_IGNORED
            with trio.move_on_after(self.role_probe_interval):
                await self._reprobe.wait()
            self._reprobe = trio.Event()

    async def _probe_role(self, url: str) -> None:
        try:
            with trio.fail_after(ROLE_PROBE_S):
                r = await self._client().get(f"{url}/server_info", headers=self.headers)
        except (httpx.HTTPError, trio.TooSlowError):
            # Unreachable: its last known role stands (the circuit breaker keeps a dead
            # worker out; a restarted one is probed again next round).
            self.role_probes["failed"] += 1
            return
        self.role_probes["ok"] += 1
        probed = _probed_role(r)
        if probed is None:
            self.probed.pop(url, None)  # it reports no switchable role: the configured one
        else:
            self.probed[url] = probed

    def _route_by_role(self) -> None:
        for gone in set(self.probed) - set(self._configured):  # probed as it was removed
            del self.probed[gone]
        targets: dict[str, PrefillTarget] = {}
        decode: list[str] = []
        colocated: list[str] = []
        for url, (role, port, host) in self._configured.items():
            probed = self.probed.get(url)
            if probed is not None:
                if not probed.serving:
                    continue  # draining or switching: neither role's any more
                role = probed.role
                port = probed.bootstrap_port if probed.bootstrap_port is not None else port
                host = probed.bootstrap_host or host
            if role == "prefill":
                targets[url] = PrefillTarget.from_url(url, port, host)
            elif role == "decode":
                decode.append(url)
            elif role == "null":
                colocated.append(url)
        self._route_to(targets, decode, colocated)

    # ------------------------------------------------------------------ added, removed

    async def add(self, request: Request) -> Response:
        """``POST /workers/add {"url", "role": "prefill"|"decode"|"null", "bootstrap_port"}``:
        route one more worker (a launcher started it), at once as ``role`` and then as its role
        probes say; 200 (``added`` false: it was routed already, now as ``role``)."""
        body = await _worker_change(request, {"url", "role", "bootstrap_port"}, self.bootstrap_url)
        if isinstance(body, Response):
            return body
        url, role, port = body["url"], body.get("role"), body.get("bootstrap_port")
        if role not in ("prefill", "decode", "null"):
            return _refuse(400, f'body.role must be "prefill", "decode" or "null", got {role!r}')
        if port is not None and (type(port) is not int or not 0 < port < 65536):
            return _refuse(400, "body.bootstrap_port must be a port number (1-65535) or null: "
                                "P's side-channel port")
        added = url not in self._configured
        self._configured[url] = (role, port, None)
        self._route_by_role()
        self._reprobe.set()  # its own /server_info next, not an interval from now
        log.warning("workers: %s %s as %s", "added" if added else "re-added", url, role)
        return JSONResponse({"url": url, "role": role, "added": added})

    async def remove(self, request: Request) -> Response:
        """``POST /workers/remove {"url"}``: no new leg goes to it once this answered 200 (its
        rooms in flight go on: it drains). 404 for a worker this proxy does not route."""
        body = await _worker_change(request, {"url"}, self.bootstrap_url)
        if isinstance(body, Response):
            return body
        url = body["url"]
        if url not in self._configured:
            return _refuse(404, f"body.url: {url} is not a worker this proxy routes")
        del self._configured[url]
        self.probed.pop(url, None)
        self._route_by_role()
        log.warning("workers: removed %s", url)
        return JSONResponse({"url": url, "removed": True})

    # ------------------------------------------------------------------ discovery

    async def discover(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
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

    # dict[str, Any] here and below: a bootstrap registry record, as bootstrap.listing types
    # one (a JSON object read by key).
    async def _list(self, role: str) -> list[dict[str, Any]]:
        assert self.bootstrap_url is not None
        return await list_role(self._client(), self.bootstrap_url, role)

    def _set_workers(self, prefill: list[dict[str, Any]], decode: list[dict[str, Any]]) -> None:
        targets: dict[str, PrefillTarget] = {}
        for rec in prefill:
            url = worker_url(rec)
            if url is None or url in targets:
                continue
            host, port = _advertised(rec)
            targets[url] = PrefillTarget(url, host, port)
        decode_urls = sorted({u for u in map(worker_url, decode) if u is not None})
        # A --colocated worker the registry lists (it was switched to P or D) is routed as that.
        colocated = [c for c in self.static_colocated if c not in targets and c not in decode_urls]
        self._route_to(dict(sorted(targets.items())), decode_urls, colocated)

    def _route_to(self, targets: dict[str, PrefillTarget], decode_urls: list[str],
                  colocated: list[str]) -> None:
        if (targets != self.targets or decode_urls != self.decode_urls
                or colocated != self.colocated_urls):
            before = _roles_of(self.targets, self.decode_urls, self.colocated_urls)
            after = _roles_of(targets, decode_urls, colocated)
            self.role_changes += sum(before.get(u) != after.get(u) for u in {*before, *after})
            epochs = {u: p.epoch for u, p in self.probed.items()}
            log.info("workers: prefill %s, decode %s, colocated %s%s", sorted(targets),
                     decode_urls, colocated, f" (role epochs {epochs})" if epochs else "")
        self.targets = targets
        self.decode_urls = decode_urls
        self.colocated_urls = colocated
        self._router.set_workers(list(self.targets), decode_urls, colocated)

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        """200 only while at least one prefill and one decode worker (a decode worker alone
        with ``--local-prefill-without-prefill``), or one colocated worker, answer their own
        /health (probed now, concurrently, within HEALTH_PROBE_S): routers
        and load balancers poll this to decide whether to send traffic, and a proxy that can
        serve no request can only fail it."""
        sides = {"prefill": list(self.targets), "decode": list(self.decode_urls),
                 "colocated": list(self.colocated_urls)}
        healthy: dict[str, int] = {side: 0 for side in sides}

        async def probe(side: str, url: str) -> None:
            try:
                with trio.fail_after(HEALTH_PROBE_S):
                    r = await self._client().get(f"{url}/health", headers=self.headers)
                if r.status_code == 200:
                    healthy[side] += 1
            except (httpx.HTTPError, trio.TooSlowError):
                pass

        async with trio.open_nursery() as nursery:
            for side, urls in sides.items():
                for url in urls:
                    nursery.start_soon(probe, side, url)
        # D alone serves every request where the router lets it (no P listed): P is optional.
        needed = (("decode",) if self._router.planner.config.local_prefill_without_prefill
                  else ("prefill", "decode"))
        missing = ([] if healthy["colocated"] else
                   [side for side in needed if healthy[side] == 0])
        body: dict[str, object] = {
            "status": "ok" if not missing else f"no healthy {' or '.join(missing)} worker",
            **{side: {"healthy": healthy[side], "configured": len(urls)}
               for side, urls in sides.items()},
        }
        if missing:
            body["missing"] = missing
        return JSONResponse(body, status_code=503 if missing else 200)

    async def listing(self, request: Request) -> Response:
        """The workers routed to now, by role (their HTTP URLs; colocated: role "null"), and
        each one's circuit breaker (CLOSED, OPEN, HALF_OPEN, PROBING)."""
        return JSONResponse({"prefill": list(self.targets), "decode": list(self.decode_urls),
                             "colocated": list(self.colocated_urls),
                             "breakers": self._router.breakers.states(),
                             "roles": {u: _role_row(p) for u, p in self.probed.items()}})

    async def info(self, request: Request) -> Response:
        """Pass-through to the first decode worker (then prefill, then colocated)."""
        for base in [*self.decode_urls, *self.targets, *self.colocated_urls]:
            try:
                r = await self._client().get(base + request.url.path, headers=self.headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return JSONResponse(error_body(503, "no worker reachable"), status_code=503)


async def _worker_change(request: Request, fields: set[str], bootstrap_url: str | None
                         ) -> dict[str, Any] | Response:
    """The body of ``/workers/add`` or ``/workers/remove`` (``fields`` allowed, ``url``
    required, its trailing slash dropped), or the 4xx answer naming what is wrong."""
    if bootstrap_url is not None:
        return _refuse(409, f"this proxy routes the workers the registry lists "
                            f"(--bootstrap-url {bootstrap_url}): add or remove them there")
    try:
        body = await read_json(request, CHANGE_BODY_MAX)
    except BodyError as exc:
        return _refuse(exc.status, exc.message)
    if not isinstance(body, dict):
        return _refuse(400, 'the body must be a JSON object: {"url": "http://HOST:PORT", ...}')
    unknown = sorted(set(body) - fields)
    if unknown:
        return _refuse(400, f"unknown field(s) {', '.join(unknown)} @ body: give "
                            f"{', '.join(sorted(fields))}")
    url = body.get("url")
    try:
        if not isinstance(url, str):
            raise ValueError(url)
        url = service_url(url, "body.url")
    except ValueError:
        return _refuse(400, "body.url must be a worker's URL: http://HOST:PORT, https://... or "
                            "unix:PATH")
    return {**body, "url": url}


def _refuse(status: int, message: str) -> Response:
    return JSONResponse(error_body(status, message, "invalid_request_error" if status == 400
                                   else "proxy_error"), status_code=status)


def _probed_role(r: httpx.Response) -> ProbedRole | None:
    """A worker's role from its ``/server_info`` answer; None when it reports no switchable
    role (no ``role_epoch``: an sglang worker, or one that cannot switch)."""
    if r.status_code != 200:
        return None
    try:
        info = strict_loads(r.content, what="a worker's /server_info")
    except ValueError:
        return None
    if not isinstance(info, dict):
        return None
    role, epoch = info.get("disaggregation_mode"), info.get("role_epoch")
    if role not in ("prefill", "decode", "null") or type(epoch) is not int:
        return None
    # P's side-channel port while it is P (routers inject it as bootstrap_port; the config's
    # disaggregation_bootstrap_port is the registry's).
    port, host = info.get("prefill_bootstrap_port"), info.get("prefill_bootstrap_host")
    return ProbedRole(role, epoch, info.get("role_state", "SERVING") == "SERVING",
                      port if type(port) is int else None, _ipc_host(host))


def _roles_of(targets: dict[str, PrefillTarget], decode: list[str], colocated: list[str]
              ) -> dict[str, str]:
    return {**{u: "null" for u in colocated}, **{u: "decode" for u in decode},
            **{u: "prefill" for u in targets}}


def _role_row(probed: ProbedRole) -> dict[str, Any]:
    """A probed role as ``/workers`` lists it (``bootstrap_host`` only for a P on a unix socket
    alone)."""
    row = attrs.asdict(probed)
    if row["bootstrap_host"] is None:
        del row["bootstrap_host"]
    return row


def _ipc_host(host: object) -> str | None:
    """``host`` if it is an ``ipc://`` endpoint (what a P on a unix socket alone is known by)."""
    return host if isinstance(host, str) and host.startswith(IPC_PREFIX) else None


def _advertised(rec: dict[str, Any]) -> tuple[str, int | None]:
    zmq = str(rec.get("zmq_addr", ""))
    if zmq.startswith(IPC_PREFIX):  # a P on a unix socket alone: known by its endpoint
        port = rec.get("bootstrap_port")
        return str(rec.get("bootstrap_host") or zmq), port if type(port) is int else None
    zmq = zmq.removeprefix("tcp://")
    zhost, _, zport = zmq.rpartition(":")
    host = rec.get("bootstrap_host") or zhost or "127.0.0.1"
    port = rec.get("bootstrap_port") or (int(zport) if zport.isdigit() else None)
    return str(host), port
