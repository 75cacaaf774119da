"""Every owner of effects in the core, with the parts it runs some of them through and the tables
whose effects it runs (for ``pd-fsm spec check``, which holds each against
``dispatch.handler_problems``).

Its own module because it names the owners: they import ``dispatch`` to bind their handlers, so
the list cannot live there without an import circle.
"""

from __future__ import annotations

from pd_fsm.core.breakers import WorkerBreakers
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.core.prefill_lease import Leases
from pd_fsm.core.registry import BootstrapRegistry
from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.session import ProxySession, SequenceSession
from pd_fsm.core.tables import StateTable


def core_machines() -> list[tuple[type, tuple[type, ...], tuple[StateTable, ...]]]:
    """Every owner in the core with its parts and the tables whose effects they run."""
    return [
        (PrefillEndpoint, PrefillEndpoint.effect_parts, (PrefillEndpoint.table,)),
        (Leases, (), (Leases.table,)),
        (DecodeEndpoint, DecodeEndpoint.effect_parts, (DecodeEndpoint.table,)),
        (BootstrapRegistry, (), (BootstrapRegistry.table,)),
        (RoomRouter, (), (RoomRouter.table,)),
        (WorkerBreakers, (), (WorkerBreakers.table,)),
        (ProxySession, (), (ProxySession.table,)),
        (SequenceSession, (), (SequenceSession.table,)),
        (HandoffLedger, (), (HandoffLedger.table,)),
        (RoleSwitch, (), (RoleSwitch.table,)),
    ]
