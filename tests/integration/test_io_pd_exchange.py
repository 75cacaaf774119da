"""P and D over real sockets on 127.0.0.1: bootstrap server (hypercorn), bootstrap clients,
ZMQ side channel, endpoint drivers. The scheduler behind each endpoint is the recording sink."""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial

import pytest
import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.io_trio.bootstrap.client import BootstrapClient, BootstrapResolver
from pd_fsm.io_trio.bootstrap.records import split_host_port
from pd_fsm.io_trio.bootstrap.server import BootstrapServer, serve_bootstrap
from tests.support.io_doubles import RecordingSink, sample_record
from tests.support.services import DecodeIO, PrefillIO, serve_decode, serve_prefill

SECRET = b"cluster-secret"
ROOM = 5882942782861604684  # a router-drawn room: uniform in [0, 2^63)
HB, PEER_TIMEOUT = 0.2, 1.0


class Cluster:
    """Bootstrap + one P (cancellable on its own) + one D, all in the test's nursery."""

    p_sink: RecordingSink
    d_sink: RecordingSink
    p: PrefillIO
    d: DecodeIO
    p_endpoint: PrefillEndpoint
    d_endpoint: DecodeEndpoint
    bootstrap_addr: str
    p_scope: trio.CancelScope

    async def start(self, nursery: trio.Nursery) -> None:
        url = await nursery.start(serve_bootstrap, BootstrapServer(secret=SECRET), "127.0.0.1", 0)
        self.p_sink, self.d_sink = RecordingSink(), RecordingSink()
        self.p_endpoint = PrefillEndpoint("L", random.Random(1), LeaseConfig(initial=5))
        self.p_scope = trio.CancelScope()
        self.p = await nursery.start(self._run_p, url)
        self.d_endpoint = DecodeEndpoint(
            "decode-0", "L", DecodeConfig(heartbeat_interval=HB, peer_timeout=PEER_TIMEOUT)
        )
        lookups = BootstrapClient(url, secret=SECRET)
        serve = partial(serve_decode, secret=SECRET)
        self.d = await nursery.start(
            serve, self.d_endpoint, self.d_sink, BootstrapResolver(lookups)
        )

    async def _run_p(self, url: str, *, task_status: trio.TaskStatus[PrefillIO]) -> None:
        with self.p_scope:
            async with trio.open_nursery() as nursery:
                serve = partial(serve_prefill, secret=SECRET)
                p: PrefillIO = await nursery.start(serve, self.p_endpoint, self.p_sink)
                host, port = split_host_port(p.address)
                # Routers know this P as 127.0.0.1:<its side-channel port> (docs/design.md).
                self.bootstrap_addr = f"{host}:{port}"
                record = sample_record(zmq_addr=f"{host}:{port}", layout_hash="L")
                client = BootstrapClient(url, record, secret=SECRET, heartbeat_interval=0.5)
                await nursery.start(client.run)
                with trio.fail_after(5):
                    while not client.registered:
                        await trio.sleep(0.01)
                task_status.started(p)


async def _until(probe: Callable[[], bool], timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while not probe():
            await trio.sleep(0.01)


async def test_p_and_d_reach_success(nursery: trio.Nursery) -> None:
    c = Cluster()
    await c.start(nursery)
    await c.p.driver.submit(ev.PrefillRequestAccepted(ROOM))
    await c.d.driver.submit(ev.DecodeRequestAccepted(ROOM, c.bootstrap_addr, 3))
    # RECV_INIT reached P; then let a few batched heartbeats (and their acks) go by.
    await _until(lambda: c.p_endpoint.state_of(ROOM) == "WAITING_FOR_INPUT")
    await trio.sleep(3 * HB)
    assert c.d_endpoint.peers[c.bootstrap_addr].incarnation == c.p_endpoint.incarnation
    await c.p.driver.submit(ev.PrefillFinished(ROOM, first_token=42, n_pages=3))
    _, done = await c.d_sink.wait_for(fx.CompleteTransfer, ROOM, timeout=5)
    assert done.first_token == 42
    _, release = await c.p_sink.wait_for(fx.ReleaseKV, ROOM, timeout=5)  # after D's DONE
    _, pull = c.d_sink.of_type(fx.StartPull, ROOM)[0]
    assert pull.uuid == release.uuid and pull.transfer_addr == "127.0.0.1:7001"
    assert c.p_endpoint.poll(ROOM) is KVPoll.Success
    assert c.d_endpoint.poll(ROOM) is KVPoll.Success
    p_stats, d_stats = c.p.side_channel.stats, c.d.side_channel.stats
    # P got RECV_INIT, >= 2 HB, DONE; D got READY and the acks. Nothing dropped or refused.
    assert p_stats.received >= 4 and d_stats.received >= 3
    assert p_stats.malformed == d_stats.malformed == 0
    assert p_stats.send_full == d_stats.send_full == p_stats.send_unroutable == 0
    nursery.cancel_scope.cancel()


async def test_silent_p_fails_d_room_within_peer_timeout(nursery: trio.Nursery) -> None:
    c = Cluster()
    await c.start(nursery)
    await c.p.driver.submit(ev.PrefillRequestAccepted(ROOM))
    await c.d.driver.submit(ev.DecodeRequestAccepted(ROOM, c.bootstrap_addr, 3))
    await _until(lambda: c.p_endpoint.state_of(ROOM) == "WAITING_FOR_INPUT")
    await trio.sleep(2 * HB)
    assert c.d_endpoint.poll(ROOM) is KVPoll.WaitingForInput
    t_stop = trio.current_time()
    c.p_scope.cancel()  # P stops answering: its side channel and driver are gone
    t_fail, failure = await c.d_sink.wait_for(fx.FailRequest, ROOM, timeout=5)
    # The last ack came at most one heartbeat before the stop; silence for peer_timeout fails it.
    assert PEER_TIMEOUT - HB - 0.05 <= t_fail - t_stop <= PEER_TIMEOUT + 0.5
    assert "silent" in failure.reason and failure.status == 502
    assert c.d_endpoint.poll(ROOM) is KVPoll.Failed
    assert c.d_sink.of_type(fx.ReleaseBlocks, ROOM)
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("p_secret", [None, b"other-secret"])
async def test_secret_mismatch_never_pairs(nursery: trio.Nursery, p_secret: bytes | None) -> None:
    """P and D that disagree on the cluster secret drop each other's frames (counted); D's room
    fails by the peer timeout instead of hanging."""
    p_endpoint = PrefillEndpoint("L", random.Random(1))
    p = await nursery.start(partial(serve_prefill, secret=p_secret), p_endpoint, RecordingSink())

    async def resolve(addr: str) -> ev.PeerResolved:
        return ev.PeerResolved(addr, p.address, "127.0.0.1:7001", "L")

    d_sink = RecordingSink()
    d_endpoint = DecodeEndpoint("d", "L", DecodeConfig(heartbeat_interval=HB, peer_timeout=1.0))
    d = await nursery.start(partial(serve_decode, secret=SECRET), d_endpoint, d_sink, resolve)
    await p.driver.submit(ev.PrefillRequestAccepted(ROOM))
    await d.driver.submit(ev.DecodeRequestAccepted(ROOM, "127.0.0.1:8998", 3))
    _, failure = await d_sink.wait_for(fx.FailRequest, ROOM, timeout=5)
    assert "silent" in failure.reason
    assert p.side_channel.stats.malformed >= 2  # RECV_INIT and heartbeats, all refused
    assert p.side_channel.stats.received == 0 and p_endpoint.state_of(ROOM) == "BOOTSTRAPPING"
    nursery.cancel_scope.cancel()
