"""What a PD scheduler's role offers the worker that embeds it (``PDRole``), and the scheduler
that holds one (``DisaggregationCommon``, the base of RFC-2 §5.4's mixins).

Two layers: the role (prefill.py, decode.py) owns the core link and plans, the worker does the
I/O. The worker calls the role (``sched.role``) and reads its books there; the scheduler calls
the role at its named points (schedulers/role.py). Nothing here passes calls on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Generic, Protocol, TypeVar

from pd_fsm.core import effects as fx
from pd_fsm.jax_engine.kv.pool_spec import KVArgs
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import PDLink
from pd_fsm.schedulers.role import SchedulerRole
from pd_fsm.schedulers.scheduler import Scheduler


class PDRole(SchedulerRole, Protocol):
    # Any: the worker passes events on unread; each role's own ``deliver`` takes its event union.
    link: PDLink[Any, Any]
    engine: KVTransferEngine
    kv_args: KVArgs
    kv_copy: str  # which side of a room's KV copy the role runs: "gather" (P), "scatter" (D)
    held_pages: dict[int, list[int]]  # rooms whose pages stay held once their leg answered

    @property
    def transfer_stats(self) -> Mapping[str, float]: ...

    def deliver(self, event: Any, now: float | None = None) -> None:
        """Feed an event from the I/O layer into the core at ``now`` (when it happened on the
        role's clock; default now). A message that arrived while a forward step ran is
        delivered with its arrival time, so that a heartbeat received in time extends a lease
        before the lease's expiry is judged."""

    def step_started(self) -> list[fx.BusyEffect]:
        """Tell the core a step starts: what the I/O side must do until :meth:`step_ended` to
        keep peers from taking this busy worker for a dead one."""

    def step_ended(self) -> None: ...

    def next_deadline(self) -> float | None:
        """When (on the role's clock) the core next needs ``deliver(TimeAdvanced())``."""

    def close(self) -> None:
        """What the role closes of its own (D: the pull threads), before the engine."""


R = TypeVar("R", bound=PDRole)


class DisaggregationCommon(Scheduler, Generic[R]):
    """The colocated scheduler holding a PD role (``self.role``), which is its PD API: the
    worker's adapters and the simulator's real workers call the role."""

    args: DisaggregationArgs  # P's and D's constructors take these (Scheduler stores them)
    role: R
