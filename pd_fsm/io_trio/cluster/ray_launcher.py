"""The launcher on Ray: ``pd-fsm cluster --ray [ADDRESS] --max-workers N`` serves the
local runner's control endpoint (``launcher.Launcher``: the same paths, answers and refusals),
whose workers are Ray actors (``ActorBackend``).

- ``POST /scale_up {"role"}`` creates one more worker actor of that role, placed like its
  siblings (the role's nodes, round robin: ``RayCluster.add_worker``); the actor picks its ports
  on its node and runs ``pd-fsm serve`` with its siblings' flags. The answer comes once the
  worker answers ``/health`` and the proxy routes it (``POST /workers/add``). An actor not placed
  and started within ``--startup-timeout`` is 504, a worker not healthy within it 504, one whose
  process exits first 502 with its last lines (until it serves, its actor is not armed: the
  process's exit does not take it down, it answers how the process ended); either way the actor
  is stopped and killed without restart.
- ``POST /scale_down {"worker"}`` takes the worker out of the proxy, then has its actor SIGTERM
  the process (it drains), SIGKILL it past its ``--drain-timeout`` and a grace, and the actor is
  killed without restart (``RayCluster.retire``).

Once it serves, a launched worker is the cluster's like its siblings: the driver prints its lines,
Ray restarts it on the same ports, and a worker down for good stops the cluster.

Why a thread: the Ray driver (``ray_cluster.RayCluster``) is synchronous — Ray's client calls
block (``ray.get``), and its main thread prints the services' output, watches restarts and takes
the signals — while the launcher is trio, its HTTP server and its scales tasks of one nursery.
Rather than copy the launcher as blocking code, or wrap the driver's blocking loop in trio, the
launcher's trio loop runs in a thread of the driver (``LauncherThread``), and each of its actor
calls in a worker thread (``trio.to_thread.run_sync``, at most ``RAY_CALLS`` at once) so that the
endpoint keeps answering while an actor starts or drains. Every Ray call there has a timeout, so
every such thread ends. The two threads share the services list, under the cluster's lock. The
launcher serves from before the cluster starts (503 until it is ready, as on the local runner);
it learns the proxy's URL once the proxy is placed. On stop the driver cancels the launcher's
loop first (a scale in flight stops the worker it was starting, within its deadlines) and joins
it, then stops every actor in tiers.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import attrs
import trio

from pd_fsm.io_trio.cluster.launcher import (
    Launcher,
    Stopped,
    drain_timeout,
    exited_before_healthy,
)
from pd_fsm.io_trio.cluster.ray_cluster import RayCluster, RayLaunchError, Service
from pd_fsm.io_trio.cluster.supervisor import STOP_GRACE, Child
from pd_fsm.io_trio.http_edge import describe

log = logging.getLogger("pd_fsm.io_trio.cluster.ray_launcher")

RAY_CALLS = 8  # actor calls in flight at once (each holds a thread while ray.get blocks)
SERVE_S = 30.0  # for the launcher's HTTP server to listen
T = TypeVar("T")


@attrs.define
class ActorBackend:
    """The Ray runner's workers (``launcher.WorkerBackend``): one actor each, a ``Child`` to the
    launcher (its name, role, URL and side-channel port), its ``Service`` here."""

    cluster: RayCluster
    start_timeout: float
    services: dict[str, Service] = attrs.field(factory=dict)
    _limiter: trio.CapacityLimiter | None = None

    def present(self) -> list[Child]:
        found = []
        for s in self.cluster.snapshot():
            if s.role is not None:
                self.services[s.name] = s
                found.append(_child(s))
        return found

    def new(self, role: str, name: str) -> Child:
        return Child(name, [], role=role)  # its URL once its actor picked its ports

    async def start(self, child: Child) -> tuple[int, str] | None:
        try:
            s = await self._call(self.cluster.add_worker, str(child.role), child.name,
                                 self.start_timeout)
        except RayLaunchError as exc:
            return exc.status, str(exc)
        self.services[child.name] = s
        child.url, child.side_port, child.extra = s.url, _child(s).side_port, s.extra
        return None

    async def exited(self, child: Child) -> str | None:
        try:
            ended = await self._call(self.cluster.exit_of, self.services[child.name])
        except RayLaunchError as exc:
            return str(exc)
        return None if ended is None else exited_before_healthy(*ended)

    def serving(self, child: Child) -> None:
        self.cluster.arm(self.services[child.name])

    async def stop(self, child: Child, grace: float) -> Stopped:
        s = self.services.pop(child.name, None)
        if s is None:  # its actor never started (add_worker stopped it)
            return None, False
        return await self._call(self.cluster.retire, s, grace)

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        if self._limiter is None:  # made in the launcher's trio loop, its first call
            self._limiter = trio.CapacityLimiter(RAY_CALLS)
        # Abandoned on cancel (the driver stopping): the driver's stop then stops every actor,
        # and a Ray call blocked for its timeout does not hold the stop up.
        return await trio.to_thread.run_sync(functools.partial(fn, *args),
                                             limiter=self._limiter, abandon_on_cancel=True)


def _child(s: Service) -> Child:
    side = s.info["ports"][1] if s.role == "prefill" else None
    return Child(s.name, [], s.url, s.extra, role=s.role, side_port=side)


class LauncherThread:
    """The launcher's trio loop, in a thread of the synchronous driver (see the docstring)."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.url: str | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._scope: trio.CancelScope | None = None
        self._listening = threading.Event()
        self._ended = threading.Event()
        self._closing = False
        self._error = "the launcher's loop ended"
        # A daemon: a driver that must exit does not wait on an actor call blocked in Ray.
        self._thread = threading.Thread(target=self._run, name="pd-fsm-launcher", daemon=True)

    def start(self) -> str:
        """Its URL once it listens (it answers 503 until ``ready``)."""
        self._thread.start()
        if not self._listening.wait(SERVE_S) or self.url is None:
            raise RayLaunchError(f"the launcher does not listen: {self._error}")
        return self.url

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:  # its end is the driver's to report, not this thread's
            log.exception("launcher: its loop failed")
            self._error = f"the launcher failed: {describe(exc)}"
        finally:
            self._ended.set()
            self._listening.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        with trio.CancelScope() as self._scope:
            async with trio.open_nursery() as nursery:
                self.url = await nursery.start(self.launcher.serve)
                self._listening.set()

    def ready(self, proxy_url: str) -> None:
        """The cluster is up: the launcher scales from now, through this proxy."""

        def ready() -> None:
            self.launcher.proxy_url = proxy_url.rstrip("/")
            self.launcher.ready()

        trio.from_thread.run_sync(ready, trio_token=self._token)

    def failure(self) -> str | None:
        """Why the launcher ended while the cluster runs; None while it serves."""
        return self._error if self._ended.is_set() and not self._closing else None

    def close(self, timeout: float) -> None:
        """Cancel its loop (scales in flight stop their workers) and wait ``timeout`` seconds for
        it to end."""
        self._closing = True
        if self._token is not None and self._scope is not None and not self._ended.is_set():
            with contextlib.suppress(trio.RunFinishedError):  # it ended meanwhile
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)
        self._thread.join(timeout)


def launcher_thread(cluster: RayCluster, args: argparse.Namespace) -> LauncherThread:
    """The launcher of ``--max-workers``, on the driver's node (no key, no TLS: ``--ray``
    refuses both)."""
    backend = ActorBackend(cluster, args.startup_timeout)
    launcher = Launcher(backend, max_workers=args.max_workers, proxy_url="", headers={},
                        host=cluster.here, port=0, start_timeout=args.startup_timeout,
                        stop_timeout=drain_timeout(args) + STOP_GRACE)
    return LauncherThread(launcher)
