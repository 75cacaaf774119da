"""The local runner's children as processes of one trio program: start them, forward their output
with a ``[name]`` prefix (the last lines are kept for the error report), wait for every
``/health`` under one deadline (printing progress while models load), print the URLs, and stop
every child on Ctrl-C or SIGTERM (SIGTERM, then SIGKILL after a grace period). A child that dies
on its own stops the cluster with exit status 1 and that child's last log lines — unless it is not
``fatal``: a worker the launcher (``launcher.py``) is starting or stopping, whose exit the
launcher answers for.

Services (``ClusterService``: the launcher's control endpoint) run in the same nursery, started
before the children so that their URL answers from the first moment any child could call it.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
from typing import Any, Protocol

import attrs
import httpx
import trio

from pd_fsm.io_trio.http_server import http_client
from pd_fsm.io_trio.tls import NO_TLS, TLS
from pd_fsm.io_trio.unix_sockets import display

TAIL_LINES = 40
STOP_GRACE = 10.0
PROGRESS_EVERY = 5.0


class ClusterFailed(Exception):
    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        self.child = child


@attrs.define(eq=False)
class Child:
    name: str
    argv: list[str]
    url: str | None = None  # has /health when set
    extra: str = ""  # shown next to the URL
    proc: trio.Process | None = None
    tail: collections.deque[str] = attrs.field(
        factory=lambda: collections.deque(maxlen=TAIL_LINES)
    )
    healthy: bool = False
    status: str = "starting"
    health_path: str = "/health"  # Prometheus answers on /-/ready
    # A PD worker: the role it was started in, and its side-channel port (P's bootstrap port).
    role: str | None = None
    side_port: int | None = None
    # Its exit stops the cluster. The launcher clears it while it starts the child (a worker
    # that never gets healthy is stopped and the request answered) and before it stops it.
    fatal: bool = True


class ClusterService(Protocol):
    """A server of the runner's own, in the cluster's nursery (the launcher)."""

    name: str
    url: str | None
    extra: str

    async def serve(self, *, task_status: trio.TaskStatus[str]) -> None: ...

    def ready(self) -> None:
        """Every child answered its /health: the cluster is whole."""


class Cluster:
    def __init__(self, children: list[Child], *, startup_timeout: float,
                 tls: TLS = NO_TLS) -> None:
        self.children = children
        self.tls = tls
        self.startup_timeout = startup_timeout
        self.stopping = False
        self.failure: ClusterFailed | None = None
        self.services: list[ClusterService] = []
        self._nursery: trio.Nursery | None = None

    def by_name(self, name: str) -> Child | None:
        return next((c for c in self.children if c.name == name), None)

    async def run(self, ready_action: Any = None) -> int:
        """Start everything, wait until healthy, then run ``ready_action()`` (returns an exit
        status) or wait for a signal; always stops every child before returning."""
        result = 0
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for service in self.services:
                    service.url = await nursery.start(service.serve)
                for child in self.children:
                    await self._start(child, nursery)
                nursery.start_soon(self._signals, nursery.cancel_scope)
                await self._wait_healthy()
                self._print_ready()
                for service in self.services:
                    service.ready()
                if ready_action is not None:
                    result = await ready_action(self)
                    nursery.cancel_scope.cancel()
                else:
                    await trio.sleep_forever()
        except ClusterFailed as exc:
            self.failure = exc
        finally:
            self.stopping = True
            with trio.CancelScope(shield=True):
                await self._stop_all()
        if self.failure is not None:
            self._report(self.failure)
            return 1
        return result

    async def spawn(self, child: Child) -> None:
        """Start one more child (the launcher's); it is stopped with the others at the end."""
        assert self._nursery is not None, "Cluster.run is not running"
        await self._start(child, self._nursery)  # raises OSError if it cannot start at all
        self.children.append(child)

    async def retire(self, child: Child, grace: float) -> tuple[int, bool]:
        """Stop ``child`` for good (SIGTERM: a worker drains and exits 0), killing it past
        ``grace`` seconds; its exit status and whether it was killed. Its exit does not stop the
        cluster."""
        child.fatal = False
        killed = await self._stop([child], grace)
        if child in self.children:
            self.children.remove(child)
        assert child.proc is not None and child.proc.returncode is not None
        return child.proc.returncode, bool(killed)

    async def _start(self, child: Child, nursery: trio.Nursery) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        child.proc = await trio.lowlevel.open_process(
            child.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
            stdin=subprocess.DEVNULL,
        )
        nursery.start_soon(self._forward, child)
        nursery.start_soon(self._watch, child, nursery.cancel_scope)

    async def _forward(self, child: Child) -> None:
        assert child.proc is not None and child.proc.stdout is not None
        pending = b""
        async for chunk in child.proc.stdout:
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                self._line(child, raw.decode("utf-8", "replace"))
        if pending:
            self._line(child, pending.decode("utf-8", "replace"))

    def _line(self, child: Child, line: str) -> None:
        child.tail.append(line)
        print(f"[{child.name}] {line}", flush=True)

    async def _watch(self, child: Child, scope: trio.CancelScope) -> None:
        assert child.proc is not None
        code = await child.proc.wait()
        child.status = f"exited {code}"
        if child.fatal and not self.stopping and self.failure is None:
            await trio.sleep(0.2)  # let the forwarder print the child's last lines
            self.failure = ClusterFailed(f"{child.name} exited with status {code}", child)
            scope.cancel()

    async def _signals(self, scope: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                print(f"pd-fsm cluster: {signal.Signals(signum).name}, stopping", flush=True)
                self.stopping = True
                scope.cancel()
                return

    async def _wait_healthy(self) -> None:
        start = trio.current_time()
        last_progress = start
        async with http_client(timeout=2.0, tls=self.tls) as http:
            with trio.move_on_after(self.startup_timeout) as timeout:
                while not all(c.healthy for c in self.children if c.url):
                    for child in self.children:
                        if child.url and not child.healthy:
                            await probe(http, child)
                            if child.healthy:  # model loaded and warmed up (or no model)
                                print(f"pd-fsm cluster: {child.name} up after "
                                      f"{trio.current_time() - start:.1f} s", flush=True)
                    now = trio.current_time()
                    if now - last_progress >= PROGRESS_EVERY:
                        last_progress = now
                        waiting = ", ".join(f"{c.name} ({c.status})" for c in self.children
                                            if c.url and not c.healthy)
                        print(f"pd-fsm cluster: {now - start:.0f} s, waiting for {waiting}",
                              flush=True)
                    await trio.sleep(0.5)
            if timeout.cancelled_caught:
                slow = next(c for c in self.children if c.url and not c.healthy)
                raise ClusterFailed(
                    f"{slow.name} not healthy after {self.startup_timeout:.0f} s", slow
                )
        self.ready_after = trio.current_time() - start

    def _print_ready(self) -> None:
        print(f"pd-fsm cluster: ready in {self.ready_after:.1f} s", flush=True)
        rows = [(c.name, c.url, c.extra) for c in self.children]
        for name, url, extra in rows + [(s.name, s.url, s.extra) for s in self.services]:
            shown = f"  ({extra})" if extra else ""
            print(f"  {name:<12} {display(url) if url else '-'}{shown}", flush=True)

    async def _stop_all(self) -> None:
        # In tiers: the proxy first (no new rooms), then the workers, the bootstrap server last,
        # so that workers deregister from a registry that is still there.
        def tier(child: Child) -> int:
            return {"proxy": 0, "prometheus": 0, "bootstrap": 2}.get(child.name, 1)

        for level in (0, 1, 2):
            await self._stop([c for c in self.children if tier(c) == level])

    async def _stop(self, children: list[Child], grace: float = STOP_GRACE) -> list[Child]:
        """SIGTERM to each live child, SIGKILL to those still alive ``grace`` seconds later;
        the children killed."""
        live = [c for c in children if c.proc and c.proc.returncode is None]
        for child in live:
            assert child.proc is not None
            child.proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            for child in live:
                assert child.proc is not None
                await child.proc.wait()
        killed = []
        for child in live:
            assert child.proc is not None
            if child.proc.returncode is None:
                print(f"pd-fsm cluster: {child.name} ignored SIGTERM, killing", flush=True)
                child.proc.kill()
                await child.proc.wait()
                killed.append(child)
        return killed

    def _report(self, failure: ClusterFailed) -> None:
        print(f"pd-fsm cluster: FAILED: {failure}", file=sys.stderr, flush=True)
        if failure.child is not None:
            print(f"--- last lines of {failure.child.name} ---", file=sys.stderr)
            for line in failure.child.tail:
                print(f"  {line}", file=sys.stderr)
            sys.stderr.flush()


async def probe(http: httpx.AsyncClient, child: Child) -> None:
    """One GET of ``child``'s health path: ``healthy`` once it answers 200, else ``status`` says
    what it answered (its JSON ``status`` while a worker loads or warms up)."""
    try:
        r = await http.get(f"{child.url}{child.health_path}")
    except httpx.HTTPError:
        child.status = "not listening yet"
        return
    if r.status_code == 200:
        child.healthy = True
        child.status = "healthy"
    else:
        try:
            child.status = str(r.json().get("status", r.status_code))
        except (ValueError, AttributeError):
            child.status = f"HTTP {r.status_code}"
