"""The adaptive loop end to end (issue 30 §1 and §2), in real processes on the tiny model: a
bootstrap server, P ``a`` and Ds ``b`` and ``c`` (each ``--roles prefill,decode``), a colocated
reference, ``pd-fsm proxy`` given static lists (it follows roles by probing ``/server_info``)
and ``pd-fsm planner`` over the three workers.

The planner's TTFT target is set far below anything the tiny model can do and its ITL target far
above, so its first observation of P's real TTFT histogram is prefill-bound: it switches one D
to prefill with ``POST /switch_role``. Requests flow through the proxy the whole time: every one
answers 200 with the colocated tokens (a leg refused by the draining D goes to the other D), the
proxy routes the switched worker as a P within its probe interval, requests then use it as P,
and every worker ends holding nothing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    proxied_and_greedy,
    wait_clean,
    wait_until,
)

ROLES = ["--roles", "prefill,decode", "--drain-timeout", "20"]
PROBE_S = 0.3


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("role_switch_planner"))
    f.bootstrap()
    a = f.prefill("a", extra=ROLES)
    b, c = f.decode("b", extra=ROLES), f.decode("c", extra=ROLES)
    f.colocated()
    f.proxy("proxy", [a], [b, c], extra=["--role-probe-interval", str(PROBE_S)])
    f.planner("planner", [a, b, c], ["--ttft-slo", "0.0001", "--itl-slo", "100",
                                     "--interval", "0.5", "--patience", "1",
                                     "--cooldown", "3600"])
    f.start()
    yield f
    f.close()


async def test_the_planner_switches_a_decode_worker_to_prefill_and_nothing_is_lost(
    fleet: Fleet,
) -> None:
    answers: list[tuple[list[int], list[int]]] = []
    async with httpx.AsyncClient(timeout=60) as http:
        planner, proxy = fleet["planner"].url, fleet["proxy"].url

        async def decided() -> dict[str, Any] | None:
            got = (await http.get(f"{planner}/decisions")).json()["decisions"]
            return got[0] if got else None

        async with trio.open_nursery() as nursery:
            stop = trio.Event()

            async def traffic() -> None:  # through the whole switch
                seed = 0
                while not stop.is_set():
                    answers.append(await proxied_and_greedy(http, fleet, seed))
                    seed += 1

            nursery.start_soon(traffic)
            decision, _ = await wait_until(decided, 60, "a planner decision")
            assert (decision["kind"], decision["to"], decision["outcome"]) == (
                "SwitchRole", "prefill", "switching"), decision
            moved = decision["worker"]
            assert moved in (fleet["b"].url, fleet["c"].url)
            assert "prefill pressure" in decision["reason"]

            async def routed_as_prefill() -> bool | None:
                w = (await http.get(f"{proxy}/workers")).json()
                return True if moved in w["prefill"] and moved not in w["decode"] else None

            await wait_until(routed_as_prefill, 60, f"the proxy routing {moved} as P")
            before = len(answers)
            with trio.fail_after(60):
                while len(answers) < before + 6:
                    await trio.sleep(0.05)
            stop.set()
        info = (await http.get(f"{moved}/server_info")).json()
        assert (info["disaggregation_mode"], info["role_epoch"], info["role_state"]) == (
            "prefill", 1, "SERVING")
        # The switched worker served prefill legs after the switch (round robin over two P).
        served = info["internal_states"][0].get("requests_total", {})
        assert sum(served.values()) >= 1, info["internal_states"][0]
        metrics = (await http.get(f"{planner}/metrics")).text
        proxy_metrics = (await http.get(f"{proxy}/metrics")).text
        await wait_clean(http, fleet["a"], fleet["b"], fleet["c"], timeout=SLACK)
    # No client saw an error, and every answer is the colocated one.
    assert answers and all(got == want for got, want in answers), answers
    assert ('pd_fsm_planner_decisions_total{kind="SwitchRole",outcome="switching",'
            'pressure="prefill_bound",to="prefill"} 1.0') in metrics
    # Into prefill (and out of decode while it drained, if a probe saw it draining).
    changes = re.search(r"^pd_fsm_proxy_role_changes_total (\S+)$", proxy_metrics, re.M)
    assert changes is not None and float(changes.group(1)) in (1.0, 2.0), proxy_metrics
