"""Free ports picked before the processes that bind them start (the cluster runner, the tests).

A port is picked outside the kernel's ephemeral range and never handed out twice by one process:
a port from the ephemeral range (what binding port 0 gives) can, between the pick and the bind,
become the local end of some process's outgoing connection (seen in CI: a worker's "Address
already in use" at start), and two picks of port 0 can return the same number once the first
socket is closed (seen once: the bootstrap's and a worker's).

Two processes that pick ports for children at the same time cannot see each other's picks, so
they pick from different bands: the tests and benches below the ephemeral range, launchers
(``pd-fsm cluster``, which a test or bench may start) above it. Seen in CI when both shared one
band: a test's proxy took the port the cluster it had started meant for its prefill worker.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"
_HANDED_OUT: set[int] = set()
_PORTS = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _band(launcher: bool) -> range:
    low, high = _ephemeral_range()
    below, above = range(20000, low), range(high + 1, 65536)
    if len(below) < 1000:  # an unusual ephemeral range: split what is above it
        middle = (above.start + above.stop) // 2
        below, above = range(above.start, middle), range(middle, above.stop)
    return above if launcher else below


def free_port(host: str = HOST, *, launcher: bool = False) -> int:
    """A port free now on ``host``, outside the ephemeral range, not handed out before here;
    from the launchers' band with ``launcher`` (see the module docstring)."""
    candidates = _band(launcher)
    while True:
        port = _PORTS.choice(candidates)
        if port not in _HANDED_OUT and _binds(host, port):
            _HANDED_OUT.add(port)
            return port


def free_ports(n: int, host: str = HOST, *, launcher: bool = False) -> list[int]:
    return [free_port(host, launcher=launcher) for _ in range(n)]


def free_port_pair(host: str = HOST, *, launcher: bool = False) -> int:
    """A port for which :func:`free_port`'s promises hold for it and its successor (a rank 0 of
    an instance spanning processes binds both: JAX's coordinator and its command stream)."""
    while True:
        port = free_port(host, launcher=launcher)
        if port + 1 not in _HANDED_OUT and _binds(host, port + 1):
            _HANDED_OUT.add(port + 1)
            return port
