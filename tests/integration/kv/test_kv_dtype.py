"""`--kv-dtype bfloat16` with real processes (issue 33 §2): a bf16 P and a bf16 D serve a PD
request as a bf16 colocated worker does, every pull moving half the bytes of the same request
between f32 workers; a D whose KV dtype differs from its P's refuses the room by name before
reserving a page, and everything is released afterwards.

Real processes: a bf16 P and D (``p16``, ``d16``), an f32 P and D (``p0``, ``d0``), a bf16 and
an f32 colocated worker (``c16``, ``c``), in the fleet this package's modules share
(conftest.py)."""

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

async def test_bf16_pd_equals_bf16_colocated_and_moves_half_the_bytes(fleet: Fleet) -> None:
    ids = prompt(23, seed=5)  # six pages of 4 tokens
    pulled: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for p, d, c in (("p16", "d16", "c16"), ("p0", "d0", "c")):
            expected = await greedy(http, fleet[c], ids, 6)
            before = int((await stats(http, fleet[d]))["transfer"]["bytes"])
            p_r, d_r = await both_legs(http, fleet[p], fleet[d], leg(new_room(), ids, 6, fleet[p]))
            assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
            assert d_r.json()["output_ids"] == expected, (d, c)
            pulled[d] = int((await stats(http, fleet[d]))["transfer"]["bytes"]) - before
        assert pulled["d16"] * 2 == pulled["d0"] > 0, pulled
        # Each P registers the dtype its pool keeps (D checks it before reserving pages).
        for name, dtype in (("p16", "bfloat16"), ("p0", "float32")):
            record = await prefill_record(http, fleet, fleet[name])
            assert record["kv_dtype"] == dtype, (name, record)
        await wait_clean(http, *(fleet[n] for n in ("p16", "d16", "p0", "d0")), timeout=SLACK)


async def test_a_decode_of_another_kv_dtype_refuses_the_prefill_by_name(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        message = await refused_by_name(http, fleet["p16"], fleet["d0"], prompt(9, seed=6))
    assert "keeps its KV in bfloat16, this decode in float32" in message, message
    assert "--kv-dtype" in message, message
