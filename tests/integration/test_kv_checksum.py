"""`--disaggregation-kv-checksum` with real processes (issue 31 §3): a P and a D that both run it
serve a PD request as the colocated worker does, every pull verified (the counters are in D's
/metrics); a D and a P that disagree refuse each other by name before a page is reserved, both
ways, and nothing is pulled. (Corrupted pulls, their re-pull and the failure policies are driven
at the scheduler level: ``test_kv_checksum_schedulers.py``.)

Real processes: bootstrap, a P and a D with the flag, a P and a D without, a colocated worker;
the tiny model, ``failure_support``'s short windows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    Proc,
    error_message,
    greedy,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow

CHECKSUM = ["--disaggregation-kv-checksum"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("kv_checksum"))
    f.bootstrap()
    f.prefill("pk", extra=CHECKSUM)
    f.decode("dk", extra=CHECKSUM)
    f.prefill("p0")
    f.decode("d0")
    f.colocated("c")
    f.start()
    yield f
    f.close()


async def _pd(http: httpx.AsyncClient, p: Proc, d: Proc, body: dict[str, Any]
              ) -> tuple[httpx.Response, httpx.Response]:
    out: dict[str, httpx.Response] = {}

    async def post(name: str, proc: Proc) -> None:
        out[name] = await http.post(f"{proc.url}/generate", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "p", p)
        nursery.start_soon(post, "d", d)
    return out["p"], out["d"]


def _metric(text: str, name: str) -> float:
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


async def test_a_checksummed_pd_request_is_verified_and_equals_colocated(fleet: Fleet) -> None:
    ids = prompt(19, seed=3)  # five pages of 4 tokens
    async with httpx.AsyncClient(timeout=60) as http:
        expected = await greedy(http, fleet["c"], ids, 6)
        before = (await stats(http, fleet["dk"]))["transfer"]
        p_r, d_r = await _pd(http, fleet["pk"], fleet["dk"], leg(new_room(), ids, 6, fleet["pk"]))
        assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
        assert d_r.json()["output_ids"] == expected
        after = (await stats(http, fleet["dk"]))["transfer"]
        assert after["pulls_ok"] == before["pulls_ok"] + 1
        assert after["pulls_corrupted"] == before["pulls_corrupted"] == 0
        metrics = (await http.get(f"{fleet['dk'].url}/metrics")).text
        for name in ("kv_checksum_mismatches_total", "kv_checksum_repulls_total"):
            assert _metric(metrics, f"pd_fsm_worker_backend_{name}") == 0.0, name
        # P says in the registry that its READY carries checksums (D checks it, see below).
        listed = (await http.get(f"{fleet.boot_url}/list", params={"role": "prefill"})).json()
        flags = sorted(r["mesh_meta"]["kv_checksum"] for r in listed["instances"])
        assert flags == [False, True], listed  # pk's and p0's
        await wait_clean(http, fleet["pk"], fleet["dk"], timeout=SLACK)


@pytest.mark.parametrize(("p", "d", "says"), [
    ("p0", "dk", "sends no KV checksums, this decode verifies every pull"),
    ("pk", "d0", "checksums its KV, this decode does not verify them"),
])
async def test_a_decode_and_a_prefill_that_disagree_refuse_each_other_by_name(
    fleet: Fleet, p: str, d: str, says: str
) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        before = (await stats(http, fleet[d]))["transfer"]
        p_r, d_r = await _pd(http, fleet[p], fleet[d],
                             leg(new_room(), prompt(9, seed=4), 4, fleet[p]))
        assert d_r.status_code >= 400, d_r.text
        message = error_message(d_r)
        assert says in message and "--disaggregation-kv-checksum" in message, message
        assert p_r.status_code >= 400, p_r.text  # P's leg ends too (no D ever claims it)
        assert (await stats(http, fleet[d]))["transfer"] == before  # nothing pulled
        await wait_clean(http, fleet[p], fleet[d], timeout=SLACK)
