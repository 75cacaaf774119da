"""The SLA planner's policy (pd_fsm/core/planner.py): classification, hysteresis, cooldown,
floors, scaling, and that every decision says why."""

from __future__ import annotations

import math

import attrs
import pytest

from pd_fsm.core.planner import (
    MoveStreams,
    Planner,
    PlannerConfig,
    Role,
    ScaleDown,
    ScaleUp,
    SetCpus,
    SetNice,
    SwitchRole,
    WorkerSnapshot,
    split_halves,
)


def cluster(p_ttft: float, d_itl: float, n_p: int = 2, n_d: int = 2,
            **extra: float) -> list[WorkerSnapshot]:
    ps = [WorkerSnapshot(f"p{i}", "prefill", waiting=i, ttft_p90=p_ttft) for i in range(n_p)]
    ds = [WorkerSnapshot(f"d{i}", "decode", running=i, itl_p90=d_itl, **extra)  # type: ignore[arg-type]
          for i in range(n_d)]
    return ps + ds


def test_classes() -> None:
    planner = Planner(PlannerConfig(ttft_slo=2.0, itl_slo=0.1))
    assert planner.classify(cluster(3.0, 0.05)) == "prefill_bound"
    assert planner.classify(cluster(0.5, 0.2)) == "decode_bound"
    assert planner.classify(cluster(3.0, 0.2)) == "both"
    assert planner.classify(cluster(0.2, 0.01)) == "idle"
    assert planner.classify(cluster(1.0, 0.05)) == "balanced"
    # No finished request yet: queues and KV still speak.
    assert planner.classify(cluster(math.nan, math.nan)) == "idle"
    assert planner.classify(cluster(math.nan, math.nan, kv_usage=0.95)) == "decode_bound"
    busy = [WorkerSnapshot("p0", "prefill", waiting=9), WorkerSnapshot("d0", "decode")]
    assert planner.classify(busy) == "prefill_bound"
    # A request waiting past the TTFT target, before any TTFT was observed: prefill-bound.
    stuck = [WorkerSnapshot("p0", "prefill", waiting=1, oldest_wait=2.5),
             WorkerSnapshot("d0", "decode")]
    assert planner.classify(stuck) == "prefill_bound"
    assert planner.pressures(stuck)[0] == pytest.approx(1.25)


def test_hysteresis_then_a_switch_of_the_least_loaded_donor() -> None:
    planner = Planner(PlannerConfig(patience=3, cooldown=10.0))
    snap = cluster(3.0, 0.05, n_p=1, n_d=3)
    assert planner.observe(snap, 0.0) == [] and planner.observe(snap, 1.0) == []
    (decision,) = planner.observe(snap, 2.0)
    assert isinstance(decision, SwitchRole)
    assert (decision.worker, decision.to) == ("d0", "prefill")  # d0 runs the fewest rows
    assert "prefill pressure 1.50" in decision.reason
    # Cooldown: the same pressure decides nothing for 10 s, and the run starts again after it.
    assert all(planner.observe(snap, t) == [] for t in (3.0, 5.0, 11.0, 12.0, 13.0))
    assert planner.observe(snap, 14.0) != []
    assert [t for t, _ in planner.decisions] == [2.0, 14.0]


def test_a_broken_run_starts_the_count_again() -> None:
    planner = Planner(PlannerConfig(patience=2, cooldown=0.0))
    hot, calm = cluster(3.0, 0.05), cluster(1.0, 0.05)
    assert planner.observe(hot, 0) == []
    assert planner.observe(calm, 1) == []
    assert planner.observe(hot, 2) == []
    assert planner.observe(hot, 3) != []


def test_never_below_the_floor_nor_a_worker_already_switching() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, min_decode=1))
    lone = cluster(3.0, 0.05, n_p=1, n_d=1)
    assert planner.observe(lone, 0.0) == []  # the only D stays a D
    draining = [*cluster(3.0, 0.05, n_p=1, n_d=1),
                WorkerSnapshot("d9", "decode", switching=True)]
    assert planner.observe(draining, 1.0) == []  # d9 is mid-switch, not a donor


def test_a_cluster_that_may_grow_asks_for_a_worker_and_gives_one_back() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, max_workers=6, min_workers=2))
    (up,) = planner.observe(cluster(0.5, 0.3), 0.0)
    assert isinstance(up, ScaleUp) and up.role == "decode"
    (both,) = planner.observe(cluster(5.0, 0.15), 1.0)
    assert isinstance(both, ScaleUp) and both.role == "prefill"  # the worse side first
    (down,) = planner.observe(cluster(0.1, 0.01, n_p=2, n_d=3), 2.0)
    assert isinstance(down, ScaleDown) and down.worker in ("p0", "d0")
    assert "every side under" in down.reason
    full = cluster(0.5, 0.3, n_p=3, n_d=3)
    assert planner.observe(full, 3.0) != [] and isinstance(planner.decisions[-1][1],
                                                            SwitchRole)


def test_both_over_moves_toward_the_much_worse_side_only() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, imbalance=1.5))
    assert planner.observe(cluster(2.4, 0.11), 0.0) == []  # 1.2 vs 1.1: hold
    (move,) = planner.observe(cluster(6.0, 0.11), 1.0)  # 3.0 vs 1.1: P gains a worker
    assert isinstance(move, SwitchRole) and move.to == "prefill" and "worse" in move.reason


def test_a_large_gap_moves_several_workers_at_once() -> None:
    # P at 2x its target on 4 workers needs 6 more to get back to headroom (0.8); 12 D at a quarter
    # of theirs can give 9 and stay under it: 6 switch in one decision, the least loaded first.
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, headroom=0.8, max_step=0))
    moves = planner.observe(cluster(4.0, 0.02, n_p=4, n_d=12), 0.0)
    assert len(moves) == 6 and all(isinstance(m, SwitchRole) and m.to == "prefill"
                                   for m in moves)
    assert [m.worker for m in moves] == [f"d{i}" for i in range(6)]  # type: ignore[union-attr]
    capped = Planner(PlannerConfig(patience=1, cooldown=0.0, max_step=2))
    assert len(capped.observe(cluster(4.0, 0.02, n_p=4, n_d=12), 0.0)) == 2


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        PlannerConfig(patience=0)
    with pytest.raises(ValueError):
        PlannerConfig(cooldown=-1.0)
    with pytest.raises(ValueError, match="strictly decreasing"):
        PlannerConfig(prefill_nices=(0, 10))
    with pytest.raises(ValueError, match=r"-20\.\.19"):
        PlannerConfig(prefill_nices=(20, 10))


# -- colocate: merges, splits, orphans ---------------------------------------------------------

def colocated(ttft: float, itl: float, n: int = 2) -> list[WorkerSnapshot]:
    return [WorkerSnapshot(f"c{i}", "null", waiting=i, ttft_p90=ttft, itl_p90=itl)
            for i in range(n)]


def test_without_colocate_colocated_workers_are_left_alone() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0))
    assert planner.observe(colocated(0.5, 0.5), 0.0) == []  # not its to move
    # Nor do they weigh on the P/D part's pressures.
    assert planner.observe([*cluster(1.0, 0.05), *colocated(9.0, 9.0)], 1.0) == []


def test_orphans_become_colocated_at_once_unless_something_is_switching() -> None:
    planner = Planner(PlannerConfig(patience=5, cooldown=0.0, colocate=True))
    lone_p = [*cluster(1.0, 0.05, n_p=2, n_d=0), *colocated(0.5, 0.05)]
    moves = planner.observe(lone_p, 0.0)  # no patience: nothing to wait for
    assert sorted((m.worker, m.to) for m in moves) == [("p0", "null"), ("p1", "null")]
    assert all("no decode worker" in m.reason for m in moves)
    mid_split = [*lone_p, WorkerSnapshot("c9", "null", switching=True)]
    assert Planner(PlannerConfig(patience=5, colocate=True)).observe(mid_split, 0.0) == []


def test_a_pressed_pd_part_gives_pairs_to_colocated_as_many_as_its_pressure_asks() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, colocate=True, headroom=0.8))
    # P at 2x its target, D at 0.5 (not idle): 4 pairs x (1 - 0.8 / 2) = 2.4 -> 3 pairs.
    moves = planner.observe(cluster(4.0, 0.05, n_p=4, n_d=4), 0.0)
    assert all(isinstance(m, SwitchRole) and m.to == "null" for m in moves)
    assert sorted(m.worker for m in moves) == ["d0", "d1", "d2", "p0", "p1", "p2"]
    assert "colocated" in moves[0].reason  # type: ignore[union-attr]
    # The donor side idle merges too (a move is a bet that the phase lasts): 2 pairs x
    # (1 - 0.8 / 2) = 1.2 -> 2, the donor side first. Without colocate, a move.
    merged = Planner(PlannerConfig(patience=1, colocate=True)).observe(
        cluster(4.0, 0.01, n_p=2, n_d=4), 0.0)
    assert [(m.worker, m.to) for m in merged] == [  # type: ignore[union-attr]
        ("d0", "null"), ("d1", "null"), ("p0", "null"), ("p1", "null")]
    (move,) = Planner(PlannerConfig(patience=1)).observe(cluster(4.0, 0.01, n_p=2, n_d=4), 0.0)
    assert isinstance(move, SwitchRole) and move.to == "prefill"


def test_colocated_missing_itl_with_ttft_to_spare_splits_once_per_recall() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, colocate=True, recall=60.0))
    slow_steps = colocated(0.5, 0.3, n=4)  # TTFT 0.25 of its target, ITL 3x
    moves = planner.observe(slow_steps, 0.0)
    assert sorted((m.worker, m.to) for m in moves) == [("c0", "decode"), ("c1", "prefill")]
    assert "decode steps wait behind prefills" in moves[0].reason  # type: ignore[union-attr]
    mixed = [*cluster(1.0, 0.15, n_p=1, n_d=1), *colocated(0.5, 0.3, n=2)]
    assert planner.observe(mixed, 30.0) == []  # not within recall of the last split
    # P/D did worse than colocated (3.0) did: back at once, a pair.
    back = planner.observe([*cluster(1.0, 0.35, n_p=1, n_d=1), *colocated(0.5, 0.3, n=2)], 31.0)
    assert sorted((m.worker, m.to) for m in back) == [("d0", "null"), ("p0", "null")]
    assert "colocated did 3.00" in back[0].reason  # type: ignore[union-attr]
    # Past recall, colocated must do imbalance (1.5) x worse than P/D did (3.5) to split again.
    assert planner.observe(colocated(0.5, 0.5, n=4), 80.0) == []  # 5.0 < 1.5 x 3.5
    again = planner.observe(colocated(0.5, 0.6, n=4), 81.0)  # 6.0 > 5.25
    assert [m.to for m in again] == ["decode", "prefill"]
    # A calm P/D part beside them gains the least loaded one, on its more pressed side.
    calm = [*cluster(1.0, 0.06, n_p=1, n_d=1), *colocated(0.5, 0.3, n=2)]
    (to_d,) = Planner(PlannerConfig(patience=1, colocate=True)).observe(calm, 0.0)
    assert (to_d.worker, to_d.to) == ("c0", "decode")  # type: ignore[union-attr]


def test_two_workers_merge_one_at_a_time_and_never_split_back() -> None:
    """Never every serving worker draining at once (measured: a 1P1D merge and split drained the
    whole cluster, and requests failed at the drain deadline)."""
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, colocate=True))
    (first,) = planner.observe(cluster(1.0, 0.4, n_p=1, n_d=1), 0.0)  # decode-bound, P not idle
    assert (first.worker, first.to) == ("p0", "null")  # type: ignore[union-attr]
    mid = [WorkerSnapshot("p0", "null", switching=True), *cluster(0.5, 0.4, n_p=0, n_d=1)]
    assert planner.observe(mid, 1.0) == []  # the lone D waits while p0 drains
    merged = [WorkerSnapshot("p0", "null"), *cluster(0.5, 0.4, n_p=0, n_d=1)]
    (then,) = planner.observe(merged, 2.0)  # now an orphan
    assert (then.worker, then.to) == ("d0", "null")  # type: ignore[union-attr]
    assert planner.observe(colocated(0.5, 0.6, n=2), 300.0) == []  # no split of the last two
    only_ds = cluster(0.5, 0.05, n_p=0, n_d=2)  # orphans serving nothing: all but one now
    assert len(planner.observe(only_ds, 301.0)) == 1


# -- priorities before roles (prefill_nices) ---------------------------------------------------

STEPS = (19, 10, 5, 0, -5)


def shared(p_ttft: float, d_itl: float, p_nice: int | None, n_p: int = 1, n_d: int = 1,
           **extra: bool) -> list[WorkerSnapshot]:
    """P at ``p_nice`` and D at -5 on shared cores."""
    ps = [WorkerSnapshot(f"p{i}", "prefill", ttft_p90=p_ttft, nice=p_nice, **extra)  # type: ignore[arg-type]
          for i in range(n_p)]
    return ps + [WorkerSnapshot(f"d{i}", "decode", itl_p90=d_itl, nice=-5) for i in range(n_d)]


def test_a_starved_prefill_side_gets_the_next_higher_priority_before_any_role_moves() -> None:
    planner = Planner(PlannerConfig(patience=2, cooldown=30.0, nice_cooldown=5.0,
                                    prefill_nices=STEPS))
    hot = shared(3.0, 0.05, 10, n_d=3)  # with three Ds, a role move was possible too
    assert planner.observe(hot, 0.0) == []  # patience as for any decision
    (decision,) = planner.observe(hot, 1.0)
    assert decision == SetNice("p0", 5, decision.reason)
    assert "prefill_bound: P's priority up: nice 10 -> 5" in decision.reason
    # A priority change quiets the planner for nice_cooldown, not cooldown.
    assert planner.observe(hot, 5.0) == [] and planner.observe(hot, 6.5) == []
    assert planner.observe(hot, 7.0) == [SetNice("p0", 5, planner.decisions[-1][1].reason)]
    # At the last step the role moves decide again (a D moved over to P).
    top = shared(3.0, 0.05, -5, n_d=3)
    assert planner.observe(top, 20.0) == []
    (move,) = planner.observe(top, 21.0)
    assert isinstance(move, SwitchRole) and move.to == "prefill"


def test_a_decode_bound_cluster_moves_every_prefill_worker_one_step_back() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, nice_cooldown=0.0,
                                    prefill_nices=STEPS))
    assert [(d.worker, d.nice) for d in planner.observe(shared(0.5, 0.12, 0, n_p=2), 0.0)
            if isinstance(d, SetNice)] == [("p0", 5), ("p1", 5)]
    # A value between the steps moves to the nearest step beyond it.
    assert [d.nice for d in planner.observe(shared(0.5, 0.12, 7), 1.0)
            if isinstance(d, SetNice)] == [10]
    # One more step per doubling of the pressure past headroom: 2.0 / 0.8 -> two, 7.5 / 0.8
    # -> four (as far as the steps go).
    assert [d.nice for d in planner.observe(shared(0.5, 0.2, 0), 2.0)
            if isinstance(d, SetNice)] == [10]
    assert [d.nice for d in planner.observe(shared(0.5, 0.75, -5), 3.0)
            if isinstance(d, SetNice)] == [19]
    up = planner.observe(shared(15.0, 0.05, 10), 4.0)  # 7.5 / 0.8: three steps up, two left
    assert [d.nice for d in up if isinstance(d, SetNice)] == [-5]
    # At the lowest priority already: nothing left to give (one P, one D: no role move).
    assert planner.observe(shared(0.5, 0.2, 19), 5.0) == []


def test_priorities_follow_the_worse_side_only_when_it_is_much_worse() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, nice_cooldown=0.0,
                                    prefill_nices=STEPS))
    assert planner.observe(shared(2.2, 0.11, 10), 0.0) == []  # both over, neither 1.5x worse
    (decision,) = planner.observe(shared(3.5, 0.11, 10), 1.0)
    assert isinstance(decision, SetNice) and decision.nice == 5
    (decision,) = planner.observe(shared(1.8, 0.3, 10), 2.0)
    assert isinstance(decision, SetNice) and decision.nice == 19


def test_balanced_idle_unknown_or_switching_prefill_workers_keep_their_priority() -> None:
    planner = Planner(PlannerConfig(patience=1, cooldown=0.0, nice_cooldown=0.0,
                                    prefill_nices=STEPS))
    assert planner.observe(shared(1.0, 0.05, 10), 0.0) == []  # balanced
    assert planner.observe(shared(0.1, 0.01, 10), 1.0) == []  # idle
    assert planner.observe(shared(3.0, 0.05, None), 2.0) == []  # its nice not known
    p0, d0 = shared(3.0, 0.05, 10)
    moving = [attrs.evolve(p0, switching=True), attrs.evolve(p0, worker="p1"), d0]
    assert [(d.worker, d.nice) for d in planner.observe(moving, 3.0)
            if isinstance(d, SetNice)] == [("p1", 5)]
    # Without prefill_nices, the same pressure leaves priorities alone.
    plain = Planner(PlannerConfig(patience=1, cooldown=0.0))
    assert not any(isinstance(d, SetNice) for d in plain.observe(shared(3.0, 0.05, 10, n_d=3),
                                                                  0.0))


CORES = frozenset({0, 1})
P_HALF, D_HALF = frozenset({0}), frozenset({1})


def placed(p_ttft: float, d_itl: float, p_cpus: frozenset[int], d_cpus: frozenset[int],
           busy: float, p_nice: int = 10, d_threads: int | None = None) -> list[WorkerSnapshot]:
    """1P1D on ``CORES``, D busy for ``busy`` of the window (its pools of ``d_threads``)."""
    return [WorkerSnapshot("p0", "prefill", ttft_p90=p_ttft, nice=p_nice, cpus=p_cpus),
            WorkerSnapshot("d0", "decode", itl_p90=d_itl, nice=-5, cpus=d_cpus, busy=busy,
                           pool_threads=d_threads)]


def cores_planner(**extra: object) -> Planner:
    return Planner(PlannerConfig(patience=2, cooldown=30.0, nice_cooldown=5.0, cores=CORES,
                                 **extra))  # type: ignore[arg-type]


def test_split_halves_give_prefill_the_larger_half() -> None:
    assert split_halves(frozenset({0, 1})) == {"prefill": P_HALF, "decode": D_HALF,
                                               "null": CORES}
    odd = split_halves(frozenset({4, 5, 6}))
    assert (odd["prefill"], odd["decode"]) == (frozenset({4, 5}), frozenset({6}))
    with pytest.raises(ValueError, match=r"split_above 0\.3 is below share_below 0\.4"):
        PlannerConfig(split_above=0.3)


def test_a_starved_prefill_beside_an_idle_decode_shares_the_cores_then_keeps_them() -> None:
    planner = cores_planner(prefill_nices=STEPS)
    hot = placed(3.0, 0.05, P_HALF, D_HALF, busy=0.2)
    assert planner.observe(hot, 0.0) == [] and planner.placement == "split"  # read, patience
    decisions = planner.observe(hot, 1.0)
    assert [(d.worker, d.cpus) for d in decisions if isinstance(d, SetCpus)] == [
        ("p0", CORES), ("d0", CORES)]
    assert "busiest D 20% busy: P over its target, D mostly idle" in decisions[0].reason
    assert planner.placement == "shared"
    # Drains nothing: nice_cooldown. Shared now, the priority lever acts on P next.
    assert planner.observe(placed(3.0, 0.05, CORES, CORES, 0.3), 5.0) == []
    now_shared = placed(3.0, 0.05, CORES, CORES, 0.3)
    assert planner.observe(now_shared, 6.5) == []
    (up,) = planner.observe(now_shared, 7.0)
    assert up == SetNice("p0", 5, up.reason)


def test_split_keeps_a_starved_prefill_beside_a_busy_decode_and_ignores_priorities() -> None:
    planner = cores_planner(prefill_nices=STEPS)
    busy = placed(3.0, 0.05, P_HALF, D_HALF, busy=0.5)  # inside the band: no move
    assert all(planner.observe(busy, t) == [] for t in range(6))
    assert planner.placement == "split"


def test_shared_splits_for_a_decode_over_its_target_or_a_prefill_behind_a_busy_decode() -> None:
    planner = cores_planner()
    assert planner.observe(placed(0.5, 0.2, CORES, CORES, 0.5), 0.0) == []
    assert planner.placement == "shared"
    decisions = planner.observe(placed(0.5, 0.2, CORES, CORES, 0.5), 1.0)
    assert [(d.worker, d.cpus) for d in decisions] == [("p0", P_HALF), ("d0", D_HALF)]
    assert "D over its target beside P: P and D split the cores" in decisions[0].reason
    other = cores_planner()
    behind = placed(3.0, 0.05, CORES, CORES, busy=0.7)
    assert other.observe(behind, 0.0) == []
    decisions = other.observe(behind, 1.0)
    assert [d.cpus for d in decisions] == [P_HALF, D_HALF]
    assert "P over its target behind a busy D" in decisions[0].reason
    # The same starved P beside a D in the band stays shared.
    third = cores_planner()
    assert all(third.observe(placed(3.0, 0.05, CORES, CORES, 0.5), t) == [] for t in range(5))


@pytest.mark.parametrize(("threads", "splits"), [(1, False), (2, True), (None, True)])
def test_a_prefill_behind_a_busy_one_thread_decode_stays_shared(threads: int | None,
                                                                splits: bool) -> None:
    """A D on XLA pools of one thread keeps at most one core busy: P shared with it already
    has the other, and a split would take D's idle share from it. Two threads (or not known):
    the rule as measured with spinning pools."""
    planner = cores_planner()
    behind = placed(3.0, 0.05, CORES, CORES, busy=0.9, d_threads=threads)
    decisions = [d for t in range(5) for d in planner.observe(behind, t)
                 if isinstance(d, SetCpus)]
    assert bool(decisions) is splits
    assert planner.placement == ("split" if splits else "shared")
    # Beside a one-thread D over its own target, P and D still split.
    if threads == 1:
        over = placed(0.5, 0.2, CORES, CORES, busy=0.9, d_threads=1)
        assert [d.cpus for t in (10, 11) for d in planner.observe(over, t)] == [P_HALF, D_HALF]


def test_a_placement_left_lately_comes_back_only_when_this_one_does_worse() -> None:
    planner = cores_planner(recall=100.0)
    hot = placed(3.0, 0.05, P_HALF, D_HALF, busy=0.2)  # prefill pressure 1.5: left split
    planner.observe(hot, 0.0)
    assert planner.observe(hot, 1.0) != [] and planner.placement == "shared"
    mild = placed(2.6, 0.05, CORES, CORES, busy=0.8)  # 1.3: better than split did
    assert all(planner.observe(mild, t) == [] for t in (10.0, 11.0, 12.0))
    worse = placed(3.4, 0.05, CORES, CORES, busy=0.8)  # 1.7: worse than split did
    assert [d.cpus for d in planner.observe(worse, 20.0)] == [P_HALF, D_HALF]
    # Past recall, nothing is remembered.
    late = cores_planner(recall=5.0)
    late.observe(hot, 0.0)
    late.observe(hot, 1.0)
    assert late.observe(mild, 10.0) == [] and late.observe(mild, 11.0) != []


def test_a_worker_off_its_roles_cores_is_moved_at_once() -> None:
    planner = cores_planner()
    p0, d0 = placed(1.0, 0.05, P_HALF, D_HALF, busy=0.1)
    assert planner.observe([p0, d0], 0.0) == []
    # d0 became a P (a role switch): it is moved to P's half at once, no patience; one still
    # switching, or of unknown cores, is left alone.
    d0_as_p = attrs.evolve(d0, role="prefill")
    (move,) = planner.observe([p0, d0_as_p, attrs.evolve(d0, worker="d1"),
                               attrs.evolve(d0, worker="d2", switching=True, cpus=CORES),
                               attrs.evolve(d0, worker="d3", cpus=None)], 1.0)
    assert move == SetCpus("d0", P_HALF, move.reason)
    assert "prefill worker on cores 1: split, its cores are 0" in move.reason
    # Colocated workers take every core.
    fresh = cores_planner(colocate=True)
    null = WorkerSnapshot("c0", "null", cpus=P_HALF)
    moves = fresh.observe([p0, d0, null], 0.0)
    assert moves == [SetCpus("c0", CORES, moves[0].reason)]
    # Without the lever (fewer than two cores), cores are left alone.
    assert Planner(PlannerConfig(patience=1, cores=frozenset({0}))).observe(
        [attrs.evolve(p0, ttft_p90=3.0), d0], 0.0) == []


def test_a_move_the_workers_did_not_take_is_decided_again_not_repeated() -> None:
    planner = cores_planner()
    hot = placed(3.0, 0.05, P_HALF, D_HALF, busy=0.2)
    planner.observe(hot, 0.0)
    assert len(planner.observe(hot, 1.0)) == 2 and planner.placement == "shared"
    # Not taken (refused, or a --dry-run planner): the workers are still split. The placement
    # is read from them, nobody is "misplaced", and after nice_cooldown and patience the same
    # decision comes again.
    assert planner.observe(hot, 6.5) == [] and planner.placement == "split"
    assert [d.cpus for d in planner.observe(hot, 7.0)] == [CORES, CORES]
    # Half taken (D refused): split still, and P goes back to its half at once.
    half = placed(3.0, 0.05, CORES, D_HALF, busy=0.2)
    (back,) = planner.observe(half, 13.0)
    assert back == SetCpus("p0", P_HALF, back.reason)


def test_a_decode_over_its_target_beside_a_raised_prefill_lowers_it_before_splitting() -> None:
    """Shared, D over its target: a P the priority lever raised goes back down its steps
    first (D gets its cores' time back at once, P keeps what D leaves idle); only a P at the
    lowest step leaves the split to the cores lever."""
    planner = cores_planner(prefill_nices=STEPS)
    over = placed(0.5, 0.2, CORES, CORES, busy=0.9, p_nice=-5, d_threads=1)
    assert planner.observe(over, 0.0) == []
    (down,) = planner.observe(over, 1.0)
    # D at 2.5x headroom: two steps down.
    assert down == SetNice("p0", 5, down.reason) and "P's priority down" in down.reason
    assert planner.placement == "shared"
    at_floor = placed(0.5, 0.2, CORES, CORES, busy=0.9, p_nice=19, d_threads=1)
    assert planner.observe(at_floor, 10.0) == []
    assert [d.cpus for d in planner.observe(at_floor, 11.0)] == [P_HALF, D_HALF]


def test_a_narrow_decode_over_its_target_makes_the_wide_prefill_colocated_then_p_again() -> None:
    """A D of one thread over its ITL target: before any priority or cores lever (runs 14-15 of
    bench/RESULTS_adaptive.md: lowering P gave it nothing), the wide P becomes colocated alone
    and D stays a standby; the colocated worker's decode steps behind its prefills make it P
    again beside the standby. A narrow D never merges another way (run 16)."""
    config = PlannerConfig(patience=1, cooldown=0.0, colocate=True, recall=30.0,
                           prefill_nices=(19, 10, -5), cores=frozenset({0, 1}))
    both = frozenset({0, 1})

    def pd(d_threads: int, ttft: float, itl: float, waiting: int = 0) -> list[WorkerSnapshot]:
        return [WorkerSnapshot("p0", "prefill", ttft_p90=ttft, nice=-5, cpus=both,
                               pool_threads=2, waiting=waiting),
                WorkerSnapshot("d0", "decode", itl_p90=itl, running=4, cpus=both, busy=0.9,
                               pool_threads=d_threads)]

    planner = Planner(config)
    # Both sides over, P with a backlog now (a long-prompt phase): no merge of the narrow D
    # (nor its P).
    assert not any(isinstance(m, SwitchRole)
                   for m in planner.observe(pd(1, 2.5, 0.1, waiting=4), 0.0))
    # Both over, but P's side is the TTFTs of requests answered, nothing waiting now (the first
    # seconds of a short-prompt phase after a long-prompt one): the wide merge.
    (early,) = Planner(config).observe(pd(1, 2.5, 0.1), 0.0)
    assert isinstance(early, SwitchRole) and (early.worker, early.to) == ("p0", "null")
    (merge,) = planner.observe(pd(1, 0.2, 0.15), 1.0)  # P at nice -5: no priority step first
    assert isinstance(merge, SwitchRole) and (merge.worker, merge.to) == ("p0", "null")
    assert "D's XLA pools of 1 thread(s), P's of 2" in merge.reason
    assert "standby" in merge.reason
    # A D as wide as P: the priority lever as before (its P side idle, no merge).
    (lower,) = Planner(config).observe(pd(2, 0.2, 0.15), 0.0)
    assert isinstance(lower, SetNice) and lower.nice == 10
    # P taking heavy prompts (a long-prompt phase goes on): D over its target, alone or with
    # P over its own, is P's prefills on the shared cores: P's priority down, no merge (run 32).
    def heavy(ttft: float) -> list[WorkerSnapshot]:
        p, d = pd(1, ttft, 0.15)
        return [attrs.evolve(p, prompt_tokens=600.0), d]

    (down,) = Planner(config).observe(heavy(0.2), 0.0)
    assert isinstance(down, SetNice) and down.nice == 10
    assert not any(isinstance(m, SwitchRole) for m in Planner(config).observe(heavy(2.5), 0.0))

    merged = [WorkerSnapshot("p0", "null", ttft_p90=0.3, itl_p90=0.09, cpus=both,
                             pool_threads=2),
              WorkerSnapshot("d0", "decode", cpus=both, pool_threads=1)]
    # The lone D is no orphan to merge, and the cores lever has no P to place beside it.
    assert planner.observe(merged, 2.0) == []
    # Colocated over its ITL target with light prefills: its own steps, which the narrow D
    # would not better: it stays (run 17 split back on this, and lost).
    slow = [attrs.evolve(merged[0], itl_p90=0.3), merged[1]]
    assert planner.observe(slow, 2.5) == []
    # Over both, its TTFT the worse: requests queue for a batch slot at a short-prompt
    # phase's peak (run 24 of bench/RESULTS_adaptive.md split back on this, and lost).
    queued = [attrs.evolve(merged[0], ttft_p90=5.0, itl_p90=0.15), merged[1]]
    assert planner.observe(queued, 2.7) == []
    # Over both, its decode side the worse, but short prompts taken (or none): its own full
    # batch at a short-prompt phase's peak (run 25 split back on this, and lost).
    for prompts in (40.0, math.nan):
        full = [attrs.evolve(merged[0], ttft_p90=3.0, itl_p90=0.4, prompt_tokens=prompts),
                merged[1]]
        assert planner.observe(full, 2.8) == []
    # Colocated's decode steps behind its long prefills, its TTFT over too: P again.
    merged[0] = attrs.evolve(merged[0], ttft_p90=3.0, itl_p90=0.4, prompt_tokens=600.0)
    (back,) = planner.observe(merged, 3.0)
    assert isinstance(back, SwitchRole) and (back.worker, back.to) == ("p0", "prefill")
    assert "P beside the standby D" in back.reason and "P/D did 1.50" in back.reason
    # A colocated worker's lone D as wide as it is an orphan as before.
    wide_d = [merged[0], attrs.evolve(merged[1], pool_threads=2)]
    (orphan,) = Planner(config).observe(wide_d, 0.0)
    assert isinstance(orphan, SwitchRole) and (orphan.worker, orphan.to) == ("d0", "null")


def test_light_prompts_beside_a_busy_narrow_decode_merge_before_it_misses() -> None:
    """A short-prompt phase's start: P takes light prompts while the one-thread D decodes,
    still under its target. The wide merge does not wait for D's inter-token p90 to pass it
    (7-23 s of each such phase in runs 23 and 26 of bench/RESULTS_adaptive.md, and the batch
    built meanwhile never drained); nor for colocated's pressure remembered from the heavy
    prompts it split back on; nor for P's backlog of the last phase's long prompts to clear
    (run 32: 11.7 s of its last phase): they drain on P. Heavy prompts, none taken or an idle
    D: none."""
    config = PlannerConfig(patience=1, cooldown=0.0, colocate=True, recall=30.0)

    def pd(prompts: float, itl: float, waiting: int = 0) -> list[WorkerSnapshot]:
        return [WorkerSnapshot("p0", "prefill", ttft_p90=0.3, pool_threads=2, waiting=waiting,
                               oldest_wait=2.0 * waiting, prompt_tokens=prompts),
                WorkerSnapshot("d0", "decode", itl_p90=itl, running=2, pool_threads=1)]

    for prompts, itl, waiting in ((600.0, 0.06, 0), (math.nan, 0.06, 0), (40.0, math.nan, 0),
                                  (600.0, 0.06, 8)):
        assert Planner(config).observe(pd(prompts, itl, waiting), 0.0) == []
    # P still holds 8 long prompts (prefill pressure 8.0): merged all the same.
    (queued,) = Planner(config).observe(pd(40.0, 0.06, 8), 0.0)
    assert isinstance(queued, SwitchRole) and (queued.worker, queued.to) == ("p0", "null")
    assert "P's 8 queued drain on it" in queued.reason
    # Light prompts one window, none the next: the last prompts P took are still light (run
    # 33 merged only at the next prompt, 7-10 s into the phase)...
    patient = Planner(attrs.evolve(config, patience=2))
    assert patient.observe(pd(40.0, 0.06), 0.0) == []
    (later,) = patient.observe(pd(math.nan, 0.06), 2.0)
    assert isinstance(later, SwitchRole) and later.to == "null"
    # ...within recall: light prompts beside an idle D, then D busy 31 s later with none taken.
    stale = Planner(config)
    assert stale.observe(pd(40.0, math.nan), 0.0) == []
    assert stale.observe(pd(math.nan, 0.06), 31.0) == []
    planner = Planner(config)
    (merge,) = planner.observe(pd(40.0, 0.06), 0.0)
    assert isinstance(merge, SwitchRole) and (merge.worker, merge.to) == ("p0", "null")
    assert "P took prompts of 40 tokens at most" in merge.reason and "queued" not in merge.reason
    # Back to P beside the standby on heavy prompts (colocated over both, 4.00 remembered)...
    behind = [WorkerSnapshot("p0", "null", ttft_p90=3.0, itl_p90=0.4, pool_threads=2,
                             prompt_tokens=600.0),
              WorkerSnapshot("d0", "decode", pool_threads=1)]
    (back,) = planner.observe(behind, 1.0)
    assert isinstance(back, SwitchRole) and back.to == "prefill"
    # ...and light prompts again: merged at D's 0.60, not only past colocated's 4.00.
    (again,) = planner.observe(pd(40.0, 0.06), 2.0)
    assert isinstance(again, SwitchRole) and again.to == "null" and "did" not in again.reason


def test_light_prompts_merge_through_a_priority_changes_quiet() -> None:
    """The priority lever raised P 12-18 s before every last-phase merge of runs 34, 37 and 39
    (bench/RESULTS_adaptive.md); held by its quiet, those merges came 9.4-11.7 s into the
    short-prompt phase. The merge on light prompts reads the prompts P takes, not the latencies
    that quiet waits for: it counts its patience through it. Not a merge on D's latencies, not
    within a role switch's cooldown, not with ``merge_in_nice_cooldown`` off."""
    config = PlannerConfig(patience=2, cooldown=30.0, nice_cooldown=10.0, colocate=True,
                           recall=30.0, prefill_nices=(10, 0, -5))

    def pd(prompts: float, itl: float = 0.06) -> list[WorkerSnapshot]:
        return [WorkerSnapshot("p0", "prefill", ttft_p90=3.0, pool_threads=2, nice=10,
                               prompt_tokens=prompts),
                WorkerSnapshot("d0", "decode", itl_p90=itl, running=2, pool_threads=1)]

    def raised(planner: Planner) -> None:
        assert planner.observe(pd(600.0), 0.0) == []
        (up,) = planner.observe(pd(600.0), 1.0)  # P starved on long prompts: priority up
        assert isinstance(up, SetNice) and up.nice == 0

    planner = Planner(config)
    raised(planner)
    assert planner.observe(pd(40.0), 2.0) == []  # patience: one observation so far
    (merge,) = planner.observe(pd(40.0), 3.0)  # within the quiet (until 11.0)
    assert isinstance(merge, SwitchRole) and (merge.worker, merge.to) == ("p0", "null")
    assert "P took prompts of 40 tokens at most" in merge.reason
    assert planner.observe(pd(40.0), 5.0) == []  # the merge's own cooldown holds everything
    # In a row: a window of heavy prompts between two light ones starts the count again.
    broken = Planner(config)
    raised(broken)
    assert broken.observe(pd(40.0), 2.0) == [] and broken.observe(pd(600.0), 3.0) == []
    assert broken.observe(pd(40.0), 4.0) == []
    assert len(broken.observe(pd(40.0), 5.0)) == 1
    # D over its target on long prompts: that is what the quiet waits on.
    slow = Planner(config)
    raised(slow)
    assert slow.observe(pd(600.0, itl=0.3), 2.0) == [] and slow.observe(pd(600.0, 0.3), 3.0) == []
    # Off: the quiet holds the merge as before, which comes once it ended (and patience).
    held = Planner(attrs.evolve(config, merge_in_nice_cooldown=False))
    raised(held)
    assert [held.observe(pd(40.0), t) for t in (2.0, 3.0, 11.0)] == [[], [], []]
    (late,) = held.observe(pd(40.0), 12.0)
    assert isinstance(late, SwitchRole) and late.to == "null"


def test_the_standby_gives_its_streams_to_the_colocated_worker_once_it_serves() -> None:
    """``move_standby``: after a wide merge, once the worker made colocated serves (not while
    it drains, nor during the merge's cooldown), the standby D's running streams of at most
    ``heavy_prompt`` tokens so far move to it — once (run 34 and 37 of bench/RESULTS_adaptive.md:
    the colocated worker decoded 15-40 % slower a token while the standby beside it on the same
    cores still decoded the streams P had handed it). Without it, or with nothing running on
    the standby, or a switch that ended otherwise: no move."""
    config = PlannerConfig(patience=1, cooldown=30.0, colocate=True, recall=30.0,
                           move_standby=True)
    pd = [WorkerSnapshot("p0", "prefill", ttft_p90=0.3, pool_threads=2, prompt_tokens=40.0),
          WorkerSnapshot("d0", "decode", itl_p90=0.06, running=3, pool_threads=1)]

    def after(p_role: Role, switching: bool, running: int = 3) -> list[WorkerSnapshot]:
        return [attrs.evolve(pd[0], role=p_role, switching=switching),
                attrs.evolve(pd[1], running=running)]

    planner = Planner(config)
    (merge,) = planner.observe(pd, 0.0)
    assert isinstance(merge, SwitchRole) and merge.to == "null"
    assert planner.observe(after("prefill", True), 2.0) == []  # P drains its queue first
    assert planner.observe(after("null", False)[1:], 3.0) == []  # P's scrape failed: waits
    (move,) = planner.observe(after("null", False), 4.0)  # within the cooldown
    assert move == MoveStreams("d0", 256, move.reason)
    assert "standby D decoding 3 stream(s)" in move.reason
    assert planner.decisions[-1] == (4.0, move)
    assert planner.observe(after("null", False), 6.0) == []  # once
    # Off (the default), or nothing on the standby: none.
    off = Planner(attrs.evolve(config, move_standby=False))
    off.observe(pd, 0.0)
    assert off.observe(after("null", False), 4.0) == []
    idle = Planner(config)
    idle.observe(pd, 0.0)
    assert idle.observe(after("null", False, running=0), 4.0) == []
    assert idle.observe(after("null", False), 6.0) == []
    # The switch refused or undone (P serves as P again): nothing to move to, and no later move.
    undone = Planner(config)
    undone.observe(pd, 0.0)
    assert undone.observe(after("prefill", False), 4.0) == []
    assert undone.observe(after("null", False), 6.0) == []
