"""HTTP plumbing every pd_fsm service shares: hypercorn on trio for the servers, one client
factory for the httpx clients, and the keep-alive contract between the two.

**Keep-alive.** A pooled connection that the server closes for idleness at the moment a client
reuses it fails that request ("Server disconnected without sending a response", or a reset).
Measured under load: hypercorn's default keep-alive is 5 s, httpx keeps idle
connections 5 s, and workers heartbeat the registry every 5 s, so the two timers raced and 12
heartbeats failed in 5 minutes. The rule now: every pd_fsm server keeps an idle connection
``SERVER_KEEP_ALIVE_S`` (120 s), clearly longer than any client of ours keeps one idle
(``CLIENT_KEEPALIVE_EXPIRY_S``, 30 s) and than reqwest's default pool idle timeout (90 s, the
sglang-router's client). A client then always drops an idle connection before the server does.
Idempotent calls (the registry's) also retry once at once on a connection-level error of a
reused connection (``bootstrap/client.py``), for servers that are not ours.

**Probes.** sglang-router opens HTTP/2 prior-knowledge (gRPC) probes against every worker.
Hypercorn 0.18's trio TCPServer then races its connection close (``send_eof``) against a pending
``send_all``; the loser raises ``trio.BusyResourceError``, which nothing catches, so it escapes
``serve_listeners`` and takes the whole server down (measured here: the router's first probe
killed a worker). The subclass below treats that error like the ``BrokenResourceError`` hypercorn
already handles: the connection is closing anyway, the data has nowhere to go.

**One connection never takes the server down.** The same probes meet another hypercorn 0.18 bug:
an HTTP/2 event for a stream its h2 protocol had already dropped (``KeyError: 1`` in
``H2Protocol._handle_events``) escapes ``serve_listeners`` too and would end the worker.
Whatever a connection's handler raises is logged and counted (:func:`connection_failures`,
``http_connection_failures_total`` in a worker's stats); hypercorn has closed that connection
already, and every other one is served on.
"""

from __future__ import annotations

import functools
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, cast

import httpx
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.events import Closed, Event
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.run import worker_serve
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.utils import wrap_app

from pd_fsm.io_trio.http_edge import contained
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import UnixSocket, bind_unix, unix_mounts

SERVER_KEEP_ALIVE_S = 120.0
CLIENT_KEEPALIVE_EXPIRY_S = 30.0


log = logging.getLogger("pd_fsm.io_trio.http_server")
_failures = 0  # connections whose handler raised (trio's thread only: no lock needed)


def connection_failures() -> int:
    """Connections of this process's HTTP servers whose protocol handler failed (each closed)."""
    return _failures


class _ClosingSafeTCPServer(TCPServer):
    async def run(self) -> None:
        global _failures
        try:
            await super().run()  # closes the connection in its own ``finally``
        except Exception as exc:  # contained: one connection, not the server
            _failures += 1
            log.warning("closed an HTTP connection whose handler failed (%d so far): %r",
                        _failures, exc)

    async def protocol_send(self, event: Event) -> None:
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())


def install_probe_safe_server() -> None:
    # hypercorn.trio.run builds its per-connection servers from this module global. It imports
    # TCPServer without re-exporting it, so the global is reached through the module's dict.
    names = vars(hypercorn_run)
    if names.get("TCPServer") is TCPServer:
        names["TCPServer"] = _ClosingSafeTCPServer


def hypercorn_config(
    host: str, port: int | None, *, keep_alive: float = SERVER_KEEP_ALIVE_S, tls: TLS = NO_TLS
) -> HypercornConfig:
    """``port`` None: no TCP listener (a server on a unix socket alone: ``serve_app``'s
    ``uds``)."""
    config = HypercornConfig()
    config.bind = [] if port is None else [f"{host}:{port}"]
    if tls.serving:  # hypercorn then serves HTTPS only, and reports https:// binds
        config.certfile = str(tls.certfile)
        config.keyfile = str(tls.keyfile)
    config.accesslog = None
    config.errorlog = logging.getLogger("pd_fsm.io_trio.hypercorn")
    config.graceful_timeout = 2.0
    config.keep_alive_timeout = keep_alive
    return config


def http_client(
    *,
    base_url: str = "",
    timeout: float | httpx.Timeout = 10.0,
    max_connections: int = 100,
    max_keepalive: int = 20,
    keepalive_expiry: float = CLIENT_KEEPALIVE_EXPIRY_S,
    tls: TLS = NO_TLS,
    headers: dict[str, str] | None = None,
) -> httpx.AsyncClient:
    """An httpx client that drops idle connections before any pd_fsm server closes them, and
    verifies HTTPS servers against ``tls.ca_file`` when one is given."""
    if keepalive_expiry >= SERVER_KEEP_ALIVE_S:
        raise ValueError("a client must expire idle connections before the server closes them")
    limits = httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive,
        keepalive_expiry=keepalive_expiry,
    )
    verify: ssl.SSLContext | bool = tls.client_context() if tls.ca_file is not None else True
    # http://unix:PATH: URLs go over their unix sockets (unix_sockets.py), the rest over TCP.
    return httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits, verify=verify,
                             headers=headers, mounts=unix_mounts(limits))


async def serve_app(
    app: Any,
    host: str,
    port: int | None,
    *,
    config: HypercornConfig | None = None,
    tls: TLS = NO_TLS,
    uds: UnixSocket | None = None,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` (0: any free port; None: no TCP) and on the unix socket
    ``uds`` if given; ``started()`` with the bound URLs (TCP first; a unix socket's as
    ``http://unix:PATH:``). A request whose handler raises is answered 500 and counted, never the
    server's end (``http_edge.Contained``)."""
    if port is None and uds is None:
        raise ValueError("a server needs a TCP port or a unix socket (--port or --uds)")
    install_probe_safe_server()
    config = config or hypercorn_config(host, port, tls=tls)
    # Starlette is an ASGI 3 app; hypercorn's annotation is narrower than the protocol.
    served = cast(Any, contained(app))
    if uds is None:
        await hypercorn_serve(served, config, shutdown_trigger=shutdown_trigger,
                              task_status=task_status)
        return
    if tls.serving:
        raise ValueError("HTTPS is not served on unix sockets: give --uds or the TLS flags")
    # The sockets are made here, not by hypercorn, which removes whatever socket file is at the
    # path (a live server's too) and cannot set its mode (unix_sockets.bind_unix does both).
    tcp = config.create_sockets().insecure_sockets
    bound = None
    try:
        for sock in tcp:
            sock.listen(config.backlog)
        bound = await trio.to_thread.run_sync(bind_unix, uds, config.backlog)
        sockets = Sockets([], [*tcp, bound.sock], [])
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(functools.partial(
                worker_serve, wrap_app(served, config.wsgi_max_body_size, None), config,
                sockets=sockets, shutdown_trigger=shutdown_trigger))
            task_status.started([*binds[:len(tcp)], uds.url])
    finally:
        for sock in tcp:
            sock.close()
        if bound is not None:
            bound.sock.close()
            bound.remove()
