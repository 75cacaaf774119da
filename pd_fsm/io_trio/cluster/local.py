"""`pd-fsm cluster`: bootstrap + N prefill + M decode workers + proxy (+ a colocated worker to
compare with) as child processes of one trio program.

Free ports are picked here and handed to the children; this module plans them and reads the
flags. ``supervisor.py`` runs them: every child's output forwarded with a ``[name]`` prefix,
every ``/health`` waited for under one deadline, the URLs printed; Ctrl-C or SIGTERM stops every
child; a child that dies on its own stops the cluster with exit status 1 and that child's last
log lines. With ``--max-workers N`` the runner also serves a launcher (``launcher.py``) that adds
and removes PD workers with the flags their siblings got. ``--ray`` hands everything to the Ray
runner (``ray_driver.py``), which serves the same launcher over worker actors.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import attrs
import trio

from pd_fsm.core.planner import split_halves
from pd_fsm.io_trio.api_key import bearer
from pd_fsm.io_trio.cluster import observability, ray_driver
from pd_fsm.io_trio.cluster.ask import ask
from pd_fsm.io_trio.cluster.cpu_placement import cpu_list, may_take_nice, parse_cpus
from pd_fsm.io_trio.cluster.launcher import Launcher, ProcessBackend, drain_timeout
from pd_fsm.io_trio.cluster.supervisor import STOP_GRACE, Child, Cluster
from pd_fsm.io_trio.cluster.tpu_roles import add_tpu_arguments, chip_plan, tpu_refusal
from pd_fsm.io_trio.ports import free_port_pair, free_ports
from pd_fsm.io_trio.tls import NO_TLS, TLS, throwaway_ca
from pd_fsm.io_trio.unix_sockets import (
    UnixSocket,
    check_path,
    display,
    side_channel_endpoint,
    socket_path_of,
    unix_url,
)

log = logging.getLogger("pd_fsm.io_trio.cluster.local")

HOST = "127.0.0.1"
# The planner waits this much longer for the launcher than the launcher waits for a worker (its
# health, or its drain): the launcher then stops a worker that failed, within STOP_GRACE.
LAUNCHER_MARGIN_S = STOP_GRACE + 20.0


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pd_fsm.cli", *args]


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The `pd-fsm serve` flags every worker gets, whatever launches it (here or on Ray)."""
    # Children log at WARNING by default: INFO would print every registry heartbeat of every
    # process; the runner prints its own progress (who is up, how long the warm-up took).
    worker = ["--model", args.model, "--log-level", args.log_level,
              *shlex.split(args.worker_args or "")]
    # One key file for every public endpoint: workers require it, the proxy requires it and
    # sends it to the workers (the key itself never appears on a command line).
    if args.api_key_file is not None:
        worker += ["--api-key-file", str(args.api_key_file)]
    for flag in ("num_pages", "page_size", "max_running", "context_length"):
        value = getattr(args, flag)
        if value is not None:
            worker += [f"--{flag.replace('_', '-')}", str(value)]
    return worker


# `pd-fsm cluster --planner`: the roles every PD worker compiles at start and may switch to.
PLANNER_ROLES = "prefill,decode,null"

# Where P and D run on one machine (`--pd-cores`). "split", the local runner's default: P on
# the first half of the cores this process may use, D on the rest, each
# worker's XLA pools sized to its half, so a prefill never stalls a decode step. With fresh
# prompts on a 2-core machine it met the SLO at least as often as colocated at every rate from
# 0.25 to 1.5 req/s, where P and D sharing the cores was level with colocated
# (bench/RESULTS_placement.md). It loses where prompts are long: a one-core P takes ~2.4 s to
# prefill 419-788 tokens, past a 2 s TTFT target (bench/RESULTS_adaptive.md).
# "shared": P and D on every core, D above P (SHARED_CORES_NICE) and on XLA pools of one thread
# (SHARED_D_POOLS), so a decode step takes a core from a prefill instead of waiting behind it and
# leaves P the other; the default with --max-workers (workers come and go on the same cores), on
# a machine of one core, and with --planner, which may split them (`planner --cores`,
# movable_cores). With D on one thread it is level with split and ahead at TPOT <= 50 ms
# (bench/RESULTS_placement.md); a planner started split loses the first seconds of a
# long-prompt phase before it shares (bench/RESULTS_adaptive.md).
PD_CORES = ("auto", "split", "shared")

# P and D on the same cores: D above P. Where this process may not lower a priority, D stays at
# 0 and P still steps back.
SHARED_CORES_NICE = {"prefill": 10, "decode": -5}

# D beside P on the same cores: XLA pools of one thread. Idle pool threads spin, so a D with two
# keeps ~1.5 cores busy even at batch 1 and P behind it gets the rest; with one it keeps ~1.1
# busy and steps as fast (bench/RESULTS_placement.md).
SHARED_D_POOLS = "1"


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity, which its children inherit)."""
    return sorted(os.sched_getaffinity(0))


def split_cores(cores: list[int]) -> dict[str, str]:
    """`--pd-cores split`: P the first half of ``cores`` (the larger, for an odd count: prefill
    is the compute-bound side), D the rest, as `pd-fsm serve --cpus` lists."""
    halves = split_halves(frozenset(cores))
    return {role: cpu_list(halves[role]) for role in ("prefill", "decode")}


def pd_cores(args: argparse.Namespace, cores: list[int] | None = None) -> str:
    """How P and D take this machine's cores: "split", "shared", or "" (no PD, or a role's
    cores given by hand: ``--prefill-cpus``/``--decode-cpus`` place it)."""
    if not (args.prefill and args.decode):
        return ""
    if args.prefill_cpus is not None or args.decode_cpus is not None:
        return ""
    mode = getattr(args, "pd_cores", "auto")
    if mode != "auto":
        return str(mode)
    n = len(usable_cores() if cores is None else cores)
    shared = getattr(args, "max_workers", 0) or getattr(args, "planner", False) or n < 2
    return "shared" if shared else "split"


def role_cpus(args: argparse.Namespace, cores: list[int] | None = None
              ) -> dict[str, str | None]:
    """Each role's ``--cpus``: ``--ROLE-cpus``, else P's and D's halves under "split"; None
    leaves the worker on every core its launcher has."""
    cpus: dict[str, str | None] = {role: getattr(args, f"{role}_cpus")
                                   for role in ("prefill", "decode", "colocated")}
    cores = usable_cores() if cores is None else cores
    if pd_cores(args, cores) == "split":
        cpus.update(split_cores(cores))
    return cpus


def placement_line(args: argparse.Namespace) -> str:
    """Where P and D run, for the runner's log ("" without PD)."""
    if not (args.prefill and args.decode):
        return ""
    cpus, nices, pools = role_cpus(args), role_nices(args), role_pools(args)

    def where(role: str) -> str:
        listed, threads = cpus[role], pools[role]
        at = ("every core" if listed is None else
              f"cores {listed}" if "," in listed or "-" in listed else f"core {listed}")
        if threads is not None and threads.isdigit():
            at += f" ({threads}-thread pools)"
        return at if nices[role] is None else f"{at} at nice {nices[role]}"

    mode = pd_cores(args)
    how = f"--pd-cores {mode}" if mode else "--prefill-cpus/--decode-cpus"
    if movable_cores(args):
        how += ("; the planner may make them share every core" if mode == "split" else
                "; the planner may split them")
    return f"P on {where('prefill')}, D on {where('decode')} ({how})"


def movable_cores(args: argparse.Namespace, cores: list[int] | None = None) -> bool:
    """The planner may move P and D between split and shared cores (``planner --cores``): with
    the planner, two cores or more, and no ``--max-workers``. Split at start, their pools are
    sized to every core (``serve --cpu-pools all``); shared, they are anyway."""
    cores = usable_cores() if cores is None else cores
    return (bool(getattr(args, "planner", False)) and not getattr(args, "max_workers", 0)
            and len(cores) >= 2 and pd_cores(args, cores) in ("split", "shared"))


def role_pools(args: argparse.Namespace) -> dict[str, str | None]:
    """Each role's ``serve --cpu-pools``: ``--ROLE-cpu-pools``, else, where P and D share the
    cores or the planner may make them share, D's pools of one thread (``SHARED_D_POOLS``) and
    P's sized to every core ("all", when it starts split); None: the worker's default (pools
    sized to its ``--cpus``). Not with the planner and ``--max-workers``: there it moves
    workers between roles rather than cores, and a D made P would prefill on one thread."""
    pools: dict[str, str | None] = {role: getattr(args, f"{role}_cpu_pools", None)
                                    for role in ("prefill", "decode", "colocated")}
    planner = bool(getattr(args, "planner", False))
    if movable_cores(args) or (pd_cores(args) == "shared" and not planner):
        pools["decode"] = pools["decode"] or SHARED_D_POOLS
    if movable_cores(args) and pd_cores(args) == "split":
        pools["prefill"] = pools["prefill"] or "all"
    return pools


def narrow_decode(args: argparse.Namespace) -> bool:
    """D's XLA pools have fewer threads than P's (``role_pools``: D's of one thread beside P
    under the planner by default; a pool count, else as many threads as the worker's cores)."""
    pools, cpus = role_pools(args), role_cpus(args)

    def threads(role: str) -> int:
        count, listed = pools[role], cpus[role]
        if count is not None and count.isdigit():
            return int(count)
        if count == "all" or listed is None:
            return len(usable_cores())
        return len(parse_cpus(listed))

    return threads("decode") < threads("prefill")


def role_nices(args: argparse.Namespace) -> dict[str, int | None]:
    """Each role's CPU priority: ``--ROLE-nice``, else, for P and D sharing cores, D above P
    (``SHARED_CORES_NICE``); None leaves the worker at its launcher's."""
    nices: dict[str, int | None] = {role: getattr(args, f"{role}_nice", None)
                                    for role in ("prefill", "decode", "colocated")}
    # Split under the planner, P and D may come to share the cores (`planner --cores`).
    shared = pd_cores(args) == "shared" or movable_cores(args)
    for role, nice in SHARED_CORES_NICE.items():
        if shared and nices[role] is None:
            nices[role] = nice if may_take_nice(nice) else max(nice, 0)
    return nices


@attrs.frozen
class Listen:
    """Where one child serves: a TCP port on ``HOST``, or a unix socket (``--uds DIR``)."""

    port: int | None = None
    uds: Path | None = None

    def flags(self) -> list[str]:
        return ["--port", str(self.port)] if self.uds is None else ["--uds", str(self.uds)]

    def url(self, tls: TLS) -> str:
        return f"{tls.scheme}://{HOST}:{self.port}" if self.uds is None else unix_url(str(self.uds))

    def registry_flags(self) -> list[str]:
        """How a worker reaches the bootstrap server listening here."""
        if self.uds is not None:
            return ["--disaggregation-bootstrap-host", f"unix:{self.uds}"]
        return ["--disaggregation-bootstrap-host", HOST,
                "--disaggregation-bootstrap-port", str(self.port)]


@attrs.frozen
class _Ports:
    """Where one cluster's children serve: free ports picked at once, or, with ``--uds DIR``,
    a unix socket each in DIR (``NAME.sock``; a P's side channel beside it, ``NAME.sock.zmq``)."""

    bootstrap: Listen
    proxy: Listen
    prefill: list[Listen]
    side: list[int | None]  # each P's side-channel port (None: beside its unix socket)
    decode: list[Listen]
    colocated: Listen
    decode_side: list[int | None]  # with the planner: each D's side channel, for when it is a P
    planner: Listen
    launcher: Listen  # the runner's own control endpoint (--max-workers)

    @classmethod
    def pick(cls, n_p: int, n_d: int, planner: bool) -> _Ports:
        # With the planner every D may become a P: it needs a side-channel port of its own too.
        ports = free_ports(4 + 2 * n_p + n_d + (n_d + 1 if planner else 0), launcher=True)
        tcp = [Listen(port) for port in ports]
        return cls(
            bootstrap=tcp[0], proxy=tcp[1], prefill=tcp[2 : 2 + n_p],
            side=[*ports[2 + n_p : 2 + 2 * n_p]], decode=tcp[2 + 2 * n_p : 2 + 2 * n_p + n_d],
            colocated=tcp[2 + 2 * n_p + n_d],
            decode_side=[*ports[3 + 2 * n_p + n_d : 3 + 2 * n_p + 2 * n_d]] if planner else [],
            planner=tcp[-2], launcher=tcp[-1],
        )

    @classmethod
    def in_dir(cls, folder: Path, n_p: int, n_d: int, planner: bool) -> _Ports:
        """Every child on a unix socket in ``folder``: no TCP port is picked, nor bound."""
        return cls(
            bootstrap=uds_in(folder, "bootstrap"), proxy=uds_in(folder, "proxy"),
            prefill=[uds_in(folder, f"prefill-{i}") for i in range(n_p)], side=[None] * n_p,
            decode=[uds_in(folder, f"decode-{i}") for i in range(n_d)],
            colocated=uds_in(folder, "colocated"), decode_side=[None] * n_d if planner else [],
            planner=uds_in(folder, "planner"), launcher=uds_in(folder, "launcher"),
        )


def uds_in(folder: Path, name: str) -> Listen:
    return Listen(uds=folder / f"{name}.sock")


def plan(args: argparse.Namespace, tls: TLS = NO_TLS, ports: _Ports | None = None
         ) -> list[Child]:
    """The children to start, in start order (the proxy last); with ``tls``, every one serves
    HTTPS with its certificate and verifies the others against its CA. ``ports``: picked here
    unless given (the launcher serves on one of them)."""
    n_p, n_d = args.prefill, args.decode
    planner = getattr(args, "planner", False)
    ports = ports or _Ports.pick(n_p, n_d, planner)
    children: list[Child] = []
    if n_p or n_d:
        children.append(_bootstrap_child(args, tls, ports.bootstrap))
    prefills: list[Child] = []
    for i, (at, side) in enumerate(zip(ports.prefill, ports.side, strict=True)):
        prefills.append(_add_instance(children, args, f"prefill-{i}", "prefill", _pd_argv(
            args, tls, "prefill", at, side, ports.bootstrap,
        ), at.url(tls), side))
    decodes: list[Child] = []
    for i, at in enumerate(ports.decode):
        d_side = ports.decode_side[i] if planner else None
        decodes.append(_add_instance(children, args, f"decode-{i}", "decode", _pd_argv(
            args, tls, "decode", at, d_side, ports.bootstrap,
        ), at.url(tls), d_side))
    if args.colocated:
        _add_instance(children, args, "colocated", "colocated", _cli(
            "serve", "--host", HOST, *worker_flags(args), *tls.argv(),
            *_role_flags(args, "colocated"), *ports.colocated.flags(),
            "--disaggregation-mode", "null",
        ), ports.colocated.url(tls))
    if n_p and n_d:
        children.append(_proxy_child(args, tls, ports, prefills, decodes))
    if planner and n_p and n_d:
        children.append(_planner_child(args, tls, ports, [*prefills, *decodes]))
    return children


def _pd_argv(args: argparse.Namespace, tls: TLS, role: str, at: Listen, side: int | None,
             bootstrap: Listen) -> list[str]:
    """A P or D worker's command line (one the cluster starts, or one the launcher adds)."""
    side_flag = [] if side is None else ["--disaggregation-side-channel-port", str(side)]
    return _cli("serve", "--host", HOST, *worker_flags(args), *tls.argv(),
                *_role_flags(args, role), *at.flags(), "--disaggregation-mode", role,
                *bootstrap.registry_flags(),
                *_switchable(args, getattr(args, "planner", False)), *side_flag)


def launched_worker(args: argparse.Namespace, tls: TLS, role: str, name: str,
                    bootstrap: Listen) -> Child:
    """One more P or D worker for the launcher (``POST /scale_up``): the flags its siblings got,
    on ports picked now (a side channel for a P, and for a D that may become one), or on a unix
    socket of its name beside theirs (``--uds DIR``)."""
    planner = getattr(args, "planner", False)
    folder: Path | None = getattr(args, "uds", None)
    if folder is not None:
        at, side_port = uds_in(folder, name), None
    else:
        port, side = free_ports(2, launcher=True)
        at, side_port = Listen(port), side if role == "prefill" or planner else None
    return Child(name, _pd_argv(args, tls, role, at, side_port, bootstrap), at.url(tls),
                 _side_note(role, at, side_port), role=role, side_port=side_port)


def _side_note(role: str, at: Listen, side_port: int | None) -> str:
    """What the runner shows beside a P: its bootstrap port, or its side channel's socket."""
    if side_port is not None:
        return f"bootstrap port {side_port}"
    if role == "prefill" and at.uds is not None:
        return f"side channel {side_channel_endpoint(at.uds)}"
    return ""


def _quiet(args: argparse.Namespace) -> list[str]:
    return ["--log-level", args.log_level]


def _worker_key(args: argparse.Namespace) -> list[str]:
    """The flag that gives a caller of the workers their key file (none without one)."""
    return [] if args.api_key_file is None else ["--worker-api-key-file", str(args.api_key_file)]


def _bootstrap_child(args: argparse.Namespace, tls: TLS, at: Listen) -> Child:
    serving = TLS(tls.certfile, tls.keyfile)  # the bootstrap server calls nobody
    return Child("bootstrap", _cli("bootstrap", "--host", HOST, *at.flags(),
                                   *_quiet(args), *serving.argv()), at.url(tls))


def _role_flags(args: argparse.Namespace, role: str) -> list[str]:
    """The role's own flags: its cores and XLA pools, its CPU priority and its tensor-parallel
    size."""
    cpus, tp = role_cpus(args)[role], getattr(args, f"{role}_tp", None)
    nice, pools = role_nices(args)[role], role_pools(args)[role]
    if pools is not None and pools.isdigit() and cpus is None:
        cpus = cpu_list(frozenset(usable_cores()))  # N threads: on every core, as unpinned
    flags = [] if cpus is None else ["--cpus", cpus]
    flags += [] if pools is None else ["--cpu-pools", pools]
    flags += [] if nice is None else ["--nice", str(nice)]
    return flags + ([] if tp is None else ["--tp", str(tp)])


def _switchable(args: argparse.Namespace, planner: bool) -> list[str]:
    """With the planner: every PD worker compiles both roles and colocated (``--roles``: the
    planner may switch it to null, and the proxy's role probes route it whole requests then)
    and carries every role's priority (a D also gets a side-channel port of its own: it serves
    on it as a P)."""
    if not planner:
        return []
    # The priority follows the role (`serve --role-nice`): a merged (null) worker takes
    # colocated's, a D that becomes P steps back.
    nices = role_nices(args)
    role_nice = ",".join(f"{role}={nices[name] or 0}" for role, name in
                         (("prefill", "prefill"), ("decode", "decode"), ("null", "colocated")))
    return ["--roles", PLANNER_ROLES, "--role-nice", role_nice]


def _add_instance(children: list[Child], args: argparse.Namespace, name: str, role: str,
                  argv: list[str], url: str, side_port: int | None = None) -> Child:
    """One instance added to ``children``: a child, or with ``--ROLE-nnodes N`` N children of
    one instance (rank 0 serves HTTP, and is returned; the others have no URL, and one that dies
    stops the cluster too). A P shows its side-channel port: its bootstrap port."""
    argv = [*argv, *_chip_flags(args, role, name)]
    nnodes = getattr(args, f"{role}_nnodes", 1) or 1
    uds = socket_path_of(url)
    extra = _side_note(role, Listen(uds=None if uds is None else Path(uds)), side_port)
    pd_role = role if role in ("prefill", "decode") else None
    if nnodes == 1:
        children.append(Child(name, argv, url, extra, role=pd_role, side_port=side_port))
        return children[-1]
    addr = f"{HOST}:{free_port_pair(launcher=True)}"
    for rank in range(nnodes):
        ranked = [*argv, "--nnodes", str(nnodes), "--node-rank", str(rank),
                  "--dist-init-addr", addr]
        children.append(Child(name, ranked, url, extra, role=pd_role, side_port=side_port)
                        if rank == 0 else
                        Child(f"{name}-rank{rank}", ranked, extra=f"rank {rank} of {name}"))
    return children[-nnodes]


def _chip_flags(args: argparse.Namespace, role: str, name: str) -> list[str]:
    """The worker's TPU chips (``tpu_roles``): none on a host with no TPU."""
    chips = chip_plan(args)
    return [] if chips is None else chips.flags(args, role, name)


def _proxy_child(args: argparse.Namespace, tls: TLS, ports: _Ports, prefills: list[Child],
                 decodes: list[Child]) -> Child:
    keyed = [] if args.api_key_file is None else ["--api-key-file", str(args.api_key_file)]
    # With the planner a role switch may leave no P listed for a drain's length (its
    # colocated worker becoming P again beside a standby D): D prefills alone meanwhile.
    alone = ["--local-prefill-without-prefill"] if args.planner else []
    proxy_args = ["proxy", "--host", HOST, *ports.proxy.flags(), *keyed, *_quiet(args),
                  *tls.argv(), *alone, *shlex.split(args.proxy_args or ""), *_worker_key(args)]
    for child, at, side in zip(prefills, ports.prefill, ports.side, strict=True):
        known_by = side_channel_endpoint(at.uds) if at.uds is not None else str(side)
        proxy_args += ["--prefill", display(str(child.url)), known_by]
    for child in decodes:
        proxy_args += ["--decode", display(str(child.url))]
    return Child("proxy", _cli(*proxy_args), ports.proxy.url(tls),
                 f"{len(prefills)} prefill, {len(decodes)} decode")


def prefill_nice_steps(nices: dict[str, int | None]) -> tuple[int, ...]:
    """With P above D's nice (P and D sharing cores, D first): the priorities the planner may
    give P (``planner --prefill-nices``), least first — 19, P's own, then every 5 down to D's
    (10/-5: 19,10,5,0,-5). Empty when the two are not placed by priority."""
    p, d = nices["prefill"], nices["decode"]
    if p is None or d is None or p <= d:
        return ()
    return tuple(sorted({19, p, d, *range(p, d, -5)}, reverse=True))


def _planner_child(args: argparse.Namespace, tls: TLS, ports: _Ports, workers: list[Child]
                   ) -> Child:
    # The priority lever by default where P and D share cores by priority; --planner-args
    # comes after, so its own --prefill-nices wins ("" turns the lever off).
    steps = prefill_nice_steps(role_nices(args))
    lever = ["--prefill-nices", ",".join(map(str, steps))] if steps else []
    if movable_cores(args):  # and the cores lever
        lever += ["--cores", cpu_list(frozenset(usable_cores()))]
    if narrow_decode(args):
        # D's own steps are slow on its one thread: the planner's one lever that gives decode
        # more threads makes P colocated beside a standby D (without it, half the SLOs the
        # best static placement meets: bench/RESULTS_adaptive.md). --planner-args=
        # --no-colocate: off. Not --move-standby: the standby's streams prefilled again on the
        # colocated worker stall its steps more than their decode beside it does.
        lever += ["--colocate"]
    max_workers = getattr(args, "max_workers", 0)
    if max_workers:
        # The launcher lists every PD worker, those it adds too: the planner observes its list.
        # It answers a scale-up once the worker is healthy (within --startup-timeout), a
        # scale-down once the worker has drained and exited.
        longest = max(args.startup_timeout, drain_timeout(args) + STOP_GRACE)
        observed = ["--launcher-url", display(ports.launcher.url(tls)),
                    "--max-workers", str(max_workers),
                    "--launcher-timeout", f"{longest + LAUNCHER_MARGIN_S:g}"]
    else:
        observed = [arg for child in workers for arg in ("--worker", display(str(child.url)))]
    planner_args = ["planner", "--host", HOST, *ports.planner.flags(), *_quiet(args),
                    *tls.argv(), *lever, *observed, *shlex.split(args.planner_args or ""),
                    *_worker_key(args)]
    if args.api_key_file is not None:  # its own /decisions, /pause and /resume
        planner_args += ["--api-key-file", str(args.api_key_file)]
    what = "switches roles and scales" if max_workers else "switches roles"
    return Child("planner", _cli(*planner_args), ports.planner.url(tls),
                 f"{what}: GET /decisions")


def prometheus_child(urls: dict[str, str], tls: TLS) -> Child:
    """Prometheus beside the cluster, with the shipped configuration and rules
    (``deploy/prometheus``) and this cluster's processes as its targets, in a folder that goes
    with the run."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise FileNotFoundError("no `prometheus` on PATH (Debian: apt-get install prometheus)")
    folder = Path(tempfile.mkdtemp(prefix="pd-fsm-prometheus-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = observability.prepare_prometheus(folder / "config", urls, ca_file=tls.ca_file)
    (port,) = free_ports(1, launcher=True)
    return Child("prometheus", [binary, f"--config.file={config}",
                                f"--storage.tsdb.path={folder / 'data'}",
                                f"--web.listen-address={HOST}:{port}", "--log.level=warn"],
                 f"http://{HOST}:{port}", "dashboard: deploy/grafana/pd_fsm.json",
                 health_path="/-/ready")


# --------------------------------------------------------------------------------- CLI


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cluster", help="start bootstrap + prefill + decode + proxy locally")
    _add_worker_arguments(p)
    _add_service_arguments(p)
    _add_ray_arguments(p)
    add_tpu_arguments(p)
    p.set_defaults(func=main)


def _add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """How many workers of each role, their model and pool, and each role's cores, priority,
    tensor-parallel size and processes."""
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--colocated", action="store_true", help="also start a colocated worker")
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | checkpoint directory")
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--pd-cores", choices=PD_CORES, default="auto",
                   help="P and D on one machine: split (P the first half of the cores, D the "
                        "rest), shared (both on every core, D above P: nice "
                        f"{SHARED_CORES_NICE['prefill']} / {SHARED_CORES_NICE['decode']}); "
                        "default auto: split; shared with --planner (which may split them), "
                        "with --max-workers or on one core; "
                        "split halves P's prefill rate: for long prompts prefer shared or "
                        "--planner; "
                        "--prefill-cpus/--decode-cpus place P and D by hand instead")
    for role in ("prefill", "decode", "colocated"):
        p.add_argument(f"--{role}-cpus", default=None, metavar="LIST",
                       help=f"pin every {role} worker to these cores (`pd-fsm serve --cpus`)")
        p.add_argument(f"--{role}-nice", type=int, default=None, metavar="N",
                       help=f"CPU priority of every {role} worker (`pd-fsm serve --nice`, "
                            "-20..19, lower first; P and D sharing cores default to "
                            f"{SHARED_CORES_NICE['prefill']} and {SHARED_CORES_NICE['decode']}: "
                            "D above P)")
        p.add_argument(f"--{role}-cpu-pools", default=None, metavar="cpus|all|N",
                       help=f"XLA's thread pools of every {role} worker (`pd-fsm serve "
                            f"--cpu-pools`; N threads on every core, or on --{role}-cpus)")
        p.add_argument(f"--{role}-tp", type=int, default=None, metavar="N",
                       help=f"every {role} worker tensor-parallel over N devices (`pd-fsm serve "
                            "--tp`); P and D may differ: D regroups P's KV shards")
        p.add_argument(f"--{role}-nnodes", type=int, default=1, metavar="N",
                       help=f"every {role} instance over N processes (`pd-fsm serve --nnodes`; "
                            f"--{role}-tp a multiple of N); multi-process P and D pair rank for "
                            "rank, so both need the same N and tp")


def _add_service_arguments(p: argparse.ArgumentParser) -> None:
    """What every child gets (log level, key, more flags), the planner, and what the runner does
    once the cluster is up (--ask, Prometheus, TLS)."""
    p.add_argument("--log-level", default="WARNING",
                   help="of every child process (default WARNING; INFO shows each heartbeat)")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                   help="workers and proxy require 'Authorization: Bearer <key in FILE>'")
    p.add_argument("--worker-args", default="",
                   help="more `pd-fsm serve` flags for every worker, as one quoted string")
    p.add_argument("--proxy-args", default="",
                   help="more `pd-fsm proxy` flags, as one quoted string (e.g. "
                        "'--prefill-policy cache_aware --local-prefill-tokens 32')")
    p.add_argument("--planner", action="store_true",
                   help="every PD worker compiles both roles and colocated (`pd-fsm serve "
                        f"--roles {PLANNER_ROLES}`) and `pd-fsm planner` switches them to meet "
                        "its targets (the proxy follows by probing their roles; a worker in "
                        "role null gets whole requests)")
    p.add_argument("--max-workers", type=int, default=0, metavar="N",
                   help="serve a launcher (POST /scale_up, /scale_down; its URL is printed) "
                        "that starts and stops PD workers (with --ray: worker actors), at most "
                        "N in all; with --planner the "
                        "planner scales through it (`planner --launcher-url --max-workers N`). "
                        "Default 0: no launcher, a fixed set of workers")
    p.add_argument("--planner-args", default="",
                   help="more `pd-fsm planner` flags, as one quoted string (e.g. '--ttft-slo 2 "
                        "--itl-slo 0.1 --interval 5')")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for every child to answer /health (default 600)")
    p.add_argument("--ask", metavar="PROMPT", default=None,
                   help="once ready: send this chat prompt through the proxy and to the "
                        "colocated worker, print both answers, stop")
    p.add_argument("--max-tokens", type=int, default=32, help="for --ask (default 32)")
    p.add_argument("--prometheus", action="store_true",
                   help="also start Prometheus (Debian's `prometheus`) scraping every process "
                        "with deploy/prometheus's config, recording and alert rules; prints "
                        "its URL (import deploy/grafana/pd_fsm.json into Grafana over it)")
    p.add_argument("--prometheus-targets", type=Path, default=None, metavar="FILE",
                   help="write a Prometheus file-based service discovery file naming every "
                        "process (labels role and name), e.g. into deploy/prometheus/targets/")
    p.add_argument("--tls", action="store_true",
                   help="HTTPS everywhere, with a throwaway CA made for this run (openssl)")
    p.add_argument("--uds", type=Path, default=None, metavar="DIR",
                   help="every server on a unix socket in DIR (NAME.sock; created 0700), none "
                        "on a TCP port: the bootstrap server, the workers, the proxy, the "
                        "planner and the launcher; P and D still pull KV over TCP on loopback "
                        "(jax.experimental.transfer has no other transport)")


def _add_ray_arguments(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("on Ray (pd_fsm[ray]): every service a Ray actor on a chosen node")
    ray.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                     help="place the services on the Ray cluster at ADDRESS (default: auto, "
                     "the one this machine is part of; local: a Ray of this machine alone, "
                     "started for this run)")
    for role, what in (("prefill", "P workers"), ("decode", "D workers")):
        ray.add_argument(f"--{role}-nodes", default=None, metavar="LIST",
                         help=f"{what}: comma-separated node IPs or resource:NAME (a Ray custom "
                         "resource), round robin (default: the driver's node)")
    for role in ("bootstrap", "proxy", "colocated"):
        ray.add_argument(f"--{role}-node", dest=f"{role}_nodes", default=None, metavar="NODE",
                         help=f"the {role} service's node: an IP or resource:NAME")
    ray.add_argument("--ray-max-restarts", type=int, default=3, metavar="N",
                     help="Ray restarts a service whose process died, at most N times (default 3)")


def _refusal(args: argparse.Namespace) -> str | None:
    """What makes the flags impossible, or None."""
    if args.prefill < 0 or args.decode < 0:
        return "--prefill and --decode must be >= 0"
    if (args.prefill == 0) != (args.decode == 0):
        return "PD needs both prefill and decode workers (or neither)"
    if not (args.prefill or args.colocated):
        return "nothing to start"
    for role in ("prefill", "decode", "colocated"):
        nnodes, tp = getattr(args, f"{role}_nnodes"), getattr(args, f"{role}_tp") or 1
        if nnodes < 1 or tp % nnodes:
            return f"--{role}-nnodes {nnodes} must be >= 1 and divide --{role}-tp {tp}"
    if args.pd_cores != "auto" and (args.prefill_cpus is not None
                                    or args.decode_cpus is not None):
        return f"--pd-cores {args.pd_cores} and --prefill-cpus/--decode-cpus both place P and D"
    cores = usable_cores()
    if args.pd_cores == "split" and args.prefill and len(cores) < 2:
        return f"--pd-cores split needs 2 or more cores (this process may use {cores})"
    if args.ray is not None and max(args.prefill_nnodes, args.decode_nnodes,
                                    args.colocated_nnodes) > 1:
        return "--ROLE-nnodes is for the local runner (not --ray)"
    if args.ray is not None and (args.prometheus or args.prometheus_targets is not None):
        return "--prometheus and --prometheus-targets are for the local runner (not --ray)"
    uds_refusal = _uds_refusal(args)
    if uds_refusal is not None:
        return uds_refusal
    if args.planner and (args.ray is not None or not args.prefill):
        return ("--planner is for PD workers on the local runner (not --ray: there, run "
                "`pd-fsm planner --launcher-url` against `--ray --max-workers`' launcher)")
    return _max_workers_refusal(args)


def _uds_refusal(args: argparse.Namespace) -> str | None:
    """What ``--uds DIR`` cannot go with: what only TCP reaches."""
    if args.uds is None:
        return None
    if args.ray is not None:
        return "--uds is for the local runner (a unix socket is reached from its host only)"
    if args.tls:
        return "--uds and --tls: HTTPS is not served on unix sockets"
    if args.prometheus or args.prometheus_targets is not None:
        return "--uds and --prometheus(-targets): Prometheus scrapes TCP targets only"
    if max(args.prefill_nnodes, args.decode_nnodes, args.colocated_nnodes) > 1:
        return ("--uds and --ROLE-nnodes: the ranks of an instance meet over TCP "
                "(jax.distributed)")
    try:
        check_path(args.uds / "decode-00.sock.zmq", "--uds")  # the longest name it makes
    except ValueError as exc:
        return str(exc)
    return None


def _max_workers_refusal(args: argparse.Namespace) -> str | None:
    if not args.max_workers:
        return None
    if args.max_workers < 0:
        return "--max-workers must be >= 0 (0: no launcher)"
    if not args.prefill:
        return "--max-workers is for PD workers (give --prefill and --decode)"
    if max(args.prefill_nnodes, args.decode_nnodes) > 1:
        return "--max-workers launches one-process workers: not with --prefill/--decode-nnodes"
    if args.max_workers < args.prefill + args.decode:
        return (f"--max-workers {args.max_workers} is below the {args.prefill + args.decode} "
                "prefill and decode workers the cluster starts with")
    return None


def _launcher(args: argparse.Namespace, tls: TLS, ports: _Ports, cluster: Cluster) -> Launcher:
    key = None if args.api_key_file is None else args.api_key_file.read_text().strip()

    def new_worker(role: str, name: str) -> Child:
        return launched_worker(args, tls, role, name, ports.bootstrap)

    at = ports.launcher
    return Launcher(ProcessBackend(cluster, new_worker), max_workers=args.max_workers,
                    proxy_url=ports.proxy.url(tls),
                    headers=bearer(key) if key else {}, host=HOST, port=at.port,
                    uds=None if at.uds is None else UnixSocket(at.uds),
                    start_timeout=args.startup_timeout,
                    stop_timeout=drain_timeout(args) + STOP_GRACE, tls=tls, api_key=key)


def main(args: argparse.Namespace) -> int:
    refusal = _refusal(args) or tpu_refusal(args)
    if refusal is not None:
        print(f"pd-fsm cluster: {refusal}", file=sys.stderr)
        return 2
    if args.ray is not None:
        return ray_driver.main(args, worker_flags(args), ["--log-level", args.log_level])
    placed = placement_line(args)
    if placed:
        print(f"pd-fsm cluster: {placed}", flush=True)
    if (chips := chip_plan(args)) is not None:
        print(f"pd-fsm cluster: {chips.describe()}", flush=True)
    tls = NO_TLS
    if args.tls:
        # A throwaway CA for this run, in a directory that goes with it (key readable by us only).
        tls_dir = Path(tempfile.mkdtemp(prefix="pd-fsm-tls-"))
        atexit.register(shutil.rmtree, tls_dir, ignore_errors=True)
        tls = throwaway_ca(tls_dir, [HOST, "localhost"])
        print(f"pd-fsm cluster: TLS on, throwaway CA {tls.ca_file} (curl --cacert it)", flush=True)
    if args.uds is not None:
        # Only its owner may enter the folder: every socket in it is the cluster's.
        args.uds.mkdir(mode=0o700, parents=True, exist_ok=True)
        ports = _Ports.in_dir(args.uds, args.prefill, args.decode, args.planner)
        print(f"pd-fsm cluster: every server on a unix socket in {args.uds} (the KV pulls go "
              "over TCP on loopback: jax.experimental.transfer listens on TCP only)"
              if args.prefill else
              f"pd-fsm cluster: every server on a unix socket in {args.uds}", flush=True)
    else:
        ports = _Ports.pick(args.prefill, args.decode, args.planner)
    children = plan(args, tls, ports)
    urls = {c.name: c.url for c in children if c.url}
    if args.prometheus_targets is not None:  # for a Prometheus of the operator's own
        observability.write_targets(args.prometheus_targets, urls)
    if args.prometheus:
        try:
            children.append(prometheus_child(urls, tls))
        except FileNotFoundError as exc:
            print(f"pd-fsm cluster: --prometheus: {exc}", file=sys.stderr)
            return 2
    cluster = Cluster(children, startup_timeout=args.startup_timeout, tls=tls)
    if args.max_workers:
        cluster.services.append(_launcher(args, tls, ports, cluster))
    action = None
    if args.ask is not None:
        prompt, max_tokens = args.ask, args.max_tokens

        headers = {} if args.api_key_file is None else bearer(args.api_key_file.read_text().strip())

        async def action(c: Cluster) -> int:
            return await ask({ch.name: str(ch.url) for ch in c.children if ch.url}, prompt,
                             max_tokens, headers, tls)

    return trio.run(cluster.run, action)
