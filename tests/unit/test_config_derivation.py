"""One source for configuration (issue 29 §5): every `pd-fsm serve` flag reaches a ServeConfig
field and every field is set from a flag, and the objects built from ServeConfig —
SchedulerArgs, DisaggregationArgs, then the core's DecodeConfig and LeaseConfig — take each
field by name (``same_named``) except the few their builders name. A field added on either side
fails here until it is matched by name, named by its builder, or listed as left at its
default."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.io_trio.flag_spec import config_default, parse_type, unaccounted
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.flag_hooks import SERVE_HOOKS
from pd_fsm.io_trio.worker.flags import SERVE_FLAGS
from pd_fsm.io_trio.worker.pd_backends import disaggregation_args
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.disaggregation import DisaggregationArgs


def _unmatched(source: type[Any], target: type[Any], prefix: str = "") -> set[str]:
    """``target``'s fields that ``same_named`` finds no field of ``source`` for."""
    have = attrs.fields_dict(source)
    return {f.name for f in attrs.fields(target)
            if f.name not in have and prefix + f.name not in have}


def test_every_flag_sets_a_field_and_every_field_is_set() -> None:
    assert unaccounted(SERVE_FLAGS, SERVE_HOOKS, ServeConfig) == []


def test_flag_names_and_dests_are_unique() -> None:
    names = [name for flag in SERVE_FLAGS for name in flag.names]
    assert len(names) == len(set(names))
    dests = [flag.dest for flag in SERVE_FLAGS]
    assert len(dests) == len(set(dests))


@pytest.mark.parametrize("flag", SERVE_FLAGS, ids=lambda flag: flag.name)
def test_each_flag_has_a_parse_type_and_a_switch_is_off_by_default(flag: Any) -> None:
    if parse_type(flag, ServeConfig) is bool:
        assert config_default(flag, ServeConfig) is False  # store_true cannot turn a thing off


def test_scheduler_args_are_serve_config_fields_by_name() -> None:
    assert _unmatched(ServeConfig, SchedulerArgs) == set()


def test_disaggregation_args_are_matched_by_name_or_named_by_their_builder() -> None:
    # Named in pd_backends.disaggregation_args (they differ), or left at the default: no flag
    # sets resolve_timeout.
    assert _unmatched(ServeConfig, DisaggregationArgs, "disaggregation_") == {
        "transfer_host", "heartbeat_interval", "pull_thread_nice", "resolve_timeout"}


def test_the_core_configs_are_disaggregation_args_by_name() -> None:
    # No flag sets these: the core's own defaults.
    assert _unmatched(DisaggregationArgs, DecodeConfig) == {"heartbeat_misses",
                                                             "recently_finished"}
    assert _unmatched(DisaggregationArgs, LeaseConfig, "lease_") == {"recently_finished"}


def test_values_travel_from_serve_config_to_the_core_configs() -> None:
    config = ServeConfig(
        model="tiny", disaggregation_mode="decode", host="10.0.0.1", port=5, tp_size=2,
        radix_cache=False, decode_radix_cache=True, disaggregation_lease_initial=1.0,
        disaggregation_lease_extension=2.0, disaggregation_peer_timeout=3.0,
        disaggregation_ready_timeout=4.0, disaggregation_transfer_timeout=50.0,
        disaggregation_pull_deadline=6.0, disaggregation_queue_timeout=7.0,
        disaggregation_bootstrap_heartbeat_interval=0.5, disaggregation_failure_policy="recompute",
        transfer_nice=-3, disaggregation_pull_workers=9,
    )
    args = disaggregation_args(config)
    assert (args.model, args.tp_size, args.radix_cache) == ("tiny", 2, True)  # D's own cache
    assert (args.instance_id, args.transfer_host) == ("decode-10.0.0.1-5", "10.0.0.1")
    assert (args.pull_deadline, args.pull_workers, args.pull_thread_nice) == (6.0, 9, -3)
    assert args.failure_policy == "recompute"
    assert args.decode_config() == DecodeConfig(
        heartbeat_interval=0.5, peer_timeout=3.0, queue_timeout=7.0, ready_timeout=4.0,
        transfer_timeout=50.0)
    assert args.lease_config() == LeaseConfig(initial=1.0, extension=2.0)
