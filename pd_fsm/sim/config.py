"""The simulated cluster's windows, its configuration, and what a run returns (``pd_fsm.sim``)."""

from __future__ import annotations

import attrs

from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.core.routing import RoutingConfig

LAYOUT = "sim-layout"
SECRET = b"pd_fsm sim cluster secret"
PAGE_TOKENS = 16
VOCAB = 50257
RECOMPUTABLE = frozenset({500, 502, 504})
TOLERANCE = 1.0  # seconds past a deadline before a live room is a violation (skew is per host)

# Windows of the simulated cluster: production's, scaled so that a seed's life is short.
LEASE = LeaseConfig(initial=10.0, extension=6.0)
DECODE = DecodeConfig(heartbeat_interval=1.0, peer_timeout=3.0, resolve_timeout=3.0,
                      queue_timeout=15.0, ready_timeout=20.0, transfer_timeout=12.0)
PULL_DEADLINE = 8.0  # the pull executor's: inside DECODE.transfer_timeout
ROOM_TIMEOUT = 40.0
REGISTRY_TTL = 6.0
REGISTRY_HEARTBEAT = 2.0
DRAIN = 90.0  # virtual seconds after the last arrival for everything to settle

PLANTS = {
    "missing-release-on-done": "P keeps a room's pages when D's DONE releases it",
    "lease-shortens": "a heartbeat sets P's lease to now + half the extension",
    "no-ready-timeout": "D waits for READY forever (its WAITING_FOR_READY timeout removed)",
    "double-free": "D frees the pages of a room whose pull failed twice",
}


class Violation(Exception):
    """An invariant broke: the message says which, where and when."""


@attrs.frozen
class SimConfig:
    prefill: int = 2
    decode: int = 2
    requests: int = 10
    arrival_window: float = 15.0  # arrivals spread uniformly over this many seconds
    faults: bool = True
    recompute: bool = False  # D prefills a room itself when P or the transfer fails it
    plant: str | None = None
    routing: RoutingConfig = attrs.field(factory=RoutingConfig)
    pages: int = 48  # per worker
    skew: float = 2.0  # each host's clock is off by up to this many seconds


@attrs.define
class SimResult:
    seed: int
    violation: str | None
    answered: dict[str, int]  # status -> clients
    steps: int
    trace: list[str]
