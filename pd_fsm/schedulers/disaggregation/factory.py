"""``make_scheduler(args)``: the scheduler class for a disaggregation mode (RFC-2 §5.4).

It lives beside the PD schedulers, not in the folder above them: that folder's modules are what
these build on, and a module there naming them would close a loop between the two folders."""

from __future__ import annotations

import attrs

from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.decode import DecodeScheduler
from pd_fsm.schedulers.disaggregation.prefill import PrefillScheduler
from pd_fsm.schedulers.scheduler import Scheduler


def make_scheduler(args: SchedulerArgs, *, model: LoadedModel | None = None) -> Scheduler:
    if args.disaggregation_mode == "null":
        return Scheduler(args, model=model)
    if args.disaggregation_mode in ("prefill", "decode"):
        if not isinstance(args, DisaggregationArgs):
            fields = attrs.asdict(args, recurse=False)
            args = DisaggregationArgs(**fields)
        if args.disaggregation_mode == "prefill":
            return PrefillScheduler(args, model=model)
        return DecodeScheduler(args, model=model)
    raise ValueError(f"unknown disaggregation_mode {args.disaggregation_mode!r}")
