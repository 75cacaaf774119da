"""RoleSwitch: a worker's role at runtime (table role_switch).

One per worker process. It knows the role the worker serves, that role's epoch (0 at start, one
more per completed switch), the roles the worker compiled at start (``--roles``), and, during a
switch, the role it goes to. Sans-IO like every owner in the core: the worker feeds it what
happened (``ev.RoleSwitchEvent``) with ``now`` and carries out the effects it answers with —
leave the registry, refuse legs, fail what is left at the deadline, stop one backend and start
another, answer a second request 409, exit. The drain's deadline is its own timer
(``next_deadline``), fired by ``TimeAdvanced``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import ROLE_SWITCH

# The worker roles, as `pd-fsm serve --disaggregation-mode` names them.
ROLES = ("null", "prefill", "decode")
# How a leg names the role it is addressed to, and how a worker in another role answers it
# (409 with its own role and epoch): HTTP headers the proxy and the workers share.
ROLE_HEADER = "X-PD-Role"
EPOCH_HEADER = "X-PD-Role-Epoch"

_T = ROLE_SWITCH.T
_S = ROLE_SWITCH.S
_TRIGGER: dict[type, str] = {
    ev.SwitchRequested: _T.SwitchRequested,
    ev.RoleDrained: _T.Drained,
    ev.RoleStarted: _T.RoleStarted,
    ev.RoleStartFailed: _T.RoleStartFailed,
}
# How each switch ended, for role_switches_total{outcome}.
OUTCOMES = ("switched", "switched_after_drain_timeout", "restored", "failed", "refused")


class RoleSwitch:
    table = ROLE_SWITCH

    def __init__(self, role: str, roles: Sequence[str]) -> None:
        unknown = [r for r in (role, *roles) if r not in ROLES]
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(map(repr, unknown))} (expected "
                             f"{', '.join(ROLES)})")
        if role not in roles:
            raise ValueError(f"the starting role {role!r} must be one of the roles {list(roles)}")
        self.roles = tuple(roles)
        self.state = self.table.initial
        self.role = role
        self.epoch = 0
        # During a switch: the role being left (``role`` until CommitRole), the one asked for,
        # the drain's length and deadline, and why the new role failed to start (RESTORING).
        self.source = role
        self.target = role
        self._drain_s = 0.0
        self._deadline: float | None = None
        self.drain_timed_out = False
        self.reason = ""
        # (from, to, outcome) -> switches so far (role_switches_total).
        self.outcomes: dict[tuple[str, str, str], int] = {}
        self._now = 0.0
        self._fx = bind_effects(self, self.table)

    # -- what the worker asks before feeding a request -------------------------------------------

    def refusal(self, role: str) -> str | None:
        """Why ``role`` can never be switched to here (a 400), or None."""
        if role not in ROLES:
            return f"role must be one of {', '.join(ROLES)}, got {role!r}"
        if role not in self.roles:
            return (f"role {role!r} is not one this worker compiled at start: allowed roles "
                    f"are {', '.join(self.roles)} (pd-fsm serve --roles)")
        return None

    @property
    def serving(self) -> bool:
        return self.state == _S.SERVING

    # -- the endpoint -------------------------------------------------------------------------

    def handle(self, event: ev.RoleSwitchEvent, now: float) -> list[fx.RoleSwitchEffect]:
        self._now = now
        out: list[fx.RoleSwitchEffect] = []
        if self._deadline is not None and now >= self._deadline:
            self._deadline = None
            self.drain_timed_out = True
            self._step(_T.DrainTimedOut, out)
        if isinstance(event, ev.TimeAdvanced):
            return out
        trigger = _TRIGGER.get(type(event))
        if trigger is None:
            raise LocalProtocolError(f"RoleSwitch cannot handle {type(event).__name__}")
        if isinstance(event, ev.SwitchRequested):
            if self.refusal(event.role) is not None or (self.serving and event.role == self.role):
                # The worker answers these itself (400, or 200 "already"): our bug to feed one.
                raise LocalProtocolError(f"role_switch: no switch to {event.role!r} from "
                                         f"{self.role!r}")
            if self.serving:
                self.source, self.target, self._drain_s = self.role, event.role, event.drain_s
                self.drain_timed_out, self.reason = False, ""
        elif isinstance(event, ev.RoleStartFailed):
            self.reason = (f"{self.reason}; then {event.reason}" if self.reason
                           else event.reason)
        self._step(trigger, out)
        return out

    def next_deadline(self) -> float | None:
        return self._deadline

    # -- internals ------------------------------------------------------------------------------

    def _step(self, trigger: str, out: list[fx.RoleSwitchEffect]) -> None:
        tr = self.table.step(self.state, trigger)
        if tr is None:
            raise LocalProtocolError(f"role_switch: {self.state} has no row for {trigger}")
        if self.state == _S.DRAINING and tr.target != _S.DRAINING:
            self._deadline = None  # the drain is over, one way or the other
        self.state = tr.target
        for name in tr.effects:
            self._fx[name](out)

    def _count(self, outcome: str) -> None:
        key = (self.source, self.target, outcome)
        self.outcomes[key] = self.outcomes.get(key, 0) + 1

    # -- effects (names from the table) ---------------------------------------------------------

    def _fx_WithdrawRecord(self, out: list[fx.RoleSwitchEffect]) -> None:
        out.append(fx.WithdrawRecord())

    def _fx_RefuseLegs(self, out: list[fx.RoleSwitchEffect]) -> None:
        out.append(fx.RefuseLegs(f"the worker is switching its role from {self.source} to "
                                 f"{self.target}: send the request to another worker"))

    def _fx_ArmDrainDeadline(self, out: list[fx.RoleSwitchEffect]) -> None:
        self._deadline = self._now + self._drain_s

    def _fx_FailInFlight(self, out: list[fx.RoleSwitchEffect]) -> None:
        out.append(fx.FailInFlight(
            f"the worker switched its role from {self.source} to {self.target}: the drain "
            f"timeout ({self._drain_s:g} s) passed with this request in flight"))

    def _fx_StopRole(self, out: list[fx.RoleSwitchEffect]) -> None:
        out.append(fx.StopRole(self.source))

    def _fx_StartRole(self, out: list[fx.RoleSwitchEffect]) -> None:
        out.append(fx.StartRole(self.target, self.epoch + 1))

    def _fx_CommitRole(self, out: list[fx.RoleSwitchEffect]) -> None:
        self.role, self.epoch = self.target, self.epoch + 1
        self._count("switched_after_drain_timeout" if self.drain_timed_out else "switched")

    def _fx_AcceptLegs(self, out: list[fx.RoleSwitchEffect]) -> None:
        if self.role != self.target:  # RESTORING's row: the old role serves again
            self._count("restored")
        out.append(fx.AcceptLegs(self.role, self.epoch))

    def _fx_RestoreRole(self, out: list[fx.RoleSwitchEffect]) -> None:
        out.append(fx.StartRole(self.role, self.epoch, restoring=True, reason=self.reason))

    def _fx_RefuseSwitch(self, out: list[fx.RoleSwitchEffect]) -> None:
        self._count("refused")
        out.append(fx.RefuseSwitch(
            f"a switch from {self.source} to {self.target} is under way ({self.state}): ask "
            "again once the worker serves"))

    def _fx_ExitProcess(self, out: list[fx.RoleSwitchEffect]) -> None:
        self._count("failed")
        out.append(fx.ExitProcess(
            f"switching from {self.role} to {self.target} failed ({self.reason}): the worker "
            "cannot serve any role"))
