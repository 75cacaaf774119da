"""pd-fsm proxy routes a worker switched to role null as colocated (issue 30), in real processes
on the tiny model: a bootstrap server, P ``a``, D ``b`` (``--roles decode,null``), a colocated
reference, and ``pd-fsm proxy`` given static lists (it follows roles by probing
``/server_info``).

``b`` is switched to null with ``POST /switch_role``: the proxy, left with a P and no D, routes
it every request whole (a D-alone room whose leg is addressed as null). Requests through the
proxy answer 200 with the colocated reference's greedy tokens; ``b``'s own stats count them as
its colocated backend's, the planner's scrape reads ``b`` as a null worker, the proxy counts the
rooms by path; ``b`` switched back to decode is a D again; every worker ends holding nothing.
A second proxy lists no P: with ``--local-prefill-without-prefill`` ``b`` answers alone."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.io_trio.planner.scrape import parse
from tests.integration.failure_support import (
    SLACK,
    Fleet,
    Proc,
    proxied_and_greedy,
    stats,
    wait_clean,
    wait_until,
)

PROBE_S = 0.3
N_COLOCATED = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("proxy_colocated"))
    f.bootstrap()
    a = f.prefill("a")
    b = f.decode("b", extra=["--roles", "decode,null", "--drain-timeout", "5"])
    f.colocated()
    f.proxy("proxy", [a], [b], extra=["--role-probe-interval", str(PROBE_S)])
    # No P listed at all, as while the planner's colocated worker drains to become P again
    # beside a standby D: this proxy lets D prefill alone (pd-fsm cluster --planner's does).
    f.proxy("alone", [], [b], extra=["--local-prefill-without-prefill"])
    f.start()
    yield f
    f.close()


async def _switched(http: httpx.AsyncClient, fleet: Fleet, worker: Proc, role: str,
                    epoch: int, routed: dict[str, list[str]]) -> None:
    """Switch ``worker`` to ``role``; back once it serves so and the proxy routes ``routed``
    (the seconds each took are printed: ``pytest -s``)."""
    r = await http.post(f"{worker.url}/switch_role", json={"role": role})
    assert r.status_code == 202, r.text

    async def serving() -> bool | None:
        i = (await http.get(f"{worker.url}/server_info")).json()
        return True if (i["disaggregation_mode"], i["role_epoch"], i["role_state"]) == (
            role, epoch, "SERVING") else None

    async def proxy_routes() -> bool | None:
        w = (await http.get(f"{fleet['proxy'].url}/workers")).json()
        return True if {k: w[k] for k in routed} == routed else None

    _, served = await wait_until(serving, SLACK, f"{worker.name} serving as {role}")
    _, seen = await wait_until(proxy_routes, SLACK, f"the proxy routing {routed}")
    print(f"{worker.name} -> {role}: serving after {served:.2f} s, routed so {seen:.2f} s later")


def _routed(metrics: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^pd_fsm_proxy_rooms_routed_total\{key="(\w+)"\} (\S+)$', metrics, re.M)}


async def test_a_worker_switched_to_null_gets_whole_requests_and_back(fleet: Fleet) -> None:
    a, b, proxy = fleet["a"], fleet["b"], fleet["proxy"].url
    answers: list[tuple[list[int], list[int]]] = []
    async with httpx.AsyncClient(timeout=60) as http:
        answers.append(await proxied_and_greedy(http, fleet, 0))  # a PD room: P a, D b
        await _switched(http, fleet, b, "null", 1,
                        {"prefill": [a.url], "decode": [], "colocated": [b.url]})

        async def ask(seed: int) -> None:
            answers.append(await proxied_and_greedy(http, fleet, seed))

        async with trio.open_nursery() as nursery:  # at once: b serves them side by side
            for seed in range(1, 1 + N_COLOCATED):
                nursery.start_soon(ask, seed)
        served: dict[str, Any] = await stats(http, b)
        scrape = parse((await http.get(f"{b.url}/server_info")).json(),
                       (await http.get(f"{b.url}/metrics")).text)
        proxy_metrics = (await http.get(f"{proxy}/metrics")).text
        # And back: b is a D again, the proxy routes it as one, a request uses it.
        await _switched(http, fleet, b, "decode", 2,
                        {"prefill": [a.url], "decode": [b.url], "colocated": []})
        answers.append(await proxied_and_greedy(http, fleet, 99))
        after_back = _routed((await http.get(f"{proxy}/metrics")).text)
        await wait_clean(http, a, b, fleet["colocated"], timeout=SLACK)
    assert all(got == want for got, want in answers), answers
    # b's colocated backend (new at the switch) finished exactly the requests routed to it.
    assert sum(served["requests_total"].values()) == N_COLOCATED, served
    assert served["requests_total"]["error"] == served["requests_total"]["abort"] == 0, served
    assert "pd_queues" not in served  # a colocated backend: no PD queues
    # The planner's view of b while it was null: a colocated worker's own TTFT and ITL.
    assert scrape.role == "null" and scrape.ttft.total >= N_COLOCATED and scrape.itl.total > 0
    snap = scrape.snapshot(b.url, None)
    assert snap is not None and (snap.role, snap.waiting, snap.running) == ("null", 0, 0)
    assert _routed(proxy_metrics) == {"pd": 1.0, "decode_alone": 0.0,
                                      "colocated": float(N_COLOCATED), "handoff": 0.0}
    assert after_back["pd"] == 2.0 and after_back["colocated"] == N_COLOCATED
    assert re.search(r'^pd_fsm_proxy_route_decisions_total\{key="colocated:no_decode"\} '
                     rf'{N_COLOCATED}\.0$', proxy_metrics, re.M), proxy_metrics


async def test_with_no_prefill_listed_d_answers_alone(fleet: Fleet) -> None:
    """``--local-prefill-without-prefill``: no P listed and no colocated worker, the proxy opens
    a D-alone room (D prefills itself) instead of a 503, and D answers as the colocated
    reference does (after the test above ``b`` is a D again)."""
    b, alone = fleet["b"], fleet["alone"].url
    async with httpx.AsyncClient(timeout=60) as http:
        # It probes roles too: it routes b as a D again only once it saw b serve as one.
        async def routes_b() -> bool | None:
            w = (await http.get(f"{alone}/workers")).json()
            return True if (w["prefill"], w["decode"]) == ([], [b.url]) else None

        await wait_until(routes_b, SLACK, "the D-alone proxy routing b as a D")
        before = (await stats(http, b))["local_prefills_total"]
        answers = [await proxied_and_greedy(http, fleet, seed, proxy="alone")
                   for seed in (7, 8)]
        after = (await stats(http, b))["local_prefills_total"]
        metrics = (await http.get(f"{alone}/metrics")).text
        await wait_clean(http, b, fleet["colocated"], timeout=SLACK)
    assert all(got == want for got, want in answers), answers
    assert after == before + 2
    assert _routed(metrics)["decode_alone"] == 2.0
    assert re.search(r'^pd_fsm_proxy_route_decisions_total\{key="local:no_prefill"\} 2\.0$',
                     metrics, re.M), metrics
