"""`--kv-dtype bfloat16` with real processes (issue 33 §2): a bf16 P and a bf16 D serve a PD
request as a bf16 colocated worker does, every pull moving half the bytes of the same request
between f32 workers; a D whose KV dtype differs from its P's refuses the room by name before
reserving a page, and everything is released afterwards.

Real processes: bootstrap, a bf16 P and D, an f32 P and D, a bf16 and an f32 colocated worker,
the tiny model, ``failure_support``'s short windows."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    both_legs,
    greedy,
    leg,
    new_room,
    prompt,
    refused_by_name,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow

BF16 = ["--kv-dtype", "bfloat16"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("kv_dtype"))
    f.bootstrap()
    f.prefill("p16", extra=BF16)
    f.decode("d16", extra=BF16)
    f.prefill("p32")
    f.decode("d32")
    f.colocated("c16", extra=BF16)
    f.colocated("c32")
    f.start()
    yield f
    f.close()


async def test_bf16_pd_equals_bf16_colocated_and_moves_half_the_bytes(fleet: Fleet) -> None:
    ids = prompt(23, seed=5)  # six pages of 4 tokens
    pulled: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for p, d, c in (("p16", "d16", "c16"), ("p32", "d32", "c32")):
            expected = await greedy(http, fleet[c], ids, 6)
            before = int((await stats(http, fleet[d]))["transfer"]["bytes"])
            p_r, d_r = await both_legs(http, fleet[p], fleet[d], leg(new_room(), ids, 6, fleet[p]))
            assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
            assert d_r.json()["output_ids"] == expected, (d, c)
            pulled[d] = int((await stats(http, fleet[d]))["transfer"]["bytes"]) - before
        assert pulled["d16"] * 2 == pulled["d32"] > 0, pulled
        # Each P registers the dtype its pool keeps (D checks it before reserving pages).
        listed = (await http.get(f"{fleet.boot_url}/list", params={"role": "prefill"})).json()
        assert sorted(r["kv_dtype"] for r in listed["instances"]) == ["bfloat16", "float32"]
        await wait_clean(http, *(fleet[n] for n in ("p16", "d16", "p32", "d32")), timeout=SLACK)


async def test_a_decode_of_another_kv_dtype_refuses_the_prefill_by_name(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        message = await refused_by_name(http, fleet["p16"], fleet["d32"], prompt(9, seed=6))
    assert "keeps its KV in bfloat16, this decode in float32" in message, message
    assert "--kv-dtype" in message, message
