"""What a PD scheduler offers its worker beyond the colocated scheduler's API, over the role it
holds (``self.role``): RFC-2 §5.4's mixins are these views plus the role objects behind them.

Nothing here overrides the scheduler: the role's behaviour is the role's (prefill.py,
decode.py), called by the scheduler at its named points (schedulers/role.py); these only pass the
worker's calls on.
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

from pd_fsm.core import effects as fx
from pd_fsm.jax_engine.kv.pool_spec import KVArgs
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import PDLink, warm_kv_copies
from pd_fsm.schedulers.role import SchedulerRole
from pd_fsm.schedulers.scheduler import Scheduler


class PDRole(SchedulerRole, Protocol):
    # Any: the view passes events on unread; each role's own ``deliver`` takes its event union.
    link: PDLink[Any, Any]
    engine: KVTransferEngine
    kv_args: KVArgs
    kv_copy: str  # which side of a room's KV copy the role runs: "gather" (P), "scatter" (D)

    def step_started(self) -> list[fx.BusyEffect]: ...

    def step_ended(self) -> None: ...

    def next_deadline(self) -> float | None: ...


R = TypeVar("R", bound=PDRole)


class DisaggregationCommon(Scheduler, Generic[R]):
    args: DisaggregationArgs  # P's and D's constructors take these (Scheduler stores them)
    role: R

    @property
    def engine(self) -> KVTransferEngine:
        return self.role.engine

    @property
    def kv_args(self) -> KVArgs:
        return self.role.kv_args

    @property
    def layout_hash(self) -> str:
        return self.role.kv_args.layout_hash

    @property
    def KV_COPY(self) -> str:  # the name the worker reads
        return self.role.kv_copy

    def warm_kv_copies(self) -> int:
        """Compile this role's KV copy for every page bucket a prompt can need; how many
        executables that compiled."""
        return warm_kv_copies(self, self.role.kv_args, self.role.kv_copy)

    def step_started(self) -> list[fx.BusyEffect]:
        """Tell the core a step starts: what the I/O side must do until :meth:`step_ended` to
        keep peers from taking this busy worker for a dead one."""
        return self.role.step_started()

    def step_ended(self) -> None:
        self.role.step_ended()

    def take_outbox(self) -> list[fx.IOEffect]:
        """Effects only the I/O layer can carry out (SendMessage, ResolvePeer), in order."""
        return self.role.link.take_outbox()

    def next_deadline(self) -> float | None:
        """When (on the role's clock) the core next needs ``deliver(TimeAdvanced())``."""
        return self.role.next_deadline()

    def pop_failure(self, rid: str) -> tuple[int, str] | None:
        return self.role.link.failures.pop(rid, None)

    def take_phase_samples(self) -> list[tuple[str, float]]:
        """``(phase key, value)`` samples since the last call (the worker observes them)."""
        return self.role.link.phases.take()

    def pd_stats(self) -> dict[str, int]:
        """KVPoll state counts and the endpoint's counters, for /metrics."""
        return self.role.link.pd_stats()
