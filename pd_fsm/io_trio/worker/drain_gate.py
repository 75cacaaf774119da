"""Whether a draining worker hands its running streams off, decided when it starts
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

A registry record outlives its process: a decode worker that crashed stays listed until its
lease expires. Handing off to it loses the streams (the proxy's hand-off room fails on it, and
its fallback, a re-prefill, may find no decode worker but the draining one, which refuses new
legs). So each listed taker's ``/health`` is probed, concurrently and within the gate's one
deadline (the registry read and the probes together), and only a taker answering 200 counts: a
crashed, unreachable, loading or draining one does not. Listed takers none of which answered
finish the streams in place (reason ``no_healthy_decode``).

Each drain's decision is logged and counted (``pd_fsm_worker_drains_total{outcome,reason}``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import attrs
import httpx
import trio

from pd_fsm.io_trio.bootstrap.client import BootstrapError
from pd_fsm.io_trio.bootstrap.records import InstanceRecord
from pd_fsm.io_trio.http_server import http_client
from pd_fsm.io_trio.tls import TLS
from pd_fsm.io_trio.worker.backend import HandsOff, ServeBackend, start_hand_off
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


async def healthy(found: Sequence[InstanceRecord], tls: TLS, deadline: float
                  ) -> tuple[list[InstanceRecord], list[str]]:
    """Those of ``found`` whose ``/health`` answered 200 by ``deadline`` (``trio`` time; probed
    concurrently), and what each of the others answered, for the log."""
    ok: list[InstanceRecord] = []
    answers: dict[str, str] = {}

    async def probe(client: httpx.AsyncClient, r: InstanceRecord) -> None:
        try:
            answer = await client.get(f"{r.scheduler_addr}/health")
        except httpx.HTTPError as exc:
            answers[r.instance_id] = type(exc).__name__
            return
        answers[r.instance_id] = f"HTTP {answer.status_code}"
        if answer.status_code == 200:
            ok.append(r)

    async with http_client(tls=tls) as client, trio.open_nursery() as nursery:
        nursery.cancel_scope.deadline = deadline
        for r in found:
            if r.scheduler_addr:  # (a record without a URL cannot be probed, nor routed to)
                nursery.start_soon(probe, client, r)
    return ok, [f"{r.instance_id} {r.scheduler_addr}: "
                f"{answers.get(r.instance_id, 'no answer in time')}"
                for r in found if r not in ok]


async def decide(backend: ServeBackend, config: ServeConfig, timeout: float) -> DrainDecision:
    """The gate (see the module docstring); reads the registry and probes the takers for at
    most ``timeout`` in all."""
    if not config.drain_handoff:
        return _in_place("disabled", "--no-drain-handoff")
    if backend.mode != "decode" or not isinstance(backend, HandsOff):
        return _in_place("not_decode", f"a {backend.mode} worker hands nothing off")
    if config.nnodes > 1:
        return _in_place("spans_processes", "an instance spanning processes hands nothing off")
    deadline = trio.current_time() + timeout
    try:
        with trio.fail_at(deadline):
            own, records = await backend.handoff_peers()
    except (BootstrapError, trio.TooSlowError) as exc:
        return _in_place("registry_unreadable",
                         f"the registry's decode workers could not be read: {exc or 'too slow'}")
    found = takers(own, records)
    if not found:
        return _in_place("no_other_decode", "no other decode worker (of this KV layout) is "
                                            "registered")
    alive, failed = await healthy(found, config.tls, deadline)
    if not alive:
        return _in_place("no_healthy_decode",
                         f"{len(found)} other decode worker(s) registered, none answered "
                         f"/health 200: {'; '.join(failed)}")
    names = ", ".join(f"{r.instance_id} {r.scheduler_addr}" for r in alive)
    return DrainDecision(HANDED_OFF, "other_decode_healthy",
                         f"{len(alive)} other decode worker(s) registered and healthy: {names}"
                         + (f" (not: {'; '.join(failed)})" if failed else ""))


async def drain_streams(backend: ServeBackend, config: ServeConfig, started: float,
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
