"""Issue 30 §1 in the simulation: a worker's role switched at runtime (P to D, D to P) by its
``RoleSwitch`` through the core's one driver, racing the other faults (``pd_fsm/sim/switch.py``).
After every switch the old role holds nothing (StopRole's check), every invariant holds and the
drain leaves every worker, the new roles' included, with nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from pd_fsm.cli import main as cli_main
from pd_fsm.core.routing import RoutingConfig
from pd_fsm.sim import SimConfig, run_seed
from pd_fsm.sim.config import SHORT_DRAIN
from pd_fsm.sim.switch import RACES

SEEDS = 250  # ~6 s on this machine shared with two other jobs


def test_switches_racing_every_fault_lose_nothing() -> None:
    """A switch (or two) in every seed: none breaks an invariant, every way a switch can end
    happens, and switches race each kind of fault in some seeds."""
    config = SimConfig(role_switches=1.0)
    outcomes: Counter[str] = Counter()
    raced: Counter[str] = Counter()  # kind -> seeds with a switch that raced it
    for seed in range(SEEDS):
        r = run_seed(seed, config)
        assert r.violation is None, (seed, r.violation)
        outcomes.update(r.switches)
        raced.update(r.races.keys())
    # switched: drained and switched; after_drain_timeout: what was left failed at the deadline;
    # restored: the new role failed to start, the old one serves again; failed: both failed (the
    # process exits and restarts); refused: a second request during a switch (409); crashed: the
    # process died mid-switch; unreachable: it was down; declined: the last of its role;
    # sigtermed: the process got SIGTERM mid-switch (the switch ends with it); refused_stopping:
    # asked of a worker draining for SIGTERM (503; rare, so not required here).
    assert set(outcomes) - {"refused_stopping"} == {
        "switched", "switched_after_drain_timeout", "restored", "failed", "refused", "crashed",
        "unreachable", "declined", "sigtermed"}, outcomes
    assert outcomes["switched"] > SEEDS, outcomes
    assert set(raced) == set(RACES), raced
    assert min(raced.values()) >= 3, raced


def test_short_drains_fail_what_is_left_and_free_it() -> None:
    """Drain deadlines shorter than most rooms: most switches fail what the old role still
    holds (FailInFlight: every room aborted, every pull cancelled), and StopRole still finds
    nothing held."""
    config = SimConfig(role_switches=1.0, switch_drain=SHORT_DRAIN)
    outcomes: Counter[str] = Counter()
    for seed in range(60):
        r = run_seed(seed, config)
        assert r.violation is None, (seed, r.violation)
        outcomes.update(r.switches)
    assert outcomes["switched_after_drain_timeout"] >= 10, outcomes


@pytest.mark.parametrize("plant", ["switch-leaks", "switch-skips-drain"])
def test_a_switch_that_leaks_is_caught_by_stop_role(plant: str) -> None:
    """The planted switch bugs are caught by StopRole's check, which names what leaked (the
    generic plant test catches them too; this one checks it is StopRole that does)."""
    caught = next(r for r in (run_seed(s, SimConfig(plant=plant)) for s in range(50))
                  if r.violation)
    assert caught.violation is not None and "its role switch stopped" in caught.violation
    assert "pages never freed" in caught.violation, caught.violation


def test_a_seed_with_switches_replays_bit_for_bit() -> None:
    config = SimConfig(role_switches=1.0)
    a, b = run_seed(3, config, trace=True), run_seed(3, config, trace=True)
    assert a.trace == b.trace and a.switches == b.switches and a.races == b.races
    assert any("role switch requested" in line for line in a.trace)


def test_the_command_reports_switches(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["sim", "--seeds", "0:10", "--role-switches", "1"]) == 0
    out = capsys.readouterr().out
    assert "10 seeds, 0 failing" in out and "role switches {" in out and "'switched': " in out
    assert "raced (seeds) {" in out
    assert cli_main(["sim", "--seeds", "0:10", "--role-switches", "0"]) == 0
    assert "role switches" not in capsys.readouterr().out
    assert cli_main(["sim", "--seeds", "0:5", "--role-switches", "2"]) == 2


def test_d_prefilling_alone_while_no_p_is_listed_loses_nothing_and_answers_more() -> None:
    """``local_prefill_without_prefill`` (on under ``pd-fsm cluster --planner``) with switches
    racing every fault: a room with no P listed (its P draining, switched, or down) goes to a D
    alone, and a retry around the workers that refused it too. No invariant breaks, and the
    same seeds answer more requests 200 than without it (fewer 503 "no prefill workers")."""
    answered: dict[bool, Counter[str]] = {}
    for alone in (False, True):
        config = SimConfig(role_switches=1.0,
                           routing=RoutingConfig(local_prefill_without_prefill=alone))
        answered[alone] = Counter()
        for seed in range(150):
            r = run_seed(seed, config)
            assert r.violation is None, (alone, seed, r.violation)
            answered[alone].update(r.answered)
    assert answered[True]["200"] > answered[False]["200"], answered
    assert answered[True]["503"] < answered[False]["503"], answered
