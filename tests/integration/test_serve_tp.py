"""Tensor-parallel instances through PD, with real processes: P and D of equal and of different
tp sizes (the tiny model's 4 kv-heads; CPU devices forced by ``pd-fsm serve --tp``), D pulling
P's per-shard KV over ``jax.experimental.transfer`` and regrouping it onto its own devices. Every
answer equals the colocated tp=1 worker's; afterwards every page and registration is released.
Then ``pd-fsm cluster --prefill-tp 2 --decode-tp 1`` answers through its proxy as colocated."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    HOST,
    Fleet,
    d_leg_first,
    greedy,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
)
from tests.integration.serve_support import (
    PDCluster,
    fetch_answer,
    request_body,
)

pytestmark = pytest.mark.slow

TP = {"p1": 1, "p2": 2, "p4": 4, "d1": 1, "d2": 2}
# (P, D): tp 1 -> 2 (split), 2 -> 1 and 4 -> 2 (merge), 2 -> 2 (as is).
PAIRS = [("p1", "d2"), ("p2", "d1"), ("p4", "d2"), ("p2", "d2")]
LENGTHS = (5, 23, 61)  # 2, 6 and 16 pages of 4 tokens
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("tp"), windows={})
    fleet.bootstrap()
    for name, tp in TP.items():
        role = fleet.prefill if name.startswith("p") else fleet.decode
        # P streams its KV in parts of 8 tokens (2 pages): each part is registered per shard
        # and regrouped by D as READY's rest is (issue 31 §1).
        stream = ["--disaggregation-stream-tokens", "8"] if name.startswith("p") else []
        role(name, extra=["--tp", str(tp), *stream])
    fleet.colocated()
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.close()


@pytest.mark.parametrize(("p", "d"), PAIRS)
async def test_pd_between_tp_sizes_equals_colocated(fleet: Fleet, p: str, d: str) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
        before = (await stats(http, fleet[d]))["transfer"]
        for seed, n in enumerate(LENGTHS):
            # A prompt of its own per pair: a P's prefix cache would hold one it prefilled for
            # another pair, and prefill only its last page (no chunks, so no parts).
            ids = prompt(n, seed + 10 * PAIRS.index((p, d)))
            want = await greedy(http, fleet["colocated"], ids, NEW_TOKENS)
            # D's leg first, P's once D's hello reached P: the parts stream (the tiny model's
            # prefill is faster than D's hello otherwise).
            p_r, d_r = await d_leg_first(http, fleet[p], fleet[d],
                                         leg(new_room(), ids, NEW_TOKENS, fleet[p]))
            answers = {p: p_r, d: d_r}
            assert answers[p].status_code == 200, answers[p].text
            assert answers[d].status_code == 200, answers[d].text
            assert answers[d].json()["output_ids"] == want, (p, d, n)
        after = (await stats(http, fleet[d]))["transfer"]
        # Parts: none for 5 tokens (one chunk), 2 for 23 (chunks 8, 8, 7), 7 for 61; then READY's.
        assert after["parts_pulled"] - before["parts_pulled"] == 0 + 2 + 7
        assert after["pulls_ok"] - before["pulls_ok"] == len(LENGTHS) + 9
        await wait_clean(http, fleet[p], fleet[d], timeout=30)


async def test_registry_records_each_instance_tp_size(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=10) as http:
        for name in ("p1", "p2", "p4"):
            r = await http.get(f"{fleet.boot_url}/route", params={
                "role": "prefill", "host": HOST, "port": fleet[name].bootstrap_port})
            assert r.status_code == 200, r.text
            (record,) = r.json()["instances"]
            assert (record["tp_rank"], record["tp_size"]) == (0, TP[name])
            assert record["mesh_meta"]["kv_shards"] == TP[name]


def test_cluster_prefill_tp2_decode_tp1(tmp_path: Path) -> None:
    cluster = PDCluster.start(["--model", "tiny", "--prefill", "1", "--decode", "1",
                               "--prefill-tp", "2", "--decode-tp", "1", "--colocated",
                               "--page-size", "4", "--num-pages", "128", "--max-running", "4",
                               "--context-length", "256", "--startup-timeout", "240"])
    try:
        async def main() -> None:
            async with httpx.AsyncClient(timeout=120) as http:
                for endpoint in ("generate", "chat"):
                    body = request_body(endpoint, "Sharded heads, one answer", 12,
                                        stream=endpoint == "chat")
                    pd = await fetch_answer(http, cluster.urls["proxy"], endpoint, body)
                    ref = await fetch_answer(http, cluster.urls["colocated"], endpoint, body)
                    assert pd == ref, endpoint

        trio.run(main)
    finally:
        cluster.stop()
