"""Whether a draining worker hands its running streams off (issue 32 §2), decided when it starts
to drain (SIGTERM, or a role switch leaving decode).

A hand-off only helps when another decode worker can take the stream: without one, the proxy's
attempt to continue it elsewhere fails (and falls back to a re-prefill that has nowhere to run
either), while the draining worker could simply have finished it. So a decode worker hands off
only when, at that moment, the registry lists another decode instance that could pull the
stream's KV: another instance (neither our instance id nor our URL), in one process (an instance
spanning processes takes no hand-off) and with our KV layout (a ticket of another layout is
refused). The registry is what a decode worker knows of its peers; every decode worker has one
(it registers to be routed), but the proxy may route from static lists instead. The proxy
therefore asks for a hand-off (``accept_handoff``) only on a leg for which it lists another
decode worker itself: the stream is handed off only when both sides see somewhere to send it.
A registry that cannot be read in time counts as no peer: the streams finish in place.

Each drain's decision is logged and counted (``pd_fsm_worker_drains_total{outcome,reason}``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs
import trio

from pd_fsm.io_trio.bootstrap.client import BootstrapError
from pd_fsm.io_trio.bootstrap.records import InstanceRecord
from pd_fsm.io_trio.worker.backend import Backend, HandsOff, start_hand_off
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.metrics import DRAIN_OUTCOMES

log = logging.getLogger("pd_fsm.io_trio.worker.drain_gate")

HANDED_OFF, FINISHED_IN_PLACE = DRAIN_OUTCOMES
# The registry read delays the drain's start: a quarter of the drain, within these bounds.
GATE_TIMEOUT_S = 2.0
GATE_TIMEOUT_MIN_S = 0.25


@attrs.frozen
class DrainDecision:
    outcome: str  # HANDED_OFF or FINISHED_IN_PLACE
    reason: str  # one of DRAIN_OUTCOMES[outcome] (metrics.py: every one counted from 0)
    detail: str  # for the log

    @property
    def hands_off(self) -> bool:
        return self.outcome == HANDED_OFF


def takers(own: InstanceRecord, records: Sequence[InstanceRecord]) -> list[InstanceRecord]:
    """The decode records of ``records`` that could take a hand-off from ``own``."""
    return [r for r in records
            if r.role == "decode" and r.tp_rank == 0
            and r.instance_id != own.instance_id and r.scheduler_addr != own.scheduler_addr
            and r.mesh_meta.get("processes", 1) == 1
            and bool(own.layout_hash) and r.layout_hash == own.layout_hash]


def _in_place(reason: str, detail: str) -> DrainDecision:
    return DrainDecision(FINISHED_IN_PLACE, reason, detail)


async def decide(backend: Backend, config: ServeConfig, timeout: float) -> DrainDecision:
    """The gate (see the module docstring); reads the registry for at most ``timeout``."""
    if not config.drain_handoff:
        return _in_place("disabled", "--no-drain-handoff")
    if backend.mode != "decode" or not isinstance(backend, HandsOff):
        return _in_place("not_decode", f"a {backend.mode} worker hands nothing off")
    if config.nnodes > 1:
        return _in_place("spans_processes", "an instance spanning processes hands nothing off")
    try:
        with trio.fail_after(timeout):
            own, records = await backend.handoff_peers()
    except (BootstrapError, trio.TooSlowError) as exc:
        return _in_place("registry_unreadable",
                         f"the registry's decode workers could not be read: {exc or 'too slow'}")
    found = takers(own, records)
    if not found:
        return _in_place("no_other_decode", "no other decode worker (of this KV layout) is "
                                            "registered")
    names = ", ".join(f"{r.instance_id} {r.scheduler_addr}" for r in found)
    return DrainDecision(HANDED_OFF, "other_decode_registered",
                         f"{len(found)} other decode worker(s) registered: {names}")


async def drain_streams(backend: Backend, config: ServeConfig, started: float,
                        why: str) -> DrainDecision:
    """At a drain's start (``started``: its ``time.monotonic()``; ``why``: SIGTERM or the
    switch, for the log): decide, log, and start the hand-off when the gate says so, its lease
    ending just before the drain's deadline."""
    left = config.drain_timeout - (time.monotonic() - started)
    decision = await decide(backend, config, max(GATE_TIMEOUT_MIN_S, min(GATE_TIMEOUT_S,
                                                                     left / 4)))
    if decision.hands_off:
        start_hand_off(backend, config.drain_timeout - (time.monotonic() - started))
        log.info("%s: handing running streams off to other decode workers (%s)", why,
                 decision.detail)
    elif decision.reason in ("disabled", "not_decode"):
        log.info("%s: running requests finish here (%s)", why, decision.detail)
    else:  # a decode worker that would have handed off: say why it does not
        log.warning("%s: running streams finish here, not handed off: %s", why,
                    decision.detail)
    return decision
