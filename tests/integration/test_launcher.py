"""The launcher end to end (issue 30 §2), in real processes on the tiny model:
``pd-fsm cluster --prefill 1 --decode 1 --colocated --planner --max-workers 3``.

The planner's TTFT target is far below anything the tiny model can do, so while requests flow it
is prefill-bound and, the cluster being under its bound, asks the launcher for a prefill worker:
the launcher starts one with its siblings' flags and answers once the proxy routes it; requests
through the proxy use it, and every answer equals the colocated worker's. Once the requests
stop the cluster is idle and the planner gives a prefill worker back: the launcher takes it out
of the proxy, SIGTERMs it, and it exits 0.

Then, the planner paused, an operator's scale-up of a decode worker and the scale-down of a
decode worker that is streaming answers, with requests arriving all the while: every request
answers 200 with the colocated answer (the drained worker's streams finish or are handed to the
other D; no new leg reaches it), the stopped worker is gone, the last decode worker cannot be
removed, and every worker left ends holding nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import httpx
import pytest
import trio

from tests.integration.failure_support import SLACK, prompt, stats, wait_clean, wait_until
from tests.integration.serve_support import PDCluster, sse_events

pytestmark = pytest.mark.slow

ARGS = ["--prefill", "1", "--decode", "1", "--colocated", "--model", "tiny", "--page-size", "4",
        "--num-pages", "256", "--max-running", "8", "--context-length", "256",
        "--startup-timeout", "120", "--planner", "--max-workers", "3",
        "--worker-args", "--drain-timeout 20", "--proxy-args", "--role-probe-interval 0.3",
        "--planner-args", "--ttft-slo 0.0001 --itl-slo 100 --interval 0.5 --patience 1 "
                          "--cooldown 2 --prefill-nices ''"]
STREAM_TOKENS = 200


@attrs.frozen
class Worker:
    name: str
    url: str


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    c = PDCluster.start(ARGS, timeout=180)
    try:
        yield c
    finally:
        c.stop()


def _body(seed: int, tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"input_ids": prompt(10, seed=seed), "stream": stream,
            "sampling_params": {"max_new_tokens": tokens, "temperature": 0.0, "ignore_eos": True}}


async def _both(http: httpx.AsyncClient, urls: dict[str, str], seed: int
                ) -> tuple[list[int], list[int]]:
    """One greedy request through the proxy (answered 200) and to the colocated worker."""
    body = _body(seed, 6)
    r = await http.post(f"{urls['proxy']}/generate", json=body)
    assert r.status_code == 200, r.text
    g = await http.post(f"{urls['colocated']}/generate", json=body)
    assert g.status_code == 200, g.text
    return list(r.json()["output_ids"]), list(g.json()["output_ids"])


async def _serving(http: httpx.AsyncClient, launcher: str) -> list[Worker]:
    listed = (await http.get(f"{launcher}/workers")).json()["workers"]
    return [Worker(w["name"], w["url"]) for w in listed if w["state"] == "serving"]


async def _decision(http: httpx.AsyncClient, planner: str, kind: str) -> dict[str, Any] | None:
    got = (await http.get(f"{planner}/decisions")).json()["decisions"]
    return next((d for d in got if d["kind"] == kind), None)


async def test_the_planner_launches_a_worker_and_gives_one_back(cluster: PDCluster) -> None:
    urls = cluster.urls
    answers: list[tuple[list[int], list[int]]] = []
    async with httpx.AsyncClient(timeout=60) as http:
        async with trio.open_nursery() as nursery:
            stop = trio.Event()

            async def traffic() -> None:
                seed = 0
                while not stop.is_set():
                    answers.append(await _both(http, urls, seed))
                    seed += 1

            nursery.start_soon(traffic)
            up, _ = await wait_until(lambda: _decision(http, urls["planner"], "ScaleUp"), 90,
                                     "the planner's ScaleUp")
            assert (up["to"], up["outcome"]) == ("prefill", "launched"), up
            assert "prefill pressure" in up["reason"]
            (added,) = [w for w in await _serving(http, urls["launcher"])
                        if w.name == "prefill-1"]
            assert added.url in (await http.get(f"{urls['proxy']}/workers")).json()["prefill"]

            async def used() -> bool | None:  # round robin over two P: it gets legs
                served = (await stats(http, added)).get("requests_total", {})
                return True if sum(served.values()) >= 1 else None

            await wait_until(used, 60, f"a request prefilled on {added.url}")
            stop.set()
        down, _ = await wait_until(lambda: _decision(http, urls["planner"], "ScaleDown"), 60,
                                   "the planner's ScaleDown once idle")
        assert down["outcome"] == "stopped", down
        gone = down["worker"]
        left = await _serving(http, urls["launcher"])
        assert gone not in [w.url for w in left] and len(left) == 2, left
        routed = (await http.get(f"{urls['proxy']}/workers")).json()
        assert gone not in routed["prefill"] and len(routed["prefill"]) == 1, routed
        with pytest.raises(httpx.ConnectError):  # exited, not merely withdrawn
            await http.get(f"{gone}/health")
        metrics = (await http.get(f"{urls['planner']}/metrics")).text
        await wait_clean(http, *left, timeout=SLACK)
    assert answers and all(got == want for got, want in answers), answers
    for outcome in ('kind="ScaleUp",outcome="launched"', 'kind="ScaleDown",outcome="stopped"'):
        assert f"pd_fsm_planner_decisions_total{{{outcome}," in metrics, metrics


async def test_a_streaming_decode_worker_drains_and_stops_with_nothing_lost(
    cluster: PDCluster,
) -> None:
    urls, launcher = cluster.urls, cluster.urls["launcher"]
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.post(f"{urls['planner']}/pause")).status_code == 200
        r = await http.post(f"{launcher}/scale_up", json={"role": "decode"}, timeout=150)
        assert r.status_code == 200 and r.json()["role"] == "decode", r.text
        want = (await http.post(f"{urls['colocated']}/generate",
                                json=_body(99, STREAM_TOKENS))).json()["text"]
        streams: list[bytes] = []
        answers: list[tuple[list[int], list[int]]] = []
        async with trio.open_nursery() as nursery:
            async def stream(started: trio.Event) -> None:
                async with http.stream("POST", f"{urls['proxy']}/generate",
                                       json=_body(99, STREAM_TOKENS, stream=True)) as s:
                    assert s.status_code == 200
                    chunks: list[bytes] = []
                    async for chunk in s.aiter_raw():
                        chunks.append(chunk)
                        started.set()
                    streams.append(b"".join(chunks))

            begun = [trio.Event() for _ in range(4)]
            for started in begun:  # round robin: two streams on each D
                nursery.start_soon(stream, started)
            with trio.fail_after(30):
                for started in begun:
                    await started.wait()
            (victim,) = [w for w in await _serving(http, launcher) if w.name == "decode-0"]

            async def traffic() -> None:  # new requests while it drains: none may reach it
                for seed in range(200, 206):
                    answers.append(await _both(http, urls, seed))

            nursery.start_soon(traffic)
            r = await http.post(f"{launcher}/scale_down", json={"worker": victim.url},
                                timeout=60)
            assert r.status_code == 200, r.text
            assert (r.json()["exit_status"], r.json()["killed"]) == (0, False), r.json()
        left = await _serving(http, launcher)
        assert victim.url not in [w.url for w in left]
        (last_d,) = [w for w in left if w.name.startswith("decode")]
        r = await http.post(f"{launcher}/scale_down", json={"worker": last_d.url})
        assert r.status_code == 409 and "last decode worker" in r.text, r.text
        await wait_clean(http, *left, timeout=SLACK)
    assert len(streams) == 4
    for raw in streams:
        events = sse_events(raw.decode())
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
        chunks = [e for e in events if isinstance(e, dict)]
        assert not any("error" in c for c in chunks), raw[-800:]
        assert chunks[-1]["text"] == want
        assert chunks[-1]["meta_info"]["completion_tokens"] == STREAM_TOKENS
    assert len(answers) == 6 and all(got == want_ids for got, want_ids in answers), answers
