"""The SLA planner's policy (issue 30 §2): from snapshots of every worker, decide which worker
changes role, and when to ask for one more worker or give one back — each decision with its
reason. Sans-IO like the rest of the core: ``Planner.observe(snapshots, now)`` returns
decisions; an adapter gathers the snapshots (the workers' /metrics, or the performance model's
workers, ``pd_fsm/sim/perf_cluster.py``) and acts on them.

The rule, after Dynamo's SLA planner and DistServe: TTFT is P's to keep, ITL is D's.

- Each observation classifies the cluster: ``prefill_bound`` when the prefill side's pressure
  (the worst P's TTFT p90 over the target, or its queue over ``queue_per_prefill``) is above
  ``headroom`` while the decode side's (the worst D's ITL p90 over the target, or its KV use over
  ``kv_high``) is not; ``decode_bound`` the other way; ``both`` and ``idle`` (every pressure
  under ``idle_below``); else ``balanced``.
- Hysteresis: a class must hold for ``patience`` observations in a row before it is acted on.
- Acting: ``prefill_bound`` or ``decode_bound`` asks for a worker of the starved role when the
  cluster may grow (``max_workers``), else moves the least loaded worker of the other role over
  (never below ``min_prefill`` / ``min_decode``, never one already switching); ``both`` grows
  when it may, else moves a worker toward the side whose pressure is at least ``imbalance``
  times the other's (both over target, the worse side gains most); ``idle`` gives back the
  least loaded worker of the side with the lower pressure (never below the minimums or
  ``min_workers``).
- Cooldown: after a decision nothing is decided for ``cooldown`` seconds (a switched worker's
  queues and histograms need that long to show its effect), and the run of observations starts
  again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import attrs

Role = Literal["prefill", "decode"]
Pressure = Literal["prefill_bound", "decode_bound", "both", "idle", "balanced"]


@attrs.frozen
class WorkerSnapshot:
    """One worker as the planner sees it. Latencies are p90 over the adapter's last window
    (NaN: nothing finished there); ``kv_usage`` is the share of KV pages in use."""

    worker: str
    role: Role
    waiting: int = 0  # requests queued: not prefilled yet (P), KV not arrived yet (D)
    running: int = 0  # rows decoding (D)
    ttft_p90: float = math.nan
    itl_p90: float = math.nan
    kv_usage: float = 0.0
    switching: bool = False  # draining for a role switch: neither side's any more


@attrs.frozen
class PlannerConfig:
    ttft_slo: float = 2.0
    itl_slo: float = 0.1
    headroom: float = 0.8  # a side is under pressure past this share of its target
    idle_below: float = 0.3  # every side under this share: a worker may be given back
    queue_per_prefill: int = 4  # P's queue this long is pressure 1.0 whatever its TTFT
    kv_high: float = 0.9  # D's KV this full is pressure 1.0
    imbalance: float = 1.5  # both sides over: move a worker when one is this much worse
    patience: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    cooldown: float = attrs.field(default=30.0, validator=attrs.validators.ge(0.0))
    min_prefill: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    min_decode: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    min_workers: int = 2
    max_workers: int = 0  # 0: the cluster does not grow or shrink, only switches roles
    # Switches decided at once, at most (0: as many as the pressures ask). 1 by default: in the
    # modelled 64-worker run (bench/RESULTS_planner_sim.md) the proportional step overshot.
    max_step: int = 1


@attrs.frozen
class SwitchRole:
    worker: str
    to: Role
    reason: str


@attrs.frozen
class ScaleUp:
    role: Role
    reason: str


@attrs.frozen
class ScaleDown:
    worker: str
    reason: str


Decision = SwitchRole | ScaleUp | ScaleDown


def _worst(values: Sequence[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return max(known, default=0.0)


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._run: tuple[Pressure, int] = ("balanced", 0)
        self._quiet_until = -math.inf
        self.decisions: list[tuple[float, Decision]] = []  # every decision, for /metrics and logs

    def pressures(self, snapshots: Sequence[WorkerSnapshot]) -> tuple[float, float]:
        """(prefill side, decode side): 1.0 is at the target."""
        c = self.config
        p = [s for s in snapshots if s.role == "prefill" and not s.switching]
        d = [s for s in snapshots if s.role == "decode" and not s.switching]
        p_load = max(_worst([s.ttft_p90 / c.ttft_slo for s in p]),
                     _worst([s.waiting / c.queue_per_prefill for s in p]))
        d_load = max(_worst([s.itl_p90 / c.itl_slo for s in d]),
                     _worst([s.kv_usage / c.kv_high for s in d]))
        return p_load, d_load

    def classify(self, snapshots: Sequence[WorkerSnapshot]) -> Pressure:
        c = self.config
        p_load, d_load = self.pressures(snapshots)
        if p_load > c.headroom and d_load > c.headroom:
            return "both"
        if p_load > c.headroom:
            return "prefill_bound"
        if d_load > c.headroom:
            return "decode_bound"
        if p_load < c.idle_below and d_load < c.idle_below:
            return "idle"
        return "balanced"

    def observe(self, snapshots: Sequence[WorkerSnapshot], now: float) -> list[Decision]:
        """One observation of every worker; the decisions to act on now (several switches at
        once when the pressure asks for them, else at most one)."""
        if now < self._quiet_until:  # the last decision's effect is not in the figures yet
            return []
        pressure = self.classify(snapshots)
        kind, count = self._run
        self._run = (pressure, count + 1 if kind == pressure else 1)
        if self._run[1] < self.config.patience:
            return []
        decisions = self._decide(pressure, snapshots)
        if not decisions:
            return []
        self.decisions.extend((now, d) for d in decisions)
        self._quiet_until = now + self.config.cooldown
        self._run = ("balanced", 0)
        return decisions

    def _decide(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot]
                ) -> list[Decision]:
        c = self.config
        live = [s for s in snapshots if not s.switching]
        count = {r: sum(s.role == r for s in live) for r in ("prefill", "decode")}
        grow = c.max_workers > 0 and len(snapshots) < c.max_workers
        p_load, d_load = self.pressures(snapshots)
        why = f"prefill pressure {p_load:.2f}, decode pressure {d_load:.2f}"
        worse: Role = "prefill" if p_load >= d_load else "decode"
        if pressure == "both":
            if grow:
                return [ScaleUp(worse, f"{why}: both over {c.headroom:g}")]
            if max(p_load, d_load) < c.imbalance * min(p_load, d_load):
                return []
            pressure = "prefill_bound" if worse == "prefill" else "decode_bound"
            why = f"{why}: both over {c.headroom:g}, {worse} {c.imbalance:g}x worse"
        if pressure in ("prefill_bound", "decode_bound"):
            starved: Role = "prefill" if pressure == "prefill_bound" else "decode"
            donor: Role = "decode" if starved == "prefill" else "prefill"
            if grow:
                return [ScaleUp(starved, f"{why}: {starved} over {c.headroom:g}")]
            floor = c.min_decode if donor == "decode" else c.min_prefill
            if count[donor] <= floor:
                return []
            loads = {"prefill": p_load, "decode": d_load}
            # As many as bring the starved side back to headroom, as many as the donor can
            # give while staying under it (one when both are over), within its floor.
            need = math.ceil(count[starved] * (loads[starved] / c.headroom - 1.0))
            spare = (math.floor(count[donor] * (1.0 - loads[donor] / c.headroom))
                     if loads[donor] < c.headroom else 1)
            k = max(1, min(need, spare, count[donor] - floor))
            if c.max_step:
                k = min(k, c.max_step)
            donors = sorted((s for s in live if s.role == donor), key=_load)[:k]
            return [SwitchRole(d.worker, starved, f"{why}: {starved} over {c.headroom:g}, "
                               f"{donor} under it ({k} of {count[donor]})") for d in donors]
        if pressure == "idle" and c.max_workers > 0 and len(live) > c.min_workers:
            side: Role = "prefill" if p_load <= d_load else "decode"
            floor = c.min_prefill if side == "prefill" else c.min_decode
            if count[side] <= floor:
                return []
            idlest = min((s for s in live if s.role == side), key=_load)
            return [ScaleDown(idlest.worker, f"{why}: every side under {c.idle_below:g}")]
        return []


def _load(s: WorkerSnapshot) -> tuple[int, str]:
    return s.waiting + s.running, s.worker
