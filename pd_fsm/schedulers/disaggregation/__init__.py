"""Prefill and decode schedulers (RFC-2 §5.4): the colocated Scheduler holding a prefill or decode
role (``PrefillRole``, ``DecodeRole``), which owns the core link and is the PD API
(``sched.role``); the §5.4 mixins and schedulers are the entry that builds one."""

from pd_fsm.schedulers.disaggregation.args import FAILURE_POLICIES, DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import DuplicateRoomError
from pd_fsm.schedulers.disaggregation.decode import (
    DecodeRole,
    DecodeScheduler,
    SchedulerDisaggregationDecodeMixin,
)
from pd_fsm.schedulers.disaggregation.prefill import (
    PrefillRole,
    PrefillScheduler,
    SchedulerDisaggregationPrefillMixin,
)

__all__ = [
    "FAILURE_POLICIES",
    "DecodeRole",
    "DecodeScheduler",
    "DisaggregationArgs",
    "DuplicateRoomError",
    "PrefillRole",
    "PrefillScheduler",
    "SchedulerDisaggregationDecodeMixin",
    "SchedulerDisaggregationPrefillMixin",
]
