"""Schedulers: the colocated one, and (built from mixins) the prefill and decode ones."""

from pd_fsm.schedulers.args import DISAGGREGATION_MODES, SchedulerArgs
from pd_fsm.schedulers.disaggregation.decode import (
    DecodeScheduler,
    SchedulerDisaggregationDecodeMixin,
)
from pd_fsm.schedulers.disaggregation.factory import make_scheduler
from pd_fsm.schedulers.disaggregation.prefill import (
    PrefillScheduler,
    SchedulerDisaggregationPrefillMixin,
)
from pd_fsm.schedulers.model_runner import MAIN_KV
from pd_fsm.schedulers.request import FinishReason, Req, ReqState, RequestOutput
from pd_fsm.schedulers.scheduler import (
    DecodeBatch,
    PrefillBatch,
    PrefillRow,
    Scheduler,
    SchedulerStats,
)

__all__ = [
    "DISAGGREGATION_MODES",
    "MAIN_KV",
    "DecodeBatch",
    "DecodeScheduler",
    "FinishReason",
    "PrefillBatch",
    "PrefillRow",
    "PrefillScheduler",
    "Req",
    "ReqState",
    "RequestOutput",
    "Scheduler",
    "SchedulerArgs",
    "SchedulerDisaggregationDecodeMixin",
    "SchedulerDisaggregationPrefillMixin",
    "SchedulerStats",
    "make_scheduler",
]
