"""`pd-fsm sim --schedulers real` (issue 12 §5): the cluster with the real PD schedulers on the
tiny model, each driven through the worker's own tick (``run_tick``) on the virtual clock, the
transfer server simulated. Every 200 must be the colocated model's greedy answer; every page,
registration and room is accounted by the schedulers themselves; planted bugs in the schedulers'
own code are caught."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pd_fsm.sim import PLANTS, SimConfig, run_seed
from pd_fsm.sim.config import SCENARIO_PLANTS, SHORT_DRAIN
from pd_fsm.sim.scenarios import scenario_config

REAL = SimConfig(schedulers="real", requests=6)
SEEDS = 40


def test_seeds_with_faults_keep_every_invariant() -> None:
    start = time.perf_counter()
    results = [run_seed(s, REAL) for s in range(SEEDS)]
    took = time.perf_counter() - start
    answers: Counter[str] = Counter()
    for r in results:
        answers.update(r.answered)
    print(f"{SEEDS} seeds in {took:.1f} s; answers {dict(answers)}")
    assert not [r for r in results if r.violation], [
        (r.seed, r.violation) for r in results if r.violation][:3]
    assert answers["200"] > SEEDS * 3  # most clients get their (checked) answer


def test_recompute_keeps_every_invariant() -> None:
    config = SimConfig(schedulers="real", requests=6, recompute=True)
    failing = [r for r in (run_seed(s, config) for s in range(12)) if r.violation]
    assert not failing, [(r.seed, r.violation) for r in failing[:3]]


def test_kv_checksums_keep_every_invariant(receiver_rows: Counter[tuple[str, str]]) -> None:
    """Issue 31 §3 with the real schedulers: some pulls arrive with a page overwritten; P's
    checksums catch each on D, which pulls P's spare registration again, and every 200 is still
    the colocated answer (``test_each_planted_bug_in_the_real_schedulers_is_caught`` shows the
    same fault, unchecked, reaching an answer: ``unverified-kv``)."""
    config = SimConfig(schedulers="real", requests=6, kv_checksum=True)
    results = [run_seed(s, config) for s in range(8)]
    assert not [r for r in results if r.violation], [
        (r.seed, r.violation) for r in results if r.violation][:3]
    assert receiver_rows[("TRANSFERRING", "ChecksumMismatched")] > 0
    assert receiver_rows[("REPULLING", "PullSucceeded")] > 0


@pytest.mark.parametrize("stream_tokens", [0, 8])
def test_without_faults_every_answer_is_the_colocated_one(stream_tokens: int) -> None:
    """Also with P streaming the KV in parts of 8 tokens (2 pages: up to 5 parts a prompt),
    gathered and scattered by the real schedulers (issue 31 §1)."""
    config = SimConfig(schedulers="real", requests=6, faults=False, stream_tokens=stream_tokens)
    for seed in range(6 if not stream_tokens else 3):
        r = run_seed(seed, config)
        assert r.violation is None and r.answered == {"200": 6}, (seed, r)


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_each_planted_bug_in_the_real_schedulers_is_caught(plant: str) -> None:
    config = SimConfig(schedulers="real", requests=6, plant=plant)
    if plant in SCENARIO_PLANTS:  # only its scenario stages the fault the bug lets through
        config = scenario_config(SCENARIO_PLANTS[plant], config)
    caught = next((s for s in range(40) if run_seed(s, config).violation), None)
    assert caught is not None, f"{plant} not caught in 40 seeds"


def test_p_dies_mid_pull_with_the_real_pull_executor() -> None:
    """The named scenario with the real schedulers: the core's CancelPull reaches the real
    PullExecutor (its cancel under the pool's lock) and ReleaseBlocks the real page budget,
    while the pulls from the dead P hang; every page of those rooms is back within the peer
    timeout, and every page, registration and room is accounted after the drain."""
    config = scenario_config("p-dies-mid-pull", SimConfig(schedulers="real"))
    results = [run_seed(s, config) for s in range(3)]
    assert not [r for r in results if r.violation], [(r.seed, r.violation) for r in results]
    assert all(r.scenario == {"staged": 1, "pages_back": 1} for r in results), results


def test_a_seed_replays_bit_for_bit() -> None:
    a, b = run_seed(5, REAL, trace=True), run_seed(5, REAL, trace=True)
    assert a.trace == b.trace and len(a.trace) > 100 and a.answered == b.answered


def test_role_switches_past_their_drain_deadline_free_everything() -> None:
    """Issue 30 §1 with the real schedulers: a switch whose drain deadline passes aborts what
    the old role holds through the scheduler and the core, cancels its pulls, and StopRole finds
    every page, room and registration released (the seeds are ones whose switches time out)."""
    config = SimConfig(schedulers="real", requests=6, role_switches=1.0,
                       switch_drain=SHORT_DRAIN)
    outcomes: Counter[str] = Counter()
    for seed in (0, 12, 17):
        r = run_seed(seed, config)
        assert r.violation is None, (seed, r.violation)
        outcomes.update(r.switches)
    assert outcomes["switched_after_drain_timeout"] >= 2 and outcomes["switched"] >= 1, outcomes
