"""KV corrupted in flight, for tests: a decode scheduler whose real transfer engine hands the
pull executor a damaged copy of what it pulled (``pd_fsm.sim.real.corrupted``) for the next
``corrupt`` pulls (-1: every pull). Everything else is the real engine's: the transfer server,
the one-shot registrations on P, the deadlines."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from pd_fsm.jax_engine.transfer.base import KVTransferEngine, PendingPull, ReleaseResult
from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine
from pd_fsm.schedulers.disaggregation import DecodeScheduler, DisaggregationArgs
from pd_fsm.sim.real import corrupted


class _Damaged(PendingPull):
    def __init__(self, inner: PendingPull, garbage: bool) -> None:
        self.inner, self.garbage = inner, garbage
        self.peer, self.uuid, self.arrays = inner.peer, inner.uuid, []

    def wait(self) -> None:
        self.inner.wait()
        first, *rest = self.inner.arrays
        self.arrays = [corrupted(first, self.garbage), *rest]


class CorruptingEngine(KVTransferEngine):
    def __init__(self, inner: KVTransferEngine) -> None:
        self.inner = inner
        self.corrupt = 0  # the next pulls to damage; -1: all
        self.garbage = False  # damage a whole page instead of flipping one bit
        self.pulls = 0

    @property
    def address(self) -> str:
        return self.inner.address

    def register(self, uuid: int, arrays: Sequence[jax.Array], lease_s: float) -> None:
        self.inner.register(uuid, arrays, lease_s)

    def extend_lease(self, uuid: int, lease_s: float) -> bool:
        return self.inner.extend_lease(uuid, lease_s)

    def release(self, uuid: int, reason: str) -> ReleaseResult:
        return self.inner.release(uuid, reason)

    def reap_expired(self) -> list[ReleaseResult]:
        return self.inner.reap_expired()

    def registrations(self) -> Mapping[int, int]:
        return self.inner.registrations()

    def start_pull(
        self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct], deadline_s: float
    ) -> PendingPull:
        self.pulls += 1
        pending = self.inner.start_pull(peer, uuid, specs, deadline_s)
        if self.corrupt == 0:
            return pending
        if self.corrupt > 0:
            self.corrupt -= 1
        return _Damaged(pending, self.garbage)

    def drop_connection(self, peer: str, reason: str) -> None:
        self.inner.drop_connection(peer, reason)

    def close(self) -> None:
        self.inner.close()


class CorruptingDecode(DecodeScheduler):
    """A ``DecodeScheduler`` on a :class:`CorruptingEngine` (``self.role.engine``)."""


    def __init__(self, args: DisaggregationArgs, **kw: Any) -> None:
        engine = CorruptingEngine(JaxTransferKVEngine(args.transfer_host, reaper_interval_s=None))
        super().__init__(args, engine=engine, **kw)
