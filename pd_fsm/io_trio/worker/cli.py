"""`pd-fsm serve`: a worker process (DESIGN §8): HTTP API + backend in one trio program.

``--disaggregation-mode null`` serves a colocated scheduler; ``prefill`` / ``decode`` build the
backend with ``pd_fsm.io_trio.worker.pd_backends.make_pd_backend(config)``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, NoReturn

import trio

from pd_fsm.io_trio.cli_common import STOP_GRACE_S, listened, run_service, stop_on_signal
from pd_fsm.io_trio.cluster.cpu_placement import (
    check_cpus,
    cpu_list,
    parse_cpus,
    pin_to,
    pools_cores,
    set_nice,
)
from pd_fsm.io_trio.worker.config import (
    ServeConfig,
    add_serve_arguments,
    check_environment,
    config_from_args,
    force_host_devices,
)

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.backend import RoleBackend
    from pd_fsm.jax_engine.transfer.base import KVTransferEngine

log = logging.getLogger("pd_fsm.io_trio.worker.cli")

def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run a worker (colocated, prefill or decode)")
    add_serve_arguments(p)
    p.set_defaults(func=main)


def make_backend(config: ServeConfig, engine: KVTransferEngine | None = None) -> RoleBackend:
    """The backend of ``config``'s role (``roles.make_backend``; imported here, not at the top:
    `pd-fsm --help` reads this module and must not pay for JAX)."""
    from pd_fsm.io_trio.worker.roles import make_backend as make

    return make(config, engine)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format=f"pd-fsm serve[{args.disaggregation_mode}]: %(asctime)s %(levelname)s "
        "%(name)s: %(message)s",
    )
    try:
        config = config_from_args(args)
        _prepare_process(config)
    except (ValueError, OSError) as exc:
        log.error("%s", exc)
        return 2
    except RuntimeError as exc:  # jax.distributed: the other ranks did not join in time
        log.error("cannot join the instance: %s", exc)
        return 1
    if config.node_rank > 0:
        return _follow(config)
    from pd_fsm.io_trio.worker.roles import shared_engine

    # One transfer engine for every PD role of a worker that may switch (roles.py says why).
    engine = shared_engine(config)
    backend = make_backend(config, engine)
    from pd_fsm.io_trio.worker.app import WorkerApp

    worker = WorkerApp(config, backend, engine=engine)
    code = run_service(_run, worker, host=config.host, port=config.port, log=log,
                       uds=config.unix_socket)
    if config.nnodes > 1:
        return code  # jax.distributed's shutdown (atexit) tells the other ranks
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """End a worker that has stopped, skipping the interpreter's finalization. Everything a
    peer can see was released before ``run_service`` returned (registry record, rooms, transfer
    registrations: the drain checks them), the side channel's sockets close with linger 0 and
    the executable store writes atomically, so nothing is left for finalization but freeing
    memory the OS takes back anyway: the garbage collection of ~350k objects and JAX's
    destructors. That took over 10 s of wall time for a P at nice 10 on a loaded 2-core machine
    (py-spy: the main thread in ``gc_collect_main`` after "stopped"), past `pd-fsm cluster`'s
    grace, which then killed it ("ignored SIGTERM"). ``kv/tiered.py``'s atexit hook, which
    would also wait up to 120 s for a background compile in progress, is skipped too: a compile
    cut off by ``_exit`` aborts nothing (the abort it guards against is a C++ exception
    unwinding through finalization) and leaves no partial file."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _prepare_process(config: ServeConfig) -> None:
    """Before the worker starts anything: the environment checked, the heap, cores, nice,
    devices, the instance joined and the compilation cache set up (raises ValueError, OSError,
    or RuntimeError when the other ranks did not join in time)."""
    check_environment(os.environ)
    if config.tpu is not None:
        # libtpu reads them when JAX starts its TPU backend, which nothing has done yet.
        config.tpu.apply(os.environ)
        log.info("%s", config.tpu.describe())
    config.cluster_secret()  # fail now, not at the first registration
    if config.port is None and any(role != "null" for role in config.role_list):
        check_transfer_tcp(config.public_host)
    # An experiment's knob (bench/tpu_serve.sh switch): how long a thread holding the GIL keeps
    # it before one waiting (the step thread, back from the device) may take it; Python's: 5 ms.
    if os.environ.get("PD_FSM_GIL_SWITCH_MS"):
        sys.setswitchinterval(float(os.environ["PD_FSM_GIL_SWITCH_MS"]) / 1000)
    if config.host_heap == "hugepages":
        # glibc reads the tunable at start-up only: this re-executes the process once (same
        # PID). `pd-fsm serve` has done so already, before its imports (pd_fsm/cli.py); here
        # it is a no-op then, and covers a caller that enters `main` directly.
        from pd_fsm.jax_engine.kv.host_memory import hugepages_in_force, reexec_with_hugepages

        reexec_with_hugepages()
        log.info("host heap: huge pages %s", "on" if hugepages_in_force() else "unavailable")
    if config.cpus is not None:
        # Before anything starts JAX: XLA sizes its thread pools from the affinity. With
        # --cpu-pools all or N the threads go to --cpus once the pools exist (app.py).
        cpus = parse_cpus(config.cpus)
        check_cpus(cpus)
        pools = pools_cores(cpus, config.cpu_pools)
        if pools is not None:
            log.info("pinned to cores %s", cpu_list(pin_to(pools)))
    nice = config.nice_of(config.disaggregation_mode)
    if nice != 0:
        # Before anything starts a thread: each inherits its creator's nice (Linux).
        log.info("nice %d", set_nice(nice))
    if config.tp_size > 1:
        # Read when JAX first starts a backend, which nothing has done yet. Only the host
        # (CPU) platform reads it: on an accelerator the devices are the chips.
        force_host_devices(os.environ, config.tp_size // config.nnodes)
    if config.nnodes > 1:
        from pd_fsm.jax_engine.parallel import distributed
        log.info("rank %d of %d: joining the instance at %s", config.node_rank,
                 config.nnodes, config.dist_init_addr)
        assert config.dist_init_addr is not None
        distributed.initialize(config.dist_init_addr, config.nnodes, config.node_rank)
        if config.compilation_cache:
            # Not tried with executables spanning processes: every rank compiles.
            log.info("compilation cache: off (a multi-process instance)")
    elif config.compilation_cache:
        from pd_fsm.jax_engine.compilation import cache as compilation_cache
        where = compilation_cache.enable(
            config.compilation_cache_dir or compilation_cache.default_dir()
        )
        log.info("compilation cache: %s", where)


def check_transfer_tcp(host: str) -> None:
    """A P or D moves KV with jax.experimental.transfer, whose server listens on TCP only (there
    is no unix socket transport): on a machine that refuses TCP sockets, where a worker on its
    unix socket alone may well be, say so at start, by name, instead of failing in the engine."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.bind(address)
    except OSError as exc:
        raise ValueError(
            f"a prefill or decode worker moves KV over jax.experimental.transfer, which listens "
            f"on TCP only, and this machine refused a TCP socket on {host} "
            f"({exc.strerror or exc}): on unix sockets alone serve colocated "
            "(--disaggregation-mode null), or give P and D a machine that allows TCP") from None


def _follow(config: ServeConfig) -> int:
    """A rank > 0: its replica of rank 0's scheduler, built and warmed in step with rank 0's,
    then rank 0's commands until it stops (spmd/follower.py; a PD role: pd_replica.py)."""
    if config.disaggregation_mode != "null":
        from pd_fsm.io_trio.worker.pd_replica import run_replica

        return trio.run(run_replica, config, config.spmd_key())
    from pd_fsm.io_trio.worker.colocated import ColocatedBackend
    from pd_fsm.io_trio.worker.spmd.follower import follow

    backend = ColocatedBackend(config.scheduler_args(), warmup=config.warmup)
    scheduler = backend.build_scheduler()
    log.info("rank %d ready: following rank 0 at %s", config.node_rank, config.spmd_addr())
    return follow(scheduler, config.spmd_addr(), config.node_rank, config.spmd_key())


async def _run(worker: object) -> None:
    from pd_fsm.io_trio.worker.app import WorkerApp, serve_worker

    assert isinstance(worker, WorkerApp)
    stop, drained = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal, stop, log)
        serve = functools.partial(serve_worker, shutdown_trigger=drained.wait)
        c = worker.config
        url = await nursery.start(serve, worker, c.host, c.port)
        # One machine-readable line for launchers (the cluster runner reads the port from it).
        print(f"pd-fsm serve: listening on {listened(url, c.port, c.unix_socket)}", flush=True)
        await stop.wait()
        timeout = worker.config.drain_timeout
        with trio.move_on_after(timeout) as waited:
            await worker.drain()
        if waited.cancelled_caught:
            log.warning("drain timeout (%g s) passed with requests in flight: they fail now",
                        timeout)
        log.info("shutting down")
        drained.set()
        nursery.cancel_scope.deadline = trio.current_time() + STOP_GRACE_S
