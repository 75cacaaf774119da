"""Schedulers: the colocated one, and (built from mixins) the prefill and decode ones."""

from pd_fsm.schedulers.args import DISAGGREGATION_MODES, SchedulerArgs
from pd_fsm.schedulers.factory import make_scheduler
from pd_fsm.schedulers.request import FinishReason, Req, ReqState, RequestOutput
from pd_fsm.schedulers.scheduler import (
    MAIN_KV,
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
    "FinishReason",
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
