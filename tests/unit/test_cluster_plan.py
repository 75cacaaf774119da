"""`pd-fsm cluster --ROLE-nnodes N`: each instance of the role becomes N processes of one
instance (one coordinator address, ranks 0..N-1, the role's tp), only rank 0 has a URL and is
what the proxy routes to; flags that cannot make such an instance are refused by name. Every
worker command line the runners build is one `pd-fsm serve` accepts."""

from __future__ import annotations

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.launcher import drain_timeout
from pd_fsm.io_trio.cluster.local import Listen, launched_worker, main, plan, worker_flags
from pd_fsm.io_trio.tls import NO_TLS
from pd_fsm.io_trio.worker.config import config_from_args


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_each_instance_is_n_processes_and_the_proxy_knows_rank_0() -> None:
    args = build_parser().parse_args([
        "cluster", "--model", "tiny", "--prefill", "2", "--decode", "1",
        "--prefill-tp", "2", "--decode-tp", "4", "--prefill-nnodes", "2", "--decode-nnodes", "2"])
    children = {c.name: c for c in plan(args)}
    assert sorted(children) == ["bootstrap", "decode-0", "decode-0-rank1", "prefill-0",
                                "prefill-0-rank1", "prefill-1", "prefill-1-rank1", "proxy"]
    addrs = set()
    for name in ("prefill-0", "prefill-1", "decode-0"):
        rank0, rank1 = children[name], children[f"{name}-rank1"]
        assert rank0.url is not None and rank1.url is None
        assert [_flag(c.argv, "--node-rank") for c in (rank0, rank1)] == ["0", "1"]
        assert {_flag(c.argv, "--nnodes") for c in (rank0, rank1)} == {"2"}
        addr = {_flag(c.argv, "--dist-init-addr") for c in (rank0, rank1)}
        assert len(addr) == 1
        addrs |= addr
        # The same instance: identical flags but the rank.
        assert [a for a in rank0.argv if a not in ("0", "1")] == [
            a for a in rank1.argv if a not in ("0", "1")]
    assert len(addrs) == 3  # one coordinator per instance
    proxy = children["proxy"].argv
    assert [proxy[i + 1] for i, a in enumerate(proxy) if a in ("--prefill", "--decode")] == [
        children["prefill-0"].url, children["prefill-1"].url, children["decode-0"].url]


@pytest.mark.parametrize(("flags", "reason"), [
    (["--prefill-nnodes", "2"], "--prefill-nnodes 2 must be >= 1 and divide --prefill-tp 1"),
    (["--decode-tp", "2", "--decode-nnodes", "0"], "--decode-nnodes 0 must be >= 1"),
])
def test_impossible_instances_are_refused(flags: list[str], reason: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["cluster", "--model", "tiny", *flags])
    assert main(args) == 2
    assert reason in capsys.readouterr().err


def test_worker_command_lines_are_ones_serve_accepts() -> None:
    # The runners spell serve's flags out; a flag renamed in serve's declarations (flags.py)
    # must not leave them behind.
    args = build_parser().parse_args([
        "cluster", "--model", "tiny", "--prefill", "1", "--decode", "1", "--colocated",
        "--num-pages", "64", "--page-size", "8", "--max-running", "2", "--context-length", "256",
        "--prefill-tp", "2", "--decode-nnodes", "1", "--prefill-cpus", "0",
        "--worker-args", "--warmup minimal --decode-radix-cache"])
    workers = [c for c in plan(args) if c.argv[3:4] == ["serve"]]
    assert [c.name for c in workers] == ["prefill-0", "decode-0", "colocated"]
    for child in workers:
        serve_args = build_parser(child.argv[3:]).parse_args(child.argv[3:])
        config = config_from_args(serve_args)
        assert (config.model, config.num_pages, config.warmup) == ("tiny", 64, "minimal")
    # The Ray runner adds --host, --port and the PD flags above to the same worker flags.
    ray_argv = ["serve", *worker_flags(args), "--host", "127.0.0.1", "--port", "0",
                "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-host",
                "127.0.0.1", "--disaggregation-bootstrap-port", "8998",
                "--disaggregation-side-channel-port", "0"]
    assert config_from_args(build_parser(ray_argv).parse_args(ray_argv)).max_running == 2


def test_the_planner_observes_every_pd_worker_and_each_can_take_every_role() -> None:
    args = build_parser().parse_args([
        "cluster", "--model", "tiny", "--prefill", "1", "--decode", "2", "--planner",
        "--planner-args", "--interval 2 --ttft-slo 1.5"])
    children = {c.name: c for c in plan(args)}
    planner = children["planner"].argv
    assert planner[3] == "planner"
    assert [planner[i + 1] for i, a in enumerate(planner) if a == "--worker"] == [
        children[n].url for n in ("prefill-0", "decode-0", "decode-1")]
    assert _flag(planner, "--interval") == "2" and _flag(planner, "--ttft-slo") == "1.5"
    build_parser(planner[3:]).parse_args(planner[3:])  # one `pd-fsm planner` accepts
    sides = set()
    for name in ("prefill-0", "decode-0", "decode-1"):
        argv = children[name].argv
        assert _flag(argv, "--roles") == "prefill,decode,null"
        sides.add(_flag(argv, "--disaggregation-side-channel-port"))
        config = config_from_args(build_parser(argv[3:]).parse_args(argv[3:]))
        assert set(config.roles) == {"prefill", "decode", "null"}
    assert len(sides) == 3 and None not in sides  # a port of its own for each as a P
    ports = [c.url for c in children.values() if c.url]
    assert len(set(ports)) == len(ports)
    # A switch may leave no P listed for a drain's length: D prefills alone meanwhile.
    proxy = children["proxy"].argv
    assert "--local-prefill-without-prefill" in proxy
    build_parser(proxy[3:]).parse_args(proxy[3:])
    without = {c.name: c for c in plan(build_parser().parse_args(
        ["cluster", "--model", "tiny"]))}
    assert "planner" not in without
    assert "--local-prefill-without-prefill" not in without["proxy"].argv


def test_with_max_workers_the_planner_scales_through_the_launcher_and_added_workers_match() -> None:
    args = build_parser().parse_args([
        "cluster", "--model", "tiny", "--prefill", "1", "--decode", "1", "--planner",
        "--max-workers", "3", "--startup-timeout", "100", "--worker-args", "--drain-timeout 5"])
    children = {c.name: c for c in plan(args)}
    planner = children["planner"].argv
    assert "--worker" not in planner  # the launcher's list is every PD worker, added ones too
    assert _flag(planner, "--max-workers") == "3"
    assert _flag(planner, "--launcher-timeout") == "130"  # the start deadline and a margin
    assert (_flag(planner, "--launcher-url") or "").startswith("http://127.0.0.1:")
    build_parser(planner[3:]).parse_args(planner[3:])
    assert drain_timeout(args) == 5.0
    for role in ("prefill", "decode"):
        sibling = children[f"{role}-0"]
        added = launched_worker(args, NO_TLS, role, f"{role}-1", Listen(8998))
        assert (added.role, sibling.role) == (role, role)
        config = config_from_args(build_parser(added.argv[3:]).parse_args(added.argv[3:]))
        assert (config.disaggregation_mode, set(config.roles)) == (
            role, {"prefill", "decode", "null"})
        # The same flags as its sibling's, but the ports: its own HTTP and side-channel port.
        ports = ("--port", "--disaggregation-side-channel-port", "--disaggregation-bootstrap-port")
        assert _without(added.argv, ports) == _without(sibling.argv, ports)
        assert added.side_port is not None and added.url != sibling.url
        assert _flag(added.argv, "--disaggregation-side-channel-port") == str(added.side_port)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    skip = {i + 1 for i, a in enumerate(argv) if a in flags}
    return [a for i, a in enumerate(argv) if i not in skip and a not in flags]


@pytest.mark.parametrize(("flags", "reason"), [
    (["--max-workers", "1"], "--max-workers 1 is below the 2 prefill and decode workers"),
    (["--max-workers", "-1"], "--max-workers must be >= 0"),
    (["--max-workers", "3", "--prefill-tp", "2", "--prefill-nnodes", "2", "--decode-tp", "2",
      "--decode-nnodes", "2"], "not with --prefill/--decode-nnodes"),
    (["--max-workers", "3", "--prefill", "0", "--decode", "0", "--colocated"],
     "--max-workers is for PD workers"),
])
def test_impossible_launchers_are_refused(flags: list[str], reason: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["cluster", "--model", "tiny", *flags])
    assert main(args) == 2
    assert reason in capsys.readouterr().err
