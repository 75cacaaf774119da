"""`pd-fsm profile`'s clock (--budget-s) and its failure guard: a point reached after the budget,
or one that fails, is skipped and named, and the points around it are kept."""

from __future__ import annotations

from pd_fsm.sim.profiler.measure import BudgetClock


def test_a_point_after_the_budget_is_skipped_and_named() -> None:
    assert BudgetClock(None).allows("prefill 16")
    clock = BudgetClock(3600.0)
    assert clock.allows("prefill 16") and not clock.skipped
    spent = BudgetClock(0.0)
    assert not spent.allows("decode 8 x 512")
    assert spent.skipped == ["decode 8 x 512: not measured, the time budget (--budget-s) ran "
                             "out"]


def test_a_failing_point_is_skipped_with_its_error_and_the_rest_go_on() -> None:
    clock = BudgetClock(None)
    into: dict[int, float] = {}

    def fails() -> float:
        raise MemoryError("RESOURCE_EXHAUSTED: 15.8G of 15.7G")

    assert clock.survives("prefill 16", lambda: 0.5, into, 16)
    assert not clock.survives("prefill 8192", fails, into, 8192)
    assert into == {16: 0.5}
    assert clock.skipped == ["prefill 8192: failed: MemoryError: RESOURCE_EXHAUSTED: 15.8G of "
                             "15.7G"]
