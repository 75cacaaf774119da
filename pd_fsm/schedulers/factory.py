"""``make_scheduler(args)``: the scheduler class for a disaggregation mode (RFC-2 §5.4)."""

from __future__ import annotations

import attrs

from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.scheduler import Scheduler


def make_scheduler(args: SchedulerArgs, *, model: LoadedModel | None = None) -> Scheduler:
    if args.disaggregation_mode == "null":
        return Scheduler(args, model=model)
    if args.disaggregation_mode in ("prefill", "decode"):
        # Imported here: the PD schedulers bring the transfer engine, the colocated one does not.
        from pd_fsm.schedulers.disaggregation import (
            DecodeScheduler,
            DisaggregationArgs,
            PrefillScheduler,
        )

        if not isinstance(args, DisaggregationArgs):
            fields = attrs.asdict(args, recurse=False)
            args = DisaggregationArgs(**fields)
        if args.disaggregation_mode == "prefill":
            return PrefillScheduler(args, model=model)
        return DecodeScheduler(args, model=model)
    raise ValueError(f"unknown disaggregation_mode {args.disaggregation_mode!r}")
