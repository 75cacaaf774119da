"""`pd-fsm cluster` on a TPU host: each worker's `serve --tpu-chips` (the default split, chips
given per role and shared by its workers), every such command line one serve takes with exactly
the environment of its chips, the splits that do not fit refused before anything starts, and the
TPU chips each Ray actor asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.local import main, plan
from pd_fsm.io_trio.cluster.tpu_placement import host_named, placement
from pd_fsm.io_trio.cluster.tpu_roles import chip_plan, ray_tpu_requests
from pd_fsm.io_trio.worker.config import config_from_args


def _args(*flags: str) -> Any:
    return build_parser(["cluster"]).parse_args(["cluster", "--model", "tiny", *flags])


def _workers(*flags: str) -> dict[str, list[str]]:
    return {c.name: c.argv for c in plan(_args(*flags)) if c.argv[3] == "serve"}


def _flag(argv: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` (the one argparse keeps)."""
    at = max((i for i, arg in enumerate(argv) if arg == flag), default=None)
    return None if at is None else argv[at + 1]


def _served(argv: list[str]) -> Any:
    """What serve makes of a worker's command line (the runner's flags must be serve's)."""
    return config_from_args(build_parser(["serve"]).parse_args(argv[3:]))


def test_p_and_d_split_the_host_by_default_and_serve_takes_their_chips() -> None:
    workers = _workers("--tpu-host", "v6e-8")
    assert set(workers) == {"prefill-0", "decode-0"}
    for name, chips, port in (("prefill-0", "0,1,2,3", "8476"), ("decode-0", "4,5,6,7", "8480")):
        argv = workers[name]
        assert (_flag(argv, "--tpu-chips"), _flag(argv, "--tpu-host"), _flag(argv, "--tp")) == (
            chips, "v6e-8", "4")
        config = _served(argv)
        assert config.tp_size == 4
        assert config.tpu.env()["TPU_VISIBLE_CHIPS"] == chips
        assert config.tpu.env()["TPU_PROCESS_PORT"] == port


def test_each_role_s_chips_are_shared_in_order_by_its_workers() -> None:
    workers = _workers("--tpu-host", "v6e-8", "--prefill", "2", "--prefill-chips", "0-3",
                       "--decode-chips", "4-5", "--decode-tp", "2", "--colocated",
                       "--colocated-chips", "6")
    chips = {name: _flag(argv, "--tpu-chips") for name, argv in workers.items()}
    assert chips == {"prefill-0": "0,1", "prefill-1": "2,3", "decode-0": "4,5",
                     "colocated": "6"}
    assert {name: _served(argv).tp_size for name, argv in workers.items()} == {
        "prefill-0": 2, "prefill-1": 2, "decode-0": 2, "colocated": 1}
    assert _served(workers["colocated"]).tpu == placement("6", host_named("v6e-8"))


def test_a_role_on_the_cpu_and_a_host_found_on_its_own(tmp_path: Path) -> None:
    none = _workers("--tpu-host", "v5e-4", "--prefill-chips", "0-3", "--decode-chips", "none")
    assert _flag(none["decode-0"], "--tpu-chips") == "none"
    assert _served(none["decode-0"]).tpu.env() == {"JAX_PLATFORMS": "cpu"}
    assert _flag(none["prefill-0"], "--tp") == "4"
    found = chip_plan(_args("--tpu-host", "auto"), {"TPU_ACCELERATOR_TYPE": "v5litepod-4"},
                      tmp_path)
    assert found is not None and found.workers == {"prefill": [frozenset({0, 1})],
                                                   "decode": [frozenset({2, 3})]}
    assert found.describe() == "TPU chips of this v5e-4 (4 chips, 2x2): prefill 0-1; decode 2-3"


def test_no_tpu_host_and_a_lone_worker_change_nothing(tmp_path: Path) -> None:
    assert chip_plan(_args(), {}, tmp_path) is None  # no TPU here, none named
    alone = _args("--prefill", "0", "--decode", "0", "--colocated")
    assert chip_plan(alone, {"TPU_ACCELERATOR_TYPE": "v6e-8"}, tmp_path) is None  # every chip


@pytest.mark.parametrize(("flags", "reason"), [
    (["--prefill-chips", "0-3", "--decode-chips", "2-3"],
     "chip 2 is given to both prefill-0 and decode-0"),
    (["--prefill-chips", "0-3", "--decode-chips", "8"], "has chips 0-7, not 8"),
    (["--prefill-chips", "0-2", "--decode-chips", "4-7"], "--prefill-chips 0-2 is not a sub-mesh"),
    (["--prefill", "2", "--prefill-chips", "0-5", "--decode-chips", "6-7"],
     "--prefill-chips (a worker's share) 0-2 is not a sub-mesh"),
    (["--prefill", "3"], "--prefill-chips 0-3: 4 chips do not split evenly into 3 workers"),
    (["--decode-chips", "4-7"], "give both --prefill-chips and --decode-chips, or neither"),
    (["--colocated"], "--colocated-chips: beside other workers on this v6e-8"),
    (["--decode-tp", "2"], "--decode-tp 2 does not match the 4 chip(s) each decode worker opens"),
    (["--prefill-nnodes", "2", "--prefill-tp", "2"], "--ROLE-nnodes on one TPU host"),
    (["--max-workers", "3"], "--max-workers on a TPU host"),
    (["--prefill-tpu", "4"], "--prefill-tpu / --decode-tpu / --colocated-tpu are for --ray"),
    (["--ray", "--prefill-chips", "0-3"], "--prefill-chips: on Ray the chips are Ray's"),
    (["--ray", "--decode-tpu", "3"], "--decode-tpu 3: Ray gives 1, 2, 4 or 8 TPU chips"),
])
def test_splits_that_do_not_fit_are_refused_before_anything_starts(
        flags: list[str], reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_args("--tpu-host", "v6e-8", *flags)) == 2
    assert reason in capsys.readouterr().err


def test_chips_on_a_host_with_no_tpu_name_the_flag(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TPU_ACCELERATOR_TYPE", raising=False)
    assert main(_args("--prefill-chips", "0", "--decode-chips", "1")) == 2
    assert "no TPU found on this host" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ Ray

def _node(ip: str, tpu: int = 0, **resources: float) -> dict[str, Any]:
    return {"NodeManagerAddress": ip, "Alive": True,
            "Resources": {"CPU": 8.0, **({"TPU": float(tpu)} if tpu else {}), **resources}}


def _specs(prefill: str = "10.0.0.1", decode: str = "10.0.0.1",
           colocated: str = "10.0.0.1") -> dict[str, list[str]]:
    return {"prefill": prefill.split(","), "decode": decode.split(","),
            "colocated": colocated.split(",")}


@pytest.mark.parametrize(("flags", "specs", "nodes", "asked"), [
    # P and D on one v6e-8 node: half each (RFC-2 §4.5's split, Ray's ids 0-3 and 4-7).
    ([], _specs(), [_node("10.0.0.1", 8)], {"prefill": 4, "decode": 4, "colocated": 0}),
    # Each alone on its node: every chip of it; a node without TPU: none.
    ([], _specs(decode="10.0.0.2"), [_node("10.0.0.1", 8), _node("10.0.0.2")],
     {"prefill": 8, "decode": 0, "colocated": 0}),
    (["--prefill", "2", "--decode", "2"], _specs(), [_node("10.0.0.1", 8)],
     {"prefill": 2, "decode": 2, "colocated": 0}),
    (["--colocated"], _specs(), [_node("10.0.0.1", 8)],
     {"prefill": 2, "decode": 2, "colocated": 2}),  # 8 chips for 3: a pair each
    (["--decode-tpu", "1"], _specs(), [_node("10.0.0.1", 8)],
     {"prefill": 4, "decode": 1, "colocated": 0}),
    ([], _specs(prefill="resource:hostA", decode="resource:hostB"),
     [_node("10.0.0.1", 4, hostA=1), _node("10.0.0.2", 4, hostB=1)],
     {"prefill": 4, "decode": 4, "colocated": 0}),
    (["--prefill", "2"], _specs(prefill="10.0.0.1,10.0.0.2", decode="10.0.0.2"),
     [_node("10.0.0.1", 8), _node("10.0.0.2", 4)],
     {"prefill": 2, "decode": 2, "colocated": 0}),  # the fewest of its workers' shares
])
def test_ray_actors_ask_for_their_share_of_their_node_s_chips(
        flags: list[str], specs: dict[str, list[str]], nodes: list[dict[str, Any]],
        asked: dict[str, int]) -> None:
    assert ray_tpu_requests(_args("--ray", *flags), specs, nodes) == asked


def test_ray_refuses_a_node_whose_chips_do_not_go_round() -> None:
    with pytest.raises(ValueError, match=r"node 10\.0\.0\.1 has 4 TPU chip\(s\) for 5 workers"):
        ray_tpu_requests(_args("--ray", "--prefill", "3", "--decode", "2"), _specs(),
                         [_node("10.0.0.1", 4)])
