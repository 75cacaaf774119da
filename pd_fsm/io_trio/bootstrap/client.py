"""The instance's side of the bootstrap server: register, heartbeat, deregister, resolve.

``run`` is a service: start it with ``await nursery.start(client.run)``. It registers (retrying
with jittered exponential backoff while the server is unreachable), heartbeats every
``heartbeat_interval``, registers again when a heartbeat answers 404 (the server restarted or our
entry expired), and deregisters on the way out when cancelled. ``registered`` is the health
condition a worker's ``/health`` can report. ``resolve`` is D's lookup of the P behind a request's
``bootstrap_host``/``bootstrap_port``; :class:`BootstrapResolver` turns it into the core's
``PeerResolved``/``PeerResolutionFailed`` events for the driver.

With a cluster secret, every write is signed (:mod:`pd_fsm.core.request_auth`) with the registry
key derived from it (:func:`pd_fsm.core.keys.registry_key`): the secret and the keys never leave
the process; a write carries the sender's wall-clock time, a fresh nonce and a MAC over them and
the request. Reads (``GET``) are not signed: the registry answers them to anyone.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
from collections.abc import Callable, Generator
from types import TracebackType
from typing import Any

import httpx
import trio

from pd_fsm.core import events as ev
from pd_fsm.core.keys import registry_key
from pd_fsm.core.request_auth import NONCE_BYTES, sign_request
from pd_fsm.io_trio import strict_json
from pd_fsm.io_trio.bootstrap.records import (
    InstanceRecord,
    KeyBody,
    record_from_json,
    split_host_port,
    to_json,
)
from pd_fsm.io_trio.http_server import http_client
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import IPC_PREFIX

log = logging.getLogger("pd_fsm.io_trio.bootstrap.client")


# What a connection closed by the server under a reused request looks like (a fresh connection
# that cannot be made is a ConnectError: the server is down, and retrying at once won't help).
_STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class RegistrySigner(httpx.Auth):
    """httpx auth that signs registry writes (every method but GET) with the registry key derived
    from the cluster secret (:mod:`pd_fsm.core.request_auth`); only the key is kept.

    httpx runs it for every request it sends, so each attempt gets its own time and nonce: a
    retried write whose first attempt did reach the server is not refused as a replay. Usable
    with any ``httpx.AsyncClient`` (``auth=RegistrySigner(secret)``), e.g. from tools and tests.
    """

    requires_request_body = True  # the MAC covers the exact body bytes

    def __init__(self, secret: bytes, wall_clock: Callable[[], float] = time.time) -> None:
        self._key = registry_key(secret)
        self._wall_clock = wall_clock

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        if request.method != "GET":  # reads are open: nothing to sign
            headers = sign_request(
                self._key,
                request.method,
                request.url.path,
                request.content,
                sent_at=self._wall_clock(),
                nonce=secrets.token_bytes(NONCE_BYTES),
            )
            request.headers.update(headers)
        yield request


class BootstrapError(Exception):
    """The bootstrap server could not be reached or refused the request."""


class ResolveError(BootstrapError):
    """No live instance answers to the (host, port, role, ranks) asked for."""


class BootstrapClient:
    def __init__(
        self,
        base_url: str,
        record: InstanceRecord | None = None,
        *,
        secret: bytes | None = None,
        heartbeat_interval: float = 5.0,
        request_timeout: float = 2.0,
        backoff_initial: float = 0.2,
        backoff_max: float = 5.0,
        stale_after: float | None = None,
        http: httpx.AsyncClient | None = None,
        rng: random.Random | None = None,
        tls: TLS = NO_TLS,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.record = record
        self.heartbeat_interval = heartbeat_interval
        self.request_timeout = request_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        # Past this long without an acknowledged write the server has (or soon will have)
        # dropped us: 3 intervals, the default TTL's ratio.
        self.stale_after = 3 * heartbeat_interval if stale_after is None else stale_after
        self.server_ttl: float | None = None  # the registry's own, from its last answer
        # ``secret`` is the cluster secret: only the signer's derived key is kept, nothing is sent
        # but MACs. ``wall_clock`` stamps signed writes; the server checks it against its own.
        self._signer = RegistrySigner(secret, wall_clock) if secret else None
        self._http = http or http_client(base_url=base_url, timeout=request_timeout, tls=tls)
        self._owns_http = http is None
        self._rng = rng or random.Random()
        self._acked_at: float | None = None
        self.registrations = 0
        self.heartbeats = 0
        self.failures = 0  # registrations and heartbeats that failed (each logged)
        self.heartbeat_failures = 0
        # Requests that met a connection the server had closed and went through on a retry.
        self.stale_retries = 0

    async def __aenter__(self) -> BootstrapClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    @property
    def registered(self) -> bool:
        """Health condition: the server acknowledged us within ``stale_after``."""
        return (
            self._acked_at is not None and trio.current_time() - self._acked_at < self.stale_after
        )

    # -- the service --------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Register, heartbeat, re-register on 404; deregister when cancelled."""
        if self.record is None:
            raise ValueError("BootstrapClient.run needs the instance's record")
        task_status.started()
        try:
            while True:
                await self._register_with_retry()
                await self._heartbeat_until_gone()
        finally:
            # Shielded: we are usually here because of cancellation, and the DELETE is what
            # spares routers a TTL's worth of requests sent to an instance that is gone.
            with trio.CancelScope(shield=True), trio.move_on_after(self.request_timeout):
                await self._deregister()

    async def _register_with_retry(self) -> None:
        delay = self.backoff_initial
        while True:
            try:
                await self.register()
                return
            except BootstrapError as exc:
                self.failures += 1
                wait = delay * (0.5 + 0.5 * self._rng.random())
                log.warning("bootstrap registration failed (%s); retrying in %.2f s", exc, wait)
                await trio.sleep(wait)
                delay = min(delay * 2, self.backoff_max)

    async def _heartbeat_until_gone(self) -> None:
        """Heartbeat on a fixed cadence; return when the server no longer knows us (404)."""
        next_at = trio.current_time()
        while True:
            next_at += self.heartbeat_interval
            now = trio.current_time()
            if next_at < now:  # a slow heartbeat overran its slot: skip, do not burst
                next_at = now + self.heartbeat_interval
            await trio.sleep_until(next_at)
            try:
                status = await self._write("POST", "/heartbeat", to_json(self._key()))
            except BootstrapError as exc:
                self.failures += 1
                self.heartbeat_failures += 1
                log.warning("bootstrap heartbeat failed: %s", exc)
                continue
            if status == 404:
                self._acked_at = None
                log.info("bootstrap server does not know us (restarted or expired): registering")
                return
            self.heartbeats += 1

    def _key(self) -> KeyBody:
        assert self.record is not None
        return KeyBody.of(self.record)

    # -- single requests ----------------------------------------------------------------------

    async def register(self) -> None:
        assert self.record is not None
        status = await self._write("PUT", "/route", to_json(self.record))
        if status == 404:
            raise BootstrapError("PUT /route answered 404")
        self.registrations += 1
        log.info("registered %s with the bootstrap server", self.record.key)

    def _learn_ttl(self, response: httpx.Response) -> None:
        """The registry answers every write with its TTL: from then on that, not the TTL we
        assumed, says when it would drop us; a cadence that cannot beat it is said once."""
        try:
            ttl = response.json().get("ttl")
        except (ValueError, AttributeError):
            return
        if not isinstance(ttl, int | float) or isinstance(ttl, bool) or ttl <= 0:
            return
        if ttl != self.server_ttl:
            self.server_ttl = float(ttl)
            self.stale_after = self.server_ttl
            if 2 * self.heartbeat_interval > self.server_ttl:
                log.warning(
                    "the registry's TTL is %g s: heartbeats every %g s leave no room for a lost "
                    "one (keep the interval under half the TTL)",
                    self.server_ttl, self.heartbeat_interval,
                )

    async def _deregister(self) -> None:
        if self._acked_at is None:
            return  # never registered, or the server already forgot us
        try:
            await self._write("DELETE", "/route", to_json(self._key()))
        except BootstrapError as exc:
            log.warning("deregistration failed (the TTL will expire us): %s", exc)
        finally:
            self._acked_at = None

    async def _write(self, method: str, path: str, body: dict[str, Any]) -> int:
        """Status 200 or 404; anything else raises :class:`BootstrapError`."""
        content = json.dumps(body, separators=(",", ":")).encode()
        response = await self._request(method, path, content=content)
        if response.status_code == 200:
            self._acked_at = trio.current_time()
            self._learn_ttl(response)
            return 200
        if response.status_code == 404:
            return 404
        raise BootstrapError(f"{method} {path}: HTTP {response.status_code} {_detail(response)}")

    async def _request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
    ) -> httpx.Response:
        """One request under ``request_timeout``; retried once at once when the connection
        failed before any answer (every call here is idempotent: PUT, DELETE, a heartbeat,
        GET). A pooled connection that the server closed for idleness just as we reused it
        fails exactly so; a second failure is real and raises :class:`BootstrapError`.
        A write (``content`` given) is signed per attempt: see :meth:`_attempt`."""
        try:
            with trio.fail_after(self.request_timeout):
                try:
                    return await self._attempt(method, path, params, content)
                except _STALE_CONNECTION as exc:
                    log.debug("%s %s: %s on a reused connection; retrying", method, path, exc)
                    response = await self._attempt(method, path, params, content)
                    self.stale_retries += 1
                    return response
        except trio.TooSlowError:
            raise BootstrapError(
                f"{method} {path}: no answer within {self.request_timeout:g} s"
            ) from None
        except httpx.HTTPError as exc:
            raise BootstrapError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    async def _attempt(
        self, method: str, path: str, params: dict[str, Any] | None, content: bytes | None
    ) -> httpx.Response:
        """Send once. A write is signed by :class:`RegistrySigner` as part of this call, with
        this attempt's time and a fresh nonce: the first attempt of a retried request may well
        have reached the server (only the answer was lost), and the server's replay guard would
        refuse the same signature a second time."""
        headers = {"content-type": "application/json"} if content is not None else {}
        auth = self._signer if self._signer is not None else httpx.USE_CLIENT_DEFAULT
        return await self._http.request(
            method, path, params=params, content=content, headers=headers, auth=auth
        )

    def stats(self) -> dict[str, int]:
        """Counters for the owner's ``/metrics`` (read on the trio thread that mutates them)."""
        return {
            "registrations_total": self.registrations,
            "heartbeats_total": self.heartbeats,
            "heartbeat_failures_total": self.heartbeat_failures,
            "failures_total": self.failures,
            "stale_connection_retries_total": self.stale_retries,
        }

    async def resolve(
        self,
        host: str,
        port: int | None,
        role: str = "prefill",
        ranks: dict[str, int] | None = None,
    ) -> list[InstanceRecord]:
        """Live instances of ``role`` known to routers as ``host:port`` (``port`` None: ``host``
        is a side channel's ``ipc://`` endpoint) (filtered by ranks, e.g. ``{"tp_rank": 0}``);
        :class:`ResolveError` if there are none."""
        at = {"host": host} if port is None else {"host": host, "port": port}
        params: dict[str, Any] = {**at, "role": role, **(ranks or {})}
        response = await self._request("GET", "/route", params=params)
        if response.status_code == 404:
            known = host if port is None else f"{host}:{port}"
            raise ResolveError(f"no live {role} instance known as {known}")
        if response.status_code != 200:
            raise ResolveError(f"GET /route: HTTP {response.status_code} {_detail(response)}")
        try:
            return _records(response)
        except ValueError as exc:
            raise ResolveError(f"GET /route: unreadable answer ({exc})") from None

    async def list(self, role: str | None = None) -> list[InstanceRecord]:
        params = {"role": role} if role else {}
        response = await self._request("GET", "/list", params=params)
        if response.status_code != 200:
            raise BootstrapError(f"GET /list: HTTP {response.status_code} {_detail(response)}")
        try:
            return _records(response)
        except ValueError as exc:
            raise BootstrapError(f"GET /list: unreadable answer ({exc})") from None


class BootstrapResolver:
    """Answers the core's ResolvePeer: the P behind ``bootstrap_addr`` ("host:port", or
    "ipc://PATH") at the ranks this D pairs with. Pass as ``resolver=`` to the decode side's
    EndpointDriver."""

    def __init__(
        self,
        client: BootstrapClient,
        ranks: dict[str, int] | None = None,
        check: Callable[[InstanceRecord], str | None] | None = None,
    ) -> None:
        """``check(record)``: the reason D must not use that P (e.g. an untrusted CURVE key),
        or None."""
        self.client = client
        self.ranks = ranks
        self.check = check

    async def __call__(self, bootstrap_addr: str) -> ev.PeerResolved | ev.PeerResolutionFailed:
        host: str
        port: int | None
        if bootstrap_addr.startswith(IPC_PREFIX):  # P's side channel on a unix socket
            host, port = bootstrap_addr, None
        else:
            try:
                host, port = split_host_port(bootstrap_addr)
            except ValueError as exc:
                return ev.PeerResolutionFailed(bootstrap_addr, str(exc))
        try:
            records = await self.client.resolve(host, port, "prefill", self.ranks)
        except BootstrapError as exc:
            return ev.PeerResolutionFailed(bootstrap_addr, str(exc))
        p = records[0]  # sorted by key on the server: deterministic when several match
        refusal = self.check(p) if self.check is not None else None
        if refusal is not None:
            return ev.PeerResolutionFailed(bootstrap_addr, refusal)
        return ev.PeerResolved(bootstrap_addr, p.zmq_addr, p.transfer_addr, p.layout_hash)


def _records(response: httpx.Response) -> list[InstanceRecord]:
    """The records of a ``{"instances": [...]}`` answer, parsed as strictly as the server parses
    what it stores; ValueError (RecordError and JsonError are ValueErrors) if it is not that."""
    body = strict_json.loads(response.content, what="answer")
    instances = body.get("instances") if isinstance(body, dict) else None
    if not isinstance(instances, list):
        raise ValueError("no list of instances")
    return [record_from_json(r) for r in instances]


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200]
    if isinstance(body, dict) and "error" in body:
        problems = body.get("problems")
        return f"{body['error']}" + (f": {'; '.join(problems)}" if problems else "")
    return str(body)[:200]
