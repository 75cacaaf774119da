"""Bootstrap server and client on trio's MockClock (autojump): TTLs fire at exactly the
configured times. The ASGI app runs in-process (httpx.ASGITransport), so no real socket can make
the clock jump while a request is in flight. Signed writes (cluster secret) read a wall clock the
tests inject where it matters: a retry is signed afresh, a restart refuses earlier signatures."""

from __future__ import annotations

import random
from typing import Any

import attrs
import httpx
import pytest
import trio

from pd_fsm.core import events as ev
from pd_fsm.core.config import RegistryConfig
from pd_fsm.io_trio.bootstrap.client import (
    BootstrapClient,
    BootstrapError,
    BootstrapResolver,
    ResolveError,
)
from pd_fsm.io_trio.bootstrap.records import to_json
from pd_fsm.io_trio.bootstrap.server import BootstrapServer
from tests.support.io_doubles import sample_record

KEY = ("prefill", "p0", 0, 0, 0, 0)
SECRET = b"cluster-secret-for-the-clock-tests"


class SwitchableTransport(httpx.AsyncBaseTransport):
    """Routes to whichever server is "up"; raises ConnectError while none is (a restart)."""

    def __init__(self) -> None:
        self.server: BootstrapServer | None = None
        self.cut = False  # this client's network is gone (simulates a crash: no DELETE)
        self.hang = False
        self.seen: list[httpx.Request] = []  # every request sent, as sent (a wire recording)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if self.hang:
            await trio.sleep_forever()
        if self.server is None or self.cut:
            raise httpx.ConnectError("connection refused", request=request)
        inner = httpx.ASGITransport(app=self.server.app)
        return await inner.handle_async_request(request)


def _client(transport: httpx.AsyncBaseTransport, **kw: Any) -> BootstrapClient:
    http = httpx.AsyncClient(transport=transport, base_url="http://bootstrap")
    kw.setdefault("rng", random.Random(0))
    return BootstrapClient("http://bootstrap", sample_record(), http=http, **kw)


async def _wait(predicate: Any, step: float = 0.01) -> None:
    with trio.fail_after(1000):
        while not predicate():
            await trio.sleep(step)


async def _start_server(nursery: trio.Nursery, ttl: float = 15.0) -> BootstrapServer:
    server = BootstrapServer(RegistryConfig(ttl=ttl))
    await nursery.start(server.run)
    return server


async def test_ttl_expiry_exactly_after_last_heartbeat(autojump_clock: trio.testing.MockClock):
    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        transport.server = server = await _start_server(nursery)
        client = _client(transport)
        t0 = trio.current_time()
        await client.register()
        assert server.registry.expires_at(KEY) == t0 + 15
        await trio.sleep(10)
        t_hb = trio.current_time()
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as http:
            r = await http.post(
                "/heartbeat",
                json={"role": "prefill", "instance_id": "p0"}
                | {f"{a}_rank": 0 for a in ("tp", "cp", "dp", "pp")},
            )
            assert r.status_code == 200
            await trio.sleep_until(t_hb + 15 - 0.001)
            assert len((await http.get("/list")).json()["instances"]) == 1
            await _wait(lambda: server.expired)
            assert server.expired[0] == (pytest.approx(t_hb + 15, abs=1e-9), KEY)
            assert (await http.get("/list")).json()["instances"] == []
            health = (await http.get("/health")).json()
            # request_failures_total counts this process's servers (other tests' included).
            assert isinstance(health.pop("request_failures_total"), int)
            assert health == {
                "status": "ok", "instances": 0, "expired_total": 1, "bad_requests_total": 0,
                "client_disconnects_total": 0, "writes_total": {
                    "registered": 1, "heartbeat": 1, "deregistered": 0, "not_registered": 0},
            }
            # A heartbeat after expiry is told to register again.
            r = await http.post(
                "/heartbeat",
                json={"role": "prefill", "instance_id": "p0"}
                | {f"{a}_rank": 0 for a in ("tp", "cp", "dp", "pp")},
            )
            assert r.status_code == 404
        nursery.cancel_scope.cancel()


async def test_heartbeating_client_stays_registered(autojump_clock: trio.testing.MockClock):
    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        transport.server = server = await _start_server(nursery)
        client = _client(transport, heartbeat_interval=5.0)
        client_scope = trio.CancelScope()

        async def run_client(*, task_status: trio.TaskStatus[None]) -> None:
            with client_scope:
                await client.run(task_status=task_status)

        await nursery.start(run_client)
        await trio.sleep(102)  # off the 5 s grid: no tie with a heartbeat
        assert client.registered
        assert client.heartbeats == 20
        assert not server.expired and len(server.registry) == 1
        t_stop = trio.current_time()
        client_scope.cancel()
        # Clean shutdown deregisters (DELETE) at once; it does not wait for the TTL.
        await _wait(lambda: len(server.registry) == 0)
        assert trio.current_time() <= t_stop + 0.01  # one polling step of _wait
        assert not server.expired and not client.registered
        nursery.cancel_scope.cancel()


async def test_restart_refills_from_heartbeats_and_ttl_holds(
    autojump_clock: trio.testing.MockClock,
):
    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        first_scope = trio.CancelScope()

        async def first_server(*, task_status: trio.TaskStatus[BootstrapServer]) -> None:
            with first_scope:
                async with trio.open_nursery() as inner:
                    task_status.started(await _start_server(inner))

        transport.server = first = await nursery.start(first_server)
        client = _client(transport, heartbeat_interval=5.0)
        t0 = trio.current_time()
        await nursery.start(client.run)
        await _wait(lambda: client.registered)
        assert first.registry.expires_at(KEY) == t0 + 15

        await trio.sleep(7)  # t0+7: the server dies, its registry with it
        first_scope.cancel()
        transport.server = None
        await trio.sleep(2)  # t0+9: a fresh, empty server
        transport.server = second = await _start_server(nursery)
        assert len(second.registry) == 0

        # The heartbeat at t0+10 gets 404; the client registers again at once.
        await _wait(lambda: len(second.registry) == 1)
        t_again = second.registry.expires_at(KEY) - 15
        assert t_again == pytest.approx(t0 + 10, abs=1e-9)
        assert client.registrations == 2 and client.registered

        await trio.sleep(2)  # t0+12: the instance crashes (no DELETE reaches the server)
        transport.cut = True
        client_failures = client.failures
        await _wait(lambda: second.expired)
        assert second.expired[0] == (pytest.approx(t_again + 15, abs=1e-9), KEY)
        assert client.failures > client_failures
        nursery.cancel_scope.cancel()


async def test_registration_retries_with_backoff_until_server_is_up(
    autojump_clock: trio.testing.MockClock,
):
    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        client = _client(transport, backoff_initial=0.2, backoff_max=2.0)
        t0 = trio.current_time()
        await nursery.start(client.run)
        await trio.sleep(10)
        assert not client.registered
        # 0.2 doubling to the 2 s cap, each jittered to [50%, 100%]: several tries in 10 s
        assert 5 <= client.failures <= 30
        transport.server = await _start_server(nursery)
        t_up = trio.current_time()
        await _wait(lambda: client.registered)
        assert t0 + 10 == pytest.approx(t_up)
        assert trio.current_time() - t_up <= 2.0  # never waits longer than backoff_max
        nursery.cancel_scope.cancel()


async def test_resolve_and_resolver(autojump_clock: trio.testing.MockClock):
    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        transport.server = await _start_server(nursery)
        p = BootstrapClient(
            "http://b",
            sample_record(bootstrap_host="10.0.0.5", bootstrap_port=8998, zmq_addr="10.0.0.5:1"),
            http=httpx.AsyncClient(transport=transport, base_url="http://b"),
        )
        await p.register()
        d = BootstrapClient(
            "http://b", http=httpx.AsyncClient(transport=transport, base_url="http://b")
        )
        [record] = await d.resolve("10.0.0.5", 8998)
        assert record.zmq_addr == "10.0.0.5:1" and record.layout_hash == "layout-1"
        with pytest.raises(ResolveError, match="no live prefill"):
            await d.resolve("10.0.0.5", 8999)
        with pytest.raises(ResolveError):
            await d.resolve("10.0.0.5", 8998, ranks={"tp_rank": 1})
        resolver = BootstrapResolver(d, ranks={"tp_rank": 0})
        assert await resolver("10.0.0.5:8998") == ev.PeerResolved(
            "10.0.0.5:8998", "10.0.0.5:1", "127.0.0.1:7001", "layout-1"
        )
        failed = await resolver("10.0.0.5:1234")
        assert isinstance(failed, ev.PeerResolutionFailed) and "no live" in failed.reason
        bad = await resolver("not-an-address")
        assert isinstance(bad, ev.PeerResolutionFailed)

        # Every wait has a deadline: a server that never answers fails after request_timeout.
        transport.hang = True
        t = trio.current_time()
        with pytest.raises(BootstrapError, match="no answer within 2 s"):
            await d.resolve("10.0.0.5", 8998)
        assert trio.current_time() - t == pytest.approx(2.0)
        nursery.cancel_scope.cancel()


async def test_stalled_registry_answers_503(autojump_clock: trio.testing.MockClock):
    server = BootstrapServer()  # its driver never runs: every write times out
    transport = httpx.ASGITransport(app=server.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as http:
        t0 = trio.current_time()
        r = await http.put("/route", json=to_json(sample_record()))
        assert r.status_code == 503 and "busy" in r.json()["error"]
        assert trio.current_time() - t0 == pytest.approx(5.0)


class LosesEveryOtherAnswer(httpx.AsyncBaseTransport):
    """Every request reaches the server and is handled; the answer to every other one is lost the
    way a pooled connection the server closed under a reused request loses it."""

    def __init__(self, server: BootstrapServer) -> None:
        self.server = server
        self.seen: list[httpx.Request] = []
        self._lose = True

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        response = await httpx.ASGITransport(app=self.server.app).handle_async_request(request)
        lose, self._lose = self._lose, not self._lose
        if lose:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response")
        return response


async def test_a_retried_write_is_signed_afresh(autojump_clock: trio.testing.MockClock):
    """The client retries at once a write whose answer was lost. The first attempt did reach the
    server, which remembers its MAC: only a retry signed with a new nonce (and time) is accepted,
    and it is, every time; the same bytes sent twice are refused as a replay."""
    async with trio.open_nursery() as nursery:
        server = BootstrapServer(secret=SECRET)
        await nursery.start(server.run)
        transport = LosesEveryOtherAnswer(server)
        client = _client(transport, secret=SECRET, heartbeat_interval=5.0)
        await nursery.start(client.run)
        await trio.sleep(31)  # register, then heartbeats at 5, 10, ..., 30 s
        assert client.registered and client.registrations == 1 and client.heartbeats == 6
        assert client.stale_retries == 7 and client.failures == 0
        assert server.bad_requests == 0 and len(server.registry) == 1
        nonces = [r.headers["x-pd-fsm-nonce"] for r in transport.seen]
        assert len(nonces) == 14 == len(set(nonces))
        last = transport.seen[-1]  # accepted: resend it exactly as it was sent
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=server.app), base_url="http://b"
        ) as http:
            r = await http.post("/heartbeat", content=last.content, headers=last.headers)
        assert r.status_code == 401 and "request replayed" in r.json()["error"]
        nursery.cancel_scope.cancel()


async def test_writes_signed_before_a_restart_are_refused(autojump_clock: trio.testing.MockClock):
    """A restarted server has forgotten the MACs it accepted. A registration recorded before the
    restart is well inside the 60 s window, yet refused: it was signed before the server started.
    The instance's own writes, signed after, are accepted."""
    wall = [1_800_000_000.0]

    def clock() -> float:
        return wall[0]

    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        transport.server = first = BootstrapServer(secret=SECRET, wall_clock=clock)
        await nursery.start(first.run)
        client = _client(transport, secret=SECRET, wall_clock=clock)
        await client.register()
        [recorded] = transport.seen

        wall[0] += 10  # ten seconds later the server restarts, empty
        transport.server = second = BootstrapServer(secret=SECRET, wall_clock=clock)
        await nursery.start(second.run)
        async with httpx.AsyncClient(transport=transport, base_url="http://b") as http:
            r = await http.put("/route", content=recorded.content, headers=recorded.headers)
            assert r.status_code == 401, r.text
            assert "10.000 s before this process started" in r.json()["error"]
            assert len(second.registry) == 0 and second.bad_requests == 1
            await client.register()  # signed now: after the restart
            assert len(second.registry) == 1
            # Unsigned, or signed by a process holding another secret: refused as before.
            assert (await http.put("/route", json=to_json(sample_record()))).status_code == 401
        wrong = _client(transport, secret=b"another-cluster", wall_clock=clock)
        with pytest.raises(BootstrapError, match="401 bad signature"):
            await wrong.register()
        nursery.cancel_scope.cancel()


async def test_an_instance_heartbeats_against_its_own_ttl(autojump_clock: trio.testing.MockClock):
    """--disaggregation-bootstrap-heartbeat-ttl travels in the record: the registry expires the
    instance after its own TTL (4 s here, the registry's being 15 s), answers every write with
    it, and the client judges its own registration by it."""
    transport = SwitchableTransport()
    async with trio.open_nursery() as nursery:
        transport.server = server = await _start_server(nursery)
        client = BootstrapClient(
            "http://bootstrap", attrs.evolve(sample_record(), heartbeat_ttl=4.0),
            http=httpx.AsyncClient(transport=transport, base_url="http://bootstrap"),
            heartbeat_interval=1.0, stale_after=15.0, rng=random.Random(0),
        )
        t0 = trio.current_time()
        await client.register()
        assert server.registry.expires_at(KEY) == t0 + 4
        assert client.server_ttl == 4.0 and client.stale_after == 4.0
        await _wait(lambda: server.expired)
        assert server.expired[0] == (pytest.approx(t0 + 4, abs=1e-9), KEY)
        assert not client.registered
        nursery.cancel_scope.cancel()
