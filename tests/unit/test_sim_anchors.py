"""The anchors' reported failures as named scenarios (pd_fsm/sim/anchors.py), run against
pd_fsm's real cores in the simulated cluster: each staged, each check passing, and what the
clients got."""

from __future__ import annotations

from collections import Counter

import pytest

from pd_fsm.sim.anchors import FAILED, STUCK
from pd_fsm.sim.config import SimConfig
from pd_fsm.sim.scenarios import SCENARIOS, scenario_config
from pd_fsm.sim.world import run_seed

SEEDS = range(12)


def _run(name: str, **base: object) -> tuple[Counter[str], Counter[str]]:
    config = scenario_config(name, SimConfig(**base))  # type: ignore[arg-type]
    answered: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    for seed in SEEDS:
        result = run_seed(seed, config)
        assert result.violation is None, f"seed {seed}: {result.violation}"
        answered.update(result.answered)
        outcomes.update(result.scenario)
    return answered, outcomes


def test_the_anchors_are_named_scenarios() -> None:
    assert {"sglang-31800-transfer-never-done", "sglang-13054-failure-sticks",
            "tpu-inference-2311-pulls-under-load"} <= set(SCENARIOS)


def test_a_pull_that_never_reports_fails_its_room_by_the_transfer_timeout() -> None:
    answered, outcomes = _run("sglang-31800-transfer-never-done")
    n = len(SEEDS)
    assert outcomes == {"staged": STUCK * n, "released": STUCK * n}
    assert answered["none"] == 0  # every client answered: nothing hangs
    assert answered["200"] >= (8 - STUCK - 1) * n  # the rooms after them are admitted


def test_a_failed_pull_does_not_fail_the_later_ones_from_that_p() -> None:
    answered, outcomes = _run("sglang-13054-failure-sticks")
    n = len(SEEDS)
    assert outcomes["staged"] == FAILED * n
    assert outcomes["landed_after_failure"] == (8 - FAILED) * n
    assert answered == {"200": (8 - FAILED) * n, "502": FAILED * n}
    # with D recomputing a failed room, every client gets its answer
    answered, _ = _run("sglang-13054-failure-sticks", recompute=True)
    assert answered == {"200": 8 * n}


def test_under_a_burst_no_pull_fails_every_client_is_answered_and_nothing_stays_held() -> None:
    answered, outcomes = _run("tpu-inference-2311-pulls-under-load")
    n = len(SEEDS)
    assert outcomes == {"all_answered": n, "recycled": n}
    assert answered["none"] == 0 and answered["200"] > 0
    # what P's pool cannot take is refused at once (502), not left to time out
    assert set(answered) <= {"200", "502"}


@pytest.mark.parametrize("name", ["sglang-31800-transfer-never-done",
                                  "sglang-13054-failure-sticks"])
def test_the_anchor_scenarios_are_deterministic_per_seed(name: str) -> None:
    config = scenario_config(name, SimConfig())
    assert run_seed(3, config).answered == run_seed(3, config).answered
    assert run_seed(3, config).steps == run_seed(3, config).steps
