"""Timing rules (RFC-2 §7, DESIGN §5). Every window is a setting with these defaults."""

from __future__ import annotations

import attrs


@attrs.frozen
class LeaseConfig:
    """P side: how long a room's KV is held without word from D."""

    initial: float = 30.0  # from the moment the room exists on P
    extension: float = 20.0  # each heartbeat: expiry = max(old, now + extension)
    recently_finished: int = 65536  # finished rooms remembered for late messages and poll()


@attrs.frozen
class DecodeConfig:
    """D side: heartbeats to P and the deadline of each waiting state."""

    heartbeat_interval: float = 5.0
    # P is lost when it has been silent this long AND has left this many of our heartbeats
    # unanswered: a D that was itself stalled (a long compile) first asks again, then judges.
    peer_timeout: float = 15.0
    heartbeat_misses: int = 2
    resolve_timeout: float = 10.0  # bootstrap server lookup
    queue_timeout: float = 300.0  # waiting for free pages (then 503)
    ready_timeout: float = 300.0  # waiting for READY while P prefills (P alive, just slow)
    transfer_timeout: float = 120.0  # backstop; the pull executor's own deadline is shorter
    recently_finished: int = 65536


@attrs.frozen
class RegistryConfig:
    ttl: float = 15.0  # = 3 x the 5 s heartbeat interval


@attrs.frozen
class RouterConfig:
    room_timeout: float = 600.0
    # The decode workers run the recompute failure policy: a failed prefill leg does not fail the
    # room (D prefills it itself), D's answer does.
    decode_recomputes: bool = False
    # A leg that failed before any byte reached the client, not by the request's fault (refused,
    # connection lost, a 5xx), opens a new room on other workers, at most this many times per
    # request, after an exponential backoff with jitter
    # (retry_backoff * 2^retry, at most retry_backoff_max, times a uniform [0.5, 1)), and only
    # while that leaves the request inside its first room's deadline.
    retry_limit: int = 2
    retry_backoff: float = 0.05
    retry_backoff_max: float = 2.0
    # A stream whose decode worker broke off continues in a new room (the prompt plus the
    # tokens so far) at most this many times per request; only requests the proxy can continue
    # exactly ask for it (RoomRequested.migratable).
    migration_limit: int = 3
    # A worker with this many consecutive worker faults (refused, broke off mid-relay) is routed
    # around for breaker_cooldown seconds, then probed by one request (table worker_breaker);
    # 0: no breaker.
    breaker_threshold: int = 3
    breaker_cooldown: float = 5.0
