"""``make_scheduler(args)``: the scheduler class for a disaggregation mode (RFC-2 §5.4)."""

from __future__ import annotations

from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.scheduler import Scheduler


def make_scheduler(args: SchedulerArgs, *, model: LoadedModel | None = None) -> Scheduler:
    if args.disaggregation_mode == "null":
        return Scheduler(args, model=model)
    if args.disaggregation_mode in ("prefill", "decode"):
        raise ValueError(
            f"disaggregation_mode={args.disaggregation_mode!r}: the "
            f"{args.disaggregation_mode} scheduler is not built yet (only 'null', colocated)"
        )
    raise ValueError(f"unknown disaggregation_mode {args.disaggregation_mode!r}")
