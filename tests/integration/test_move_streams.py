"""A worker gives its running streams up to another (``POST /move_streams``, issue 30: the
planner's standby D after a merge), in real processes on the tiny model: a bootstrap server,
P ``p``, D ``d``, a colocated worker ``colocated`` (also the greedy reference), and
``pd-fsm proxy`` routing P/D with the colocated worker listed beside them.

A long greedy stream goes P ``p`` -> D ``d``; mid-stream ``d`` is told to move its streams: it
ends the stream with a move event, the proxy reopens the request around ``d`` and the colocated
worker prefills the prompt and the tokens so far and goes on. The client's stream is whole and
equals the colocated answer; the proxy counted one move (a hand-off room without KV, not a
migration); ``d`` counted the stream as moved, not failed; every worker ends holding nothing.
A stream the proxy did not let move (posted to ``d`` directly), one longer than
``max_context``, and a prefill worker's streams stay where they are; malformed bodies get a 400
that names the field."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trio

from pd_fsm.core.planner import MoveStreams, Planner, PlannerConfig
from pd_fsm.io_trio.planner.service import PlannerService
from tests.integration.failure_support import (
    SLACK,
    Fleet,
    proxy_counts,
    stats,
    stream_acting_midway,
    wait_clean,
    wait_until,
)
from tests.integration.serve_support import (
    PATHS,
    fetch_answer,
    full_length_stream,
    sse_events,
)

pytestmark = pytest.mark.slow

PROMPT = "Tell me about the river city"
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("move_streams"), windows={})
    f.bootstrap()
    p = f.prefill("p")
    d = f.decode("d")
    c = f.colocated()
    f.proxy("proxy", [p], [d], extra=["--colocated", str(c.url)])
    f.start()
    yield f
    f.close()


async def _streams(http: httpx.AsyncClient, url: str) -> float:
    r = await http.get(f"{url}/metrics")
    line = next(x for x in r.text.splitlines()
                if x.startswith("pd_fsm_proxy_streams_moved_total "))
    return float(line.rsplit(" ", 1)[1])


async def test_a_moved_stream_goes_on_on_the_colocated_worker_whole(fleet: Fleet) -> None:
    body = full_length_stream(PROMPT, MAX_TOKENS)
    proxy, d, c = fleet["proxy"].url, fleet["d"], fleet["colocated"]
    async with httpx.AsyncClient(timeout=60) as http:
        reference = await fetch_answer(http, str(c.url), "generate", {**body, "stream": False})
        before = await proxy_counts(http, str(proxy))
        c_before = sum((await stats(http, c))["requests_total"].values())

        # The planner's own adapter carries the move out (paused: it decides nothing itself).
        planner = PlannerService(Planner(PlannerConfig()), workers=[str(d.url)],
                                 bootstrap_url=None, interval=60.0, paused=True)

        async def moved_on_d() -> bool | None:
            return True if (await stats(http, d))["requests_total"]["moved"] == 1 else None

        async def move() -> bool:
            # Six events in, the stream runs on d: the move ends it there at d's next tick.
            assert await planner.act(MoveStreams(str(d.url), 4096, "the test's")) == "moved"
            return (await wait_until(moved_on_d, SLACK, "d counting the stream moved"))[0]

        async with trio.open_nursery() as nursery:
            await nursery.start(planner.run)
            raw = await stream_acting_midway(http, f"{proxy}{PATHS['generate']}", body, move)
            nursery.cancel_scope.cancel()
        after = await proxy_counts(http, str(proxy))
        d_stats, c_stats = await stats(http, d), await stats(http, c)
        streams_moved = await _streams(http, str(proxy))
        await wait_clean(http, fleet["p"], d, c, timeout=SLACK)
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
    assert b"pd_fsm.moved" not in raw  # the move event is the proxy's, never the client's
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in e for e in chunks), raw[-800:]
    assert chunks[-1]["text"] == reference.text  # no token repeated or missing
    assert chunks[-1]["meta_info"]["completion_tokens"] == MAX_TOKENS
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("rooms_reopened_total:handoff") == 1, delta
    assert not delta.get("rooms_reopened_total:migration"), delta  # no failure, no limit used
    assert not any(delta.get(f"handoffs_total:{k}") for k in ("taken", "fell_back", "failed"))
    assert streams_moved == 1
    assert d_stats["requests_total"]["moved"] == 1 and d_stats["requests_total"]["error"] == 0
    # The colocated worker took the moved stream as one more request (after the reference).
    assert sum(c_stats["requests_total"].values()) == c_before + 1


async def test_streams_without_leave_or_too_long_stay_and_bad_bodies_are_refused(
        fleet: Fleet) -> None:
    p, d = fleet["p"], fleet["d"]
    body = full_length_stream(PROMPT, MAX_TOKENS)
    async with httpx.AsyncClient(timeout=60) as http:
        answers: list[int] = []

        async def move(limit: int) -> bool:
            r = await http.post(f"{d.url}/move_streams", json={"max_context": limit})
            assert r.status_code == 200, r.text
            answers.append(r.json()["moved"])
            return True

        # Straight to d (a D-alone request: no proxy, no accept_move): it finishes on d.
        raw = await stream_acting_midway(http, f"{d.url}{PATHS['generate']}", body,
                                         lambda: move(4096))
        # Through the proxy, but longer than max_context already: it finishes on d too.
        raw_long = await stream_acting_midway(http, f"{fleet['proxy'].url}{PATHS['generate']}",
                                              body, lambda: move(4))
        refusals = {
            "prefill": await http.post(f"{p.url}/move_streams", json={"max_context": 9}),
            "zero": await http.post(f"{d.url}/move_streams", json={"max_context": 0}),
            "bool": await http.post(f"{d.url}/move_streams", json={"max_context": True}),
            "unknown": await http.post(f"{d.url}/move_streams", json={"max_context": 9,
                                                                       "all": True}),
        }
        await wait_clean(http, p, d, timeout=SLACK)
    assert answers == [0, 0]
    for stream in (raw, raw_long):
        events = sse_events(stream.decode())
        assert events[-1] == "[DONE]" and b"pd_fsm.moved" not in stream, stream[-500:]
    assert {k: r.status_code for k, r in refusals.items()} == dict.fromkeys(refusals, 400)
    assert "a prefill worker holds no streams to move" in refusals["prefill"].text
    assert "max_context" in refusals["zero"].text and "max_context" in refusals["bool"].text
    assert "unknown field(s) all" in refusals["unknown"].text
