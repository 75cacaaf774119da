"""Serving an ASGI app with hypercorn's trio worker, robust to the probes routers send.

sglang-router opens HTTP/2 prior-knowledge (gRPC) probes against every worker. Hypercorn 0.18's
trio TCPServer then races its connection close (``send_eof``) against a pending ``send_all``;
the loser raises ``trio.BusyResourceError``, which nothing catches, so it escapes
``serve_listeners`` and takes the whole server down (measured here: the router's first probe
killed a worker). The subclass below treats that error like the ``BrokenResourceError`` hypercorn
already handles: the connection is closing anyway, the data has nowhere to go.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.events import Closed, Event
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.tcp_server import TCPServer

from pd_fsm.io_trio.bootstrap_server import hypercorn_config


class _ClosingSafeTCPServer(TCPServer):
    async def protocol_send(self, event: Event) -> None:
        try:
            await super().protocol_send(event)
        except trio.BusyResourceError:
            await self.protocol.handle(Closed())


def install_probe_safe_server() -> None:
    # hypercorn.trio.run builds its per-connection servers from this module global.
    if hypercorn_run.TCPServer is TCPServer:
        hypercorn_run.TCPServer = _ClosingSafeTCPServer  # type: ignore[misc]


async def serve_app(
    app: Any,
    host: str,
    port: int,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on ``host:port`` (0: any free port); ``started()`` with the bound URLs."""
    install_probe_safe_server()
    await hypercorn_serve(app, hypercorn_config(host, port), shutdown_trigger=shutdown_trigger,
                          task_status=task_status)
