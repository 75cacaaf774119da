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


def test_nice_is_every_later_thread_s() -> None:
    # In a child (the runner keeps its priority): threads started after set_nice, as XLA's pools
    # are, run at its value too; Linux keeps nice per thread.
    code = ("import os, threading; from pd_fsm.io_trio.cluster.cpu_placement import set_nice; "
            "print(set_nice(7)); seen = []; "
            "t = threading.Thread(target=lambda: seen.append("
            "os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))); "
            "t.start(); t.join(); print(seen[0])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["7", "7"]


@pytest.mark.parametrize("nice", [-21, 20])
def test_nice_out_of_range_is_refused(nice: int) -> None:
    from pd_fsm.io_trio.cluster.cpu_placement import set_nice

    with pytest.raises(ValueError, match=f"--nice {nice}"):
        set_nice(nice)


def test_cluster_gives_each_role_its_priority() -> None:
    args = build_parser().parse_args(["cluster", "--model", "tiny", "--colocated",
                                      "--prefill-nice", "10", "--decode-nice", "-5"])
    argv = {child.name: child.argv for child in plan(args)}

    def nice(name: str) -> str | None:
        a = argv[name]
        return a[a.index("--nice") + 1] if "--nice" in a else None

    assert (nice("prefill-0"), nice("decode-0"), nice("colocated")) == ("10", "-5", None)
    serve = build_parser(argv["decode-0"][3:]).parse_args(argv["decode-0"][3:])
    assert serve.nice == -5
