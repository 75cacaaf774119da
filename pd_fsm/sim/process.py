"""A simulated worker process (``pd_fsm.sim``): what the role switches (``switch.py``), SIGTERM
(``sigterm.py``), the drain gate (``gate.py``), the proxy and the network know of it. In a
module of its own so that each of them can name it without importing the others."""

from __future__ import annotations

import attrs

from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.sim.workers import Node


@attrs.define(eq=False)
class Process:
    name: str
    home: str  # the role its command line names
    node: Node
    switch: RoleSwitch | None  # None while the process is down
    listed: str | None  # the role routers list it under (None: its record is withdrawn)
    refusing: str = ""  # RefuseLegs's reason (a switch's or SIGTERM's), until AcceptLegs
    life: int = 0  # bumped at every crash, restart, build and SIGTERM: a stale callback sees it
    races: set[str] | None = None  # during a switch: what it raced so far
    wake_at: float = -1.0  # the drain deadline's wake already scheduled
    # SIGTERM received: draining until it exits (sigterm.py); a crash or the exit clears it.
    stopping: bool = False
