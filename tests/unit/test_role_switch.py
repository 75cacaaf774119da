"""RoleSwitch (table role_switch, issue 30 §1): whole switches through the core, as the worker
feeds them — the epoch, the drain's deadline and its reason, the restore of the old role, the
exit when nothing can start, and the answers to requests it must refuse. Every pair of the table
is in test_core_exhaustive.py; these are the sequences an operator sees."""

from __future__ import annotations

import pytest

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.core.tables import ROLE_SWITCH

S = ROLE_SWITCH.S


def test_a_switch_drains_then_starts_the_new_role_under_the_next_epoch() -> None:
    rs = RoleSwitch("prefill", ("prefill", "decode"))
    out = rs.handle(ev.SwitchRequested("decode", 10.0), 100.0)
    assert [type(e) for e in out] == [fx.WithdrawRecord, fx.RefuseLegs]
    assert "from prefill to decode" in out[1].reason  # type: ignore[union-attr]
    assert rs.state == S.DRAINING and rs.next_deadline() == 110.0
    assert rs.handle(ev.TimeAdvanced(), 105.0) == []  # not yet due
    assert rs.handle(ev.RoleDrained(), 106.0) == [fx.StopRole("prefill"), fx.StartRole("decode", 1)]
    assert rs.state == S.SWITCHING and rs.next_deadline() is None
    assert rs.role == "prefill" and rs.epoch == 0  # not before the new role serves
    assert rs.handle(ev.RoleStarted(), 107.0) == [fx.AcceptLegs("decode", 1)]
    assert (rs.state, rs.role, rs.epoch) == (S.SERVING, "decode", 1)
    assert rs.outcomes == {("prefill", "decode", "switched"): 1}
    # And back: the epoch counts completed switches.
    rs.handle(ev.SwitchRequested("prefill", 10.0), 200.0)
    rs.handle(ev.RoleDrained(), 201.0)
    rs.handle(ev.RoleStarted(), 202.0)
    assert (rs.role, rs.epoch) == ("prefill", 2)


def test_the_drain_deadline_fails_what_is_left_with_a_reason_naming_the_switch() -> None:
    rs = RoleSwitch("decode", ("prefill", "decode"))
    rs.handle(ev.SwitchRequested("prefill", 2.5), 0.0)
    out = rs.handle(ev.TimeAdvanced(), 2.5)
    assert [type(e) for e in out] == [fx.FailInFlight, fx.StopRole, fx.StartRole]
    reason = out[0].reason  # type: ignore[union-attr]
    assert "from decode to prefill" in reason and "drain timeout (2.5 s)" in reason
    rs.handle(ev.RoleStarted(), 3.0)
    assert rs.outcomes == {("decode", "prefill", "switched_after_drain_timeout"): 1}


def test_a_new_role_that_fails_to_start_gives_way_to_the_old_one() -> None:
    rs = RoleSwitch("prefill", ("prefill", "decode"))
    rs.handle(ev.SwitchRequested("decode", 5.0), 0.0)
    rs.handle(ev.RoleDrained(), 1.0)
    out = rs.handle(ev.RoleStartFailed("out of memory"), 2.0)
    assert out == [fx.StartRole("prefill", 0, restoring=True, reason="out of memory")]
    assert rs.handle(ev.RoleStarted(), 3.0) == [fx.AcceptLegs("prefill", 0)]
    assert (rs.state, rs.role, rs.epoch) == (S.SERVING, "prefill", 0)
    assert rs.outcomes == {("prefill", "decode", "restored"): 1}


def test_when_neither_role_starts_the_process_exits_naming_both_failures() -> None:
    rs = RoleSwitch("prefill", ("prefill", "decode"))
    rs.handle(ev.SwitchRequested("decode", 5.0), 0.0)
    rs.handle(ev.RoleDrained(), 1.0)
    rs.handle(ev.RoleStartFailed("first"), 2.0)
    (exit_,) = rs.handle(ev.RoleStartFailed("second"), 3.0)
    assert isinstance(exit_, fx.ExitProcess)
    assert "first" in exit_.reason and "second" in exit_.reason
    assert rs.state == S.FAILED
    with pytest.raises(LocalProtocolError):  # the process is exiting: nothing is fed any more
        rs.handle(ev.SwitchRequested("decode", 5.0), 4.0)


def test_one_switch_at_a_time() -> None:
    rs = RoleSwitch("prefill", ("prefill", "decode", "null"))
    rs.handle(ev.SwitchRequested("decode", 5.0), 0.0)
    (refused,) = rs.handle(ev.SwitchRequested("null", 5.0), 0.5)
    assert isinstance(refused, fx.RefuseSwitch) and "prefill to decode" in refused.reason
    assert rs.state == S.DRAINING and rs.target == "decode"  # the first switch goes on
    assert rs.next_deadline() == 5.0  # and keeps its own deadline


def test_requests_the_worker_answers_itself() -> None:
    rs = RoleSwitch("prefill", ("prefill", "decode"))
    assert rs.refusal("decode") is None
    assert "allowed roles are prefill, decode" in (rs.refusal("null") or "")
    assert "must be one of null, prefill, decode" in (rs.refusal("colocated") or "")
    with pytest.raises(LocalProtocolError):  # already that role: a 200, never an event
        rs.handle(ev.SwitchRequested("prefill", 5.0), 0.0)
    with pytest.raises(LocalProtocolError):  # a report out of turn
        rs.handle(ev.RoleDrained(), 0.0)
    with pytest.raises(ValueError, match="must be one of the roles"):
        RoleSwitch("null", ("prefill", "decode"))
    with pytest.raises(ValueError, match="unknown role"):
        RoleSwitch("prefill", ("prefill", "colocated"))


def test_drained_fed_after_the_deadline_passed_keeps_the_timeouts_effects() -> None:
    """The deadline passed but its timer had not fired when the drain check fed Drained: the
    timeout's row runs first (its effects are returned), and the stale Drained changes nothing."""
    from pd_fsm.core import effects as fx
    from pd_fsm.core import events as ev
    from pd_fsm.core.role_switch import RoleSwitch

    rs = RoleSwitch("prefill", ("prefill", "decode"))
    rs.handle(ev.SwitchRequested("decode", 1.0), 0.0)
    out = rs.handle(ev.RoleDrained(), 1.5)
    assert [type(e) for e in out] == [fx.FailInFlight, fx.StopRole, fx.StartRole]
    assert rs.state == "SWITCHING" and rs.drain_timed_out
    assert rs.handle(ev.RoleStarted(), 2.0)[-1] == fx.AcceptLegs("decode", 1)
