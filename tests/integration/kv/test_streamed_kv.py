"""Streamed KV with real processes (issue 31 §1): a P with `--disaggregation-stream-tokens`
prefills a room's prompt in chunks and sends D each chunk's pages as a part (KV_PART) while it
computes the next; D pulls the parts, then READY's rest, and the answer equals the colocated
worker's. With `--disaggregation-kv-checksum` on both sides every part is verified too.
Afterwards both sides hold nothing (pages, rooms, registrations: the parts' included).

Real processes: a streaming P (``ps``) and a plain D (``d0``), a streaming P and a D with KV
checksums (``psk``, ``dk``), a colocated worker (``c``), in the fleet this package's modules
share (conftest.py); the tiny model (4-token pages). Which rows a part's
failures take (P dying after part k, a part's pull failing or corrupted, aborts between parts)
is proven in the core's exhaustive and property tests and the simulator's seeds."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    Proc,
    d_leg_first,
    greedy,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow

async def _streamed(http: httpx.AsyncClient, fleet: Fleet, p: Proc, d: Proc, ids: list[int],
                    parts: int) -> None:
    expected = await greedy(http, fleet["c"], ids, 6)
    before = (await stats(http, d))["transfer"]
    p_r, d_r = await d_leg_first(http, p, d, leg(new_room(), ids, 6, p))
    assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
    assert d_r.json()["output_ids"] == expected
    after = (await stats(http, d))["transfer"]
    # Every part, then READY's rest: one pull each, none failed or corrupted.
    assert after["parts_pulled"] - before["parts_pulled"] == parts
    assert after["pulls_ok"] - before["pulls_ok"] == parts + 1
    assert after["pulls_failed"] == before["pulls_failed"]
    assert after["pulls_corrupted"] == before["pulls_corrupted"] == 0
    await wait_clean(http, p, d, timeout=SLACK)


@pytest.mark.parametrize(("tokens", "parts"), [
    (19, 2),  # 5 pages: chunks of 8 tokens write pages 0-1 and 2-3; READY brings page 4
    (7, 0),  # shorter than a part: one chunk, everything with READY
    (33, 4),  # 9 pages: four parts of 2 pages; READY brings page 8 (a chunk of 1 token)
])
async def test_a_streamed_room_equals_colocated_and_leaves_nothing(
    fleet: Fleet, tokens: int, parts: int
) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        await _streamed(http, fleet, fleet["ps"], fleet["d0"], prompt(tokens, seed=tokens), parts)


async def test_a_prefix_cache_hit_goes_to_d_as_a_part_at_admission(fleet: Fleet) -> None:
    # 33 tokens, 9 pages: the first room streams four parts of 2 pages, and P's prefix cache
    # keeps pages 0-7. The second room with the same prompt hits them: they are written before
    # any forward, so they go as one part at admission (pulled while P computes token 33), and
    # READY brings page 8 — not all nine pages with READY after the forward.
    async with httpx.AsyncClient(timeout=60) as http:
        ids = prompt(33, seed=331)
        for parts in (4, 1):
            await _streamed(http, fleet, fleet["ps"], fleet["d0"], ids, parts)


async def test_streamed_parts_are_checksummed_and_verified(fleet: Fleet) -> None:
    async with httpx.AsyncClient(timeout=60) as http:
        await _streamed(http, fleet, fleet["psk"], fleet["dk"], prompt(19, seed=19), 2)
