"""A drain whose only hand-off taker has just crashed (issue 32 §2's gap, found by the simulator):
real `pd-fsm` processes (tiny model) behind our proxy, 1 P and 2 D, both Ds routed by the proxy
and registered.

While one D streams a long greedy answer, the other is SIGKILLed: its registry record lives on
(until its heartbeat TTL) and the proxy still routes it, so the proxy asks the streaming D for a
hand-off (``accept_handoff``) and the registry lists a taker. Then the streaming D is switched
to prefill. Its drain gate probes the listed taker's ``/health``, gets no answer, and finishes the
stream in place (``pd_fsm_worker_drains_total{outcome="finished_in_place",
reason="no_healthy_decode"}``): the client's stream equals the colocated answer, with no
hand-off and no migration. Before the gate probed, the D handed off to the dead one, the proxy's
hand-off room failed there, and its fallback found no decode worker that would take the stream
(the draining one refuses new legs): the client's stream ended in an error.

Afterwards the switched worker comes back as decode, the killed one restarts, and every worker
holds nothing (pages, rooms, queues, transfer registrations).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import SLACK, Fleet, freeze_streaming_decode, wait_clean
from tests.integration.serve_support import PATHS, fetch_answer, request_body, sse_events

pytestmark = pytest.mark.slow

PROMPT = "Tell me about the river city"
MAX_TOKENS = 150
# A drain long enough for the stream to finish in place; a registry TTL long enough that the
# killed D is surely still listed when the other's gate reads the registry (the window this
# test is about: a crashed worker's record outlives it).
DRAIN = ["--drain-timeout", "60", "--disaggregation-bootstrap-heartbeat-ttl", "20",
         "--roles", "decode,prefill"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("handoff_dead_taker"), windows={})
    f.bootstrap()
    p = f.prefill("p")
    d0, d1 = f.decode("d0", extra=DRAIN), f.decode("d1", extra=DRAIN)
    f.colocated()
    f.proxy("proxy", [p], [d0, d1])
    f.start()
    yield f
    f.close()


async def _counter(http: httpx.AsyncClient, url: str, prefix: str) -> float:
    """The value of the one /metrics sample whose line starts with ``prefix`` (0 if absent)."""
    r = await http.get(f"{url}/metrics")
    r.raise_for_status()
    return sum(float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
               if line.startswith(prefix))


async def _role_of(http: httpx.AsyncClient, proc: Any) -> tuple[str, str]:
    i = (await http.get(f"{proc.url}/server_info")).json()
    return i["disaggregation_mode"], i["role_state"]


async def test_a_drain_whose_listed_taker_is_dead_finishes_the_stream_in_place(
        fleet: Fleet) -> None:
    body = request_body("generate", PROMPT, MAX_TOKENS, stream=True)
    body["sampling_params"]["ignore_eos"] = True
    proxy, p, decodes = fleet["proxy"], fleet["p"], [fleet["d0"], fleet["d1"]]
    reopened = 'pd_fsm_proxy_rooms_reopened_total{key="'
    in_place = ('pd_fsm_worker_drains_total{outcome="finished_in_place",'
                'reason="no_healthy_decode"}')
    async with httpx.AsyncClient(timeout=60) as http:
        reference = await fetch_answer(http, str(fleet["colocated"].url), "generate",
                                       {**body, "stream": False})
        before = await _counter(http, str(proxy.url), reopened)
        streaming, dead = None, None

        async def kill_the_other_then_switch() -> None:
            nonlocal streaming, dead
            # Every D frozen while we look: the kill and the switch land mid-stream.
            streaming = await freeze_streaming_decode(http, decodes)
            dead = next(d for d in decodes if d is not streaming)
            dead.kill()
            os.kill(streaming.pid, signal.SIGCONT)
            answer = await http.post(f"{streaming.url}/switch_role", json={"role": "prefill"})
            assert answer.status_code == 202, answer.text

        raw, acted = b"", False
        async with http.stream("POST", f"{proxy.url}{PATHS['generate']}", json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                raw += chunk
                if not acted and raw.count(b"data: ") >= 6:
                    acted = True
                    await kill_the_other_then_switch()
        assert streaming is not None and dead is not None

        events = sse_events(raw.decode())
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in c for c in chunks), raw[-800:]
        assert chunks[-1]["text"] == reference.text  # finished where it was: whole
        assert chunks[-1]["meta_info"]["completion_tokens"] == MAX_TOKENS
        # Neither handed off nor migrated: the proxy reopened no room.
        assert await _counter(http, str(proxy.url), reopened) == before

        with trio.fail_after(SLACK * 2):
            while await _role_of(http, streaming) != ("prefill", "SERVING"):
                await trio.sleep(0.1)
        assert await _counter(http, str(streaming.url), in_place) == 1
        log = streaming.log_path.read_text()
        assert ("running streams finish here, not handed off: 1 other decode worker(s) "
                "registered, none answered /health 200: ") in log
        assert f"{dead.url}: ConnectError" in log

        back = await http.post(f"{streaming.url}/switch_role", json={"role": "decode"})
        assert back.status_code == 202, back.text
        with trio.fail_after(SLACK * 2):
            while await _role_of(http, streaming) != ("decode", "SERVING"):
                await trio.sleep(0.1)
        fleet.restart(dead.name)
        await wait_clean(http, p, *decodes, timeout=SLACK * 2)
