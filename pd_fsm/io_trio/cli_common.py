"""What every service command (`bootstrap`, `proxy`, `serve`, `planner`) does around its trio
program."""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from pd_fsm.io_trio.tls import TLS
from pd_fsm.io_trio.unix_sockets import UnixSocket, display

# How long a worker told to stop may take to finish its requests (serve's --drain-timeout
# default); the cluster launcher waits as long for a worker it stops.
DRAIN_TIMEOUT_S = 30.0

STOP_GRACE_S = 5.0  # after SIGTERM: how long work still running may take before it is cancelled


def listening_on(host: str, port: int | None, uds: UnixSocket | None) -> str:
    """Where a service listens, as a person reads it."""
    where = [] if port is None else [f"{host}:{port}"]
    return " and ".join([*where, *([] if uds is None else [str(uds)])])


def run_service(
    program: Callable[..., Awaitable[None]], *args: Any, host: str, port: int | None,
    log: logging.Logger, uds: UnixSocket | None = None,
) -> int:
    """``trio.run(program, *args)``; the exit status, with a bind failure logged as such."""
    failed: tuple[BaseException, ...] = ()
    try:
        trio.run(program, *args)
    except* OSError as group:  # the port is taken, the unix socket live (trio groups errors)
        failed = _leaves(group)
    for exc in failed:
        log.error("cannot serve on %s: %s", listening_on(host, port, uds), exc)
    if failed:
        return 1
    log.info("stopped")
    return 0


def _leaves(exc: BaseException) -> tuple[BaseException, ...]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return tuple(leaf for e in exc.exceptions for leaf in _leaves(e))
    return (exc,)


async def stop_on_signal(
    stop: trio.Event, log: logging.Logger, scope: trio.CancelScope | None = None
) -> None:
    """Set ``stop`` on the first SIGTERM or SIGINT; with ``scope``, also give it a deadline (work
    that cannot be interrupted, such as a model loading in a thread, is not waited on long)."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            log.info("received %s", signal.Signals(signum).name)
            stop.set()
            if scope is not None:
                scope.deadline = min(scope.deadline, trio.current_time() + STOP_GRACE_S)
            return


async def serve_until_signal(
    name: str, serve: Callable[..., Awaitable[None]], service: object, host: str,
    port: int | None, log: logging.Logger, uds: UnixSocket | None = None,
) -> None:
    """Run ``serve(service, host, port, shutdown_trigger=..., task_status=...)`` (and ``uds=``
    when given) until SIGTERM or SIGINT, printing its URL on one machine-readable line
    (launchers read the port from it); then the grace period for what is still running."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal, stop, log)
        more = {} if uds is None else {"uds": uds}
        url = await nursery.start(functools.partial(serve, shutdown_trigger=stop.wait, **more),
                                  service, host, port)
        print(f"pd-fsm {name}: listening on {listened(url, port, uds)}", flush=True)
        await stop.wait()
        nursery.cancel_scope.deadline = trio.current_time() + STOP_GRACE_S


def listened(url: str, port: int | None, uds: UnixSocket | None) -> str:
    """The machine-readable address of a service that started: its first URL, and its unix
    socket too when it listens on both."""
    return display(url) if uds is None or port is None else f"{url} and {uds}"


def refuse_tls_on_unix(tls: TLS, uds: UnixSocket | None) -> None:
    """ValueError for a server given a certificate and ``--uds``: HTTPS is not served on unix
    sockets (one is reached from its host only, and its mode guards it)."""
    if tls.serving and uds is not None:
        raise ValueError("--uds and --ssl-certfile: HTTPS is not served on unix sockets (a "
                         "socket file is reached from this host only; its mode guards it)")
