"""The workers the proxy routes to (``proxy.server.Proxy`` holds one :class:`Workers`).

They come from the command line or, refreshed every ``refresh_interval``, from the bootstrap
server's ``GET /list?role=prefill|decode``; for the load-aware policies each one's ``/get_load``
is polled every ``load_interval``. The proxy's routes about them are here too: ``/health`` (a
prefill and a decode worker answer theirs), ``/workers`` (who is routed to, and each breaker) and
the pass-through of the model-info paths.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import attrs
import httpx
import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_fsm.core.router import RoomRouter
from pd_fsm.io_trio.proxy.answers import error_body
from pd_fsm.io_trio.strict_json import loads as strict_loads

log = logging.getLogger("pd_fsm.io_trio.proxy.server")  # the proxy's log, as before the split

HEALTH_PROBE_S = 2.0  # a worker that does not answer its /health within this is not healthy
LOAD_PROBE_S = 2.0  # a worker whose /get_load takes longer keeps no polled load this round


@attrs.frozen
class PrefillTarget:
    """A P worker: its HTTP URL and the (host, port) routers inject as bootstrap_host/port."""

    url: str
    bootstrap_host: str
    bootstrap_port: int | None

    @classmethod
    def from_url(cls, url: str, port: int | None) -> PrefillTarget:
        return cls(url.rstrip("/"), urlsplit(url).hostname or "127.0.0.1", port)


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
    ) -> None:
        self._router = router
        self._client = client  # the proxy's (made when it runs)
        self.targets = {p.url: p for p in prefill}
        self.decode_urls = [d.rstrip("/") for d in decode]
        # Sent to workers on every call (legs, aborts, info). Without it a leg carries the
        # client's own Authorization header, as sglang-router forwards it.
        self.headers = headers
        self.bootstrap_url = bootstrap_url.rstrip("/") if bootstrap_url else None
        self.refresh_interval = refresh_interval
        self.load_interval = load_interval
        self.load_polls = {"ok": 0, "failed": 0}  # /get_load calls (load-aware routing)
        self._polls_failing: set[str] = set()  # workers whose last poll failed (logged once)

    # ------------------------------------------------------------------ loads

    async def poll_loads(self) -> None:
        """Every ``load_interval``, each worker's ``/get_load`` (its ``num_reqs``, all ranks) for
        the load-aware policies; a worker that does not answer keeps no polled load."""
        while True:
            loads: dict[str, int] = {}
            async with trio.open_nursery() as nursery:
                for url in {*self.targets, *self.decode_urls}:
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

    async def _list(self, role: str) -> list[dict[str, Any]]:
        r = await self._client().get(f"{self.bootstrap_url}/list", params={"role": role})
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
        if sorted(targets) != sorted(self.targets) or decode_urls != self.decode_urls:
            log.info("workers: prefill %s, decode %s", sorted(targets), decode_urls)
        self.targets = dict(sorted(targets.items()))
        self.decode_urls = decode_urls
        self._router.set_workers(list(self.targets), decode_urls)

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        """200 only while at least one prefill and one decode worker answer their own /health
        (probed now, concurrently, within HEALTH_PROBE_S): routers and load balancers poll this
        to decide whether to send traffic, and a proxy with a dead side can only fail it."""
        sides = {"prefill": list(self.targets), "decode": list(self.decode_urls)}
        healthy: dict[str, int] = {"prefill": 0, "decode": 0}

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
        missing = [side for side in sides if healthy[side] == 0]
        body: dict[str, Any] = {
            "status": "ok" if not missing else f"no healthy {' or '.join(missing)} worker",
            **{side: {"healthy": healthy[side], "configured": len(urls)}
               for side, urls in sides.items()},
        }
        if missing:
            body["missing"] = missing
        return JSONResponse(body, status_code=503 if missing else 200)

    async def listing(self, request: Request) -> Response:
        """The workers routed to now, by role (their HTTP URLs), and each one's circuit breaker
        (CLOSED, OPEN, HALF_OPEN, PROBING)."""
        return JSONResponse({"prefill": list(self.targets), "decode": list(self.decode_urls),
                             "breakers": self._router.breakers.states()})

    async def info(self, request: Request) -> Response:
        """Pass-through to the first decode worker (then prefill)."""
        for base in [*self.decode_urls, *self.targets]:
            try:
                r = await self._client().get(base + request.url.path, headers=self.headers)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return JSONResponse(error_body(503, "no worker reachable"), status_code=503)


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
