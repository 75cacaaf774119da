"""Soak: 200 requests through the proxy to 1P1D, random client aborts, and D SIGKILLed and
started again (same flags, same port) in the middle.

Every request must end either correct (equal to the colocated worker's greedy answer) or as a
clean error (a JSON error with a 4xx/5xx status, or an SSE stream ending in an abort/error chunk
and ``[DONE]``); afterwards P and D hold no page, room, queue or transfer registration, the
proxy no room, and no process but D has a new pid.
"""

from __future__ import annotations

import functools
import json
import random
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    SLACK,
    Fleet,
    greedy,
    prompt,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow

N_REQUESTS = 200
CONCURRENCY = 8
KILL_AT = 100  # D is killed when this many requests have been sent
WHILE_DOWN = 16  # requests sent while D is down (they fail cleanly); the rest wait for it
ABORT_RATE = 0.15
# One prompt length and one answer length: few distinct forward shapes, so compiles (each stalls
# a worker for about a second on 2 busy cores) do not dominate; the contents still differ.
PROMPTS = [prompt(8, seed=100 + i) for i in range(6)]
MAX_NEW = 4


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("soak"))
    f.bootstrap()
    p = f.prefill("p")
    d = f.decode("d")
    f.colocated()
    f.proxy("proxy", [p], [d])
    f.start()
    yield f
    f.close()


ERRORS: Counter[str] = Counter()  # clean errors by status and message (the soak's report)


def _verdict(stream: bool, status: int, raw: bytes, want: list[int]) -> str:
    """"ok", "error" (clean) or a description of what is wrong."""
    if status != 200:
        try:
            body = json.loads(raw)
        except ValueError:
            return f"HTTP {status} without a JSON body: {raw[:200]!r}"
        if 400 <= status < 600 and isinstance(body.get("error"), dict):
            ERRORS[f"{status} {str(body['error'].get('message'))[:90]}"] += 1
            return "error"
        return f"HTTP {status} with {body!r:.200}"
    if not stream:
        body = json.loads(raw)
        return "ok" if body.get("output_ids") == want else f"wrong answer {body!r:.300}"
    events = [block.strip()[len("data: "):] for block in raw.decode().split("\n\n")
              if block.strip()]
    if not events or events[-1] != "[DONE]":
        return f"stream not terminated: {raw[-300:]!r}"
    try:
        chunks = [json.loads(e) for e in events[:-1]]
    except ValueError:
        return f"malformed SSE event in {raw!r:.1500}"
    if not chunks:
        return "empty stream"
    last = chunks[-1]
    finish = (last.get("meta_info") or {}).get("finish_reason") or {}
    if "error" in last or finish.get("type") == "abort":
        message = (last.get("error") or {}).get("message") or finish.get("message")
        ERRORS[f"SSE {str(message)[:90]}"] += 1
        return "error"
    return "ok" if last.get("output_ids") == want else f"wrong answer {last!r:.300}"


async def _warm_up(http: httpx.AsyncClient, proxy: str) -> None:
    """Compile the batch shapes the soak uses on P and D (uncounted: a cold worker's first
    batches may stall past the short windows)."""
    for _ in range(2):
        async with trio.open_nursery() as nursery:
            for i in range(CONCURRENCY):
                body = {"input_ids": PROMPTS[i % len(PROMPTS)], "stream": i % 2 == 0,
                        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
                nursery.start_soon(functools.partial(http.post, f"{proxy}/generate", json=body))


async def test_soak_random_aborts_and_a_decode_restart(fleet: Fleet) -> None:
    p, d, proxy, colo = fleet["p"], fleet["d"], fleet["proxy"], fleet["colocated"]
    pids = {name: proc.pid for name, proc in fleet.procs.items()}
    rng = random.Random(7)
    plan = [(rng.randrange(len(PROMPTS)), rng.random() < 0.5,
             rng.uniform(0.0, 0.15) if rng.random() < ABORT_RATE else None)
            for _ in range(N_REQUESTS)]
    verdicts: Counter[str] = Counter()
    problems: list[str] = []
    sent = 0
    killed = trio.Event()
    back = trio.Event()
    limits = httpx.Limits(max_connections=CONCURRENCY * 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0), limits=limits) as http:
        wants = [await greedy(http, colo, ids, MAX_NEW) for ids in PROMPTS]
        await _warm_up(http, proxy.url)
        await wait_clean(http, p, d, timeout=SLACK + 5)
        ERRORS.clear()
        start = trio.current_time()

        async def one(i: int) -> None:
            which, stream, abort_after = plan[i]
            body = {"input_ids": PROMPTS[which], "stream": stream,
                    "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0.0}}
            with trio.move_on_after(abort_after if abort_after is not None else 120) as scope:
                try:
                    r = await http.post(f"{proxy.url}/generate", json=body)
                    verdict = _verdict(stream, r.status_code, r.content, wants[which])
                except httpx.TransportError as exc:
                    verdict = f"transport error from the proxy: {exc!r}"
            if scope.cancelled_caught:
                verdict = "client aborted" if abort_after is not None else "hung (120 s)"
            verdicts[verdict if verdict in ("ok", "error", "client aborted") else "BAD"] += 1
            if verdict not in ("ok", "error", "client aborted"):
                problems.append(f"#{i} stream={stream}: {verdict}")

        async def client_task() -> None:
            nonlocal sent
            while sent < N_REQUESTS:
                if killed.is_set() and not back.is_set() and sent >= KILL_AT + WHILE_DOWN:
                    await back.wait()
                    continue
                i = sent
                sent += 1
                await one(i)

        async def restart_d() -> None:
            while sent < KILL_AT:
                await trio.sleep(0.01)
            d.kill()  # SIGKILL with CONCURRENCY requests in flight, at whatever stage
            killed.set()
            await trio.to_thread.run_sync(fleet.restart, "d")
            back.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(restart_d)
            for _ in range(CONCURRENCY):
                nursery.start_soon(client_task)
        took = trio.current_time() - start
        print(f"soak: {dict(verdicts)} in {took:.1f} s; errors:")
        for line, n in ERRORS.most_common():
            print(f"  {n:4d} x {line}")
        assert not problems, "\n".join(problems[:20])
        assert sum(verdicts.values()) == N_REQUESTS
        # Not vacuous: most requests went through, and the restart did break some.
        assert verdicts["ok"] >= N_REQUESTS // 2, verdicts
        assert verdicts["error"] >= 1, verdicts

        await wait_clean(http, p, d, timeout=SLACK + 5)
        for proc in (p, d):
            st = await stats(http, proc)
            print(f"{proc.name}: steps {st['steps_total']} in {st['step_seconds_total']:.1f} s, "
                  f"{st['forward_shapes']} shapes, transfer {st['transfer']}, "
                  f"events {st['pd_events']}")

        async def proxy_idle() -> bool | None:
            metrics = (await http.get(f"{proxy.url}/metrics")).text
            return True if "pd_fsm_proxy_rooms_live 0.0" in metrics else None

        with trio.fail_after(SLACK):
            while not await proxy_idle():
                await trio.sleep(0.1)

    for name, proc in fleet.procs.items():
        assert proc.alive(), name
        if name == "d":
            assert proc.pids == [pids["d"], proc.pid] and proc.pid != pids["d"]
        else:
            assert proc.pids == [pids[name]], name
