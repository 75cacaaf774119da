"""Issue 18: registry heartbeats never fail on a pooled connection the server just closed.

Under load, hypercorn's 5 s keep-alive and the workers' 5 s heartbeats raced: the server closed an
idle connection as the client reused it ("Server disconnected without sending a response"), 12
times in 5 minutes. Two tests:

* deterministic: a raw TCP server answers the first request of each connection and then closes
  the connection when the next request arrives on it, without answering: exactly what a client
  sees when the server's keep-alive fires under its reused request. Every heartbeat meets that
  stale connection; every one must still succeed (retried once at once on a fresh connection).
* the real bootstrap server with its keep-alive equal to the heartbeat interval, and a client
  that keeps idle connections longer than that (the misconfigured pair): no failure either.
"""

from __future__ import annotations

import functools

import trio

from pd_fsm.io_trio.bootstrap.client import BootstrapClient
from pd_fsm.io_trio.bootstrap.server import BootstrapServer, serve_bootstrap
from pd_fsm.io_trio.http_server import http_client
from tests.support.io_doubles import sample_record

HEARTBEATS = 12


async def _read_request(stream: trio.SocketStream, buf: bytearray) -> bool:
    """Consume one HTTP/1.1 request (headers + content-length body); False at EOF."""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return False
        buf += data
    head, _, rest = bytes(buf).partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        data = await stream.receive_some(65536)
        if not data:
            return False
        rest += data
    buf[:] = rest[length:]
    return True


class OneRequestPerConnection:
    """Answers the first request on a connection, then drops the connection at the second."""

    def __init__(self) -> None:
        self.answered = 0
        self.dropped = 0

    async def handle(self, stream: trio.SocketStream) -> None:
        buf = bytearray()
        async with stream:
            if not await _read_request(stream, buf):
                return
            body = b'{"status": "ok"}'
            await stream.send_all(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nconnection: keep-alive\r\n\r\n%s" % (len(body), body)
            )
            self.answered += 1
            if await _read_request(stream, buf):
                self.dropped += 1  # closed under the client's reused request: no answer


async def test_stale_pooled_connection_never_fails_a_heartbeat(nursery: trio.Nursery) -> None:
    server = OneRequestPerConnection()
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, server.handle, 0, host="127.0.0.1")
    )
    port = listeners[0].socket.getsockname()[1]
    client = BootstrapClient(f"http://127.0.0.1:{port}", sample_record(),
                             heartbeat_interval=0.05)
    async with client, trio.open_nursery() as beating:
        beating.start_soon(client.run)
        with trio.fail_after(30):
            while client.heartbeats < HEARTBEATS:
                await trio.sleep(0.01)
        assert client.registered
        beating.cancel_scope.cancel()
    # Every heartbeat met a connection the server closed under it, and none failed.
    assert server.dropped >= HEARTBEATS
    assert client.stale_retries >= HEARTBEATS
    assert client.heartbeat_failures == 0
    assert client.failures == 0
    assert client.stats()["heartbeat_failures_total"] == 0


async def test_keep_alive_equal_to_heartbeat_interval(nursery: trio.Nursery) -> None:
    interval = 0.3
    registry = BootstrapServer()
    url: str = await nursery.start(
        lambda task_status: serve_bootstrap(registry, "127.0.0.1", 0, keep_alive=interval,
                                            task_status=task_status)
    )
    # A client that keeps idle connections (60 s) far past the server's keep-alive (0.3 s).
    http = http_client(base_url=url, timeout=2.0, keepalive_expiry=60.0)
    async with http, BootstrapClient(url, sample_record(), heartbeat_interval=interval,
                                     http=http) as client, trio.open_nursery() as beating:
        beating.start_soon(client.run)
        with trio.fail_after(30):
            while client.heartbeats < HEARTBEATS:
                await trio.sleep(0.05)
                if client.heartbeats:
                    assert len(registry.registry) == 1  # never dropped out
        beating.cancel_scope.cancel()
    assert client.heartbeat_failures == 0
    assert client.failures == 0
