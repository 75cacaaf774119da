"""`pd-fsm planner`'s service against workers over HTTP (issue 30 §2): it scrapes each one's
/server_info and /metrics, and acts on the core planner's decisions with POST /switch_role.

The workers are recording stand-ins (``pd_standins``) whose /metrics is the text of a real
``WorkerMetrics`` with the queues a test sets; the real switch is in ``test_role_switch.py``."""

from __future__ import annotations

import time
from typing import Any

import httpx
import trio

from pd_fsm.core.planner import Planner, PlannerConfig
from pd_fsm.io_trio.cluster.launcher import Launcher, ProcessBackend
from pd_fsm.io_trio.cluster.supervisor import Child, Cluster
from pd_fsm.io_trio.planner.service import PlannerService, serve_planner
from pd_fsm.io_trio.worker.metrics import WorkerMetrics
from tests.integration.pd_standins import StandIn, serve_standin


def _metrics(stats: dict[str, Any]) -> str:
    return WorkerMetrics(lambda: stats).render().decode()


async def _worker(nursery: trio.Nursery, role: str, stats: dict[str, Any]) -> tuple[str, StandIn]:
    url, standin = await serve_standin(nursery, role)
    standin.role_epoch = 0
    standin.metrics = _metrics(stats)
    return url, standin


IDLE = {"queued": 0, "waiting": 0, "running": 0, "free_pages": 40, "total_pages": 40}


async def _until_it_decides(service: PlannerService) -> None:
    """Run the planner until its first decision, then stop it."""
    async with trio.open_nursery() as inner:
        await inner.start(serve_planner, service)
        with trio.fail_after(10):
            while not service.recent:
                await trio.sleep(0.02)
        inner.cancel_scope.cancel()


async def test_a_prefill_bound_cluster_gets_a_decode_worker_switched_to_prefill(
    nursery: trio.Nursery,
) -> None:
    p_url, p = await _worker(nursery, "prefill", {**IDLE, "queued": 10})  # 2.5x its queue bound
    d0_url, d0 = await _worker(nursery, "decode", {**IDLE, "running": 2})
    d1_url, d1 = await _worker(nursery, "decode", IDLE)
    service = PlannerService(Planner(PlannerConfig(patience=2, cooldown=3600)),
                             workers=[p_url, d0_url, d1_url], bootstrap_url=None, interval=0.05)
    url: str = await nursery.start(serve_planner, service)
    with trio.fail_after(10):
        while not (d0.switches or d1.switches):
            await trio.sleep(0.02)
    await trio.sleep(0.3)  # several more observations: the cooldown holds
    assert d1.switches == [{"role": "prefill"}] and not d0.switches  # the idler D moved
    assert not p.switches and d1.role == "prefill"
    async with httpx.AsyncClient(timeout=10) as http:
        decisions = (await http.get(f"{url}/decisions")).json()["decisions"]
        metrics = (await http.get(f"{url}/metrics")).text
    assert [(d["kind"], d["worker"], d["to"], d["outcome"]) for d in decisions] == [
        ("SwitchRole", d1_url, "prefill", "switching")]
    assert "prefill pressure 2.50" in decisions[0]["reason"]
    assert ('pd_fsm_planner_decisions_total{kind="SwitchRole",outcome="switching",'
            'pressure="prefill_bound",to="prefill"} 1.0') in metrics


async def test_unreachable_workers_and_dry_runs_act_on_nothing(nursery: trio.Nursery) -> None:
    """A worker that does not answer is left out of the observation (counted); a dry run
    decides and logs, and switches nobody."""
    p_url, p = await _worker(nursery, "prefill", {**IDLE, "queued": 10})
    d0_url, d0 = await _worker(nursery, "decode", IDLE)
    d1_url, d1 = await _worker(nursery, "decode", IDLE)
    gone = "http://127.0.0.1:9"  # discard port: refused at once
    service = PlannerService(Planner(PlannerConfig(patience=1, cooldown=3600)),
                             workers=[p_url, d0_url, d1_url, gone], bootstrap_url=None,
                             interval=0.05, dry_run=True)
    await _until_it_decides(service)
    assert [d["outcome"] for d in service.recent] == ["dry_run"]
    assert not (p.switches or d0.switches or d1.switches)
    failed = service.registry.get_sample_value("pd_fsm_planner_scrapes_total",
                                               {"outcome": "failed"})
    assert failed is not None and failed >= 1


async def test_with_colocate_a_lone_prefill_worker_is_made_colocated(
    nursery: trio.Nursery,
) -> None:
    """--colocate: a P whose only D became colocated serves nothing (an orphan); the service
    posts its switch to null at the first observation, and counts it."""
    p_url, p = await _worker(nursery, "prefill", IDLE)
    c_url, c = await _worker(nursery, "null", {**IDLE, "running": 1})
    service = PlannerService(
        Planner(PlannerConfig(patience=5, cooldown=3600, colocate=True)),
        workers=[p_url, c_url], bootstrap_url=None, interval=0.05)
    url: str = await nursery.start(serve_planner, service)
    with trio.fail_after(10):
        while not p.switches:
            await trio.sleep(0.02)
    assert p.switches == [{"role": "null"}] and not c.switches and p.role == "null"
    async with httpx.AsyncClient(timeout=10) as http:
        decisions = (await http.get(f"{url}/decisions")).json()["decisions"]
        metrics = (await http.get(f"{url}/metrics")).text
    assert [(d["kind"], d["worker"], d["to"]) for d in decisions] == [
        ("SwitchRole", p_url, "null")]
    assert "no decode worker to pair with" in decisions[0]["reason"]
    assert abs(decisions[0]["wall"] - time.time()) < 60  # Unix time, for other processes' logs
    assert 'to="null"} 1.0' in metrics


async def test_a_paused_planner_decides_nothing_until_resumed(nursery: trio.Nursery) -> None:
    """--paused: the planner observes nothing while a prefill-bound cluster waits (a warm-up's
    load must not move roles); POST /resume, with the planner's key, and it acts."""
    p_url, p = await _worker(nursery, "prefill", {**IDLE, "queued": 10})
    d0_url, d0 = await _worker(nursery, "decode", {**IDLE, "running": 2})
    d1_url, d1 = await _worker(nursery, "decode", IDLE)
    service = PlannerService(Planner(PlannerConfig(patience=1, cooldown=3600)),
                             workers=[p_url, d0_url, d1_url], bootstrap_url=None,
                             interval=0.05, paused=True, api_key="k")
    url: str = await nursery.start(serve_planner, service)
    await trio.sleep(0.5)  # ten intervals
    assert not (p.switches or d0.switches or d1.switches) and not service.recent
    async with httpx.AsyncClient(timeout=10) as http:
        metrics = (await http.get(f"{url}/metrics")).text  # open without the key
        assert "pd_fsm_planner_paused 1.0" in metrics
        assert "pd_fsm_planner_observations_total{" not in metrics  # none observed
        for path in ("/resume", "/pause", "/decisions"):
            assert (await http.post(f"{url}{path}")).status_code in (401, 405), path
        assert (await http.get(f"{url}/decisions")).status_code == 401
        key = {"Authorization": "Bearer k"}
        r = await http.post(f"{url}/resume", headers=key)
        assert r.status_code == 200 and r.json() == {"paused": False}
        with trio.fail_after(10):
            while not d1.switches:
                await trio.sleep(0.02)
        assert d1.switches == [{"role": "prefill"}]
        r = await http.post(f"{url}/pause", headers=key)
        assert r.json() == {"paused": True} and service.paused
        assert "pd_fsm_planner_paused 1.0" in (await http.get(f"{url}/metrics")).text


async def test_a_starved_prefill_worker_on_shared_cores_gets_a_higher_priority_first(
    nursery: trio.Nursery,
) -> None:
    """With --prefill-nices the planner's first lever is P's priority (POST /set_nice), before
    any role moves, and it reads the priority now from /server_info."""
    p_url, p = await _worker(nursery, "prefill", {**IDLE, "queued": 10})
    d0_url, d0 = await _worker(nursery, "decode", IDLE)
    d1_url, d1 = await _worker(nursery, "decode", IDLE)
    p.nice, d0.nice, d1.nice = 10, -5, -5
    config = PlannerConfig(patience=2, cooldown=3600, nice_cooldown=3600,
                           prefill_nices=(19, 10, 5, 0, -5))
    service = PlannerService(Planner(config), workers=[p_url, d0_url, d1_url],
                             bootstrap_url=None, interval=0.05)
    url: str = await nursery.start(serve_planner, service)
    with trio.fail_after(10):
        while not p.nices:
            await trio.sleep(0.02)
    await trio.sleep(0.3)  # several more observations: the cooldown holds
    # Queue 10 over 4: pressure 2.5, 3.1x headroom: two steps at once (10 -> 5 -> 0).
    assert p.nices == [{"nice": 0}] and p.nice == 0
    assert not (d0.switches or d1.switches or d0.nices or d1.nices)  # no role moved
    async with httpx.AsyncClient(timeout=10) as http:
        decisions = (await http.get(f"{url}/decisions")).json()["decisions"]
        metrics = (await http.get(f"{url}/metrics")).text
    assert [(d["kind"], d["worker"], d["to"], d["outcome"]) for d in decisions] == [
        ("SetNice", p_url, "0", "set")]
    assert "P's priority up: nice 10 -> 0" in decisions[0]["reason"]
    assert ('pd_fsm_planner_decisions_total{kind="SetNice",outcome="set",'
            'pressure="prefill_bound",to="0"} 1.0') in metrics


async def test_a_starved_split_prefill_beside_an_idle_decode_shares_the_cores(
    nursery: trio.Nursery,
) -> None:
    """With --cores the planner reads each worker's cores from /server_info and, P starved
    beside a D whose steps ran under share_below of the window, moves both to every core
    (POST /set_cpus) — before the priority lever, which waits for a shared placement."""
    p_url, p = await _worker(nursery, "prefill", {**IDLE, "queued": 10})
    d_url, d = await _worker(nursery, "decode", {**IDLE, "step_seconds_total": 0.0})
    p.nice, d.nice, p.cpus, d.cpus = 10, -5, [0], [1]
    config = PlannerConfig(patience=2, cooldown=3600, nice_cooldown=3600,
                           prefill_nices=(19, 10, 5, 0, -5), cores=frozenset({0, 1}))
    service = PlannerService(Planner(config), workers=[p_url, d_url], bootstrap_url=None,
                             interval=0.05)
    url: str = await nursery.start(serve_planner, service)
    with trio.fail_after(10):
        while not (p.cpu_moves and d.cpu_moves):
            await trio.sleep(0.02)
    await trio.sleep(0.3)  # several more observations: nice_cooldown holds
    assert (p.cpu_moves, d.cpu_moves) == ([{"cpus": "0,1"}], [{"cpus": "0,1"}])
    assert (p.cpus, d.cpus) == ([0, 1], [0, 1]) and not (p.nices or p.switches)
    async with httpx.AsyncClient(timeout=10) as http:
        decisions = (await http.get(f"{url}/decisions")).json()["decisions"]
        metrics = (await http.get(f"{url}/metrics")).text
    # In the order of the workers' URLs (random ports): compared as a set.
    assert {(x["kind"], x["worker"], x["to"], x["outcome"]) for x in decisions} == {
        ("SetCpus", p_url, "0,1", "set"), ("SetCpus", d_url, "0,1", "set")}
    assert len(decisions) == 2
    assert "busiest D 0% busy: P over its target, D mostly idle" in decisions[0]["reason"]
    assert ('pd_fsm_planner_decisions_total{kind="SetCpus",outcome="set",'
            'pressure="prefill_bound",to="0,1"} 2.0') in metrics
    assert service.planner.placement == "shared"


async def test_scale_decisions_go_to_the_launcher_whose_workers_the_planner_observes(
    nursery: trio.Nursery,
) -> None:
    """With --launcher-url the planner observes the workers the launcher lists and posts its
    ScaleUp there: a launcher at its bound refuses it (409), counted ``refused``. Without a
    launcher the same decision is ``not_actionable``. (Launching for real:
    test_launcher.py.)"""
    p_url, p = await _worker(nursery, "prefill", {**IDLE, "queued": 10})
    d_url, d = await _worker(nursery, "decode", IDLE)
    cluster = Cluster([Child("prefill-0", ["-"], p_url, role="prefill"),
                       Child("decode-0", ["-"], d_url, role="decode")], startup_timeout=10)

    def no_new_worker(role: str, name: str) -> Child:
        raise AssertionError("a launcher at its bound starts nothing")

    launcher = Launcher(ProcessBackend(cluster, no_new_worker), max_workers=2,
                        proxy_url="http://127.0.0.1:9", headers={}, host="127.0.0.1", port=0,
                        start_timeout=5, stop_timeout=5)
    launcher_url: str = await nursery.start(launcher.serve)
    launcher.ready()
    config = PlannerConfig(patience=1, cooldown=3600, max_workers=3)
    outcomes = []
    for launcher_of in (launcher_url, None):
        service = PlannerService(Planner(config), workers=[] if launcher_of else [p_url, d_url],
                                 bootstrap_url=None, interval=0.05, launcher_url=launcher_of)
        await _until_it_decides(service)
        (decision,) = service.recent
        assert (decision["kind"], decision["to"]) == ("ScaleUp", "prefill"), decision
        outcomes.append(decision["outcome"])
        assert service.registry.get_sample_value("pd_fsm_planner_workers",
                                                 {"side": "prefill"}) == 1.0
    assert outcomes == ["refused", "not_actionable"]
    assert not (p.switches or d.switches)
