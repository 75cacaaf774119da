"""Schedulers: the colocated one, and (built from mixins) the prefill and decode ones."""

from pd_fsm.schedulers.args import DISAGGREGATION_MODES, SchedulerArgs
from pd_fsm.schedulers.factory import make_scheduler
from pd_fsm.schedulers.request import FinishReason, Req, ReqState, RequestOutput
from pd_fsm.schedulers.scheduler import (
    DecodeBatch,
    KVPoolHolder,
    KVPoolRef,
    PrefillBatch,
    PrefillRow,
    Scheduler,
    SchedulerStats,
)

__all__ = [
    "DISAGGREGATION_MODES",
    "DecodeBatch",
    "FinishReason",
    "KVPoolHolder",
    "KVPoolRef",
    "PrefillBatch",
    "PrefillRow",
    "Req",
    "ReqState",
    "RequestOutput",
    "Scheduler",
    "SchedulerArgs",
    "SchedulerStats",
    "make_scheduler",
]
