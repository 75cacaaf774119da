"""Restarts (issue 11 §1): a worker or the bootstrap server SIGKILLed and started again on the
same ports serves from its first request, through our proxy and through the real sglang-router;
afterwards every worker is back to idle (pages, rooms, queues, transfer registrations).

A restarted P listens on the same HTTP and side-channel ports but on a new transfer port, with a
new incarnation. Every READY names P's incarnation and its transfer address, so D pulls from the
new process, fails only the rooms READY'd by the old one, and drops its cached transfer
connection to the dead server. A restarted D keeps its identity but names a new incarnation in
its RECV_INIT and heartbeats; P frees the rooms the old D process had claimed at once.

Production windows (docs/design.md: heartbeats 5 s, peer timeout 15 s, leases 30/20 s, registry TTL
15 s), with a cluster secret: what an operator runs, and what the failure was first seen with.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import httpx
import pytest
import trio

from pd_fsm.io_trio.worker.config import ServeConfig
from tests.integration.failure_support import (
    SLACK,
    Fleet,
    Proc,
    kvpoll,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow

HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None
QUESTION = "Tell me about the river city"
LEASE_INITIAL = 30.0  # the default
P_LEASE = 600.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("restarts"), secret=True, windows={}, ttl=15.0)
    f.bootstrap()
    # P's leases far longer than any wait here: whatever P frees, it frees by a restart rule.
    p = f.prefill("p", extra=["--disaggregation-lease-initial", str(P_LEASE),
                              "--disaggregation-lease-extension", str(P_LEASE)])
    d = f.decode("d")
    f.colocated()
    f.proxy("proxy", [p], [d])
    if HAS_ROUTER:
        f.sglang_router("router", p, d)
    f.start()
    yield f
    f.close()


def _body(n: int, max_tokens: int = 6) -> dict[str, object]:
    return {"model": "tiny", "prompt": f"{QUESTION} {n}", "max_tokens": max_tokens,
            "temperature": 0}


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0))


async def _text(http: httpx.AsyncClient, base: str, n: int) -> str:
    r = await http.post(f"{base}/v1/completions", json=_body(n))
    assert r.status_code == 200, f"{base}: {r.text}"
    return str(r.json()["choices"][0]["text"])


async def _first_three(http: httpx.AsyncClient, fleet: Fleet, base: str, first: int) -> None:
    """The first three requests after a restart, one after another: each 200 and equal to the
    colocated answer."""
    for n in range(first, first + 3):
        r = await http.post(f"{base}/v1/completions", json=_body(n))
        assert r.status_code == 200, f"request {n - first + 1} after the restart: {r.text}"
        want = await _text(http, str(fleet["colocated"].url), n)
        assert r.json()["choices"][0]["text"] == want


async def _inflight_then_kill(http: httpx.AsyncClient, fleet: Fleet, victim: Proc) -> list[int]:
    """Four requests in flight through the proxy, then SIGKILL ``victim``: every client gets
    an answer (200 if it finished first, else a JSON error) well within the default windows."""
    statuses: list[int] = []

    async def one(n: int) -> None:
        r = await http.post(f"{fleet['proxy'].url}/v1/completions", json=_body(100 + n, 48))
        statuses.append(r.status_code)

    with trio.fail_after(LEASE_INITIAL + SLACK):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(one, n)
            await trio.sleep(0.3)
            victim.kill()
    return statuses


async def _wait_relays(http: httpx.AsyncClient, router: Proc) -> None:
    """sglang-router is ready once it relays a request (it registers workers lazily)."""
    with trio.fail_after(120):
        while True:
            assert router.alive(), router.tail()
            try:
                r = await http.post(f"{router.base}/v1/completions", json=_body(0))
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.5)


async def test_prefill_restarted_between_requests_serves_its_first_request(fleet: Fleet) -> None:
    """Killed while idle: nothing tells D that P died. D still holds P's route and a transfer
    connection to the dead server, and learns of the restart from the first READY."""
    async with _client() as http:
        await _first_three(http, fleet, str(fleet["proxy"].url), 0)  # warm: all compiled
        d_before = await stats(http, fleet["d"])
        fleet.restart("p")
        await _first_three(http, fleet, str(fleet["proxy"].url), 10)
        d_after = await stats(http, fleet["d"])
        assert d_after["pd_events"]["peer_restarts"] == d_before["pd_events"]["peer_restarts"] + 1
        await wait_clean(http, fleet["p"], fleet["d"], timeout=SLACK)


async def test_prefill_killed_with_requests_in_flight(fleet: Fleet) -> None:
    async with _client() as http:
        statuses = await _inflight_then_kill(http, fleet, fleet["p"])
        assert all(s in (200, 502, 504) for s in statuses), statuses
        fleet.restart("p")
        await _first_three(http, fleet, str(fleet["proxy"].url), 20)
        # A pull D had started from the killed P can only end at its deadline (a dead transfer
        # server's pull is not cancellable: docs/failures.md), and D holds that room's pages
        # until it does (seen once in CI: one room CANCELLING with its pull in flight, 8 s on).
        await wait_clean(http, fleet["p"], fleet["d"],
                         timeout=ServeConfig().disaggregation_pull_deadline + SLACK)


async def test_decode_restarted_p_frees_its_old_rooms_at_once(fleet: Fleet) -> None:
    """The test is the router here (it posts both legs), so the stage is chosen, not raced: P
    has prefilled room R, registered its KV and sent READY, which waits in D's socket (D is
    frozen). D is SIGKILLed and restarted on the same port: same identity, new incarnation. P
    frees R on the new process's first word (its first RECV_INIT), not at lease expiry (P's
    lease is 600 s here), and the new D's requests succeed."""
    p, d = fleet["p"], fleet["d"]
    async with _client() as http:
        p_before = await stats(http, p)
        room, ids = new_room(), prompt(9, seed=3)
        body = leg(room, ids, 4, p)
        d_error: list[BaseException] = []

        async def d_leg() -> None:
            try:
                await http.post(f"{d.url}/generate", json=body)
            except httpx.TransportError as exc:
                d_error.append(exc)  # the connection died with D

        async with trio.open_nursery() as nursery:
            nursery.start_soon(d_leg)
            with trio.fail_after(SLACK):
                while kvpoll(await stats(http, p), "EARLY_PEER") != 1:  # D's hello arrived
                    await trio.sleep(0.05)
            d.pause()
            r = await http.post(f"{p.url}/generate", json=body)
            assert r.status_code == 200, r.text  # P's leg: the KV is handed off (READY sent)
            assert (await stats(http, p))["transfer_registrations"] == 1
            d.kill()
        assert d_error, "D's leg should have died with D"
        fleet.restart("d")
        restarted = trio.current_time()
        await _first_three(http, fleet, str(fleet["proxy"].url), 30)
        took = await wait_clean(http, p, d, timeout=SLACK)
        p_after = await stats(http, p)
        assert p_after["pd_events"]["peer_restarts"] == p_before["pd_events"]["peer_restarts"] + 1
        # R and the three new rooms at least; a first request refused by the new D before any
        # byte is retried by the proxy in a new room, whose registration is released too
        # (seen once in CI: 5). What matters is that every registration came back.
        released = p_after["transfer"]["released"] - p_before["transfer"]["released"]
        registered = p_after["transfer"]["registered"] - p_before["transfer"]["registered"]
        assert released == registered >= 4, p_after["transfer"]
        assert trio.current_time() - restarted < P_LEASE  # freed by the restart rule
        print(f"P idle {took:.2f} s after the restarted D's three requests")


async def test_bootstrap_restarted_while_workers_stay_up(fleet: Fleet) -> None:
    async with _client() as http:
        fleet.restart("bootstrap")
        # Workers register again on their next heartbeat (<= 5 s); D's cached route serves now.
        await _first_three(http, fleet, str(fleet["proxy"].url), 40)
        with trio.fail_after(2 * 5.0 + SLACK):
            while len((await http.get(f"{fleet.boot_url}/list")).json()["instances"]) < 2:
                await trio.sleep(0.2)
        await wait_clean(http, fleet["p"], fleet["d"], timeout=SLACK)


@pytest.mark.skipif(not HAS_ROUTER, reason="sglang-router is not installed (the 'test' extra)")
async def test_restarts_behind_sglang_router(fleet: Fleet) -> None:
    router = fleet["router"]
    async with _client() as http:
        await _wait_relays(http, router)
        for victim in ("p", "d"):
            fleet.restart(victim)
            await _first_three(http, fleet, str(router.base), 50 if victim == "p" else 60)
        await wait_clean(http, fleet["p"], fleet["d"], timeout=LEASE_INITIAL + SLACK)
