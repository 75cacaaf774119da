"""P dies while D pulls several rooms from it: D's pages come back at once, not when each pull
gives up (issue found by hand: 36 s after P's SIGKILL, D still held 48 of its 255 pages).

Real `pd-fsm serve` processes on the tiny model: the bootstrap server, ``pkill`` and ``phang``
(the P's that die, one per test), ``plive`` (a P that stays up) and ``d``, whose pull deadline
(60 s) and transfer backstop (120 s) are the production defaults, so that a page held until a
pull gives up is held far past the bound these tests allow: the peer timeout, two heartbeats and
SLACK. A busy process runs beside D the whole time (CPU contention, as when the bug was found).

"Pulls in flight when P dies" is staged, not raced (a loopback pull of the tiny model's KV takes
milliseconds): D is frozen (SIGSTOP) while P hands its rooms off (READY waits in D's socket), P is
frozen, D resumed: its pulls go on the wire to a P that cannot answer. Then either P is SIGKILLed
(its connection closes under the pulls, and the pulls queued behind them meet a dead port), or it
stays frozen, a hung P, until D declares it lost: the path where only D's own decision can free
the pages, since no pull ends by itself before its deadline. Every wait is a deadline.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    HEARTBEAT,
    PEER_TIMEOUT,
    SLACK,
    Fleet,
    Proc,
    kvpoll,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
    wait_until,
    warm_pd,
)

pytestmark = pytest.mark.slow

LONG_PULL = 60.0  # D's pull deadline: no page may wait for it
LONG_FLAGS = ["--disaggregation-pull-deadline", str(LONG_PULL),
              "--disaggregation-transfer-timeout", str(2 * LONG_PULL)]
ROOMS = 6  # rooms handed off by P before it dies
PULLING = 3  # of those, at least this many pulling when it dies: more than D's pull threads (2)
# Every prompt this long, as the warm-up's: nothing compiles while D is frozen, since P's lease
# (3 s from D's hello, extended by heartbeats a frozen D does not send) must outlast the staging.
PROMPT = 9
# The latest D may hold a page of theirs after P's death: P is judged lost once silent for the
# peer timeout, at a heartbeat; then the rest is slack for a loaded 2-core machine.
PAGES_BACK = PEER_TIMEOUT + 2 * HEARTBEAT + SLACK
assert PAGES_BACK < LONG_PULL


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("p_dies_mid_pull"))
    f.bootstrap()
    prefills = [f.prefill(name) for name in ("pkill", "phang", "plive")]
    d = f.decode("d", num_pages=96, extra=LONG_FLAGS)
    f.start()
    warm_pd(prefills, d, (PROMPT,))  # compiled, and D's connections to every P open
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # beside D
    try:
        yield f
    finally:
        busy.kill()
        busy.wait(10)
        f.close()


def _pages(s: dict[str, Any]) -> tuple[int, int]:
    return int(s["free_pages"]) + int(s.get("cached_pages", 0)), int(s["total_pages"])


async def _stage_pulls_on_a_frozen_p(http: httpx.AsyncClient, p: Proc, d: Proc,
                                     nursery: trio.Nursery, answers: dict[int, int]) -> int:
    """ROOMS rooms handed off by ``p`` (READY sent), at least PULLING of them pulled by ``d``
    from ``p``, frozen: D's legs run in ``nursery``, their statuses land in ``answers``. The
    pulls seen in flight."""

    async def d_leg(room: int, body: dict[str, Any]) -> None:
        r = await http.post(f"{d.url}/generate", json=body)
        answers[room] = r.status_code

    rooms = [new_room() for _ in range(ROOMS)]
    bodies = {room: leg(room, prompt(PROMPT, seed=40 + i), 4, p) for i, room in enumerate(rooms)}
    for room, body in bodies.items():
        nursery.start_soon(d_leg, room, body)

    async def hellos() -> bool | None:
        return True if kvpoll(await stats(http, p), "EARLY_PEER") == ROOMS else None

    await wait_until(hellos, SLACK, "D's hellos for every room")
    d.pause()
    try:
        for body in bodies.values():  # P prefills, registers, sends READY (D's socket keeps it)
            r = await http.post(f"{p.url}/generate", json=body)
            assert r.status_code == 200, r.text
        # The last READY may still be in P's side-channel queue when its leg answers: a moment
        # for it to leave (a READY frozen in P fails its room at P's loss, as the others do).
        await trio.sleep(0.2)
        p.pause()
    finally:
        d.resume()

    async def pulling() -> int | None:
        n = int((await stats(http, d))["pd_queues"]["pulls_inflight"])
        return n if n >= PULLING else None

    seen, _ = await wait_until(pulling, SLACK, f"D pulling {PULLING} rooms from the frozen P")
    return seen


async def test_p_sigkilled_with_pulls_in_flight_d_gets_its_pages_back(fleet: Fleet) -> None:
    """The bug's own case: P SIGKILLed while D's pulls from it are on the wire and more wait
    for a pull thread. The pulls on P's connection fail when it closes; those behind them find
    nothing listening at P's address (they used to wait on a fresh connection until their
    deadline, holding their pages). Every room answers 502 naming the transfer or P, and D's
    pages are all back within PAGES_BACK; then D serves a room of the other P."""
    pdie, plive, d = fleet["pkill"], fleet["plive"], fleet["d"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        await wait_clean(http, d, timeout=SLACK)
        answers: dict[int, int] = {}
        async with trio.open_nursery() as nursery:
            pulling = await _stage_pulls_on_a_frozen_p(http, pdie, d, nursery, answers)
            killed = trio.current_time()
            pdie.kill()

            async def pages_back() -> bool | None:
                free, total = _pages(await stats(http, d))
                return True if free == total else None

            await wait_until(pages_back, PAGES_BACK, "D's pages all back after P's death")
            print(f"D's pages back {trio.current_time() - killed:.2f} s after P's SIGKILL, "
                  f"{pulling} pulls in flight")
        assert sorted(answers.values()) == [502] * ROOMS, answers
        await wait_clean(http, d, timeout=SLACK)
        await _serves(http, plive, d)


async def test_p_hangs_mid_pull_d_frees_the_pages_when_p_is_lost(fleet: Fleet) -> None:
    """P hangs (frozen) with D's pulls on the wire: no pull ends by itself before its 60 s
    deadline. Once P is lost (its heartbeats unanswered for the peer timeout), D's rooms fail,
    their pulls are cancelled and their pages come back at once, P still frozen; the lost P's
    connections are dropped, which ends the hung pulls too (no pull left in flight: D's pull
    threads are free for the other P, whose room is served while this one is still frozen)."""
    pdie, plive, d = fleet["phang"], fleet["plive"], fleet["d"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        await wait_clean(http, d, timeout=SLACK)
        before = (await stats(http, d))["transfer"]
        answers: dict[int, int] = {}
        try:
            async with trio.open_nursery() as nursery:
                pulling = await _stage_pulls_on_a_frozen_p(http, pdie, d, nursery, answers)
                frozen = trio.current_time()

                async def released() -> bool | None:
                    s = await stats(http, d)
                    free, total = _pages(s)
                    idle = free == total and not s["pd_queues"]["pulls_inflight"]
                    return True if idle else None

                await wait_until(released, PAGES_BACK, "D's pages back and no pull in flight, "
                                 "P still frozen")
                print(f"D's pages back {trio.current_time() - frozen:.2f} s after P froze, "
                      f"{pulling} pulls in flight")
                assert pdie.alive()
                await _serves(http, plive, d)
        finally:
            pdie.kill()
        assert sorted(answers.values()) == [502] * ROOMS, answers
        after = (await stats(http, d))["transfer"]
        # Each room that failed with its pull in flight: cancelled, nothing scattered.
        assert after["pulls_cancelled"] - before["pulls_cancelled"] >= pulling
        # plive's room alone was scattered whole (a part P streamed while it prefilled is a
        # pull of its own, here or from the frozen P before it froze: parts_pulled counts them)
        whole = [t["pulls_ok"] - t["parts_pulled"] for t in (before, after)]
        assert whole[1] == whole[0] + 1, (before, after)
        await wait_clean(http, d, timeout=SLACK)


async def _serves(http: httpx.AsyncClient, p: Proc, d: Proc) -> None:
    """A room of ``p`` through ``d``, both legs: a 200 with its tokens."""
    room = new_room()
    body = leg(room, prompt(PROMPT, seed=77), 4, p)

    async def post(proc: Proc, out: dict[str, httpx.Response]) -> None:
        out[proc.name] = await http.post(f"{proc.url}/generate", json=body)

    out: dict[str, httpx.Response] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, d, out)
        nursery.start_soon(post, p, out)
    assert out[p.name].status_code == 200, out[p.name].text
    assert out[d.name].status_code == 200, out[d.name].text
    assert len(out[d.name].json()["output_ids"]) == 4
