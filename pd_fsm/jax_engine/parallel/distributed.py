"""One instance over several processes: ``jax.distributed`` joins them into one set of devices.

After :func:`initialize`, ``jax.devices()`` lists every process's devices (rank 0's first) and a
``Mesh`` over them runs a jitted computation as one program, each process computing on its own
devices, as long as every process makes the same calls in the same order (``io_trio/worker/spmd``
sees to that). On the CPU backend the cross-process collectives go over gloo (TCP). Measured on
CPU (2 processes x 2 forced devices, the tiny model at tp=4): tokens equal tp=1's in one process.

A process that dies is noticed by the others through the coordination service's heartbeats
(``heartbeat_timeout`` seconds; measured: rank 0 ended 28 s after its rank 1 was killed, with
``SIGABRT`` and "Terminating process because the JAX distributed service detected fatal
errors"), which then end them too: a sharded instance cannot run on
without one of its parts, and a process that hung in a collective forever would be worse.
"""

from __future__ import annotations

import ipaddress
import socket

import jax


def collectives_address_problem(coordinator_host: str, hostname: str,
                                resolved: str | None) -> str | None:
    """Why gloo's collectives could not reach the other hosts, or None. Gloo binds the address
    this host's name resolves to (JAX gives it no other): a name resolving to loopback works
    for processes of one host only. Seen on namespaced hosts: every connect went to 127.0.0.1
    and was refused, and the instance died at its first collective."""
    if resolved is None:
        return (f"this host's name {hostname!r} does not resolve: gloo's collectives bind the "
                "address it resolves to (DNS or /etc/hosts)")
    if _loopback(resolved) and not _loopback(coordinator_host):
        return (f"this host's name {hostname!r} resolves to {resolved}, a loopback address, "
                f"but the instance spans hosts (--dist-init-addr {coordinator_host}): gloo's "
                f"collectives bind the address the host's name resolves to, so make "
                f"{hostname!r} resolve to this host's address on the instance's network "
                "(DNS or /etc/hosts)")
    return None


def _loopback(host: str) -> bool:
    addr = _resolve(host)
    return addr is not None and ipaddress.ip_address(addr).is_loopback


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def initialize(coordinator: str, processes: int, rank: int, *, timeout: int = 300,
               heartbeat_timeout: int = 30, shutdown_timeout: int = 15) -> None:
    """Join the instance: ``coordinator`` is ``host:port`` of rank 0's coordination service
    (rank 0 binds it). Must run before anything starts a JAX backend; blocks until every
    process joined or ``timeout`` seconds passed (then raises)."""
    if not 0 <= rank < processes:
        raise ValueError(f"rank {rank} is not in 0..{processes - 1}")
    hostname = socket.gethostname()
    problem = collectives_address_problem(coordinator.rpartition(":")[0], hostname,
                                          _resolve(hostname))
    if problem is not None:
        raise ValueError(problem)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator, num_processes=processes, process_id=rank,
        # Rank 0's coordination service listens on the address given, not on every interface.
        coordinator_bind_address=coordinator,
        initialization_timeout=timeout, heartbeat_timeout_seconds=heartbeat_timeout,
        # At exit every process waits for the others at a barrier: not for five minutes.
        shutdown_timeout_seconds=shutdown_timeout,
    )
