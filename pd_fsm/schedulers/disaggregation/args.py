"""Knobs of the prefill/decode schedulers (RFC-2 §7 and DESIGN §5 defaults)."""

from __future__ import annotations

import attrs

from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.schedulers.args import SchedulerArgs, same_named

FAILURE_POLICIES = ("fail", "recompute")
# The core's defaults for the windows these knobs configure (DESIGN §5), named once there.
_LEASE = LeaseConfig()
_DECODE = DecodeConfig()


def _policy(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in FAILURE_POLICIES:
        raise ValueError(f"{attribute.name} must be one of {FAILURE_POLICIES}, got {value!r}")


@attrs.frozen(kw_only=True)
class DisaggregationArgs(SchedulerArgs):
    # Identity on the side channel: D's reply_to / DEALER identity; P's instance id.
    instance_id: str = "pd-fsm-0"
    transfer_host: str = "127.0.0.1"
    # P: the KV hold lease (initial window, extension per heartbeat).
    lease_initial: float = _LEASE.initial
    lease_extension: float = _LEASE.extension
    # D: heartbeats to P and the deadline of each waiting state.
    heartbeat_interval: float = _DECODE.heartbeat_interval
    peer_timeout: float = _DECODE.peer_timeout
    resolve_timeout: float = _DECODE.resolve_timeout
    queue_timeout: float = _DECODE.queue_timeout
    ready_timeout: float = _DECODE.ready_timeout
    transfer_timeout: float = _DECODE.transfer_timeout
    # The pull executor's own deadline: strictly shorter than transfer_timeout (the core's
    # backstop), so pages are never freed while a pull may still write them.
    pull_deadline: float = 60.0
    pull_workers: int = 2
    # D: nice value of the pull threads (they poll the transfer; 0 leaves them): a pull thread
    # waiting for a core behind compute finishes its pull late (thread_priority.py).
    pull_thread_nice: int = 0
    # D: what to do when the KV cannot be had: fail the request, or prefill it here.
    failure_policy: str = attrs.field(default="fail", validator=_policy)
    # P: checksum every registered KV array and register it twice (READY names both); D: verify
    # every pull against READY's checksums, pull once more on a mismatch. P and D must agree.
    kv_checksum: bool = False
    # P: stream a room's KV to D in parts while prefilling: the prompt is
    # prefilled in chunks of this many tokens (rounded down to whole pages) and each chunk's
    # pages are registered and announced to D at once; 0: the whole KV after the prefill.
    stream_tokens: int = 0

    def __attrs_post_init__(self) -> None:
        if self.pull_deadline >= self.transfer_timeout:
            raise ValueError("pull_deadline must be shorter than transfer_timeout")

    def lease_config(self) -> LeaseConfig:
        return LeaseConfig(**same_named(self, LeaseConfig, prefix="lease_"))

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(**same_named(self, DecodeConfig))
