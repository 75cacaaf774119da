"""What every service command (`bootstrap`, `proxy`, `serve`, `planner`) does around its trio
program."""

from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import trio

STOP_GRACE_S = 5.0  # after SIGTERM: how long work still running may take before it is cancelled


def run_service(
    program: Callable[..., Awaitable[None]], *args: Any, host: str, port: int,
    log: logging.Logger,
) -> int:
    """``trio.run(program, *args)``; the exit status, with a bind failure logged as such."""
    try:
        trio.run(program, *args)
    except OSError as exc:  # typically: the port is taken
        log.error("cannot serve on %s:%s: %s", host, port, exc)
        return 1
    log.info("stopped")
    return 0


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
    name: str, serve: Callable[..., Awaitable[None]], service: object, host: str, port: int,
    log: logging.Logger,
) -> None:
    """Run ``serve(service, host, port, shutdown_trigger=..., task_status=...)`` until SIGTERM
    or SIGINT, printing its URL on one machine-readable line (launchers read the port from it);
    then the grace period for what is still running."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal, stop, log)
        url = await nursery.start(functools.partial(serve, shutdown_trigger=stop.wait),
                                  service, host, port)
        print(f"pd-fsm {name}: listening on {url}", flush=True)
        await stop.wait()
        nursery.cancel_scope.deadline = trio.current_time() + STOP_GRACE_S
