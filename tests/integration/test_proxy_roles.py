"""pd-fsm proxy with static worker lists follows workers that switch roles (issue 30 §1).

The workers are recording stand-ins (``pd_standins``) that report a role epoch in
``/server_info`` and answer a leg addressed to another role 409, as a pd-fsm worker does after
``POST /switch_role``; the real switch is in ``test_role_switch.py``."""

from __future__ import annotations

import random

import httpx
import trio

from pd_fsm.core.routing import RoutingConfig
from pd_fsm.io_trio.proxy.server import PrefillTarget, ProxyServer, serve_proxy
from tests.integration.pd_standins import StandIn, serve_standin


async def _routed(http: httpx.AsyncClient, url: str) -> dict[str, list[str]]:
    r = await http.get(f"{url}/workers")
    assert r.status_code == 200
    body = r.json()
    return {"prefill": body["prefill"], "decode": body["decode"]}


async def _until_routed(http: httpx.AsyncClient, url: str, want: dict[str, list[str]]) -> None:
    with trio.fail_after(10):
        while await _routed(http, url) != want:
            await trio.sleep(0.02)


async def _switchable(nursery: trio.Nursery, role: str) -> tuple[str, StandIn]:
    url, standin = await serve_standin(nursery, role)
    standin.role_epoch = 0
    return url, standin


async def test_static_lists_follow_a_worker_that_switches_role(nursery: trio.Nursery) -> None:
    """A D that drains for a switch is routed as neither role, then as P once it serves as P;
    every leg names its role, and the requests are served throughout."""
    p_url, p = await _switchable(nursery, "prefill")
    d0_url, d0 = await _switchable(nursery, "decode")
    d1_url, d1 = await _switchable(nursery, "decode")
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d0_url, d1_url],
                  rng=random.Random(1), role_probe_interval=0.05)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        assert await _routed(http, url) == {"prefill": [p_url], "decode": [d0_url, d1_url]}
        d1.role_state = "DRAINING"
        await _until_routed(http, url, {"prefill": [p_url], "decode": [d0_url]})
        for _ in range(2):
            assert (await http.post(f"{url}/generate", json={"text": "hi"})).status_code == 200
        assert not d1.generations()  # drained: nothing new reached it
        d1.role, d1.role_epoch, d1.role_state = "prefill", 1, "SERVING"
        await _until_routed(http, url, {"prefill": [p_url, d1_url], "decode": [d0_url]})
        for _ in range(4):  # round robin over both P
            assert (await http.post(f"{url}/generate", json={"text": "hi"})).status_code == 200
        workers = (await http.get(f"{url}/workers")).json()
    assert workers["roles"][d1_url] == {"role": "prefill", "epoch": 1, "serving": True,
                                        "bootstrap_port": 8998}
    assert len(d1.generations()) == 2 and len(p.generations()) == 4
    assert len(d0.generations()) == 6
    for worker, role in ((p, "prefill"), (d0, "decode"), (d1, "prefill")):
        assert {g.headers["x-pd-role"] for g in worker.generations()} == {role}
    stats = proxy.stats()
    assert stats["role_changes_total"] == 2  # d1 out of decode, then into prefill
    assert stats["rooms_total"]["COMPLETED"] == 6 and not stats["rooms_total"]["FAILED"]


async def test_a_leg_to_a_stale_role_gets_409_goes_elsewhere_and_reprobes(
    nursery: trio.Nursery,
) -> None:
    """The proxy has not probed since D switched to P: D's leg gets 409, goes to the other D in
    the same room (P prefills once), and the proxy probes the roles at once, not an interval
    later."""
    p_url, p = await _switchable(nursery, "prefill")
    d0_url, d0 = await _switchable(nursery, "decode")
    d1_url, d1 = await _switchable(nursery, "decode")
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d0_url, d1_url],
                  rng=random.Random(1), role_probe_interval=3600)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    d0.role, d0.role_epoch = "prefill", 1  # switched behind the proxy's back
    async with httpx.AsyncClient(timeout=10) as http:
        for _ in range(2):  # round robin: one of them goes to d0 first
            r = await http.post(f"{url}/generate", json={"text": "hi"})
            assert r.status_code == 200, r.text
            assert r.json()["served_by"] == "decode"
        await _until_routed(http, url, {"prefill": [p_url, d0_url], "decode": [d1_url]})
    legs = [g.headers["x-pd-role"] for g in d0.generations()]
    assert legs[0] == "decode" and set(legs[1:]) <= {"prefill"}  # 409, then routed as P
    assert len(d1.generations()) == 2 and len(p.generations()) + len(legs[1:]) == 2
    assert proxy.stats()["rooms_reopened_total"]["redirect"] == 1


async def test_a_colocated_worker_starting_its_switch_refuses_and_the_standby_d_answers(
    nursery: trio.Nursery,
) -> None:
    """Run 19 of bench/RESULTS_adaptive.md, by hand: the colocated worker begins its switch to
    P beside a standby D before the proxy's next probe. Its 503 sends the retry to the D alone
    (``local_prefill_without_prefill``: the only colocated worker refused it), not back to it
    until the retries run out, and makes the proxy probe the roles at once."""
    c_url, c = await _switchable(nursery, "null")
    d_url, d = await _switchable(nursery, "decode")
    proxy = ProxyServer([], [d_url], colocated=[c_url], rng=random.Random(1),
                  routing=RoutingConfig(local_prefill_without_prefill=True),
                  role_probe_interval=3600)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    c.role_state = "DRAINING"  # behind the proxy's back: its next probe is an hour away
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{url}/generate", json={"text": "hi"})
        assert r.status_code == 200, r.text
        assert r.json()["served_by"] == "decode"
        await _until_routed(http, url, {"prefill": [], "decode": [d_url]})
        workers = (await http.get(f"{url}/workers")).json()
    assert [g.headers["x-pd-role"] for g in c.generations()] == ["null"]  # the one refusal
    assert [g.headers["x-pd-role"] for g in d.generations()] == ["decode"]
    assert workers["colocated"] == [] and workers["roles"][c_url]["serving"] is False
    stats = proxy.stats()
    assert stats["rooms_reopened_total"]["retry"] == 1
    assert stats["rooms_total"]["COMPLETED"] == 1 and not stats["rooms_total"]["FAILED"]


async def test_workers_that_report_no_role_keep_the_command_lines(nursery: trio.Nursery) -> None:
    """An sglang worker reports no role epoch: the proxy routes it as it was told, whatever
    its /server_info's disaggregation_mode says, and sends legs it does not refuse."""
    p_url, _ = await serve_standin(nursery, "prefill")
    d_url, d = await serve_standin(nursery, "prefill")  # says prefill, was given as decode
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [d_url], role_probe_interval=0.05)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        await trio.sleep(0.2)  # a few probe rounds
        assert await _routed(http, url) == {"prefill": [p_url], "decode": [d_url]}
        assert (await http.post(f"{url}/generate", json={"text": "hi"})).status_code == 200
    assert proxy.stats()["role_probes_total"]["ok"] >= 2 and not proxy.workers.probed
    assert len(d.generations()) == 1


async def test_a_colocated_worker_gets_whole_requests_and_a_stale_one_is_retried(
    nursery: trio.Nursery,
) -> None:
    """``--colocated``: with a P and no D the proxy sends each request whole to the colocated
    worker (no bootstrap fields, X-PD-Role null) and is healthy; once that worker switched to
    decode behind the proxy's back, its leg gets 409, the proxy probes at once and the
    request's next room is a PD one on it."""
    p_url, p = await _switchable(nursery, "prefill")
    c_url, c = await _switchable(nursery, "null")
    proxy = ProxyServer([PrefillTarget.from_url(p_url, 8998)], [], colocated=[c_url],
                  rng=random.Random(1), role_probe_interval=3600, retry_limit=4)
    url: str = await nursery.start(serve_proxy, proxy, "127.0.0.1", 0)
    async with httpx.AsyncClient(timeout=10) as http:
        health = await http.get(f"{url}/health")
        assert health.status_code == 200, health.text
        assert health.json()["colocated"] == {"healthy": 1, "configured": 1}
        for _ in range(2):
            r = await http.post(f"{url}/generate", json={"text": "hi"})
            assert r.status_code == 200 and r.json()["served_by"] == "null", r.text
        assert not p.generations()
        for g in c.generations():
            assert g.headers["x-pd-role"] == "null" and g.body["rid"]
            assert not {"bootstrap_host", "bootstrap_port", "bootstrap_room"} & set(g.body)
        c.role, c.role_epoch = "decode", 1  # switched behind the proxy's back
        r = await http.post(f"{url}/generate", json={"text": "hi"})
        assert r.status_code == 200 and r.json()["served_by"] == "decode", r.text
        workers = (await http.get(f"{url}/workers")).json()
    assert (workers["prefill"], workers["decode"], workers["colocated"]) == ([p_url], [c_url], [])
    legs = [g.headers["x-pd-role"] for g in c.generations()]
    assert legs[:3] == ["null"] * 3 and legs[-1] == "decode"  # 2 served, 1 refused 409, PD
    assert {g.headers["x-pd-role"] for g in p.generations()} == {"prefill"}
    stats = proxy.stats()
    assert stats["rooms_routed_total"]["colocated"] == len(legs) - 1
    assert stats["rooms_routed_total"]["pd"] == 1 == len(p.generations())
    assert stats["rooms_reopened_total"]["retry"] == len(legs) - 3
    assert stats["rooms_total"]["COMPLETED"] == 3 and not stats["rooms_total"]["FAILED"]
