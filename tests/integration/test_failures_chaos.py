"""Chaos under load (issue 32 §4): real `pd-fsm` processes, tiny model, 2 P and 2 D behind our
proxy. Clients stream greedy requests without pause while one worker at a time is SIGKILLed (or
SIGTERMed) and started again. Every stream that started completes and equals the colocated
answer token for token (a leg lost before any byte reached the client retries in a new room; a
stream whose D died migrates; a SIGTERMed worker drains, a D handing its streams off to the
other D with `--drain-handoff`), and afterwards every worker holds nothing: pages, rooms, queues,
transfer registrations.

Sized for the suite: a few faults over ~30 s of load.
"""

from __future__ import annotations

import random
import signal
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import SLACK, Fleet, prompt, wait_clean, wait_healthy
from tests.integration.serve_support import sse_events

pytestmark = pytest.mark.slow

CLIENTS = 3
# One worker down at a time (never every worker of a role); few, to fit the suite's budget.
FAULTS = {signal.SIGKILL: 2, signal.SIGTERM: 2}
PREFILLS, DECODES = ("p0", "p1"), ("d0", "d1")
WORKERS = PREFILLS + DECODES


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Production windows: a busy machine must not fail a room by a short lease here.
    f = Fleet(tmp_path_factory.mktemp("chaos"), windows={})
    f.bootstrap()
    p0, p1 = f.prefill("p0"), f.prefill("p1")
    # A SIGTERMed D hands its streams to the other D (issue 32 §2): their KV is pulled, not
    # prefilled again. SIGKILL never drains, so the flag changes nothing there.
    # Each D has pages for every stream of both (3 clients, up to 256 tokens each, 4 a page):
    # a D without free pages refuses a hand-off by design, and the stream then re-prefills
    # (seen under load with 64 pages; counted as handoffs_total{fell_back}).
    d0, d1 = (f.decode(name, num_pages=256, extra=["--drain-handoff"]) for name in ("d0", "d1"))
    f.colocated()
    f.proxy("proxy", [p0, p1], [d0, d1])
    f.start()
    yield f
    f.close()


def _body(rng: random.Random) -> dict[str, Any]:
    return {"input_ids": prompt(rng.randint(4, 40), seed=rng.randint(0, 5)), "stream": True,
            "sampling_params": {"max_new_tokens": rng.choice((24, 64, 120)), "temperature": 0,
                                "ignore_eos": True}}


async def _reference(http: httpx.AsyncClient, fleet: Fleet, body: dict[str, Any],
                     cache: dict[str, list[int]]) -> list[int]:
    key = repr((body["input_ids"], body["sampling_params"]["max_new_tokens"]))
    if key not in cache:
        r = await http.post(f"{fleet['colocated'].url}/generate", json={**body, "stream": False})
        assert r.status_code == 200, r.text
        cache[key] = list(r.json()["output_ids"])
    return cache[key]


async def _proxy_counts(http: httpx.AsyncClient, fleet: Fleet) -> Counter[str]:
    r = await http.get(f"{fleet['proxy'].url}/metrics")
    out: Counter[str] = Counter()
    for line in r.text.splitlines():
        if line.startswith("pd_fsm_proxy_rooms_reopened_total{"):
            out[line.split('key="')[1].split('"')[0]] = int(float(line.rsplit(" ", 1)[1]))
    return out


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
async def test_every_stream_completes_while_workers_die_and_come_back(
    fleet: Fleet, how: signal.Signals
) -> None:
    rng = random.Random(f"chaos-{how.name}")
    references: dict[str, list[int]] = {}
    done = trio.Event()
    results: list[tuple[list[int], list[int], str]] = []  # (got, expected, tail)

    async def client(i: int, http: httpx.AsyncClient) -> None:
        crng = random.Random(f"{how.name}-{i}")
        while not done.is_set():
            body = _body(crng)
            expected = await _reference(http, fleet, body, references)
            r = await http.post(f"{fleet['proxy'].url}/generate", json=body)
            assert r.status_code == 200, r.text[:500]
            events = sse_events(r.text)
            chunks = [e for e in events if isinstance(e, dict)]
            got = list(chunks[-1]["output_ids"]) if chunks else []
            ok = events[-1:] == ["[DONE]"] and not any("error" in c for c in chunks)
            results.append((got, expected, "" if ok else r.text[-400:]))

    # Each kind of worker at least once: a free draw from WORKERS picked only Ds for both seeds.
    victims = [rng.choice(PREFILLS), rng.choice(DECODES)]
    victims += [rng.choice(WORKERS) for _ in range(FAULTS[how] - len(victims))]
    rng.shuffle(victims)

    async def chaos() -> None:
        for name in victims:
            await trio.sleep(rng.uniform(1.5, 3.0))  # under load for a while
            victim = fleet[name]
            if how == signal.SIGKILL:
                await trio.to_thread.run_sync(victim.kill)
            else:  # drains: the requests it has finish there, then it exits
                await trio.to_thread.run_sync(victim.stop, 60.0)
                assert victim.popen is not None and victim.popen.returncode == 0
            victim.start()
            await trio.to_thread.run_sync(wait_healthy, [victim], 120.0)
        await trio.sleep(2.0)
        done.set()

    async with httpx.AsyncClient(timeout=120) as http:
        before = await _proxy_counts(http, fleet)
        async with trio.open_nursery() as nursery:
            for i in range(CLIENTS):
                nursery.start_soon(client, i, http)
            nursery.start_soon(chaos)
        after = await _proxy_counts(http, fleet)
        broken = [tail for got, expected, tail in results if tail or got != expected]
        assert not broken, f"{len(broken)} of {len(results)} streams broken: {broken[:3]}"
        assert len(results) >= CLIENTS * FAULTS[how]  # load ran through every fault
        if how == signal.SIGTERM:
            # Drains: a drained D's streams are handed off (their KV pulled by the other D) or
            # finish there, P's finish there: no migration, no re-prefill; a drained D's 503
            # moves the leg to the other D in the same room (redirect), a drained P's 503
            # retries before any prefill was done.
            assert after["migration"] == before["migration"], after - before
        print(f"{how.name}: {victims}, {len(results)} streams, reopened {dict(after - before)}")
        await wait_clean(http, *(fleet[w] for w in WORKERS), timeout=SLACK * 4)
