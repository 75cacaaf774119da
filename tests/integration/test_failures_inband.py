"""Nothing lost when a decode worker fails a stream in-band (issue 32 §1): real `pd-fsm`
processes (tiny model) behind our proxy, 1 P and 2 D, each D able to switch to colocated with a
drain deadline far shorter than the stream (``--drain-timeout 0.01``, hand-off off).

The D serving a stream is switched to null mid-stream: past its drain deadline it fails the
request with an in-band 503 event ("the worker switched its role ..."): an OpenAI chunk's
``error.code``, a /generate event's ``meta_info.finish_reason.status_code`` (sglang's
FINISH_ABORT). The proxy does not relay that event: the request migrates (the prompt plus the
tokens the client has, in a new room) and the client's stream ends equal to the colocated answer,
with no error chunk, usage counting each token once. This is what the adaptive benchmark's
planner-driven switches lost requests to (bench/RESULTS_adaptive.md). Afterwards every worker
holds nothing, and the switched D is switched back for the next case.
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
    Proc,
    freeze_streaming_decode,
    stream_acting_midway,
    wait_clean,
    wait_until,
)
from tests.integration.serve_support import PATHS, fetch_answer, request_body, sse_events

pytestmark = pytest.mark.slow

PROMPT = "Tell me about the river city"
MAX_TOKENS = 150
SWITCHABLE = ["--roles", "decode,null", "--drain-timeout", "0.01", "--no-drain-handoff"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("inband"), windows={})
    f.bootstrap()
    p = f.prefill("p")
    d0, d1 = f.decode("d0", extra=SWITCHABLE), f.decode("d1", extra=SWITCHABLE)
    f.colocated()
    f.proxy("proxy", [p], [d0, d1])
    f.start()
    yield f
    f.close()


async def _migrations(http: httpx.AsyncClient, proxy: Proc) -> float:
    r = await http.get(f"{proxy.url}/metrics")
    r.raise_for_status()
    for line in r.text.splitlines():
        if line.startswith('pd_fsm_proxy_rooms_reopened_total{key="migration"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _fold(endpoint: str, chunks: list[dict[str, Any]]) -> tuple[str, list[int]]:
    """A stream's text and the completion tokens its usage (each usage chunk) counts."""
    if endpoint == "generate":  # cumulative events
        meta = chunks[-1]["meta_info"]
        assert meta["finish_reason"]["type"] == "length", meta
        return chunks[-1]["text"], [meta["completion_tokens"]]
    text = "".join(ch.get("text") or "" for c in chunks for ch in c.get("choices") or [])
    return text, [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")]


@pytest.mark.parametrize("endpoint", ["completions", "generate"])
async def test_a_stream_its_decode_worker_fails_in_band_migrates(fleet: Fleet,
                                                                 endpoint: str) -> None:
    body: dict[str, Any] = request_body(endpoint, PROMPT, MAX_TOKENS, stream=True)
    (body["sampling_params"] if endpoint == "generate" else body)["ignore_eos"] = True
    proxy, decodes = fleet["proxy"], [fleet["d0"], fleet["d1"]]
    async with httpx.AsyncClient(timeout=60) as http:
        reference = await fetch_answer(http, str(fleet["colocated"].url), endpoint,
                                       {**body, "stream": False})
        before = await _migrations(http, proxy)
        victim: Proc | None = None
        switched: dict[str, httpx.Response] = {}

        async def post_switch(v: Proc) -> None:
            switched["r"] = await http.post(f"{v.url}/switch_role", json={"role": "null"})

        async with trio.open_nursery() as nursery:
            async def freeze_and_switch() -> bool:
                nonlocal victim
                victim = await freeze_streaming_decode(http, decodes)
                if victim is None:  # decoded to its end already (stream_acting_midway)
                    return False
                # Posted while the victim is frozen (the kernel queues it), so the drain's
                # 10 ms deadline starts with the stream's tokens still to come.
                nursery.start_soon(post_switch, victim)
                await trio.sleep(0.2)
                for d in decodes:
                    os.kill(d.pid, signal.SIGCONT)
                return True

            raw = await stream_acting_midway(http, f"{proxy.url}{PATHS[endpoint]}", body,
                                             freeze_and_switch)
        assert victim is not None
        assert switched["r"].status_code == 202, switched["r"].text
        events = sse_events(raw.decode())
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in c for c in chunks), raw[-800:]
        text, usage = _fold(endpoint, chunks)
        assert text == reference.text  # no token repeated or missing
        assert usage == [MAX_TOKENS]  # each token counted once
        assert await _migrations(http, proxy) == before + 1

        async def switched_to_null() -> dict[str, Any] | None:
            info = (await http.get(f"{victim.url}/server_info")).json()
            return info if info["disaggregation_mode"] == "null" else None

        info, _ = await wait_until(switched_to_null, SLACK, f"{victim.name} serving as null")
        # The stream was failed by the drain's deadline, not finished in place.
        assert info["last_role_switch"]["failed_in_flight"] == 1, info["last_role_switch"]
        await wait_clean(http, fleet["p"], *decodes, timeout=SLACK * 2)
        # The next case starts with both Ds decoding, routed so by the proxy: it has probed
        # the victim since it serves as decode again (its role epoch one more).
        back = await http.post(f"{victim.url}/switch_role", json={"role": "decode"})
        assert back.status_code == 202, back.text
        epoch = info["role_epoch"] + 1

        async def routed_again() -> bool | None:
            workers = (await http.get(f"{proxy.url}/workers")).json()
            seen = workers["roles"].get(str(victim.url)) or {}
            ok = seen.get("epoch") == epoch and seen.get("serving") and {
                str(d.url) for d in decodes} <= set(workers["decode"])
            return True if ok else None

        await wait_until(routed_again, SLACK, f"{victim.name} routed as decode again")
