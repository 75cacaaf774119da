"""A drain whose hand-off takers have just crashed (issue 32 §2's gaps, found by the simulator):
real `pd-fsm` processes (tiny model) behind our proxy, 1 P and 3 D, every D routed by the proxy
(static lists) and registered.

Every listed taker dead: while one D streams a long greedy answer, both others are SIGKILLed:
their registry records live on (until their heartbeat TTL) and the proxy still routes them, so
the proxy asks the streaming D for a hand-off (``accept_handoff``) and the registry lists takers.
Then the streaming D is switched to prefill. Its drain gate probes the listed takers' ``/health``,
gets no answer, and finishes the stream in place (``pd_fsm_worker_drains_total{outcome=
"finished_in_place", reason="no_healthy_decode"}``): the client's stream equals the colocated
answer, with no hand-off and no migration. Before the gate probed, the D handed off to a dead one,
the proxy's hand-off room failed there, and its fallback found no decode worker that would take
the stream (the draining one refuses new legs): the client's stream ended in an error.

One listed taker dead, another up: the gate finds the live one and hands the stream off, but the
proxy picks the hand-off room's D itself (the least loaded, ties in its list's order) and posts it
to the dead one first. Refused there before any byte, the leg goes, within the room and with the
same ticket, to the live D, which pulls the KV: the hand-off is taken, without a re-prefill. Before
that redirect the refused room fell back to a migration (P prefilled the prompt and the tokens
again; with no P or D left for it, the client's stream would end in an error).

Afterwards the switched worker comes back as decode, the killed ones restart, and every worker
holds nothing (pages, rooms, queues, transfer registrations), nor does the proxy (rooms).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    Proc,
    freeze_streaming_decode,
    proxy_counts,
    stats,
    stream_acting_midway,
    wait_clean,
    wait_healthy,
    wait_routed_as_decode,
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
DECODES = ("d0", "d1", "d2")  # the proxy's list, in its order
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
    decodes = [f.decode(f"d{i}", extra=DRAIN) for i in range(3)]
    f.colocated()
    f.proxy("proxy", [p], decodes)
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


async def _serving_as(http: httpx.AsyncClient, proc: Proc, role: str) -> None:
    with trio.fail_after(SLACK * 2):
        while await _role_of(http, proc) != (role, "SERVING"):
            await trio.sleep(0.1)


async def _switch_back(http: httpx.AsyncClient, proc: Proc) -> None:
    """``proc``, switched to prefill mid-stream, serves as decode again."""
    await _serving_as(http, proc, "prefill")
    back = await http.post(f"{proc.url}/switch_role", json={"role": "decode"})
    assert back.status_code == 202, back.text
    await _serving_as(http, proc, "decode")


async def _every_decode_routed(http: httpx.AsyncClient, fleet: Fleet) -> list[Proc]:
    """The Ds, in the proxy's order, each routed by it as decode; any a test left SIGKILLed
    started again (same flags)."""
    decodes = [fleet[name] for name in DECODES]
    dead = [d for d in decodes if not d.alive()]
    for proc in dead:
        proc.start()
    await trio.to_thread.run_sync(wait_healthy, dead, 120)
    await wait_routed_as_decode(http, fleet["proxy"], decodes)
    return decodes


def _whole(raw: bytes, reference: Any) -> None:
    """The client's stream equals the colocated answer: one [DONE], no error event."""
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), raw[-800:]
    assert chunks[-1]["text"] == reference.text  # no token repeated or missing
    assert chunks[-1]["meta_info"]["completion_tokens"] == MAX_TOKENS


async def _takers_fail_then_switch(http: httpx.AsyncClient, fleet: Fleet, killed: int,
                                   hung: int, before: Callable[[], Awaitable[None]]
                                   ) -> tuple[bytes, Proc, list[Proc], list[Proc]]:
    """A long greedy stream through the proxy. Six events in, with every D frozen, the one that
    streams is found and ``before`` runs; of the other Ds, in the proxy's order, the first
    ``killed`` are SIGKILLed (still listed: their records outlive them) and the next ``hung``
    left frozen; the others are thawed, and the streaming one is asked to switch to prefill
    (its drain's gate runs now). The client's raw stream, the D that streamed, the killed Ds
    and the hung ones (the caller thaws them)."""
    decodes = [fleet[name] for name in DECODES]
    streaming: Proc | None = None
    dead: list[Proc] = []
    frozen: list[Proc] = []

    async def act() -> bool:
        nonlocal streaming, dead, frozen
        streaming = await freeze_streaming_decode(http, decodes)
        if streaming is None:  # decoded to its end already (stream_acting_midway)
            return False
        await before()
        others = [d for d in decodes if d is not streaming]
        dead, frozen = others[:killed], others[killed:killed + hung]
        for d in dead:
            d.kill()
        for d in decodes:
            if d.alive() and d not in frozen:
                os.kill(d.pid, signal.SIGCONT)
        answer = await http.post(f"{streaming.url}/switch_role", json={"role": "prefill"})
        assert answer.status_code == 202, answer.text
        return True

    raw = await stream_acting_midway(http, f"{fleet['proxy'].url}{PATHS['generate']}",
                                     full_length_stream(PROMPT, MAX_TOKENS), act)
    assert streaming is not None and (len(dead), len(frozen)) == (killed, hung)
    return raw, streaming, dead, frozen


async def _nothing() -> None:
    pass


async def test_a_drain_whose_listed_takers_are_down_finishes_the_stream_in_place(
        fleet: Fleet) -> None:
    """Every other D listed, none up: one SIGKILLed, one hung (SIGSTOPped)."""
    proxy, p = fleet["proxy"], fleet["p"]
    reopened = 'pd_fsm_proxy_rooms_reopened_total{key="'
    in_place = ('pd_fsm_worker_drains_total{outcome="finished_in_place",'
                'reason="no_healthy_decode"}')
    async with httpx.AsyncClient(timeout=60) as http:
        decodes = await _every_decode_routed(http, fleet)
        reference = await fetch_answer(http, str(fleet["colocated"].url), "generate",
                                       {**full_length_stream(PROMPT, MAX_TOKENS), "stream": False})
        before = await _counter(http, str(proxy.url), reopened)
        in_place_before = {d.name: await _counter(http, str(d.url), in_place) for d in decodes}

        raw, streaming, (dead,), (hung,) = await _takers_fail_then_switch(http, fleet, 1, 1,
                                                                          _nothing)
        _whole(raw, reference)  # finished where it was
        # Neither handed off nor migrated: the proxy reopened no room.
        assert await _counter(http, str(proxy.url), reopened) == before

        # The switch ends after its gate decided (the stream may end first): thawed only then.
        await _serving_as(http, streaming, "prefill")
        hung.resume()
        assert (await _counter(http, str(streaming.url), in_place)
                == in_place_before[streaming.name] + 1)
        log = streaming.log_path.read_text()
        assert ("running streams finish here, not handed off: 2 other decode worker(s) "
                "registered, none answered /health 200: ") in log
        assert f"{dead.url}: ConnectError" in log and f"{hung.url}: no answer in time" in log

        await _switch_back(http, streaming)
        await wait_clean(http, p, *(d for d in decodes if d.alive()), timeout=SLACK * 2)


async def test_a_hand_off_refused_by_a_dead_taker_goes_to_a_live_one(fleet: Fleet) -> None:
    """One other D listed and SIGKILLed, one up: the gate hands off, the proxy's hand-off room
    goes to the dead one first (its list's order, the loads equal), then to the live one."""
    proxy, p = fleet["proxy"], fleet["p"]
    async with httpx.AsyncClient(timeout=60) as http:
        decodes = await _every_decode_routed(http, fleet)
        reference = await fetch_answer(http, str(fleet["colocated"].url), "generate",
                                       {**full_length_stream(PROMPT, MAX_TOKENS), "stream": False})
        before = await proxy_counts(http, str(proxy.url))
        taken_before = {d.name: (await stats(http, d))["handoffs_total"] for d in decodes}
        p_before: dict[str, Any] = {}

        async def p_counters() -> None:
            p_before.update(await stats(http, p))

        raw, streaming, (dead,), _ = await _takers_fail_then_switch(http, fleet, 1, 0,
                                                                    p_counters)
        taker = next(d for d in decodes if d not in (streaming, dead))
        _whole(raw, reference)

        await _serving_as(http, streaming, "prefill")
        log = streaming.log_path.read_text()
        assert "handing running streams off to other decode workers (1 other" in log
        assert f"{dead.url}: ConnectError" in log and "handed off" in log
        # Released on the proxy's word once the taker answered, not by its lease's timer.
        assert "not claimed within its lease" not in log
        assert (f"hand-off leg refused by {dead.url}, posted to {taker.url}"
                in proxy.log_path.read_text())
        after = await proxy_counts(http, str(proxy.url))
        moved = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        assert moved == {"rooms_reopened_total:handoff": 1, "rooms_reopened_total:redirect": 1,
                         "handoffs_total:taken": 1}, moved  # no fallback, no re-prefill
        p_after = await stats(http, p)
        assert p_after["prompt_tokens_total"] == p_before["prompt_tokens_total"]
        assert p_after["requests_total"] == p_before["requests_total"]
        taken = (await stats(http, taker))["handoffs_total"]
        assert taken["taken"] == taken_before[taker.name]["taken"] + 1
        assert taken["take_failed"] == taken_before[taker.name]["take_failed"]

        await _switch_back(http, streaming)
        # The killed D holds nothing; a later test starts it again (_every_decode_routed).
        await wait_clean(http, p, streaming, taker, timeout=SLACK * 2)
        assert await _counter(http, str(proxy.url), "pd_fsm_proxy_rooms_live") == 0
