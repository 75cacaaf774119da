"""Servers on unix sockets, for real (docs/unix_sockets.md): the socket file's mode, a stale one
replaced, a live one and a non-socket refused by name, the file gone with its server (and a
successor's left alone), a client of another user refused with a message naming the socket, a
worker gone behind the proxy named by its socket and a restart on the same path served again,
the side channel on ipc://, and a colocated worker served and benchmarked over a socket with no
TCP or UDP socket allowed at all (a seccomp filter, as on the TPU machine)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.core.messages import Heartbeat, HeartbeatAck
from pd_fsm.io_trio.bootstrap.records import to_json
from pd_fsm.io_trio.bootstrap.server import BootstrapServer, serve_bootstrap
from pd_fsm.io_trio.http_server import http_client
from pd_fsm.io_trio.proxy.server import ProxyServer, serve_proxy
from pd_fsm.io_trio.side_channel.channel import DecodeSideChannel, PrefillSideChannel
from pd_fsm.io_trio.unix_sockets import UnixSocket, UnixSocketError, unix_url
from tests.integration.serve_support import Proc, cli, request_body
from tests.support import no_inet
from tests.support.io_doubles import Inbox, sample_record, until

pytestmark = pytest.mark.slow

TINY = ["--model", "tiny", "--num-pages", "64", "--page-size", "4", "--max-running", "4",
        "--context-length", "128", "--warmup", "minimal"]
NOBODY = 65534


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short folder for sockets (pytest's tmp_path can outgrow sockaddr_un's 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pd-uds-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


async def _bootstrap(nursery: trio.Nursery, uds: UnixSocket
                     ) -> tuple[str, trio.CancelScope]:
    """A bootstrap server on ``uds`` alone (no TCP port), in its own cancel scope."""
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[str]) -> None:
        with scope:
            await serve_bootstrap(BootstrapServer(), "127.0.0.1", None, uds=uds,
                                  task_status=task_status)

    url: str = await nursery.start(run)
    return url, scope


async def _refusal(start: Awaitable[object]) -> str:
    """The UnixSocketError a server's start raised (trio may wrap it in groups)."""
    refused: list[BaseException] = []
    try:
        await start
    except* UnixSocketError as group:
        refused = _leaves(group)
    assert refused, "it started"
    return str(refused[0])


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for e in exc.exceptions for leaf in _leaves(e)]
    return [exc]


async def _health(url: str) -> int:
    async with http_client(timeout=5) as http:
        return (await http.get(f"{url}/health")).status_code


async def test_the_socket_file_has_its_mode_and_goes_with_its_server(
        nursery: trio.Nursery, folder: Path) -> None:
    for mode in (0o600, 0o640):
        path = folder / f"boot-{mode:o}.sock"
        url, scope = await _bootstrap(nursery, UnixSocket(path, mode))
        assert url == unix_url(str(path))
        assert stat.S_ISSOCK(os.lstat(path).st_mode) and _mode(path) == mode
        assert await _health(url) == 200
        scope.cancel()
        with trio.fail_after(10):
            while path.exists():
                await trio.sleep(0.02)


async def test_a_stale_socket_is_replaced_a_live_one_and_a_file_refused(
        nursery: trio.Nursery, folder: Path) -> None:
    stale = folder / "stale.sock"
    with socket.socket(socket.AF_UNIX) as dead:  # bound, then closed: nothing accepts on it
        dead.bind(str(stale))
    url, _ = await _bootstrap(nursery, UnixSocket(stale))
    assert await _health(url) == 200
    # A second server on the live socket is refused by name and takes nothing from the first.
    live = await trio.run_process(cli("bootstrap", "--uds", str(stale)), capture_stdout=True,
                                  capture_stderr=True, check=False)
    assert live.returncode == 1
    said = live.stderr.decode()
    assert f"cannot serve on unix:{stale}" in said
    assert "another process serves on this unix socket" in said
    assert await _health(url) == 200
    assert "another process serves" in await _refusal(_bootstrap(nursery, UnixSocket(stale)))
    # Anything but a socket at the path is left as it is.
    plain = folder / "notes.sock"
    plain.write_text("not a socket")
    assert "is not a socket" in await _refusal(_bootstrap(nursery, UnixSocket(plain)))
    assert plain.read_text() == "not a socket"


async def test_a_successors_socket_is_left_alone(nursery: trio.Nursery, folder: Path) -> None:
    path = folder / "shared.sock"
    _, first = await _bootstrap(nursery, UnixSocket(path))
    path.unlink()  # an operator moved the first one's socket away; a second server came
    second, _ = await _bootstrap(nursery, UnixSocket(path))
    first.cancel()
    await trio.sleep(0.5)  # the first one's exit, whatever it would do to the path
    assert await _health(second) == 200


def _make_another_users(path: Path) -> None:
    """Make ``path`` another user's socket for a command run by tests.support.drop_dac: root
    gives it away (and the command loses the capabilities that ignore file modes); anyone else
    cannot chown, so the socket loses its owner's bits instead."""
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    else:
        path.chmod(0)


async def test_another_users_client_is_refused_by_the_sockets_mode(
        nursery: trio.Nursery, folder: Path) -> None:
    path = folder / "boot.sock"
    url, _ = await _bootstrap(nursery, UnixSocket(path))
    _make_another_users(path)

    async def run(*argv: str) -> tuple[int, str]:
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-m", "tests.support.drop_dac", *cli(*argv)],
                capture_stdout=True, capture_stderr=True, check=False)
        return done.returncode, done.stderr.decode()

    code, said = await run("switch-role", f"unix:{path}", "null", "--wait", "0")
    assert code == 1
    assert f"cannot reach unix:{path}" in said
    assert f"unix socket {path}: permission denied" in said
    # A server of that user does not take the socket it may not probe either.
    code, said = await run("bootstrap", "--uds", str(path))
    assert code == 1 and "may not connect to" in said
    assert await _health(url) == 200  # still the first server's
    path.chmod(0o666)  # what --uds-mode 0666 would have made: the same client gets in
    code, said = await run("switch-role", f"unix:{path}", "null", "--wait", "0")
    assert code == 1 and "refused (404)" in said  # the registry has no /switch_role: it answered


async def _post(url: str, body: dict[str, Any]) -> httpx.Response:
    async with http_client(timeout=60) as http:
        return await http.post(f"{url}/generate", json=body)


def _worker(path: Path) -> Proc:
    return Proc.start(f"worker-{path.name}", cli("serve", "--uds", str(path), *TINY))


async def _until_healthy(url: str, proc: Proc, timeout: float = 120) -> None:
    with trio.fail_after(timeout):
        while True:
            try:
                if await _health(url) == 200:
                    return
            except httpx.HTTPError:
                pass
            assert proc.alive(), proc.tail()
            await trio.sleep(0.2)


async def test_a_worker_gone_is_named_by_its_socket_and_served_again_after_a_restart(
        nursery: trio.Nursery, folder: Path) -> None:
    """The proxy on a socket, routing to a colocated worker on another: killed (SIGKILL: its
    socket file stays), the proxy answers with the socket and why; a worker started again on
    the same path replaces the stale file and is served again."""
    w_path, p_path = folder / "w.sock", folder / "proxy.sock"
    worker = _worker(w_path)
    restarted: Proc | None = None
    try:
        w_url = unix_url(str(w_path))
        await _until_healthy(w_url, worker)
        proxy = ProxyServer([], [], colocated=[w_url], breaker_threshold=0,
                      retry_limit=0)
        p_url: str = await nursery.start(lambda task_status: serve_proxy(
            proxy, "127.0.0.1", None, uds=UnixSocket(p_path), task_status=task_status))
        body = request_body("generate", "the river city", 4, stream=False)
        first = await _post(p_url, body)
        assert first.status_code == 200, first.text
        worker.popen.send_signal(signal.SIGKILL)
        worker.popen.wait(30)
        assert stat.S_ISSOCK(os.lstat(w_path).st_mode)  # left behind: stale
        gone = await _post(p_url, body)
        assert gone.status_code == 502, gone.text  # the proxy could not reach its worker
        assert f"unix socket {w_path}" in gone.text and "its server is gone" in gone.text
        async with http_client(timeout=10) as http:
            assert (await http.get(f"{p_url}/health")).status_code == 503
        restarted = _worker(w_path)
        await _until_healthy(w_url, restarted)
        assert any("replaced a stale socket file" in line for line in restarted.lines)
        again = await _post(p_url, body)
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == first.json()["output_ids"]
    finally:
        worker.stop()
        if restarted is not None:
            restarted.stop()
    assert not w_path.exists()  # the restarted worker's SIGTERM removed it


async def test_the_side_channel_on_ipc(nursery: trio.Nursery, folder: Path) -> None:
    endpoint = f"ipc://{folder}/p0.sock.zmq"
    p_inbox, d_inbox = Inbox(), Inbox()
    p_scope = trio.CancelScope()
    p = PrefillSideChannel(endpoint, p_inbox.deliver, ipc_mode=0o640)

    async def run_p(*, task_status: trio.TaskStatus[str]) -> None:
        with p_scope:
            await p.run(task_status=task_status)

    assert await nursery.start(run_p) == endpoint
    assert _mode(folder / "p0.sock.zmq") == 0o640
    d = DecodeSideChannel("d0", d_inbox.deliver)
    await nursery.start(d.run)
    assert d.send(endpoint, Heartbeat(seq=1, rooms=(7,)))
    await until(lambda: p_inbox.got)
    assert p_inbox.got == [("d0", Heartbeat(seq=1, rooms=(7,)))]
    assert p.send("d0", HeartbeatAck(incarnation=5, seq=1))
    await until(lambda: d_inbox.got)
    assert d_inbox.got == [(endpoint, HeartbeatAck(incarnation=5, seq=1))]
    # A second P on the same endpoint would take the live one's path (libzmq): refused.
    second = PrefillSideChannel(endpoint, Inbox().deliver)
    assert "another process serves" in await _refusal(nursery.start(second.run))
    p_scope.cancel()
    await until(lambda: not (folder / "p0.sock.zmq").exists())


@pytest.mark.skipif(not no_inet.supported(), reason="the seccomp filter is for Linux x86-64 "
                    "and aarch64")
async def test_serve_and_bench_over_a_socket_open_no_tcp_socket(folder: Path) -> None:
    """Under a filter that refuses every IPv4 and IPv6 socket (the TPU machine allows none),
    a colocated worker serves on its socket and `pd-fsm bench` measures it over the socket;
    a P on its socket alone says at start why it cannot run there."""

    def guarded(*argv: str) -> list[str]:
        return [sys.executable, "-m", "tests.support.no_inet", *argv]

    control = subprocess.run(guarded(sys.executable, "-c", "import socket; socket.socket()"),
                             capture_output=True, text=True, timeout=60, check=False)
    assert control.returncode == 1 and "[Errno 97]" in control.stderr  # the filter holds
    path = folder / "w.sock"
    worker = Proc.start("worker", guarded(*cli("serve", "--uds", str(path), *TINY)))
    try:
        await _until_healthy(unix_url(str(path)), worker)
        bench = await trio.run_process(
            guarded(*cli("bench", "--url", f"unix:{path}", "--num-prompts", "4",
                         "--max-tokens", "4", "--dataset", "short", "--model", "tiny")),
            capture_stdout=True, capture_stderr=True, check=False)
        out = bench.stdout.decode()
        assert bench.returncode == 0, out + bench.stderr.decode()
        assert f"target:  unix:{path}" in out
        assert any(line.split()[:2] == ["completed", "4.00"] for line in out.splitlines()), out
        assert any(line.split()[:2] == ["failed", "0.00"] for line in out.splitlines()), out
        assert "time_to_first_token" in out  # /metrics scraped over the socket too
        assert worker.alive(), worker.tail()
    finally:
        worker.stop()
    assert not path.exists()
    prefill = subprocess.run(
        guarded(*cli("serve", "--uds", str(folder / "p.sock"), *TINY,
                     "--disaggregation-mode", "prefill")),
        capture_output=True, text=True, timeout=120, check=False)
    assert prefill.returncode == 2
    assert "jax.experimental.transfer, which listens on TCP only" in prefill.stderr
    assert "refused a TCP socket" in prefill.stderr


async def test_a_d_refuses_a_p_reachable_only_over_a_socket_it_cannot_reach(
        nursery: trio.Nursery, folder: Path) -> None:
    """A P registered with an ipc:// side channel that is not on D's host (here: no such
    socket) is refused by D before any page is reserved, saying that the P is reachable only
    over a unix socket and that the KV would go over TCP anyway."""
    boot = folder / "boot.sock"
    boot_url, _ = await _bootstrap(nursery, UnixSocket(boot))
    d_path = folder / "d.sock"
    d = Proc.start("decode", cli("serve", "--uds", str(d_path), *TINY,
                                 "--disaggregation-mode", "decode",
                                 "--disaggregation-bootstrap-host", f"unix:{boot}"))
    try:
        d_url = unix_url(str(d_path))
        await _until_healthy(d_url, d)
        elsewhere = f"ipc://{folder}/elsewhere/p.sock.zmq"
        record = to_json(sample_record(instance_id="p-elsewhere", zmq_addr=elsewhere,
                                       kv_dtype="float32", transfer_addr="127.0.0.1:7001"))
        async with http_client(timeout=60) as http:
            assert (await http.put(f"{boot_url}/route", json=record)).status_code == 200
            body = {**request_body("generate", "the river city", 4, stream=False),
                    "bootstrap_host": elsewhere, "bootstrap_port": None, "bootstrap_room": 7}
            r = await http.post(f"{d_url}/generate", json=body)
        assert r.status_code == 502, r.text
        said = r.json()["error"]["message"]
        assert f"prefill p-elsewhere is reachable only over a unix socket ({elsewhere})" in said
        assert "jax.experimental.transfer listens on TCP only" in said
    finally:
        d.stop()
