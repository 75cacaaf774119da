"""`--cpus` and `--nice`: core lists and per-role priorities parse strictly, pinning and renicing
really act on the process (checked in a child process, so the test runner keeps its cores and
priority), and the cluster runner passes each role's values (D above P by default on shared
cores)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.cpu_placement import may_take_nice, parse_cpus, parse_role_nice
from pd_fsm.io_trio.cluster.local import (
    main,
    narrow_decode,
    pd_cores,
    placement_line,
    plan,
    prefill_nice_steps,
    role_cpus,
    split_cores,
)
from pd_fsm.io_trio.worker.config import config_from_args


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


@pytest.mark.parametrize(("spec", "nices"), [
    ("prefill=10,decode=-5", {"prefill": 10, "decode": -5}), (" null = 0 ", {"null": 0}),
])
def test_parse_role_nice(spec: str, nices: dict[str, int]) -> None:
    assert parse_role_nice(spec) == nices


@pytest.mark.parametrize(("spec", "names"), [
    ("prefill", "not ROLE=N"), ("colocated=1", "not ROLE=N"), ("prefill=x", "not an integer"),
    ("decode=1,decode=2", "decode is named twice"), ("null=20", "not in -20..19"),
])
def test_parse_role_nice_refuses(spec: str, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        parse_role_nice(spec)


def test_renice_moves_the_threads_at_the_old_value_only() -> None:
    # In a child (the runner keeps its priorities): the main thread and a worker thread at the
    # role's value move; a thread given its own value (as the transfer threads are) keeps it.
    code = """
import os, threading
from pd_fsm.io_trio.cluster.cpu_placement import renice_threads, set_nice
set_nice(3)
go, done, seen = threading.Event(), threading.Event(), {}
def worker(name, own):
    tid = threading.get_native_id()
    if own is not None:
        os.setpriority(os.PRIO_PROCESS, tid, own)
    go.wait()
    seen[name] = os.getpriority(os.PRIO_PROCESS, tid)
threads = [threading.Thread(target=worker, args=a) for a in (("pool", None), ("transfer", 12))]
for t in threads: t.start()
import time; time.sleep(0.2)
moved = renice_threads(3, 7)
go.set()
for t in threads: t.join()
later = []
def mine(): later.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
t = threading.Thread(target=mine)
t.start(); t.join()
print(moved, seen["pool"], seen["transfer"], os.getpriority(os.PRIO_PROCESS, 0), later[0])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # Two moved (main, pool); the transfer thread kept 12; a thread started later inherits 7.
    assert out.stdout.split() == ["2", "7", "12", "7", "7"]


def test_a_core_placement_moves_every_thread_within_the_cores_it_had_at_start() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one usable core here ({cores}): nothing to move between")
    # In a child (the runner keeps its cores): a thread started before the move is moved too,
    # one started after inherits; cores outside those at start are refused, nothing moved.
    code = f"""
import os, threading
from pd_fsm.io_trio.cluster.cpu_placement import CorePlacement
go, seen = threading.Event(), {{}}
def pool():
    go.wait()
    seen["pool"] = sorted(os.sched_getaffinity(threading.get_native_id()))
t = threading.Thread(target=pool); t.start()
at_start = frozenset(os.sched_getaffinity(0))
placement = CorePlacement(at_start, at_start)
moved = placement.move_to(frozenset({{{cores[0]}}}), "test")
try:
    placement.move_to(frozenset({{{cores[-1] + 1}}}), "test")
except ValueError as exc:
    refused = str(exc)
go.set(); t.join()
later = []
t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0)))); t.start()
t.join()
print(moved, seen["pool"], later[0], sorted(placement.cpus), refused, sep="|")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    moved, pool, later, now, refused = out.stdout.strip().split("|")
    assert int(moved) >= 2 and pool == later == now == f"[{cores[0]}]"
    assert refused == (f"cores [{cores[-1] + 1}] are not available to this worker (it may use "
                       f"{','.join(map(str, cores))})")


def _serve_nices(extra: list[str]) -> list[str]:
    args = build_parser().parse_args(["cluster", "--model", "tiny", "--colocated", *extra])
    argv = {child.name: child.argv for child in plan(args)}

    def nice(name: str) -> str:
        a = argv[name]
        return a[a.index("--nice") + 1] if "--nice" in a else "-"

    return [nice("prefill-0"), nice("decode-0"), nice("colocated")]


def test_p_and_d_sharing_cores_default_to_d_above_p() -> None:
    # Root (CI) may lower D's priority; elsewhere D stays at 0 and P still steps back.
    d = "-5" if may_take_nice(-5) else "0"
    assert _serve_nices(["--pd-cores", "shared"]) == ["10", d, "-"]
    assert _serve_nices(["--planner"])[:2] == ["10", d]
    # Pinned apart, nothing is shared: no default; a given value always wins.
    assert _serve_nices(["--prefill-cpus", "0", "--decode-cpus", "1"]) == ["-", "-", "-"]
    assert _serve_nices(["--pd-cores", "shared", "--prefill-nice", "0", "--decode-nice", "0"]
                        ) == ["0", "0", "-"]


def test_with_the_planner_each_worker_carries_every_role_s_priority() -> None:
    args = build_parser().parse_args(["cluster", "--model", "tiny", "--planner",
                                      "--prefill-nice", "10", "--decode-nice", "-5",
                                      "--colocated-nice", "1"])
    argv = {child.name: child.argv for child in plan(args)}
    for name, start in (("prefill-0", "10"), ("decode-0", "-5")):
        a = argv[name]
        assert a[a.index("--role-nice") + 1] == "prefill=10,decode=-5,null=1", a
        serve = build_parser(a[3:]).parse_args(a[3:])
        config = config_from_args(serve)
        assert str(config.nice_of(config.disaggregation_mode)) == start
        assert config.nice_of("null") == 1


def test_the_planner_gets_prefill_priority_steps_where_p_and_d_share_cores_by_priority() -> None:
    assert prefill_nice_steps({"prefill": 10, "decode": -5}) == (19, 10, 5, 0, -5)
    assert prefill_nice_steps({"prefill": 10, "decode": 0}) == (19, 10, 5, 0)
    assert prefill_nice_steps({"prefill": 0, "decode": 0}) == ()  # not placed by priority
    assert prefill_nice_steps({"prefill": None, "decode": -5}) == ()

    def planner_argv(extra: list[str]) -> list[str]:
        args = build_parser().parse_args(["cluster", "--model", "tiny", "--planner", *extra])
        (planner,) = [c.argv for c in plan(args) if c.name == "planner"]
        return planner

    a = planner_argv(["--prefill-nice", "10", "--decode-nice", "-5"])
    assert a[a.index("--prefill-nices") + 1] == "19,10,5,0,-5"
    # Pinned apart: no lever. --planner-args comes later and wins ("": off).
    assert "--prefill-nices" not in planner_argv(["--prefill-cpus", "0", "--decode-cpus", "1"])
    a = planner_argv(["--prefill-nice", "10", "--decode-nice", "-5",
                      "--planner-args", "--prefill-nices ''"])
    parsed = build_parser().parse_args(a[a.index("planner"):])
    assert parsed.prefill_nices == ()


def test_the_planner_may_make_p_colocated_where_the_clusters_d_is_the_narrower() -> None:
    """Under the planner D beside P runs on XLA pools of one thread: its own steps can be over
    the ITL target whatever P's priority or cores, and the lever that helps is P colocated
    beside a standby D (``planner --colocate``). Not where D is as wide as P, nor with
    ``--max-workers``; ``--planner-args=--no-colocate`` turns it off."""
    cores = sorted(os.sched_getaffinity(0))

    def planner_argv(*extra: str) -> list[str]:
        args = _cluster("--planner", *extra)
        (planner,) = [c.argv for c in plan(args) if c.name == "planner"]
        return planner[planner.index("planner"):]

    if len(cores) >= 2:
        assert narrow_decode(_cluster("--planner"))
        assert build_parser().parse_args(planner_argv()).colocate
        assert build_parser().parse_args(planner_argv("--pd-cores", "split")).colocate
        off = planner_argv("--planner-args=--no-colocate")
        assert not build_parser().parse_args(off).colocate
    wide = planner_argv("--decode-cpu-pools", "all")
    assert "--colocate" not in wide and not build_parser().parse_args(wide).colocate
    assert "--colocate" not in planner_argv("--max-workers", "3")


@pytest.mark.parametrize(("extra", "names"), [
    (["--role-nice", "null=1"], "--role-nice names null, not among the worker's roles"),
    (["--roles", "decode,prefill", "--nice", "3", "--role-nice", "decode=4"],
     "--nice 3 contradicts --role-nice decode=4"),
])
def test_serve_refuses_a_role_nice_that_cannot_hold(extra: list[str], names: str) -> None:
    argv = ["serve", "--model", "tiny", "--disaggregation-mode", "decode", *extra]
    with pytest.raises(ValueError, match=names):
        config_from_args(build_parser(argv).parse_args(argv))



def _cluster(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["cluster", "--model", "tiny", *extra])


def test_split_gives_p_the_first_half_of_the_cores_and_d_the_rest() -> None:
    assert split_cores([0, 1]) == {"prefill": "0", "decode": "1"}
    assert split_cores([0, 1, 2, 3]) == {"prefill": "0,1", "decode": "2,3"}
    assert split_cores([2, 5, 7]) == {"prefill": "2,5", "decode": "7"}  # P the larger half


@pytest.mark.parametrize(("extra", "cores", "mode"), [
    ([], [0, 1], "split"),  # the default on a machine of two cores or more ...
    ([], [0], "shared"),  # ... and shared on one
    (["--planner"], [0, 1], "shared"),  # the planner may split them
    (["--planner", "--max-workers", "3"], [0, 1], "shared"),  # workers come and go
    (["--pd-cores", "shared"], [0, 1], "shared"),
    (["--pd-cores", "split", "--planner"], [0, 1, 2, 3], "split"),
    (["--prefill-cpus", "0", "--decode-cpus", "1"], [0, 1], ""),  # placed by hand
    (["--prefill", "0", "--decode", "0", "--colocated"], [0, 1], ""),  # no PD
])
def test_how_p_and_d_take_the_cores(extra: list[str], cores: list[int], mode: str) -> None:
    assert pd_cores(_cluster(*extra), cores) == mode


def test_the_default_pins_p_and_d_to_their_halves_without_a_priority() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one usable core here ({cores}): the default shares it")
    want = split_cores(cores)
    assert role_cpus(_cluster()) == {**want, "colocated": None}
    assert _serve_nices(["--colocated"]) == ["-", "-", "-"]
    argv = {child.name: child.argv for child in plan(_cluster("--colocated"))}
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        a = argv[name]
        assert a[a.index("--cpus") + 1] == want[role]
    assert "--cpus" not in argv["colocated"]
    line = placement_line(_cluster())
    assert line.startswith("P on core") and line.endswith(" (--pd-cores split)")
    assert f" {want['prefill']}, D on core" in line and f" {want['decode']} (" in line


@pytest.mark.parametrize(("extra", "names"), [
    (["--pd-cores", "split", "--prefill-cpus", "0"], "--pd-cores split and --prefill-cpus"),
    (["--pd-cores", "shared", "--decode-cpus", "1"], "--pd-cores shared and --prefill-cpus"),
])
def test_cluster_refuses_two_placements_of_p_and_d(extra: list[str], names: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cluster(*extra)) == 2
    assert names in capsys.readouterr().err


def test_split_under_the_planner_starts_movable_workers_and_hands_the_planner_the_cores() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"one usable core here ({cores}): split needs two")
    want = split_cores(cores)
    args = _cluster("--planner", "--pd-cores", "split", "--colocated")
    argv = {child.name: child.argv for child in plan(args)}
    # POST /set_cpus may widen either: P's pools sized to every core, D's of one thread (its
    # idle threads would spin on the core P is given when they share).
    for name, role, pools in (("prefill-0", "prefill", "all"), ("decode-0", "decode", "1")):
        a = argv[name]
        assert a[a.index("--cpus") + 1] == want[role]
        assert a[a.index("--cpu-pools") + 1] == pools, a
        config = config_from_args(build_parser(a[3:]).parse_args(a[3:]))
        assert config.cpu_pools == pools
    assert "--cpu-pools" not in argv["colocated"]
    # D above P as on shared cores, since the planner may make them share; both levers.
    d = "-5" if may_take_nice(-5) else "0"
    assert _serve_nices(["--planner", "--pd-cores", "split"])[:2] == ["10", d]
    planner = argv["planner"]
    assert planner[planner.index("--cores") + 1] == ",".join(map(str, cores))
    assert "--prefill-nices" in planner
    parsed = build_parser().parse_args(planner[planner.index("planner"):])
    assert parsed.cores == frozenset(cores)
    assert placement_line(args).endswith(
        "(--pd-cores split; the planner may make them share every core)")
    # Split without the planner: pools sized to each half, no lever; nor with --max-workers.
    plain = {child.name: child.argv for child in plan(_cluster("--pd-cores", "split"))}
    assert "--cpu-pools" not in plain["prefill-0"] and "planner" not in plain
    scaling = {c.name: c.argv for c in plan(_cluster("--planner", "--pd-cores", "split",
                                                     "--max-workers", "3"))}
    assert "--cpu-pools" not in scaling["prefill-0"] and "--cores" not in scaling["planner"]
    # Shared at start: the workers on every core (their pools sized so), the planner may split.
    shared = _cluster("--planner", "--pd-cores", "shared")
    started = {c.name: c.argv for c in plan(shared)}
    assert "--cpus" not in started["prefill-0"] and "--cpu-pools" not in started["prefill-0"]
    d_argv = started["decode-0"]
    assert d_argv[d_argv.index("--cpus") + 1] == ",".join(map(str, cores))
    assert d_argv[d_argv.index("--cpu-pools") + 1] == "1"
    assert started["planner"][started["planner"].index("--cores") + 1] == ",".join(
        map(str, cores))
    assert placement_line(shared).endswith("(--pd-cores shared; the planner may split them)")


def test_a_role_s_pools_of_n_threads_run_on_every_core_or_on_its_own() -> None:
    # D on one-thread pools beside P on shared cores: --cpus every core (a thread count needs
    # the cores it runs on), --cpu-pools 1; given its own cores, it keeps them.
    cores = sorted(os.sched_getaffinity(0))
    shared = _cluster("--pd-cores", "shared", "--decode-cpu-pools", "1")
    argv = {child.name: child.argv for child in plan(shared)}
    d = argv["decode-0"]
    assert d[d.index("--cpus") + 1] == ",".join(map(str, cores))
    assert d[d.index("--cpu-pools") + 1] == "1"
    config = config_from_args(build_parser(d[3:]).parse_args(d[3:]))
    assert (config.cpu_pools, config.cpus) == ("1", ",".join(map(str, cores)))
    assert "--cpu-pools" not in argv["prefill-0"] and "--cpus" not in argv["prefill-0"]
    assert "D on every core (1-thread pools) at nice" in placement_line(shared)
    # One thread is shared cores' default; D's pools of every core as before, when asked.
    default = {c.name: c.argv for c in plan(_cluster("--pd-cores", "shared"))}["decode-0"]
    assert default[default.index("--cpu-pools") + 1] == "1"
    wide = {c.name: c.argv for c in plan(_cluster("--pd-cores", "shared", "--decode-cpu-pools",
                                                  "all"))}["decode-0"]
    assert wide[wide.index("--cpu-pools") + 1] == "all" and "--cpus" not in wide
    # The planner moving workers between roles (--max-workers): a D may become P, so its pools
    # stay sized to every core.
    scaling = {c.name: c.argv for c in plan(_cluster("--planner", "--max-workers", "3"))}
    assert "--cpu-pools" not in scaling["decode-0"]
    own = {c.name: c.argv for c in plan(_cluster("--prefill-cpus", str(cores[0]), "--decode-cpus",
                                                 str(cores[-1]), "--decode-cpu-pools", "1"))}
    d = own["decode-0"]
    assert d[d.index("--cpus") + 1] == str(cores[-1]) and d[d.index("--cpu-pools") + 1] == "1"


def test_the_planner_takes_its_cores_and_refuses_a_band_upside_down() -> None:
    from pd_fsm.io_trio.planner.cli import service_from_args

    def planner(*extra: str) -> argparse.Namespace:
        return build_parser().parse_args(["planner", "--worker", "http://w:1", *extra])

    assert service_from_args(planner("--cores", "0-1")).planner.config.cores == {0, 1}
    assert service_from_args(planner("--cores", "")).planner.config.cores == frozenset()
    with pytest.raises(ValueError, match=r"split_above 0\.2 is below share_below 0\.4"):
        service_from_args(planner("--cores", "0-1", "--split-above", "0.2"))
    with pytest.raises(SystemExit):
        planner("--cores", "1-0")
