"""The SLA planner (core/planner.py) acting in the fleet model (sim/fleet_planner.py): a
starved side gains an instance, the switch lands a drain plus ``switch_s`` after the decision,
a launcher adds an instance within the host's chips, and the run is deterministic per seed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pd_fsm.core.planner import PlannerConfig, ScaleUp, SwitchRole
from pd_fsm.sim.fleet import FleetConfig, FleetReq, Slo, goodput, simulate_fleet, workload
from pd_fsm.sim.fleet_planner import FleetPlanning, PlannedRun, simulate_planned
from tests.unit.test_fleet_model import _costs, _profile

PD = FleetConfig("2P:2D", prefill=2, decode=2)


def _reasoning(seed: int = 0, rate: float = 40.0) -> list[FleetReq]:
    """256 in / 2,048 out: two Ds' KV fills (2,304 tokens a room) while P idles."""
    return workload("reasoning", seconds=20.0).requests(rate, seed)


def _planned(reqs: list[FleetReq], config: FleetConfig = PD, **planning: object) -> PlannedRun:
    pc = PlannerConfig(ttft_slo=1.0, itl_slo=0.05, patience=2,
                       cooldown=float(planning.pop("cooldown", 10.0)),  # type: ignore[arg-type]
                       max_workers=int(planning.pop("max_workers", 0)))  # type: ignore[call-overload]
    fp = FleetPlanning(pc, interval=1.0, window=5.0, **planning)  # type: ignore[arg-type]
    return simulate_planned(_costs(), config, reqs, 400.0, 4096, 256, fp)


def _serving(run: PlannedRun, p: int, d: int) -> float:
    """When ``p`` P and ``d`` D instances first served at once."""
    return next(t for t, pp, dd, _ in run.roles if (pp, dd) == (p, d))


def test_a_starved_decode_side_takes_a_prefill_instance_and_serves_with_it() -> None:
    reqs = _reasoning()
    run = _planned(reqs)
    t, first = run.decisions[0]
    assert isinstance(first, SwitchRole) and first.to == "decode"
    assert first.worker.startswith("p") and "decode over" in first.reason
    # Out of P at once (it takes no new prompt), a D once drained and switch_s later.
    assert _serving(run, 1, 2) == t and _serving(run, 1, 3) >= t + 2.0
    assert any(r.decode_to is not None and r.decode_to.name == first.worker
               for r in run.requests)
    static = simulate_fleet(_costs(), PD, reqs, 400.0, 4096, 256)
    slo = Slo()
    assert goodput(run.requests, slo, 0.0, 60.0) > goodput(static.requests, slo, 0.0, 60.0)


def test_a_slower_switch_lands_later_by_the_difference() -> None:
    reqs = _reasoning()
    fast = _planned(reqs, switch_s=2.0, cooldown=60.0)
    slow = _planned(reqs, switch_s=20.0, cooldown=60.0)
    assert fast.decisions[0] == slow.decisions[0]  # the same run up to the switch
    assert _serving(slow, 1, 3) - _serving(fast, 1, 3) == pytest.approx(18.0)


def test_a_launcher_adds_an_instance_within_the_hosts_chips() -> None:
    reqs = _reasoning(rate=20.0)
    one = FleetConfig("1P:1D", prefill=1, decode=1)
    run = _planned(reqs, one, launcher=True, chips=3, start_s=5.0, max_workers=4)
    t, first = run.decisions[0]
    assert isinstance(first, ScaleUp) and first.role == "decode"
    assert _serving(run, 1, 2) == pytest.approx(t + 5.0)
    assert max(p + d + k for _, p, d, k in run.roles) == 3  # the third chip, not a fourth
    assert run.refused >= 1
    refused = _planned(reqs, one, launcher=False, max_workers=4)
    assert refused.refused >= 1 and max(p + d for _, p, d, _ in refused.roles) == 2


def _fingerprint(seed: int) -> list[tuple[float, float]]:
    run = _planned(_reasoning(seed))
    return [(r.first, r.last) for r in run.requests] + [(t, 0.0) for t, _ in run.decisions]


def test_the_planned_fleet_is_deterministic_per_seed() -> None:
    assert _fingerprint(3) == _fingerprint(3)
    assert _fingerprint(3) != _fingerprint(4)


def test_pd_fsm_plan_planner_reports_it_beside_the_best_static(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _profile().dump(path)
    out = subprocess.run(
        [sys.executable, "-m", "pd_fsm.cli", "plan", "--profile", str(path), "--chips", "2",
         "--workload", "shifting", "--phase-seconds", "3", "--phase-rates", "4", "1", "2",
         "--planner", "--planner-start", "1P TP1 : 1D TP1"],
        capture_output=True, text=True, check=True).stdout
    assert "| planner (from 1P TP1 : 1D TP1) |" in out and "| best static: " in out
    assert "planner / best static: " in out and "best per phase: " in out
    assert "| static: 1P TP1 : 1D TP1 |" in out or "| best static: 1P TP1 : 1D TP1 |" in out
