"""Per-endpoint counters: what was dropped and why (exported as metrics by the adapters)."""

from __future__ import annotations

import attrs


@attrs.define(slots=True)
class EndpointStats:
    events: int = 0
    messages: int = 0
    duplicates: int = 0  # a message the room had already seen (counted, dropped)
    late: int = 0  # a message or local event for a room that already finished
    unknown_room: int = 0  # a message for a room never seen here
    foreign_peer: int = 0  # a message about a room bound to another peer (forgery or confusion)
    remote_errors: int = 0  # peer broke the protocol: the room failed, the endpoint went on
    unexpected: int = 0  # a message type this side never receives
    rejected: int = 0  # requests refused outright (duplicate live bootstrap_room)
    succeeded: int = 0
    failed: int = 0
    peer_restarts: int = 0  # a peer came back as a new process (a new incarnation)
    lease_expired: int = 0  # P: rooms whose KV hold lease ran out (no heartbeat from D)
    refusals_told: int = 0  # D: ABORTs sent for legs refused before their room opened (LegRefused)
    busy_steps: int = 0  # StepStarted: steps the embedder announced (liveness kept meanwhile)
    kv_checksum_mismatches: int = 0  # D: pulls whose KV failed READY's checksums (any state)
    kv_checksum_repulls: int = 0  # D: second pulls started after a mismatch

    def as_dict(self) -> dict[str, int]:
        return attrs.asdict(self)
