"""`--disaggregation-kv-checksum` with real processes (issue 31 §3): a P and a D that both run it
serve a PD request as the colocated worker does, every pull verified (the counters are in D's
/metrics); a D and a P that disagree refuse each other by name before a page is reserved, both
ways, and nothing is pulled. (Corrupted pulls, their re-pull and the failure policies are driven
at the scheduler level: ``test_kv_checksum_schedulers.py``.)

Real processes: a P and a D with the flag (``pk``, ``dk``), a P and a D without (``p0``,
``d0``), a colocated worker (``c``), in the fleet this package's modules share (conftest.py)."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    both_legs,
    greedy,
    leg,
    new_room,
    prefill_record,
    prompt,
    refused_by_name,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow


def _metric(text: str, name: str) -> float:
    (value,) = [line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")]
    return float(value)


async def test_a_checksummed_pd_request_is_verified_and_equals_colocated(fleet: Fleet) -> None:
    ids = prompt(19, seed=3)  # five pages of 4 tokens
    async with httpx.AsyncClient(timeout=60) as http:
        expected = await greedy(http, fleet["c"], ids, 6)
        before = (await stats(http, fleet["dk"]))["transfer"]
        pk, dk = fleet["pk"], fleet["dk"]
        p_r, d_r = await both_legs(http, pk, dk, leg(new_room(), ids, 6, pk))
        assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
        assert d_r.json()["output_ids"] == expected
        after = (await stats(http, fleet["dk"]))["transfer"]
        assert after["pulls_ok"] == before["pulls_ok"] + 1
        assert after["pulls_corrupted"] == before["pulls_corrupted"] == 0
        metrics = (await http.get(f"{fleet['dk'].url}/metrics")).text
        for name in ("kv_checksum_mismatches_total", "kv_checksum_repulls_total"):
            assert _metric(metrics, f"pd_fsm_worker_backend_{name}") == 0.0, name
        # P says in the registry that its READY carries checksums (D checks it, see below).
        for name, flag in (("pk", True), ("p0", False)):
            record = await prefill_record(http, fleet, fleet[name])
            assert record["mesh_meta"]["kv_checksum"] is flag, (name, record)
        await wait_clean(http, fleet["pk"], fleet["dk"], timeout=SLACK)


@pytest.mark.parametrize(("p", "d", "says"), [
    ("p0", "dk", "sends no KV checksums, this decode verifies every pull"),
    ("pk", "d0", "checksums its KV, this decode does not verify them"),
])
async def test_a_decode_and_a_prefill_that_disagree_refuse_each_other_by_name(
    fleet: Fleet, p: str, d: str, says: str
) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        message = await refused_by_name(http, fleet[p], fleet[d], prompt(9, seed=4))
    assert says in message and "--disaggregation-kv-checksum" in message, message
