"""The endpoint driver on trio's MockClock: leases and peer timeouts fire at exactly the
configured times. P and D talk through an in-memory loopback that still encodes and decodes
every frame with the real codec."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.codec import decode, encode
from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.messages import Message
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.io_trio.driver import EndpointDriver
from tests.support.io_doubles import RecordingSink

P_ADDR = "p:1"  # P's side-channel address, as D's core knows it
D_ID = "d-1"  # D's identity, as P's core knows it
ROOM = 4242


class Loopback:
    """A side channel that hands frames to the other driver; ``cut`` drops everything."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.other: EndpointDriver | None = None
        self.cut = False
        self.sent: list[Message] = []

    def send(self, peer: str, message: Message) -> bool:
        if self.cut or self.other is None:
            return False
        self.sent.append(message)
        return self.other.submit_nowait(ev.MessageReceived(self.me, decode(encode(message))))

    def close_peer(self, peer: str) -> bool:
        return False  # one loopback link: nothing per peer to close


async def _resolve(addr: str) -> ev.PeerResolved:
    return ev.PeerResolved(addr, P_ADDR, "p:transfer", "L")


def _pair() -> tuple[EndpointDriver, RecordingSink, Loopback, EndpointDriver, RecordingSink, Any]:
    p_sink, d_sink = RecordingSink(), RecordingSink()
    p_link, d_link = Loopback(D_ID), Loopback(P_ADDR)
    p = EndpointDriver(
        PrefillEndpoint("L", random.Random(0), LeaseConfig(initial=30, extension=20)),
        p_sink,
        side_channel=p_link,
    )
    d = EndpointDriver(
        DecodeEndpoint(D_ID, "L", DecodeConfig(heartbeat_interval=5, peer_timeout=15)),
        d_sink,
        side_channel=d_link,
        resolver=_resolve,
    )
    # P's frames arrive at D as from P_ADDR; D's arrive at P as from D_ID.
    p_link.me, d_link.me = P_ADDR, D_ID
    p_link.other, d_link.other = d, p
    return p, p_sink, p_link, d, d_sink, d_link


async def test_lease_expires_exactly_at_initial_window(autojump_clock: trio.testing.MockClock):
    sink = RecordingSink()
    endpoint = PrefillEndpoint("L", random.Random(0), LeaseConfig(initial=30))
    driver = EndpointDriver(endpoint, sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        t0 = trio.current_time()
        await driver.submit(ev.PrefillRequestAccepted(ROOM))
        t_fail, failure = await sink.wait_for(fx.FailRequest, ROOM, timeout=100)
        assert t_fail == pytest.approx(t0 + 30, abs=1e-9)
        assert "lease expired" in failure.reason
        t_release, release = await sink.wait_for(fx.ReleaseKV, ROOM)
        assert t_release == t_fail and release.uuid is None
        assert endpoint.poll(ROOM) is KVPoll.Failed
        nursery.cancel_scope.cancel()


async def test_heartbeats_extend_lease_and_silence_fails_both_sides(
    autojump_clock: trio.testing.MockClock,
):
    p, p_sink, p_link, d, d_sink, d_link = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(p.run)
        await nursery.start(d.run)
        t0 = trio.current_time()
        await p.submit(ev.PrefillRequestAccepted(ROOM))
        await d.submit(ev.DecodeRequestAccepted(ROOM, "10.0.0.1:8998", 4))
        await trio.sleep(27)  # heartbeats at t0+5, +10, ..., +25 keep P's lease rolling
        assert p.endpoint.lease_expiry(ROOM) == pytest.approx(t0 + 25 + 20, abs=1e-9)
        p_link.cut = d_link.cut = True  # the network between them goes dark at t0+27
        t_p, p_fail = await p_sink.wait_for(fx.FailRequest, ROOM, timeout=100)
        t_d, d_fail = await d_sink.wait_for(fx.FailRequest, ROOM, timeout=100)
        # D: last ack heard at t0+25, peer_timeout 15. P: last heartbeat at t0+25, extension 20.
        assert t_d == pytest.approx(t0 + 25 + 15, abs=1e-9)
        assert t_p == pytest.approx(t0 + 25 + 20, abs=1e-9)
        assert "silent" in d_fail.reason and d_fail.status == 502
        assert "lease expired" in p_fail.reason
        assert d_sink.of_type(fx.ReleaseBlocks, ROOM) and p_sink.of_type(fx.ReleaseKV, ROOM)
        nursery.cancel_scope.cancel()


async def test_full_exchange_reaches_success(autojump_clock: trio.testing.MockClock):
    p, p_sink, _, d, d_sink, _ = _pair()
    async with trio.open_nursery() as nursery:
        await nursery.start(p.run)
        await nursery.start(d.run)
        await p.submit(ev.PrefillRequestAccepted(ROOM))
        await d.submit(ev.DecodeRequestAccepted(ROOM, "10.0.0.1:8998", 4))
        await trio.sleep(12)
        await p.submit(ev.PrefillFinished(ROOM, first_token=17, n_pages=4))
        _, done = await d_sink.wait_for(fx.CompleteTransfer, ROOM)
        assert done.first_token == 17
        await p_sink.wait_for(fx.ReleaseKV, ROOM)
        assert p.endpoint.poll(ROOM) is KVPoll.Success
        assert d.endpoint.poll(ROOM) is KVPoll.Success
        assert d.stats.resolutions == 1 and d.stats.local_errors == 0
        nursery.cancel_scope.cancel()


async def test_local_protocol_error_is_reported_not_fatal(autojump_clock: trio.testing.MockClock):
    sink = RecordingSink()
    driver = EndpointDriver(PrefillEndpoint("L", random.Random(0)), sink)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        with pytest.raises(LocalProtocolError):
            await driver.call(ev.PrefillFinished(999, 1, 1))
        assert driver.stats.local_errors == 1
        # Still serving.
        await driver.call(ev.PrefillRequestAccepted(1))
        assert driver.endpoint.poll(1) is KVPoll.Bootstrapping
        nursery.cancel_scope.cancel()


async def test_resolver_deadline(autojump_clock: trio.testing.MockClock):
    async def never(addr: str) -> ev.PeerResolved:
        await trio.sleep_forever()
        raise AssertionError

    sink = RecordingSink()
    endpoint = DecodeEndpoint(D_ID, "L", DecodeConfig(resolve_timeout=10))
    driver = EndpointDriver(endpoint, sink, resolver=never, resolve_timeout=9)
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        t0 = trio.current_time()
        await driver.submit(ev.DecodeRequestAccepted(ROOM, "10.0.0.1:8998", 4))
        t, failure = await sink.wait_for(fx.FailRequest, ROOM, timeout=100)
        assert t == pytest.approx(t0 + 9, abs=1e-9)
        assert "took over 9 s" in failure.reason and failure.status == 502
        nursery.cancel_scope.cancel()
