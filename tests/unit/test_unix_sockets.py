"""Unix sockets as addresses (docs/unix_sockets.md), without a server: how `unix:PATH` reads on
every command line, how records naming a socket are indexed and checked, how a D judges a P on a
socket, and what `pd-fsm cluster --uds DIR` plans (every server on a socket, no TCP port picked).
The sockets themselves (stale, live, mode, removal, no TCP at all): tests/integration/
test_unix_sockets.py."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.bootstrap.records import parse_record, to_json, unreachable_fields
from pd_fsm.io_trio.cluster import local
from pd_fsm.io_trio.cluster.local import Listen, launched_worker, main, plan
from pd_fsm.io_trio.planner.cli import service_from_args
from pd_fsm.io_trio.proxy.cli import parse_prefill
from pd_fsm.io_trio.proxy.workers import PrefillTarget
from pd_fsm.io_trio.tls import NO_TLS
from pd_fsm.io_trio.unix_sockets import (
    check_path,
    display,
    parse_mode,
    service_url,
    side_channel_endpoint,
    socket_path_of,
    unix_url,
)
from pd_fsm.io_trio.worker.config import add_serve_arguments, config_from_args
from pd_fsm.io_trio.worker.decode_adapter import unix_only_elsewhere
from tests.support.io_doubles import sample_record


def test_unix_path_reads_as_the_url_every_client_uses() -> None:
    url = service_url("unix:/run/pd/p0.sock", "--url")
    assert url == "http://unix:/run/pd/p0.sock:"
    assert f"{url}/health".startswith(url) and socket_path_of(f"{url}/health") == "/run/pd/p0.sock"
    assert display(url) == "unix:/run/pd/p0.sock"
    assert service_url(url, "--url") == url  # the URL form is taken back as it is
    assert service_url("http://10.0.0.1:8000/", "--url") == "http://10.0.0.1:8000"
    assert display("http://10.0.0.1:8000") == "http://10.0.0.1:8000"
    relative = service_url("unix:p0.sock", "--url")
    assert relative == unix_url(str(Path.cwd() / "p0.sock"))


@pytest.mark.parametrize(("value", "said"), [
    ("10.0.0.1:8000", "--url must be http://HOST:PORT, https://... or unix:PATH"),
    ("unix:/run/a:b.sock", "may not contain ':'"),
    ("unix:/" + "x" * 120, "longer than a unix socket path may be (107 bytes)"),
    ("http://unix:/run/p0.sock", "a unix socket URL is http://unix:PATH:"),
])
def test_addresses_no_socket_can_have_are_refused_by_name(value: str, said: str) -> None:
    with pytest.raises(ValueError) as refused:
        service_url(value, "--url")
    assert said in str(refused.value)


def test_mode_is_octal_permission_bits() -> None:
    assert parse_mode("600") == parse_mode("0600") == parse_mode("0o600") == 0o600
    for bad in ("rw", "0800", "1777"):
        with pytest.raises(ValueError, match="--uds-mode"):
            parse_mode(bad)


def _serve(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    return p.parse_args(argv)


def test_serve_on_a_socket_alone_has_no_tcp_port_and_says_where_peers_reach_it() -> None:
    alone = config_from_args(_serve(["--uds", "/run/pd/w.sock", "--model", "tiny"]))
    assert alone.port is None and alone.uds == Path("/run/pd/w.sock") and alone.uds_mode == 0o600
    assert alone.url == "http://unix:/run/pd/w.sock:"
    both = config_from_args(_serve(["--uds", "/run/pd/w.sock", "--port", "30001",
                                    "--uds-mode", "0660"]))
    assert (both.port, both.uds_mode, both.url) == (30001, 0o660, "http://127.0.0.1:30001")
    assert both.side_channel_ipc is None  # P's side channel stays on TCP beside a port
    tcp = config_from_args(_serve([]))
    assert (tcp.port, tcp.uds, tcp.side_channel_ipc) == (30000, None, None)
    p = config_from_args(_serve(["--uds", "/run/pd/p.sock", "--disaggregation-mode", "prefill",
                                 "--disaggregation-bootstrap-host", "unix:/run/pd/boot.sock"]))
    assert p.side_channel_ipc == "ipc:///run/pd/p.sock.zmq"
    assert p.bootstrap_url == "http://unix:/run/pd/boot.sock:"


@pytest.mark.parametrize(("argv", "said"), [
    (["--uds", "/run/w.sock", "--ssl-certfile", "c.pem", "--ssl-keyfile", "k.pem"],
     "HTTPS is not served on unix sockets"),
    (["--uds", "/run/w.sock", "--tp", "2", "--nnodes", "2", "--node-rank", "0",
      "--dist-init-addr", "127.0.0.1:5000"], "--uds is not supported with --nnodes > 1"),
    (["--uds", "/" + "w" * 104, "--disaggregation-mode", "prefill"],
     "--uds (its side channel's socket)"),
    (["--disaggregation-bootstrap-host", "unix:/run/a:b"], "may not contain ':'"),
])
def test_serve_refuses_what_a_socket_cannot_carry(argv: list[str], said: str) -> None:
    with pytest.raises(ValueError) as refused:
        config_from_args(_serve(argv))
    assert said in str(refused.value)


def test_a_p_on_a_socket_alone_is_indexed_and_found_by_its_endpoint() -> None:
    endpoint = side_channel_endpoint(Path("/run/pd/p0.sock"))
    record = sample_record(zmq_addr=endpoint, scheduler_addr="http://unix:/run/pd/p0.sock:",
                           transfer_addr="10.0.0.7:7001")
    assert parse_record(to_json(record)) == record  # a valid record
    assert record.advertised == endpoint and record.known_as == (endpoint, None)
    assert sample_record().known_as == ("127.0.0.1", 7002)  # TCP: host and port, as before
    assert unreachable_fields(record, None) == []
    assert unreachable_fields(record, "127.0.0.1") == []
    # Sent from another host, a socket is nobody's there: refused by field.
    assert [name for name, _ in unreachable_fields(record, "10.0.0.7")] == [
        "zmq_addr", "scheduler_addr"]


def test_the_proxy_knows_a_p_on_a_socket_by_its_side_channel() -> None:
    alone, named, tcp_side = parse_prefill([
        ["unix:/run/pd/p0.sock"], ["unix:/run/pd/p1.sock", "ipc:///run/pd/other.zmq"],
        ["unix:/run/pd/p2.sock", "31000"]])
    assert alone == PrefillTarget("http://unix:/run/pd/p0.sock:", "ipc:///run/pd/p0.sock.zmq",
                                  None)
    assert (named.bootstrap_host, named.bootstrap_port) == ("ipc:///run/pd/other.zmq", None)
    assert (tcp_side.bootstrap_host, tcp_side.bootstrap_port) == ("127.0.0.1", 31000)
    http = PrefillTarget.from_url("http://10.0.0.1:30000", 31000)
    assert (http.bootstrap_host, http.bootstrap_port) == ("10.0.0.1", 31000)  # as before


def test_a_d_refuses_a_p_whose_socket_is_not_on_its_host(tmp_path: Path) -> None:
    gone = sample_record(zmq_addr=f"ipc://{tmp_path}/p0.sock.zmq", transfer_addr="127.0.0.1:5")
    why = unix_only_elsewhere(gone)
    assert why is not None
    assert "reachable only over a unix socket" in why and "jax.experimental.transfer" in why
    assert "127.0.0.1:5" in why
    with socket.socket(socket.AF_UNIX) as here:  # the same P, its socket on this host
        here.bind(f"{tmp_path}/p0.sock.zmq")
        assert unix_only_elsewhere(gone) is None
    assert unix_only_elsewhere(sample_record()) is None  # TCP: nothing to say


def _cluster(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["cluster", "--model", "tiny", *flags])


def test_cluster_uds_puts_every_server_on_a_socket_and_picks_no_port(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_ports(*args: object, **kwargs: object) -> list[int]:
        raise AssertionError("a TCP port was picked")

    monkeypatch.setattr(local, "free_ports", no_ports)
    args = _cluster("--uds", str(tmp_path), "--prefill", "1", "--decode", "1", "--colocated",
                    "--planner", "--max-workers", "3")
    ports = local._Ports.in_dir(tmp_path, 1, 1, True)
    children = {c.name: c for c in plan(args, NO_TLS, ports)}
    for name, child in children.items():
        assert "--port" not in child.argv, name
        assert child.argv[child.argv.index("--uds") + 1] == str(tmp_path / f"{name}.sock")
        assert child.url == unix_url(str(tmp_path / f"{name}.sock"))
    for name in ("prefill-0", "decode-0"):
        argv = children[name].argv
        assert argv[argv.index("--disaggregation-bootstrap-host") + 1] == (
            f"unix:{tmp_path}/bootstrap.sock")
        assert "--disaggregation-side-channel-port" not in argv
        config = config_from_args(build_parser(argv[3:]).parse_args(argv[3:]))
        assert config.port is None and config.bootstrap_url == unix_url(
            f"{tmp_path}/bootstrap.sock")
    proxy = children["proxy"].argv
    at = proxy.index("--prefill")
    assert proxy[at + 1 : at + 3] == [f"unix:{tmp_path}/prefill-0.sock",
                                      f"ipc://{tmp_path}/prefill-0.sock.zmq"]
    planner = children["planner"].argv
    assert planner[planner.index("--launcher-url") + 1] == f"unix:{tmp_path}/launcher.sock"
    added = launched_worker(args, NO_TLS, "prefill", "prefill-1", ports.bootstrap)
    assert added.url == unix_url(str(tmp_path / "prefill-1.sock")) and added.side_port is None
    assert added.argv[added.argv.index("--uds") + 1] == str(tmp_path / "prefill-1.sock")


def test_cluster_tcp_plan_is_as_before() -> None:
    args = _cluster("--prefill", "1", "--decode", "1")
    children = {c.name: c for c in plan(args)}
    for name, child in children.items():
        assert "--uds" not in child.argv, name
        assert child.url is not None and child.url.startswith("http://127.0.0.1:")
    proxy = children["proxy"].argv
    at = proxy.index("--prefill")
    assert proxy[at + 1] == children["prefill-0"].url and proxy[at + 2].isdigit()
    assert isinstance(launched_worker(args, NO_TLS, "decode", "d", Listen(8998)).url, str)


@pytest.mark.parametrize(("flags", "said"), [
    (["--ray"], "--uds is for the local runner"),
    (["--tls"], "HTTPS is not served on unix sockets"),
    (["--prometheus"], "Prometheus scrapes TCP targets only"),
    (["--prefill-tp", "2", "--prefill-nnodes", "2", "--decode-tp", "2", "--decode-nnodes", "2"],
     "the ranks of an instance meet over TCP"),
])
def test_cluster_uds_refuses_what_only_tcp_reaches(flags: list[str], said: str, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cluster("--uds", str(tmp_path), *flags)) == 2
    assert said in capsys.readouterr().err


def test_cluster_uds_refuses_a_folder_whose_sockets_would_not_fit(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_cluster("--uds", "/" + "d" * 100)) == 2
    assert "longer than a unix socket path may be" in capsys.readouterr().err


def test_check_path_makes_it_absolute() -> None:
    assert check_path("w.sock") == Path.cwd() / "w.sock"


def test_the_planner_observes_and_acts_through_sockets() -> None:
    argv = ["planner", "--worker", "unix:/run/pd/p0.sock", "--launcher-url",
            "unix:/run/pd/launcher.sock", "--bootstrap-url", "unix:/run/pd/bootstrap.sock"]
    service = service_from_args(build_parser(argv).parse_args(argv))
    assert service.static == ["http://unix:/run/pd/p0.sock:"]
    assert service.launcher_url == "http://unix:/run/pd/launcher.sock:"
    assert service.bootstrap_url == "http://unix:/run/pd/bootstrap.sock:"
    bad = ["planner", "--worker", "p0:30000"]
    with pytest.raises(ValueError, match="--worker URL must be http://HOST:PORT"):
        service_from_args(build_parser(bad).parse_args(bad))
