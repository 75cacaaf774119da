"""Nothing lost mid-stream (issue 32 §1, §3): real `pd-fsm` processes (tiny model) behind our
proxy, 1 P and 2 D.

- A decode worker SIGKILLed while it streams: the client's stream goes on in a new room (the
  prompt plus the tokens the client has, on the other D) and ends equal to the colocated
  answer, token for token, with usage counting each token once; for /generate, completions and
  chat, greedy and seeded sampling. An n = 2 stream (chat greedy, /generate seeded) goes on as
  its two sequences, each in a room of its own, and ends equal to the colocated stream,
  sequence by sequence.
- The same with output log-probs asked for: the client's log-probs (values within 1e-5, their
  tokens, alternatives and completions' text offsets exactly) equal an uninterrupted stream's.
- A decode worker that is down (its port refuses connections) while the proxy still lists it:
  every request is retried on the other one and answered.
- A decode worker SIGTERMed while it streams, with no other decode worker registered, drains:
  it leaves the registry, the stream it serves finishes there (no hand-off, no migration, no
  re-prefill: default flags) and it exits 0.
Afterwards every worker holds nothing (pages, rooms, queues, transfer registrations).
"""

from __future__ import annotations

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
    signal_streaming_decode,
    stream_acting_midway,
    wait_clean,
    wait_healthy,
)
from tests.integration.serve_support import PATHS, fetch_answer, request_body, sse_events

pytestmark = pytest.mark.slow

PROMPT = "Tell me about the river city"
MAX_TOKENS = 150  # long enough that the break lands mid-stream; the chat prompt fits too
# n = 2 within the workers' 64 pages of 4 tokens: the chat prompt (78 tokens) with both
# sequences, and after the break each sequence in a room of its own on the one D left, at once.
N_MAX_TOKENS = 40
LOGPROBS: dict[str, dict[str, Any]] = {
    "generate": {"return_logprob": True, "top_logprobs_num": 2},
    "completions": {"logprobs": 2},
    "chat": {"logprobs": True, "top_logprobs": 2},
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    # Production windows: a busy machine must not fail a room by a short lease here.
    f = Fleet(tmp_path_factory.mktemp("migration"), windows={})
    f.bootstrap()
    p = f.prefill("p")
    d0, d1 = f.decode("d0"), f.decode("d1")
    f.colocated()
    f.proxy("proxy", [p], [d0, d1])
    f.start()
    yield f
    f.close()


async def _stream_and_signal(http: httpx.AsyncClient, fleet: Fleet, endpoint: str,
                             body: dict[str, Any], how: signal.Signals) -> tuple[bytes, Proc]:
    """Stream ``body`` through the proxy, signalling the D that serves it after the 6th event;
    the whole stream the client got and the D signalled."""
    victim: Proc | None = None

    async def signal_it() -> bool:
        nonlocal victim
        live = [d for d in (fleet["d0"], fleet["d1"]) if d.alive()]
        victim = await signal_streaming_decode(http, live, how)
        return victim is not None

    raw = await stream_acting_midway(http, f"{fleet['proxy'].url}{PATHS[endpoint]}", body,
                                     signal_it)
    assert victim is not None
    return raw, victim


async def _proxy_stats(http: httpx.AsyncClient, proxy: Proc) -> dict[str, Any]:
    r = await http.get(f"{proxy.url}/metrics")
    r.raise_for_status()
    out: dict[str, Any] = {}
    for line in r.text.splitlines():
        if line.startswith("pd_fsm_proxy_rooms_reopened_total{"):
            cause = line.split('key="')[1].split('"')[0]
            out[cause] = float(line.rsplit(" ", 1)[1])
    return out


def _fold(endpoint: str, events: list[Any]
          ) -> tuple[dict[int, tuple[str, Any]], int | None, list[Any]]:
    """(text and finish reason by sequence index, completion tokens, chunks) of a streamed
    answer; /generate's tokens: each sequence's last event's, added up."""
    chunks = [e for e in events if isinstance(e, dict)]
    seqs: dict[int, tuple[str, Any]] = {}
    if endpoint == "generate":
        tokens: dict[int, int] = {}
        for c in chunks:  # cumulative: each sequence's last event has all of it
            meta, index = c["meta_info"], c.get("index", 0)
            seqs[index] = (c["text"], meta["finish_reason"])
            tokens[index] = meta["completion_tokens"]
        return seqs, sum(tokens.values()), chunks
    usage = None
    for c in chunks:
        for choice in c.get("choices") or []:
            piece = choice["delta"].get("content") if endpoint == "chat" else choice.get("text")
            text, finish = seqs.get(choice["index"], ("", None))
            seqs[choice["index"]] = (text + (piece or ""), choice["finish_reason"] or finish)
        if c.get("usage"):
            usage = c["usage"]["completion_tokens"]
    return seqs, usage, chunks


async def _migrated_stream(http: httpx.AsyncClient, fleet: Fleet, endpoint: str,
                           body: dict[str, Any]
                           ) -> tuple[dict[int, tuple[str, Any]], int | None, list[Any], Proc]:
    """Stream ``body`` through the proxy, SIGKILLing the D that serves it after the 6th event:
    ``_fold`` of the stream, whole (one ``[DONE]``, no error chunk) and migrated once, and the
    D killed."""
    before = await _proxy_stats(http, fleet["proxy"])
    raw, killed = await _stream_and_signal(http, fleet, endpoint, body, signal.SIGKILL)
    events = sse_events(raw.decode())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1, raw[-800:]
    seqs, usage, chunks = _fold(endpoint, events)
    assert not any("error" in c for c in chunks), raw[-800:]
    after = await _proxy_stats(http, fleet["proxy"])
    assert after.get("migration", 0) == before.get("migration", 0) + 1
    if endpoint != "generate":
        # The proxy asked D for token ids to follow the stream; the client did not.
        assert not any("token_ids" in ch for c in chunks for ch in c.get("choices") or [])
    if endpoint == "chat":  # one role chunk a sequence, as in an uninterrupted stream
        roles = [ch["index"] for c in chunks for ch in c.get("choices") or []
                 if ch["delta"].get("role") == "assistant"]
        assert sorted(roles) == sorted(seqs), roles
    return seqs, usage, chunks, killed


def _body(endpoint: str, sampling: str, max_tokens: int = MAX_TOKENS, **extra: Any
          ) -> dict[str, Any]:
    """A streamed request whose every sequence is ``max_tokens`` long: greedy, or sampled with
    a seed; ``extra`` goes where the endpoint keeps its sampling parameters."""
    body = request_body(endpoint, PROMPT, max_tokens, stream=True)
    params = body["sampling_params"] if endpoint == "generate" else body
    params.update(ignore_eos=True, **extra)
    if sampling == "seeded":
        params.update(temperature=1.0, top_k=40, seed=1234)
    return body


@pytest.mark.parametrize(("endpoint", "sampling"), [
    ("generate", "greedy"), ("completions", "greedy"), ("chat", "seeded"),
])
async def test_a_stream_survives_its_decode_worker_dying(
    fleet: Fleet, endpoint: str, sampling: str
) -> None:
    body = _body(endpoint, sampling)
    async with httpx.AsyncClient(timeout=60) as http:
        reference = await fetch_answer(http, str(fleet["colocated"].url), endpoint,
                                       {**body, "stream": False})
        seqs, usage, _, killed = await _migrated_stream(http, fleet, endpoint, body)
        assert seqs[0][0] == reference.text and len(seqs) == 1  # no token repeated or missing
        assert usage == reference.completion_tokens == MAX_TOKENS  # each token counted once
        fleet.restart(killed.name)
        await wait_clean(http, fleet["p"], fleet["d0"], fleet["d1"], timeout=SLACK * 2)


@pytest.mark.parametrize(("endpoint", "sampling"), [("chat", "greedy"), ("generate", "seeded")])
async def test_an_n_2_stream_survives_its_decode_worker_dying(
    fleet: Fleet, endpoint: str, sampling: str
) -> None:
    """Each sequence goes on in a request of its own (n = 1, the seed the worker drew that
    sequence with, resumed from its tokens), relayed under its index: the client's stream
    equals an uninterrupted one's, sequence by sequence, finish reasons and usage included."""
    body = _body(endpoint, sampling, N_MAX_TOKENS, n=2)
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{fleet['colocated'].url}{PATHS[endpoint]}", json=body)
        assert r.status_code == 200, r.text[:500]
        want, want_usage, _ = _fold(endpoint, sse_events(r.text))  # uninterrupted
        assert sorted(want) == [0, 1]
        if sampling == "seeded":  # each sequence drawn with a seed of its own
            assert want[0] != want[1]
        seqs, usage, _, killed = await _migrated_stream(http, fleet, endpoint, body)
        assert seqs == want  # each sequence's text and finish reason
        assert usage == want_usage == 2 * N_MAX_TOKENS  # each token counted once
        fleet.restart(killed.name)
        await wait_clean(http, fleet["p"], fleet["d0"], fleet["d1"], timeout=SLACK * 2)


def _client_logprobs(endpoint: str, chunks: list[Any]) -> list[Any]:
    """The log-probs a client folds out of a stream: /generate's last event's (cumulative)
    lists; OpenAI chunks' entries laid end to end."""
    if endpoint == "generate":
        meta = chunks[-1]["meta_info"]
        return [meta["output_token_logprobs"], meta["output_top_logprobs"]]
    out: list[Any] = []
    for c in chunks:
        for choice in c.get("choices") or []:
            lps = choice.get("logprobs")
            if lps is None:
                continue
            if endpoint == "chat":
                out.extend(lps["content"])
            else:
                out.extend(zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"],
                               lps["text_offset"], strict=True))
    return out


def _floats_apart(value: Any, floats: list[float]) -> Any:
    """``value`` with each float replaced by a mark and appended to ``floats``: what must be
    equal exactly (tokens, ids, offsets, the shape) apart from what within a tolerance."""
    if isinstance(value, float):
        floats.append(value)
        return "<float>"
    if isinstance(value, list | tuple):
        return [_floats_apart(v, floats) for v in value]
    if isinstance(value, dict):
        return {k: _floats_apart(v, floats) for k, v in value.items()}
    return value


@pytest.mark.parametrize("endpoint", ["generate", "completions", "chat"])
async def test_log_probs_continue_across_a_migration(fleet: Fleet, endpoint: str) -> None:
    body = request_body(endpoint, PROMPT, MAX_TOKENS, stream=True, **LOGPROBS[endpoint])
    (body["sampling_params"] if endpoint == "generate" else body)["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{fleet['proxy'].url}{PATHS[endpoint]}", json=body)  # uninterrupted
        assert r.status_code == 200, r.text[:500]
        seqs, _, whole = _fold(endpoint, sse_events(r.text))
        got, usage, chunks, killed = await _migrated_stream(http, fleet, endpoint, body)
        assert (got, usage) == (seqs, MAX_TOKENS)
        want_floats: list[float] = []
        got_floats: list[float] = []
        want = _floats_apart(_client_logprobs(endpoint, whole), want_floats)
        got = _floats_apart(_client_logprobs(endpoint, chunks), got_floats)
        assert len(want) == (2 if endpoint == "generate" else MAX_TOKENS)
        assert got == want  # tokens, ids, alternatives, offsets: exactly
        assert got_floats == pytest.approx(want_floats, abs=1e-5)
        fleet.restart(killed.name)
        await wait_clean(http, fleet["p"], fleet["d0"], fleet["d1"], timeout=SLACK * 2)


async def test_a_decode_worker_that_is_down_costs_a_retry_not_an_error(fleet: Fleet) -> None:
    proxy, colocated = fleet["proxy"], fleet["colocated"]
    down = fleet["d1"]
    down.kill()
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            before = await _proxy_stats(http, proxy)
            body = request_body("completions", PROMPT, 12, stream=False)
            reference = await fetch_answer(http, str(colocated.url), "completions", body)

            async def one() -> None:
                got = await fetch_answer(http, str(proxy.url), "completions", body)
                assert got == reference

            async with trio.open_nursery() as nursery:
                for _ in range(6):  # round robin sends about half to the dead port
                    nursery.start_soon(one)
            after = await _proxy_stats(http, proxy)
            # Refused before D took the room: the leg went to the other D in the same room
            # (redirect), or the request to a new room.
            moved = sum(after.get(k, 0) - before.get(k, 0) for k in ("redirect", "retry"))
            assert moved > 0, (before, after)
            await wait_clean(http, fleet["p"], fleet["d0"], timeout=SLACK * 2)
    finally:
        fleet.restart(down.name)


async def test_a_lone_decode_worker_sigtermed_mid_stream_finishes_it_and_exits_0(
        fleet: Fleet) -> None:
    """Default flags (hand-off on): with no other decode worker registered, the draining D does
    not hand its stream off (drain_gate.py): the stream finishes there, whole."""
    body = request_body("generate", PROMPT, MAX_TOKENS, stream=True)
    body["sampling_params"]["ignore_eos"] = True
    proxy, colocated, d0, d1 = fleet["proxy"], fleet["colocated"], fleet["d0"], fleet["d1"]
    assert d0.popen is not None and d1.popen is not None
    async with httpx.AsyncClient(timeout=60) as http:
        reference = await fetch_answer(http, str(colocated.url), "generate",
                                       {**body, "stream": False})
        try:
            # d1 drains with nothing in flight, leaves the registry and exits: d0 is alone.
            d1.popen.send_signal(signal.SIGTERM)
            assert await trio.to_thread.run_sync(d1.popen.wait, 30) == 0
            before = await _proxy_stats(http, proxy)
            raw, drained = await _stream_and_signal(http, fleet, "generate", body,
                                                    signal.SIGTERM)
            assert drained is d0
            events = sse_events(raw.decode())
            assert events[-1] == "[DONE]", raw[-500:]
            assert events[-2]["text"] == reference.text  # finished on the draining worker
            after = await _proxy_stats(http, proxy)
            for cause in ("handoff", "migration"):  # (d1 being down may cost a redirect)
                assert after.get(cause, 0) == before.get(cause, 0), (before, after)
            assert await trio.to_thread.run_sync(d0.popen.wait, 30) == 0
            log = d0.log_path.read_text().rsplit("==== start:", 1)[-1]  # this run's
            assert "running streams finish here, not handed off: no other decode worker" in log
            assert "handed off (KV" not in log
            r = await http.get(f"{fleet.boot_url}/list", params={"role": "decode"})
            assert r.json()["instances"] == []
        finally:
            for d in (d0, d1):
                if d.alive():
                    d.kill()
                d.start()
            wait_healthy([d0, d1], 120)
        await wait_clean(http, fleet["p"], d0, d1, timeout=SLACK * 2)
