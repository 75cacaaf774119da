"""Live KV hand-off when a decode worker drains (issue 32 §2): real `pd-fsm` processes (tiny
model) behind our proxy, 1 P and 2 D with hand-off on (the default: each D sees the other in the
registry, and the proxy routes both).

The D that streams a long greedy answer gets SIGTERM mid-stream: it registers the stream's KV
and ends its leg with a hand-off ticket; the proxy posts the request to the other D alone, which
pulls that KV and goes on. The client's stream is whole and equals the colocated answer; the
proxy counted a hand-off, not a migration; P prefilled nothing more (no re-prefill); the drained
D released its registration (the proxy told it the KV was pulled) and exited 0; afterwards every
live worker holds nothing (pages, rooms, queues, transfer registrations).

The fallback: the proxy is frozen while the draining D hands off (the other D is up, so the
drain's gate, which probes its /health, lets the hand-off go), so the ticket waits in the proxy's
socket while its lease (the drain timeout less 0.5 s) ends and the drained D exits; thawed, the
proxy posts the ticket to the other D, whose pull fails, and migrates the stream by re-prefill:
it still completes, equal to the colocated answer, counted as a hand-off that fell back.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    proxy_counts,
    signal_streaming_decode,
    stats,
    stream_acting_midway,
    wait_clean,
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
# A drain short enough that an unclaimed ticket expires within the fallback test, and a pull
# deadline that ends the pull from the drained (gone) D soon after.
# Hand-off itself is the default (--drain-handoff): with the other D registered, it happens.
DRAIN = ["--drain-timeout", "2", "--disaggregation-pull-deadline", "3",
         "--roles", "decode,prefill"]  # and a role switch hands off too


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("handoff"), windows={})
    f.bootstrap()
    p = f.prefill("p")
    d0, d1 = f.decode("d0", extra=DRAIN), f.decode("d1", extra=DRAIN)
    f.colocated()
    f.proxy("proxy", [p], [d0, d1])
    f.start()
    yield f
    f.close()


def _whole(raw: bytes, reference: Any) -> None:
    """The client's stream is the uninterrupted answer: one [DONE], no error, no ticket."""
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
    chunks = [e for e in events if isinstance(e, dict)]
    assert not any("error" in c or "transfer_addr" in c for c in chunks), raw[-800:]
    assert b"pd_fsm.handoff" not in raw  # the ticket is the proxy's, never the client's
    assert chunks[-1]["text"] == reference.text  # no token repeated or missing
    assert chunks[-1]["meta_info"]["completion_tokens"] == MAX_TOKENS


async def _reference_and_counts(http: httpx.AsyncClient, fleet: Fleet, body: dict[str, Any]
                                ) -> tuple[Any, dict[str, float]]:
    """The colocated answer to ``body`` and the proxy's counters before the stream."""
    reference = await fetch_answer(http, str(fleet["colocated"].url), "generate",
                                   {**body, "stream": False})
    return reference, await proxy_counts(http, str(fleet["proxy"].url))


async def _moved_since(http: httpx.AsyncClient, url: str, before: dict[str, float]
                       ) -> dict[str, float]:
    after = await proxy_counts(http, url)
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


async def _taken_without_a_prefill(http: httpx.AsyncClient, fleet: Fleet,
                                   before: dict[str, float], p_before: dict[str, Any]) -> None:
    """The proxy counted one hand-off, taken, and no migration; P prefilled nothing more."""
    moved = await _moved_since(http, str(fleet["proxy"].url), before)
    assert moved.get("rooms_reopened_total:handoff") == 1, moved
    assert moved.get("handoffs_total:taken") == 1, moved
    assert not moved.get("rooms_reopened_total:migration"), moved  # no re-prefill
    p_after = await stats(http, fleet["p"])
    assert p_after["prompt_tokens_total"] == p_before["prompt_tokens_total"]
    assert p_after["requests_total"] == p_before["requests_total"]


async def test_a_sigtermed_decode_worker_hands_its_stream_off_without_a_prefill(
        fleet: Fleet) -> None:
    body = full_length_stream(PROMPT, MAX_TOKENS)
    proxy, p = fleet["proxy"], fleet["p"]
    decodes = [fleet["d0"], fleet["d1"]]
    async with httpx.AsyncClient(timeout=60) as http:
        reference, before = await _reference_and_counts(http, fleet, body)
        drained, p_before = None, None

        async def sigterm() -> bool:
            nonlocal drained, p_before
            p_before = await stats(http, p)
            drained = await signal_streaming_decode(http, decodes, signal.SIGTERM)
            return drained is not None

        raw = await stream_acting_midway(http, f"{proxy.url}{PATHS['generate']}", body,
                                         sigterm)
        assert drained is not None and drained.popen is not None and p_before is not None
        _whole(raw, reference)

        await _taken_without_a_prefill(http, fleet, before, p_before)

        assert await trio.to_thread.run_sync(drained.popen.wait, 30) == 0
        log = drained.log_path.read_text()
        assert "draining: handing running streams off to other decode workers" in log
        assert "handed off" in log and "drained: nothing in flight" in log
        # Released on the proxy's word (the KV was pulled), not by its lease's timer.
        assert "not claimed within its lease" not in log
        other = next(d for d in decodes if d is not drained)
        taken = (await stats(http, other))["handoffs_total"]
        assert taken["taken"] == 1 and taken["take_failed"] == 0
        await wait_clean(http, p, other, timeout=SLACK * 2)
        fleet.restart(drained.name)
        await wait_clean(http, p, *decodes, timeout=SLACK * 2)


async def test_a_hand_off_that_cannot_be_pulled_falls_back_to_a_migration(fleet: Fleet) -> None:
    body = full_length_stream(PROMPT, MAX_TOKENS)
    proxy, p = fleet["proxy"], fleet["p"]
    decodes = [fleet["d0"], fleet["d1"]]
    async with httpx.AsyncClient(timeout=60) as http:
        reference, before = await _reference_and_counts(http, fleet, body)
        drained, other = None, None

        async def sigterm_with_the_proxy_frozen() -> bool:
            nonlocal drained, other
            # The one that streams holds a request; the proxy is frozen, so the ticket waits in
            # its socket until the drained D is gone. (Freezing the other D instead no longer
            # works: the drain's gate finds it not answering /health and hands nothing off.)
            running = [(await stats(http, d))["running"] for d in decodes]
            if not any(running):  # decoded to its end already (stream_acting_midway)
                return False
            drained, other = decodes if running[0] else decodes[::-1]
            proxy.pause()
            os.kill(drained.pid, signal.SIGTERM)
            assert drained.popen is not None
            assert await trio.to_thread.run_sync(drained.popen.wait, 30) == 0
            proxy.resume()
            return True

        raw = await stream_acting_midway(http, f"{proxy.url}{PATHS['generate']}", body,
                                         sigterm_with_the_proxy_frozen)
        assert drained is not None and other is not None
        _whole(raw, reference)
        moved = await _moved_since(http, str(proxy.url), before)
        assert moved.get("rooms_reopened_total:handoff") == 1, moved
        assert moved.get("handoffs_total:fell_back") == 1, moved
        assert moved.get("rooms_reopened_total:migration") == 1, moved  # the re-prefill
        assert "not claimed within its lease" in drained.log_path.read_text()
        assert (await stats(http, other))["handoffs_total"]["take_failed"] == 1
        fleet.restart(drained.name)
        await wait_clean(http, p, *decodes, timeout=SLACK * 2)


async def test_a_decode_worker_switching_role_hands_its_stream_off(fleet: Fleet) -> None:
    """Issue 32 §2's other trigger: the streaming D is asked to become a P (both Ds run
    ``--roles decode,prefill``). It hands the stream off as on SIGTERM — the other D pulls the
    KV, no re-prefill — and serves as P once the hand-off is released; then it switches back."""
    body = full_length_stream(PROMPT, MAX_TOKENS)
    proxy, p = fleet["proxy"], fleet["p"]
    decodes = [fleet["d0"], fleet["d1"]]
    async with httpx.AsyncClient(timeout=60) as http:
        reference, before = await _reference_and_counts(http, fleet, body)
        switched, p_before = None, None

        async def switch_to_prefill() -> bool:
            nonlocal switched, p_before
            p_before = await stats(http, p)
            running = [(await stats(http, d))["running"] for d in decodes]
            if not any(running):  # decoded to its end already (stream_acting_midway)
                return False
            switched = decodes[0] if running[0] else decodes[1]
            answer = await http.post(f"{switched.url}/switch_role", json={"role": "prefill"})
            assert answer.status_code == 202, answer.text
            return True

        raw = await stream_acting_midway(http, f"{proxy.url}{PATHS['generate']}", body,
                                         switch_to_prefill)
        assert switched is not None and p_before is not None
        _whole(raw, reference)
        await _taken_without_a_prefill(http, fleet, before, p_before)

        async def role_of(proc: Any) -> tuple[str, int, str]:
            i = (await http.get(f"{proc.url}/server_info")).json()
            return i["disaggregation_mode"], i["role_epoch"], i["role_state"]

        with trio.fail_after(SLACK * 2):
            while await role_of(switched) != ("prefill", 1, "SERVING"):
                await trio.sleep(0.1)
        info = (await http.get(f"{switched.url}/server_info")).json()
        assert info["last_role_switch"]["outcome"] == "switched"  # not past the deadline
        back = await http.post(f"{switched.url}/switch_role", json={"role": "decode"})
        assert back.status_code == 202, back.text
        with trio.fail_after(SLACK * 2):
            while await role_of(switched) != ("decode", 2, "SERVING"):
                await trio.sleep(0.1)
        await wait_clean(http, p, *decodes, timeout=SLACK * 2)
