"""P's KV hold lease of each room (table kv_hold_lease), for ``PrefillEndpoint``.

P holds a room's KV for D under a lease: granted when the room opens, extended (never shortened)
by D's heartbeats, released with the room; when it expires, the room fails (LeaseExpired) and
its KV is freed without D. A machine of its own per room, stepped beside the room's kv_sender
machine: kv_sender's GrantLease and ReleaseLease feed it, its ExpireRoom feeds kv_sender back
(through the endpoint's ``expired``). Its expiries are the endpoint's room deadlines.
"""

from __future__ import annotations

from collections.abc import Callable

from pd_fsm.core import effects as fx
from pd_fsm.core.config import LeaseConfig
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.prefill_room import SenderRoom
from pd_fsm.core.rooms import Cause
from pd_fsm.core.tables import KV_HOLD_LEASE
from pd_fsm.core.timers import DeadlineHeap

_Fx = fx.PrefillEffect

_LEASE = KV_HOLD_LEASE.transitions

# The endpoint's answer to an expired lease: fail the room (room, now, out, reason).
Expired = Callable[[SenderRoom, float, list[_Fx], str], None]


class Leases:
    table = KV_HOLD_LEASE

    def __init__(self, config: LeaseConfig, timers: DeadlineHeap[int], expired: Expired) -> None:
        self.config = config
        self._timers = timers  # the endpoint's room deadlines: on P, the leases' expiries
        self._expired = expired
        self._fx = bind_effects(self, KV_HOLD_LEASE)

    def step(self, r: SenderRoom, trigger: str, now: float, out: list[_Fx]) -> None:
        """Step the room's kv_hold_lease machine and run its row's effects."""
        tr = _LEASE.get((r.lease, trigger))
        if tr is None:
            raise LocalProtocolError(
                f"kv_hold_lease: room {r.room} in {r.lease} has no row for {trigger}"
            )
        r.lease = tr.target
        for name in tr.effects:
            self._fx[name](r, now, out, Cause(trigger))

    def set_expiry(self, r: SenderRoom, when: float) -> None:
        r.expires_at = when
        self._timers.set(r.room, when)

    # -- effects of kv_hold_lease -------------------------------------------------------------

    def _fx_SetExpiry(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        self.set_expiry(r, now + self.config.initial)

    def _fx_ExtendExpiry(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        expiry = now + self.config.extension  # never shorter: max(old, now + extension)
        if expiry > r.expires_at:
            self.set_expiry(r, expiry)

    def _fx_ExpireRoom(self, r: SenderRoom, now: float, out: list[_Fx], cause: Cause) -> None:
        self._expired(r, now, out, f"KV hold lease expired at {r.expires_at:.3f}: no heartbeat "
                                   "from D")
