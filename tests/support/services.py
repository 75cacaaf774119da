"""Test and bench wiring: an endpoint, its EndpointDriver and its side channel, started as one
service (the workers embed their endpoint in their PD scheduler instead; both run the core through
``pd_fsm.core.drive``).

A prefill worker::

    io = await nursery.start(serve_prefill, PrefillEndpoint(layout_hash, rng), sink)
    record = InstanceRecord(..., zmq_addr=io.address.removeprefix("tcp://"), ...)
    client = BootstrapClient(bootstrap_url, record)
    await nursery.start(client.run)
    await io.driver.submit(PrefillRequestAccepted(room))   # from the HTTP leg

A decode worker::

    client = BootstrapClient(bootstrap_url, record)          # record optional for lookups only
    io = await nursery.start(serve_decode, DecodeEndpoint(identity, layout_hash), sink,
                             BootstrapResolver(client))
    await io.driver.submit(DecodeRequestAccepted(room, "host:port", n_pages))
"""

from __future__ import annotations

import attrs
import trio

from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.io_trio.driver import EffectSink, EndpointDriver, Resolver
from pd_fsm.io_trio.side_channel.channel import (
    DecodeSideChannel,
    PrefillSideChannel,
    SideChannelLimits,
)


@attrs.frozen
class PrefillIO:
    driver: EndpointDriver
    side_channel: PrefillSideChannel
    address: str  # the bound ROUTER endpoint, "tcp://host:port"


@attrs.frozen
class DecodeIO:
    driver: EndpointDriver
    side_channel: DecodeSideChannel


async def serve_prefill(
    endpoint: PrefillEndpoint,
    sink: EffectSink,
    zmq_addr: str = "127.0.0.1:0",
    *,
    secret: bytes | None = None,
    limits: SideChannelLimits | None = None,
    inbox_size: int = 4096,
    task_status: trio.TaskStatus[PrefillIO] = trio.TASK_STATUS_IGNORED,
) -> None:
    driver = EndpointDriver(endpoint, sink, inbox_size=inbox_size, name="prefill")
    side = PrefillSideChannel(zmq_addr, driver.deliver, secret=secret, limits=limits)
    driver.side_channel = side
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        address: str = await nursery.start(side.run)
        task_status.started(PrefillIO(driver, side, address))


async def serve_decode(
    endpoint: DecodeEndpoint,
    sink: EffectSink,
    resolver: Resolver,
    *,
    secret: bytes | None = None,
    limits: SideChannelLimits | None = None,
    inbox_size: int = 4096,
    task_status: trio.TaskStatus[DecodeIO] = trio.TASK_STATUS_IGNORED,
) -> None:
    driver = EndpointDriver(
        endpoint,
        sink,
        resolver=resolver,
        # A little inside the core's own resolve deadline, so the driver's clear "lookup took
        # too long" answer arrives before the room's generic timeout fires.
        resolve_timeout=endpoint.config.resolve_timeout * 0.9,
        inbox_size=inbox_size,
        name="decode",
    )
    side = DecodeSideChannel(endpoint.identity, driver.deliver, secret=secret, limits=limits)
    driver.side_channel = side
    async with trio.open_nursery() as nursery:
        await nursery.start(driver.run)
        await nursery.start(side.run)
        task_status.started(DecodeIO(driver, side))
