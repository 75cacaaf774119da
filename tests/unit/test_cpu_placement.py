"""`--cpus`: core lists parse strictly, pinning really restricts the process (checked in a child
process, so the test runner keeps its cores), and the cluster runner passes each role's list."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.cluster.local import plan


@pytest.mark.parametrize(("spec", "cpus"), [
    ("0", {0}), ("0-1", {0, 1}), ("0,2,4-5", {0, 2, 4, 5}), (" 1 , 3 ", {1, 3}),
])
def test_parse(spec: str, cpus: set[int]) -> None:
    assert parse_cpus(spec) == cpus


@pytest.mark.parametrize("spec", ["", "a", "1-", "3-1", "-1", "0,,1", "1.5"])
def test_parse_refuses(spec: str) -> None:
    with pytest.raises(ValueError, match="--cpus"):
        parse_cpus(spec)


def test_pinning_restricts_the_process() -> None:
    first = min(os.sched_getaffinity(0))
    code = ("import os; from pd_fsm.io_trio.cluster.cpu_placement import pin_to; "
            f"print(sorted(pin_to(frozenset({{{first}}}))), sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"[{first}]", f"[{first}]"]
    missing = max(os.sched_getaffinity(0)) + 64
    code = ("from pd_fsm.io_trio.cluster.cpu_placement import pin_to; "
            f"pin_to(frozenset({{{missing}}}))")
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert bad.returncode != 0 and "not available here" in bad.stderr


def test_cluster_pins_each_role() -> None:
    args = build_parser().parse_args(["cluster", "--model", "tiny", "--colocated",
                                      "--prefill-cpus", "0", "--decode-cpus", "1",
                                      "--colocated-cpus", "0-1"])
    argv = {child.name: child.argv for child in plan(args)}

    def cpus(name: str) -> str | None:
        a = argv[name]
        return a[a.index("--cpus") + 1] if "--cpus" in a else None

    assert (cpus("prefill-0"), cpus("decode-0"), cpus("colocated")) == ("0", "1", "0-1")
    assert "--cpus" not in argv["bootstrap"] and "--cpus" not in argv["proxy"]
