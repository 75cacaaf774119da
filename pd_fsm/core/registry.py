"""BootstrapRegistry: the instance table behind the bootstrap server (table instance_lease).

Keys are ``(role, instance_id, tp_rank, cp_rank, dp_rank, pp_rank)``. Records are opaque to the
core (the adapter validates and serialises them); the registry only needs the address an
instance is known by to routers (``advertised``, "host:port") to answer D's lookup by
``bootstrap_host``/``bootstrap_port``. No persistence: a restarted registry is refilled by the
next heartbeats (each answered "register again").
"""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import RegistryConfig
from pd_fsm.core.dispatch import bind_effects
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.tables import INSTANCE_LEASE
from pd_fsm.core.timers import DeadlineHeap

# The table's names as attributes (tables.Names): never spelled as strings here.
_S, _T = INSTANCE_LEASE.S, INSTANCE_LEASE.T

InstanceKey = ev.InstanceKey
Rec = TypeVar("Rec")  # the adapter's record type (pd_fsm.io_trio.bootstrap.records.InstanceRecord)


@attrs.frozen(slots=True)
class RegistrationRequired:
    """Effect: answer 404, the instance must register (PUT /route) again."""

    key: InstanceKey


@attrs.frozen(slots=True)
class Acknowledged:
    """Effect: the write was applied; ``expires_at`` is the instance's new TTL deadline."""

    key: InstanceKey
    expires_at: float


# What the registry's ``handle`` returns.
RegistryEffect = RegistrationRequired | Acknowledged | fx.InstanceExpired[Rec]


@attrs.define(slots=True)
class _Instance(Generic[Rec]):
    key: InstanceKey
    state: str
    record: Rec | None = None
    advertised: str | None = None
    expires_at: float = 0.0
    ttl: float | None = None  # the instance's own, when it named one


class BootstrapRegistry(Generic[Rec]):
    table = INSTANCE_LEASE

    def __init__(self, config: RegistryConfig | None = None) -> None:
        self.config = config or RegistryConfig()
        self._instances: dict[InstanceKey, _Instance[Rec]] = {}
        self._by_advertised: dict[str, set[InstanceKey]] = {}
        self._timers: DeadlineHeap[InstanceKey] = DeadlineHeap()
        self.expired_total = 0
        self._fx = bind_effects(self, self.table)

    # -- entry point --------------------------------------------------------------------------

    def handle(self, event: ev.RegistryEvent[Rec], now: float) -> list[RegistryEffect[Rec]]:
        out: list[RegistryEffect[Rec]] = []
        for key in self._timers.pop_due(now):
            inst = self._instances[key]
            self._step(inst, _T.Expired, now, out, None)
        match event:
            case ev.InstanceRegistered():
                self._step(self._get(event.key), _T.Registered, now, out, event)
            case ev.InstanceHeartbeat():
                self._step(self._get(event.key), _T.HeartbeatReceived, now, out, None)
            case ev.InstanceDeregistered():
                self._step(self._get(event.key), _T.Deregistered, now, out, None)
            case ev.TimeAdvanced():
                pass
            case _:
                raise LocalProtocolError(
                    f"BootstrapRegistry cannot handle {type(event).__name__}"
                )
        return out

    def next_deadline(self) -> float | None:
        return self._timers.next_deadline()

    # -- queries ------------------------------------------------------------------------------

    def state_of(self, key: InstanceKey) -> str:
        inst = self._instances.get(key)
        return inst.state if inst is not None else self.table.initial

    def lookup(self, key: InstanceKey) -> Rec | None:
        inst = self._instances.get(key)
        return inst.record if inst is not None else None

    def expires_at(self, key: InstanceKey) -> float | None:
        inst = self._instances.get(key)
        return inst.expires_at if inst is not None else None

    def ttl_of(self, key: InstanceKey) -> float:
        """The instance's own TTL if it named one at registration, else the registry's."""
        inst = self._instances.get(key)
        return inst.ttl if inst is not None and inst.ttl is not None else self.config.ttl

    def instances(self, role: str | None = None) -> list[Rec]:
        return [
            i.record for k, i in sorted(self._instances.items())
            if (role is None or k[0] == role) and i.record is not None
        ]

    def resolve(self, advertised: str, role: str = "prefill") -> list[tuple[InstanceKey, Rec]]:
        """Instances of ``role`` known to routers as ``advertised`` ("host:port"), by key."""
        keys = self._by_advertised.get(advertised, ())
        found = [(k, self._instances[k].record) for k in sorted(keys) if k[0] == role]
        return [(k, record) for k, record in found if record is not None]

    def __len__(self) -> int:
        return len(self._instances)

    # -- stepping -----------------------------------------------------------------------------

    def _get(self, key: InstanceKey) -> _Instance[Rec]:
        return self._instances.get(key) or _Instance(key, self.table.initial)

    def _step(
        self,
        inst: _Instance[Rec],
        trigger: str,
        now: float,
        out: list[RegistryEffect[Rec]],
        e: ev.InstanceRegistered[Rec] | None,
    ) -> None:
        tr = self.table.step(inst.state, trigger)
        if tr is None:
            raise LocalProtocolError(f"instance_lease: {inst.state} has no row for {trigger}")
        inst.state = tr.target
        for name in tr.effects:
            self._fx[name](inst, trigger, now, out, e)
        if trigger != _T.Expired and inst.state == _S.ALIVE:
            out.append(Acknowledged(inst.key, inst.expires_at))

    # -- effects (names from the table) --------------------------------------------------------

    def _fx_StoreRecord(self, inst: _Instance[Rec], trigger: str, now: float,
                        out: list[RegistryEffect[Rec]], e: ev.InstanceRegistered[Rec] | None,
                        ) -> None:
        if e is None:
            raise LocalProtocolError(f"instance_lease: StoreRecord on {trigger}, not a write")
        self._unindex(inst)
        inst.record, inst.advertised, inst.ttl = e.record, e.advertised, e.ttl
        self._instances[inst.key] = inst
        if inst.advertised is not None:
            self._by_advertised.setdefault(inst.advertised, set()).add(inst.key)

    def _fx_RefreshTTL(self, inst: _Instance[Rec], trigger: str, now: float,
                       out: list[RegistryEffect[Rec]], e: ev.InstanceRegistered[Rec] | None,
                       ) -> None:
        inst.expires_at = now + self.ttl_of(inst.key)
        self._timers.set(inst.key, inst.expires_at)

    def _fx_DropRecord(self, inst: _Instance[Rec], trigger: str, now: float,
                       out: list[RegistryEffect[Rec]], e: ev.InstanceRegistered[Rec] | None,
                       ) -> None:
        self._unindex(inst)
        self._timers.cancel(inst.key)
        del self._instances[inst.key]
        if trigger == _T.Expired and inst.record is not None:
            self.expired_total += 1
            out.append(fx.InstanceExpired(inst.key, inst.record))

    def _fx_AskToRegister(self, inst: _Instance[Rec], trigger: str, now: float,
                          out: list[RegistryEffect[Rec]], e: ev.InstanceRegistered[Rec] | None,
                          ) -> None:
        out.append(RegistrationRequired(inst.key))

    def _unindex(self, inst: _Instance[Rec]) -> None:
        if inst.advertised is not None:
            keys = self._by_advertised.get(inst.advertised)
            if keys is not None:
                keys.discard(inst.key)
                if not keys:
                    del self._by_advertised[inst.advertised]
