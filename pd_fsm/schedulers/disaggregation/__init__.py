"""Prefill and decode schedulers, built from mixins over the colocated Scheduler (RFC-2 §5.4)."""

from pd_fsm.schedulers.disaggregation.args import FAILURE_POLICIES, DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import DuplicateRoomError
from pd_fsm.schedulers.disaggregation.decode import (
    DecodeScheduler,
    SchedulerDisaggregationDecodeMixin,
)
from pd_fsm.schedulers.disaggregation.prefill import (
    PrefillScheduler,
    SchedulerDisaggregationPrefillMixin,
)

__all__ = [
    "FAILURE_POLICIES",
    "DecodeScheduler",
    "DisaggregationArgs",
    "DuplicateRoomError",
    "PrefillScheduler",
    "SchedulerDisaggregationDecodeMixin",
    "SchedulerDisaggregationPrefillMixin",
]
