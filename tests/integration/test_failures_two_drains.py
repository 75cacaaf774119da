"""Two decode workers drain at once while each streams (issue 32: "two Ds draining at once"):
real `pd-fsm` processes (tiny model) behind our proxy, 1 P and 2 D, both Ds routed and
registered, both with `--drain-handoff` (the default).

Two greedy streams run, one on each D; both Ds are then switched to prefill in the same instant.
Each D's drain gate sees the other listed, and probes its `/health`: whichever way the race
falls, no stream may be lost — a D that sees the other already draining finishes in place, and
one that handed off to a D that then refused (it was draining too) would leave the proxy's
hand-off room nowhere to go. Checked: both clients' streams equal the colocated answer, with no
error event; afterwards both workers come back as decode and every worker holds nothing
(pages, rooms, queues, transfer registrations).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import httpx
import pytest
import trio

from tests.integration.failure_support import SLACK, Fleet, freeze_streaming_decode, wait_clean
from tests.integration.serve_support import PATHS, fetch_answer, request_body, sse_events

pytestmark = pytest.mark.slow

PROMPTS = ("Tell me about the river city", "Name the colours of the old bridge")
MAX_TOKENS = 150
DRAIN = ["--drain-timeout", "60", "--roles", "decode,prefill"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("two_drains"), windows={})
    f.bootstrap()
    p = f.prefill("p")
    d0, d1 = f.decode("d0", extra=DRAIN), f.decode("d1", extra=DRAIN)
    f.colocated()
    f.proxy("proxy", [p], [d0, d1])
    f.start()
    yield f
    f.close()


async def _load(http: httpx.AsyncClient, url: str) -> int:
    r = await http.get(f"{url}/get_load", timeout=10)
    return sum(int(rank["num_reqs"]) for rank in r.json())


async def _serving_as(http: httpx.AsyncClient, url: str, role: str) -> None:
    with trio.fail_after(SLACK * 2):
        while True:
            i = (await http.get(f"{url}/server_info")).json()
            if (i["disaggregation_mode"], i["role_state"]) == (role, "SERVING"):
                return
            await trio.sleep(0.1)


async def test_two_decode_workers_draining_at_once_lose_no_stream(fleet: Fleet) -> None:
    proxy, decodes = fleet["proxy"], [fleet["d0"], fleet["d1"]]
    bodies = [request_body("generate", text, MAX_TOKENS, stream=True) for text in PROMPTS]
    for body in bodies:
        body["sampling_params"]["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=120) as http:
        references = [await fetch_answer(http, str(fleet["colocated"].url), "generate",
                                         {**b, "stream": False}) for b in bodies]
        raws: list[bytes] = [b"", b""]
        started = [trio.Event(), trio.Event()]

        async def client(i: int) -> None:
            async with http.stream("POST", f"{proxy.url}{PATHS['generate']}",
                                   json=bodies[i]) as r:
                assert r.status_code == 200
                async for chunk in r.aiter_raw():
                    raws[i] += chunk
                    if raws[i].count(b"data: ") >= 6:
                        started[i].set()

        async def switch(url: str) -> None:
            answer = await http.post(f"{url}/switch_role", json={"role": "prefill"})
            assert answer.status_code == 202, answer.text

        async with trio.open_nursery() as nursery:
            nursery.start_soon(client, 0)
            with trio.fail_after(SLACK * 2):
                await started[0].wait()
            # The first stream's D stays frozen while the second starts (round robin sends it
            # to the other D): a fast machine could otherwise finish the first stream before the
            # second has begun (seen once in CI: loads [0, 1]).
            first = await freeze_streaming_decode(http, decodes)
            assert first is not None, "the first stream was decoded to its end already"
            for d in decodes:
                if d is not first:
                    os.kill(d.pid, signal.SIGCONT)
            nursery.start_soon(client, 1)
            with trio.fail_after(SLACK * 2):
                await started[1].wait()
            # Both frozen: each D, thawed alone, holds one stream; then thawed together, both
            # switch in one instant.
            second = await freeze_streaming_decode(http, [d for d in decodes if d is not first])
            assert second is not None, "the second stream was decoded to its end already"
            loads = []
            for d in (first, second):
                os.kill(d.pid, signal.SIGCONT)
                loads.append(await _load(http, str(d.url)))
                os.kill(d.pid, signal.SIGSTOP)
            assert loads == [1, 1], loads
            for d in decodes:
                os.kill(d.pid, signal.SIGCONT)
            async with trio.open_nursery() as both:
                for d in decodes:
                    both.start_soon(switch, str(d.url))

        for raw, reference in zip(raws, references, strict=True):
            events = sse_events(raw.decode())
            assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
            chunks = [e for e in events if isinstance(e, dict)]
            assert not any("error" in c for c in chunks), raw[-800:]
            assert chunks[-1]["text"] == reference.text
        for d in decodes:
            await _serving_as(http, str(d.url), "prefill")
        # Which way the race fell, for the record (either is right if nothing was lost).
        for d in decodes:
            text = (await http.get(f"{d.url}/metrics")).text
            print(d.name, [line for line in text.splitlines()
                           if line.startswith("pd_fsm_worker_drains_total{")
                           and not line.endswith(" 0.0")])
        text = (await http.get(f"{proxy.url}/metrics")).text
        print("proxy", [line for line in text.splitlines()
                        if line.startswith("pd_fsm_proxy_rooms_reopened_total{")])
        for d in decodes:
            back = await http.post(f"{d.url}/switch_role", json={"role": "decode"})
            assert back.status_code == 202, back.text
        for d in decodes:
            await _serving_as(http, str(d.url), "decode")
        await wait_clean(http, fleet["p"], *decodes, timeout=SLACK * 2)
