"""`pd-fsm cluster --ray [ADDRESS]`: the same services as the local runner, placed on the nodes of
an existing Ray cluster (optional extra ``pd_fsm[ray]``).

Each service (bootstrap server, P and D workers, a colocated worker, the proxy) is a Ray actor
that runs the real ``pd-fsm`` process on its node, bound to the node's Ray address (which is also
what it advertises). Placement by role: ``--prefill-nodes`` / ``--decode-nodes`` (and
``--bootstrap-node``, ``--proxy-node``) take node IPs or ``resource:NAME`` (a Ray custom
resource); worker i of a role goes to the role's i-th node, round robin. Defaults: the driver's
node.

Restarts: a service whose process exits takes its actor down with it, and Ray restarts the actor
(``--ray-max-restarts``). The restarted actor finds its state file on the node (ports, old pid),
kills what is left of the old process, and starts the service again **on the same ports**, so
routers holding its URL keep working and the worker re-registers with the bootstrap server. The
proxy is given the P and D workers' URLs (as the local runner's is), so a restarted worker is
routed to again once it answers (its circuit breaker closes); and the launcher adds and removes
workers at it (``POST /workers/add|remove``), which a proxy reading the registry refuses.

Scaling (``--max-workers N``): ``ray_launcher`` serves the local runner's launcher, whose workers
are actors this class adds (``add_worker``: placed like their siblings, watched once they serve)
and stops (``retire``: the process drains, the actor is killed without restart).

Logs: the driver pulls each actor's new output lines and prints them as ``[name] line``. Stop
(Ctrl-C or SIGTERM): in tiers, proxy first, then the workers, the bootstrap server last; each
actor stops its process (SIGTERM, then SIGKILL after a grace period) and is killed without
restart. The actors belong to the driver, so if the driver dies Ray kills them, and each service
process dies with its actor (``PR_SET_PDEATHSIG``). The driver itself is ``ray_driver``: this
module is what every actor process imports, so it imports neither trio nor the launcher.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from pd_fsm.io_trio.cluster.tpu_roles import ray_tpu_requests
from pd_fsm.io_trio.ports import free_ports

MAX_LINES = 5000  # per actor, kept until the driver reads them
STOP_GRACE = 10.0
PROGRESS_EVERY = 5.0
POLL = 0.5
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the actor process that started it dies."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _is_ours(pid: int) -> bool:
    """Is ``pid`` a live pd-fsm service (so that a stale state file never kills a stranger)?"""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pd_fsm.cli" in cmdline


class ServiceActor:
    """One pd-fsm service process on this node (used as a Ray actor; see the module docstring).

    ``argv`` may contain ``{host}`` (this node's Ray address) and ``{port0}``, ``{port1}``, ...:
    ``n_ports`` ports free on this node, chosen once and kept across restarts. ``armed``: the
    process's exit takes the actor down (so that Ray restarts it); a worker the launcher starts
    is armed once it serves (``arm``), until then its exit is the scale-up's answer (``info``).
    """

    def __init__(self, name: str, cluster_id: str, argv: list[str], n_ports: int,
                 health_port: int | None, armed: bool = True, tpu: int = 0,
                 tpu_host: str | None = None) -> None:
        import ray

        self.name = name
        # Ray's own functions carry no annotations: each call here is no-untyped-call.
        self.host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        state_dir = Path(tempfile.gettempdir()) / "pd_fsm_ray" / cluster_id
        state_dir.mkdir(parents=True, exist_ok=True)
        self._state_file = state_dir / f"{name}.json"
        state: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(self._state_file.read_text())
        old_pid = state.get("pid")
        if isinstance(old_pid, int) and _is_ours(old_pid):
            # The previous incarnation's process outlived its actor: it holds our ports.
            with contextlib.suppress(ProcessLookupError):
                os.kill(old_pid, signal.SIGKILL)
            for _ in range(100):
                if not _is_ours(old_pid):
                    break
                time.sleep(0.05)
        self.ports: list[int] = state.get("ports") or free_ports(n_ports, self.host, launcher=True)
        self.restarts: int = int(state.get("restarts", -1)) + 1
        # Ray restarts an actor with its first arguments: one restarted was armed.
        self._armed = armed or self.restarts > 0
        self._exited = False
        self.health_port = None if health_port is None else self.ports[health_port]
        # The TPU chips Ray gave this actor (``tpu`` asked for), checked and libtpu's variables
        # set here: its process inherits them (and `serve --tpu-chips` sets the same).
        self.tpu_chips = _take_tpu_chips(tpu_host) if tpu else ""
        fields = {"host": self.host, "tpu_chips": self.tpu_chips,
                  **{f"port{i}": p for i, p in enumerate(self.ports)}}
        self.argv = [a.format(**fields) for a in argv]
        self._lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=MAX_LINES)
        self._seq = 0
        self._lock = threading.Lock()
        self._stopping = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pd_fsm.cli", *self.argv],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_die_with_parent,
        )
        self._state_file.write_text(json.dumps(
            {"ports": self.ports, "pid": self.proc.pid, "restarts": self.restarts}))
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._lock:
                self._seq += 1
                self._lines.append((self._seq, raw.decode("utf-8", "replace").rstrip("\n")))

    def _watch(self) -> None:
        self.proc.wait()
        with self._lock:  # exactly one of this and arm() sees both the exit and the arming
            self._exited = True
            die = self._armed and not self._stopping
        if die:
            self._die()

    def arm(self) -> None:
        """From now on the process's exit takes the actor down (Ray restarts it)."""
        with self._lock:
            self._armed = True
            die = self._exited and not self._stopping
        if die:
            self._die()

    def _die(self) -> None:
        # The service died on its own: take the actor down so that Ray restarts it. Its last
        # lines stay beside the state file for an operator (the driver may have missed them).
        self._reader.join(1.0)
        with contextlib.suppress(OSError):
            tail = "\n".join(line for _, line in list(self._lines)[-40:])
            self._state_file.with_suffix(".last").write_text(f"exit {self.proc.returncode}\n"
                                                             f"{tail}")
        os._exit(1)

    def info(self) -> dict[str, Any]:
        """Where it serves; and, once its (unarmed) process exited, its status and last lines."""
        code = self.proc.poll()
        if code is not None:
            self._reader.join(1.0)  # its last lines read
        with self._lock:
            tail = [line for _, line in list(self._lines)[-5:]] if code is not None else []
        return {"name": self.name, "host": self.host, "ports": self.ports,
                "pid": self.proc.pid, "actor_pid": os.getpid(), "restarts": self.restarts,
                "exit": code, "tail": tail, "tpu_chips": self.tpu_chips}

    def lines(self, since: int) -> tuple[int, list[str]]:
        """Output lines after sequence number ``since``, and the newest sequence number."""
        with self._lock:
            return self._seq, [line for seq, line in self._lines if seq > since]

    def health(self) -> int | None:
        """The service's GET /health status, None while it does not answer."""
        if self.health_port is None:
            return 200 if self.proc.poll() is None else None
        try:
            url = f"http://{self.host}:{self.health_port}/health"
            with urllib.request.urlopen(url, timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as exc:
            return int(exc.code)
        except (OSError, ValueError):
            return None

    def stop(self, grace: float = STOP_GRACE) -> tuple[int | None, bool]:
        """Stop the service for good (no restart follows): SIGTERM (a worker drains), then
        SIGKILL past ``grace`` seconds; its exit status and whether it was killed."""
        self._stopping = True
        killed = False
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                killed = True
        for leftover in (self._state_file, self._state_file.with_suffix(".last")):
            with contextlib.suppress(OSError):
                leftover.unlink()
        with contextlib.suppress(OSError):
            self._state_file.parent.rmdir()  # the last service of this cluster on this node
        return self.proc.returncode, killed


def _take_tpu_chips(tpu_host: str | None) -> str:
    """The chips Ray assigned this actor (``TPU`` resource), as ``--tpu-chips`` takes them,
    after setting libtpu's variables for them in this process (``tpu_placement``); ValueError,
    which fails the actor's creation, when they are no sub-mesh of this node's host."""
    import ray

    from pd_fsm.io_trio.cluster.tpu_placement import chip_list, find_host, placement

    ids = ray.get_runtime_context().get_accelerator_ids().get("TPU", [])
    placed = placement(",".join(ids), find_host(tpu_host, os.environ), flag="Ray's TPU chips")
    placed.apply(os.environ)
    return chip_list(placed.chips)


@attrs.define(eq=False)
class Service:
    name: str
    tier: int  # stop order: 0 proxy, 1 workers, 2 bootstrap
    handle: Any
    info: dict[str, Any] = attrs.field(factory=dict)
    seq: int = 0
    healthy: bool = False
    restarts: int = 0
    down_since: float | None = None
    url_port: int = 0
    extra: str = ""
    role: str | None = None  # a P or D worker: "prefill" | "decode"
    # Its death is the cluster's (Ray restarts it; down for good stops the cluster). Not while
    # the launcher starts or stops it: its failure is then that request's answer.
    watched: bool = True

    @property
    def url(self) -> str:
        return f"http://{self.info['host']}:{self.info['ports'][self.url_port]}"


class RayLaunchError(Exception):
    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status  # the launcher's answer when a worker it starts fails so


def _placement(spec: str, nodes: list[dict[str, Any]]) -> dict[str, float]:
    """Ray resources that pin an actor to ``spec``: a node IP or ``resource:NAME``."""
    if spec.startswith("resource:"):
        name = spec.split(":", 1)[1]
        if not any(n["Resources"].get(name) for n in nodes):
            raise RayLaunchError(f"no live Ray node has the custom resource {name!r}")
        return {name: 0.001}
    ips = sorted(n["NodeManagerAddress"] for n in nodes)
    if spec not in ips:
        raise RayLaunchError(f"no live Ray node at {spec} (nodes: {', '.join(ips)})")
    return {f"node:{spec}": 0.001}


class RayCluster:
    def __init__(self, args: argparse.Namespace, worker_argv: list[str], quiet: list[str]) -> None:
        import ray

        self.ray = ray
        self.args = args
        self.worker_argv = worker_argv
        self.quiet = quiet
        self.cluster_id = uuid.uuid4().hex[:12]
        self.services: list[Service] = []
        # The launcher's thread adds and removes services while the driver's monitors them:
        # the list and each service's log position change under this lock.
        self.lock = threading.RLock()
        self.stop_requested = False
        nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
        self.here: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        self.node_specs = {
            role: [s for s in (getattr(args, f"{role}_nodes") or self.here).split(",") if s]
            for role in ("prefill", "decode", "bootstrap", "proxy", "colocated")
        }
        self.placements = {role: [_placement(s, nodes) for s in specs]
                           for role, specs in self.node_specs.items()}
        # Worker i of a role (in start order, the launcher's too) goes to the role's i-th node.
        self.placed = {"prefill": 0, "decode": 0}
        try:  # the TPU chips each P, D and colocated actor asks for (tpu_roles)
            self.tpu = ray_tpu_requests(args, self.node_specs, nodes)
        except ValueError as exc:
            raise RayLaunchError(str(exc)) from None
        self.bootstrap_flags: list[str] = []  # a P or D's, once the bootstrap server is up
        self.actor_class = ray.remote(ServiceActor)

    def _spawn(self, name: str, role: str, tier: int, argv: list[str], n_ports: int,
               health_port: int | None, extra: str = "", armed: bool = True) -> Service:
        places = self.placements[role]
        index = self.placed.get(role, 0)
        if role in self.placed:
            self.placed[role] += 1
        tpu = self.tpu.get(role, 0)
        tpu_host = getattr(self.args, "tpu_host", None)
        tpu_host = None if tpu_host == "auto" else tpu_host
        if tpu:
            # Serve opens the chips Ray gave the actor, one device each.
            argv = [*argv, "--tpu-chips", "{tpu_chips}", "--tp", str(tpu),
                    *(["--tpu-host", tpu_host] if tpu_host else [])]
        handle = self.actor_class.options(
            name=f"pd-fsm-{self.cluster_id}-{name}", num_cpus=0,
            resources={**places[index % len(places)], **({"TPU": tpu} if tpu else {})},
            max_restarts=self.args.ray_max_restarts, max_task_retries=0,
        ).remote(name, self.cluster_id, argv, n_ports, health_port, armed, tpu, tpu_host)
        service = Service(name, tier, handle, extra=extra,
                          role=role if role in self.placed else None)
        with self.lock:
            self.services.append(service)
        return service

    def _worker(self, role: str, name: str, *, watched: bool = True) -> Service:
        """A P or D worker actor (the cluster's, or one the launcher adds): `pd-fsm serve` with
        the flags every worker gets; a P serves its side channel on its second port."""
        argv = ["serve", *self.worker_argv, "--host", "{host}", "--port", "{port0}",
                "--disaggregation-mode", role, *self.bootstrap_flags]
        if role == "prefill":
            argv += ["--disaggregation-side-channel-port", "{port1}"]
        service = self._spawn(name, role, 1, argv, 2 if role == "prefill" else 1, 0,
                              armed=watched)
        service.watched = watched
        return service

    def _info(self, service: Service, timeout: float = 60.0) -> None:
        service.info = self.ray.get(service.handle.info.remote(), timeout=timeout)
        service.restarts = int(service.info["restarts"])
        if service.role == "prefill":
            service.extra = f"bootstrap port {service.info['ports'][1]}"
        if service.info.get("tpu_chips"):
            chips = f"TPU chips {service.info['tpu_chips']}"
            service.extra = f"{service.extra}, {chips}" if service.extra else chips

    def snapshot(self) -> list[Service]:
        with self.lock:
            return list(self.services)

    def _wait_healthy(self, services: list[Service], deadline: float, start: float) -> None:
        last_progress = time.monotonic()
        while True:
            self._pump()
            for s in services:
                if not s.healthy and self._health(s) == 200:
                    s.healthy = True
                    print(f"pd-fsm cluster: {s.name} up on {s.info['host']} after "
                          f"{time.monotonic() - start:.1f} s", flush=True)
            waiting = [s.name for s in services if not s.healthy]
            if not waiting:
                return
            now = time.monotonic()
            if now > deadline:
                raise RayLaunchError(f"{waiting[0]} not healthy after "
                                     f"{self.args.startup_timeout:.0f} s")
            if now - last_progress >= PROGRESS_EVERY:
                last_progress = now
                print(f"pd-fsm cluster: {now - start:.0f} s, waiting for {', '.join(waiting)}",
                      flush=True)
            time.sleep(POLL)

    def _health(self, s: Service) -> int | None:
        try:
            status: int | None = self.ray.get(s.handle.health.remote(), timeout=10)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return None
        return status

    def _pump(self, services: list[Service] | None = None) -> None:
        """Print every service's (or these services') new output lines, ``[name] line``."""
        with self.lock:
            for s in self.snapshot() if services is None else services:
                try:
                    seq, lines = self.ray.get(s.handle.lines.remote(s.seq), timeout=10)
                except (self.ray.exceptions.RayActorError,
                        self.ray.exceptions.GetTimeoutError):
                    continue
                if seq < s.seq:  # a restarted actor counts from zero again
                    s.seq = 0
                    continue
                s.seq = seq
                for line in lines:
                    print(f"[{s.name}] {line}", flush=True)

    def start(self) -> None:
        a = self.args
        start = time.monotonic()
        deadline = start + a.startup_timeout
        boot = self._spawn("bootstrap", "bootstrap", 2,
                           ["bootstrap", "--host", "{host}", "--port", "{port0}", *self.quiet],
                           1, 0)
        self._info(boot)
        self._wait_healthy([boot], deadline, start)
        self.bootstrap_flags = ["--disaggregation-bootstrap-host", boot.info["host"],
                                "--disaggregation-bootstrap-port", str(boot.info["ports"][0])]
        workers = [self._worker(role, f"{role}-{i}") for role, n in
                   (("prefill", a.prefill), ("decode", a.decode)) for i in range(n)]
        if a.colocated:
            workers.append(self._spawn(
                "colocated", "colocated", 1, ["serve", *self.worker_argv, "--host", "{host}",
                                              "--port", "{port0}", "--disaggregation-mode",
                                              "null"], 1, 0))
        for w in workers:
            try:
                self._info(w)
            except self.ray.exceptions.RayActorError as exc:
                # Its constructor raised (the TPU chips Ray gave it fit no sub-mesh, say).
                raise RayLaunchError(f"{w.name}'s actor failed as it started: {exc}") from None
        self._wait_healthy(workers, deadline, start)
        if a.prefill:
            self._wait_healthy([self._proxy(workers)], deadline, start)
        print(f"pd-fsm cluster: ready in {time.monotonic() - start:.1f} s (Ray, cluster "
              f"{self.cluster_id})", flush=True)
        for s in self.snapshot():
            extra = f"  ({s.extra})" if s.extra else ""
            print(f"  {s.name:<12} {s.url}{extra}  [node {s.info['host']}, actor pid "
                  f"{s.info['actor_pid']}, process pid {s.info['pid']}]", flush=True)

    def _proxy(self, workers: list[Service]) -> Service:
        """The proxy, given the P and D workers' URLs (as the local runner's): they keep them
        across restarts, and the launcher adds and removes workers at it (``POST
        /workers/add|remove``), which a proxy reading the registry refuses."""
        listed = []
        for w in workers:
            if w.role == "prefill":
                listed += ["--prefill", w.url, str(w.info["ports"][1])]
            elif w.role == "decode":
                listed += ["--decode", w.url]
        proxy_argv = ["proxy", "--host", "{host}", "--port", "{port0}", *listed, *self.quiet,
                      *shlex.split(self.args.proxy_args or "")]
        proxy = self._spawn("proxy", "proxy", 0, proxy_argv, 1, 0,
                            extra=f"{self.args.prefill} prefill, {self.args.decode} decode")
        self._info(proxy)
        return proxy

    # ------------------------------------------------------------------ the launcher's

    def add_worker(self, role: str, name: str, timeout: float) -> Service:
        """One more P or D actor, placed like its siblings, its ports picked on its node; not
        watched until the launcher says it serves. Raises ``RayLaunchError`` (504: not placed
        and started within ``timeout``; 502: its actor died)."""
        service = self._worker(role, name, watched=False)
        try:
            self._info(service, timeout)
        except self.ray.exceptions.GetTimeoutError:
            failure = RayLaunchError(f"its actor was not placed and started within {timeout:g} "
                                     "s (no live node of its role with room?): stopped", 504)
        except self.ray.exceptions.RayActorError as exc:
            failure = RayLaunchError(f"its actor died as it started: {exc}")
        else:
            return service
        self.retire(service, 1.0)  # nobody's else: it must not start later
        raise failure

    def exit_of(self, s: Service) -> tuple[int, list[str]] | None:
        """A worker the launcher starts (unarmed): its process's exit status and last lines once
        it exited, None while it runs (or its actor does not answer yet). Raises
        ``RayLaunchError`` when its actor died."""
        try:
            info = self.ray.get(s.handle.info.remote(), timeout=10)
        except self.ray.exceptions.GetTimeoutError:
            return None
        except self.ray.exceptions.RayActorError as exc:
            raise RayLaunchError(f"its actor died before it was healthy: "
                                 f"{type(exc).__name__}") from None
        return None if info["exit"] is None else (int(info["exit"]), list(info["tail"]))

    def arm(self, s: Service) -> None:
        """The launcher's worker serves: its death is the cluster's now, as its siblings'."""
        s.watched = True
        s.handle.arm.remote()  # not waited for: the actor's to do, at once

    def retire(self, s: Service, grace: float) -> tuple[int | None, bool]:
        """Stop one service for good: its process (SIGTERM, SIGKILL past ``grace``), its last
        lines printed, then its actor killed without restart; its exit status (None: its
        actor did not say) and whether it was killed."""
        s.watched = False
        try:
            code, killed = self.ray.get(s.handle.stop.remote(grace), timeout=grace + STOP_GRACE)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            code, killed = None, True
        with self.lock:
            self._pump([s])
            if s in self.services:
                self.services.remove(s)
        with contextlib.suppress(Exception):
            self.ray.kill(s.handle, no_restart=True)
        return code, bool(killed)

    # ------------------------------------------------------------------ running

    def urls(self) -> dict[str, str]:
        return {s.name: s.url for s in self.snapshot()}

    def monitor(self, failed: Callable[[], str | None] = lambda: None) -> None:
        """Until a stop is requested: print logs, report deaths and Ray's restarts; raise when a
        service is down for good (restarts used up), or ``failed()`` says why the cluster
        cannot go on (the launcher's thread ended)."""
        while not self.stop_requested:
            self._pump()
            why = failed()
            if why is not None:
                raise RayLaunchError(why)
            for s in self.snapshot():
                if s.watched:
                    self._check(s)
            time.sleep(POLL)

    def _check(self, s: Service) -> None:
        try:
            info = self.ray.get(s.handle.info.remote(), timeout=10)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            now = time.monotonic()
            if not s.watched:  # the launcher took it meanwhile
                return
            if s.down_since is None:
                s.down_since = now
                print(f"pd-fsm cluster: {s.name} is down; Ray restarts it "
                      f"(at most {self.args.ray_max_restarts} times)", flush=True)
            elif now - s.down_since > self.args.startup_timeout:
                raise RayLaunchError(
                    f"{s.name} down for {now - s.down_since:.0f} s: Ray did not restart "
                    "it (restarts used up, or its node is gone)") from None
            return
        if int(info["restarts"]) != s.restarts:
            s.info, s.restarts, s.seq, s.down_since = info, int(info["restarts"]), 0, None
            print(f"pd-fsm cluster: {s.name} restarted by Ray (restart {s.restarts}) on "
                  f"{info['host']}, same URL {s.url}, actor pid {info['actor_pid']}, "
                  f"process pid {info['pid']}", flush=True)

    def stop(self) -> None:
        """In tiers: proxy, workers, bootstrap; each actor stops its process, then is killed
        without restart."""
        for tier in (0, 1, 2):
            group = [s for s in self.snapshot() if s.tier == tier]
            refs = [(s, s.handle.stop.remote()) for s in group]
            for s, ref in refs:
                with contextlib.suppress(Exception):
                    self.ray.get(ref, timeout=STOP_GRACE + 5)
                with contextlib.suppress(Exception):
                    self.ray.kill(s.handle, no_restart=True)
        self._pump()
