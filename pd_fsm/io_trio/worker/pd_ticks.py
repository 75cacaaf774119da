"""Rank 0 of a PD instance spanning processes: each tick's inputs go to the other ranks
(``RankTicks``), which run the same tick on their replicas (pd_replica.py) and must end in the
same state (``fingerprint``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pd_fsm.io_trio.worker.backend import BootstrapInfo, GenerateJob
from pd_fsm.io_trio.worker.spmd.frames import Arrival, InboxEvent, LegAdded, PullAgreed, TickStarted
from pd_fsm.io_trio.worker.spmd.tick_inputs import TickInputs
from pd_fsm.io_trio.worker.streams import JobStream
from pd_fsm.schedulers.disaggregation import DecodeScheduler, PrefillScheduler

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader


def fingerprint(sched: PrefillScheduler | DecodeScheduler) -> str:
    """What two replicas of one PD scheduler must agree on after every tick (cheap to take)."""
    s = sched.stats()
    states = sorted((k, v) for k, v in sched.role.link.pd_stats().items() if k.startswith("state_"))
    # The transfer registrations too: a rank > 0 whose KV offers leak (it has no HTTP to show
    # them) leaves the instance at the next tick.
    return repr((states, s.free_pages, s.waiting, s.prefilling, s.running, s.cached_pages,
                 len(sched.role.engine.registrations())))


def job_of(leg: LegAdded) -> GenerateJob:
    boot = (None if leg.room is None or leg.bootstrap_host is None
            else BootstrapInfo(leg.bootstrap_host, leg.bootstrap_port, leg.room))
    return GenerateJob(leg.rid, leg.input_ids, leg.sampling, boot, logprobs=leg.logprobs)


def leg_of(job: GenerateJob, accepted: float) -> LegAdded:
    boot = job.bootstrap
    return LegAdded(job.rid, job.input_ids, job.sampling, job.logprobs, accepted,
                    None if boot is None else boot.host, None if boot is None else boot.port,
                    None if boot is None else boot.room)


class RankTicks:
    """Rank 0's side: the ticks sent so far, its state after the last one, and (D) the other
    ranks' finished pulls: room -> rank -> "" or why it failed."""

    def __init__(self, spmd: SpmdLeader) -> None:
        self._spmd = spmd
        self._ticks = 0
        self.fingerprint = ""
        self._rank_pulls: dict[int, dict[int, str]] = {}

    def tell(
        self, inputs: TickInputs, inbox: list[tuple[float, InboxEvent]], jobs: list[JobStream],
        aborts: list[str], may_abort: Callable[[str], bool], ready: dict[int, str] | None,
    ) -> tuple[list[str], dict[int, str] | None]:
        """Before a tick (in the tick's thread): send the other ranks this tick's inputs and set
        this rank's clock and random source as theirs. ``ready``: this rank's finished pulls
        (None: the role pulls nothing). Returns the aborts every rank applies and the pulls
        every rank collects (None: no gate)."""
        rids = {s.job.rid for s in jobs}
        aborts = [r for r in aborts if r in rids or may_abort(r)]
        gate = None if ready is None else self._agree(ready)
        self._ticks += 1
        now = time.monotonic()
        self._spmd.tick_started(TickStarted(
            self._ticks, now, self.fingerprint,
            tuple(Arrival(at, event) for at, event in inbox),
            tuple(leg_of(s.job, s.accepted) for s in jobs), tuple(aborts),
            tuple(PullAgreed(room, why) for room, why in (gate or {}).items()),
        ))
        inputs.start(self._ticks, now)
        return aborts, gate

    def _agree(self, ready: dict[int, str]) -> dict[int, str]:
        """Rooms whose pull has finished on this rank and on every other (their reports), each
        with "" or the first failure: every rank then scatters, or fails, the same rooms."""
        for report in self._spmd.reports():
            self._rank_pulls.setdefault(report.room, {})[report.rank] = (
                "" if report.ok else f"rank {report.rank}: {report.reason}")
        gate = {}
        for room, why in ready.items():
            theirs = self._rank_pulls.get(room, {})
            if len(theirs) < self._spmd.ranks - 1:
                continue
            gate[room] = why or next((w for _, w in sorted(theirs.items()) if w), "")
            del self._rank_pulls[room]
        return gate
