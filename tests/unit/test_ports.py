"""Ports picked for children: free, outside the kernel's ephemeral range, never twice in one
process, and from different bands for tests and launchers (a test and the cluster it starts
pick at the same time without seeing each other's picks)."""

from __future__ import annotations

import socket
from pathlib import Path

from pd_fsm.io_trio.ports import free_port, free_port_pair, free_ports


def _ephemeral() -> range:
    low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    return range(int(low), int(high) + 1)


def test_bands_are_apart_and_outside_the_ephemeral_range() -> None:
    ephemeral = _ephemeral()
    tests, launchers = free_ports(20), free_ports(20, launcher=True)
    assert len(set(tests + launchers)) == 40  # never handed out twice
    assert not {*tests, *launchers} & set(ephemeral)
    assert max(tests) < min(launchers)


def test_a_pair_is_two_free_ports() -> None:
    for launcher in (False, True):
        port = free_port_pair(launcher=launcher)
        for p in (port, port + 1):
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))  # free now
        assert free_port(launcher=launcher) not in (port, port + 1)
