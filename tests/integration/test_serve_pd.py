"""PD end to end with real processes on 127.0.0.1: `pd-fsm cluster` (bootstrap, 2 prefill and
2 decode workers, a colocated worker, the proxy over all of them) started once for the module,
plus a second `pd-fsm proxy` over one P and one D and the real sglang-router (PyPI) over the
same pair.

Greedy answers through every PD path must equal the colocated worker's for the same request:
text, token ids (/generate), finish reason and token count, streamed or not. After a burst of
concurrent requests every worker is back to all pages free, nothing queued, no room live and (P)
no KV registered with the transfer server. Bad PD input gets a JSON 4xx and hurts nobody, and a
client leaving mid-stream gets both legs aborted.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from pd_fsm.io_trio.bench_client import (
    WORDS,
    diff_histograms,
    metrics_urls,
    phase_table,
    scrape,
)
from pd_fsm.io_trio.http_server import http_client
from pd_fsm.io_trio.phases import PHASES, TTFT_NAME
from pd_fsm.io_trio.ports import free_ports
from pd_fsm.io_trio.unix_sockets import unix_url
from tests.integration.serve_support import (
    ENDPOINTS,
    PATHS,
    Answer,
    PDCluster,
    Proc,
    cli,
    fetch_answer,
    idle_pages,
    request_body,
    sse_events,
    wait_http_ok,
    worker_stats,
)

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
CLUSTER_ARGS = ["--prefill", "2", "--decode", "2", "--colocated", "--model", "tiny",
                "--page-size", "4", "--num-pages", "512", "--max-running", "16",
                "--context-length", "256", "--startup-timeout", "240"]
# Default PD windows: cold XLA compiles stall a worker's loop for seconds (P0 once spent 29.5 s
# in its first 16 steps), and the workers keep liveness going meanwhile (P acks heartbeats at
# once while busy; D repeats its last heartbeats), so no window needs stretching here.
HAS_ROUTER = importlib.util.find_spec("sglang_router") is not None
WORKERS = ("prefill-0", "prefill-1", "decode-0", "decode-1", "colocated")


@attrs.frozen
class Env:
    cluster: PDCluster
    proxy_1p1d: str  # our proxy over prefill-0 + decode-0 only
    tmp: Path

    def url(self, name: str) -> str:
        return self.cluster.urls[name]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    cluster = PDCluster.start(CLUSTER_ARGS)
    proxy: Proc | None = None
    try:
        (port,) = free_ports(1)
        proxy = Proc.start("proxy-1p1d", cli(
            "proxy", "--host", HOST, "--port", str(port),
            "--prefill", cluster.urls["prefill-0"], str(cluster.bootstrap_ports["prefill-0"]),
            "--decode", cluster.urls["decode-0"],
        ))
        url = f"http://{HOST}:{port}"
        wait_http_ok(f"{url}/health", proxy)
        yield Env(cluster, url, tmp_path_factory.mktemp("pd"))
    finally:
        if proxy is not None:
            proxy.stop()
        cluster.stop()
        # Kept for post-mortems (pytest's basetemp): every child's output, prefixed.
        log = tmp_path_factory.getbasetemp() / "pd_cluster.log"
        log.write_text("\n".join(cluster.proc.lines + (proxy.lines if proxy else [])))


@pytest.fixture(scope="module")
def router(env: Env) -> Iterator[str]:
    """sglang-router 0.3.2 in --pd-disaggregation mode over prefill-0 (known by its side-channel
    port, as our P registers itself) and decode-0."""
    if not HAS_ROUTER:
        pytest.skip("sglang-router is not installed (the 'test' extra)")
    port, metrics_port = free_ports(2)
    proc = Proc.start("sglang-router", [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", env.url("prefill-0"), str(env.cluster.bootstrap_ports["prefill-0"]),
        "--decode", env.url("decode-0"),
        "--host", HOST, "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
    ])
    url = f"http://{HOST}:{port}"
    try:
        # Registered once a generation goes through (it checks each worker's health first).
        body = request_body("generate", "warm up", 2, stream=False)
        with httpx.Client(timeout=30) as http:
            for _ in range(240):
                if not proc.alive():
                    raise RuntimeError(f"sglang-router exited:\n{proc.tail()}")
                try:
                    if http.post(f"{url}/generate", json=body).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            else:
                raise RuntimeError(f"sglang-router never relayed a request:\n{proc.tail()}")
        yield url
    finally:
        proc.stop()


PROMPTS = {
    "generate": "The history of the river city",
    "completions": "Once upon a time in a garden by the ocean",
    "chat": "Tell me about mountain music",
}


async def _compare(base: str, colocated: str, endpoint: str, stream: bool,
                   prompt: str, max_tokens: int = 12) -> tuple[Answer, Answer]:
    async with httpx.AsyncClient(timeout=120) as http:
        body = request_body(endpoint, prompt, max_tokens, stream=stream)
        pd = await fetch_answer(http, base, endpoint, body)
        ref = await fetch_answer(http, colocated, endpoint, body)
    return pd, ref


# ----------------------------------------------------------------------------- 1: our proxy


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_proxy_1p1d_equals_colocated(env: Env, endpoint: str, stream: bool) -> None:
    pd, ref = await _compare(env.proxy_1p1d, env.url("colocated"), endpoint, stream,
                             PROMPTS[endpoint])
    assert pd == ref
    assert pd.completion_tokens and pd.completion_tokens > 0


async def test_every_phase_has_a_histogram_on_its_side(env: Env) -> None:
    """After one PD request through the 1P1D proxy every phase histogram has counted it on the
    side doing that phase, and only there (counts, never timings); the bench finds P and D from
    the proxy's /workers and lists every phase in its table."""
    sides = {role: url.rstrip("/") for role, url in (
        ("proxy", env.proxy_1p1d), ("prefill", env.url("prefill-0")),
        ("decode", env.url("decode-0")))}
    async with httpx.AsyncClient(timeout=120) as http:
        urls = await metrics_urls(http, env.proxy_1p1d)
        assert sorted(urls) == sorted(sides.values())
        before = await scrape(http, urls)
        body = request_body("generate", "where does the time go", 4, stream=True)
        await fetch_answer(http, env.proxy_1p1d, "generate", body)
        # P's leg may reach the proxy after the client has D's answer: wait for it, bounded.
        with trio.fail_after(60):
            while True:
                after = await scrape(http, urls)
                deltas = {url: diff_histograms(before[url], after[url]) for url in urls}
                if all(deltas[sides[p.role]].get(p.name, {}).get(math.inf, 0) >= 1
                       for p in PHASES):
                    break
                await trio.sleep(0.1)
    for phase in PHASES:
        for role, url in sides.items():
            assert (phase.name in after[url]) == (role == phase.role), (phase.name, role)
    assert deltas[sides["decode"]][TTFT_NAME][math.inf] >= 1
    table = phase_table(before, after)
    for phase in PHASES:
        side = {"prefill": "P", "decode": "D", "proxy": "proxy"}[phase.role]
        assert re.search(rf"^{side}\s+{phase.key.removeprefix('proxy_')}\s", table, re.M), table


# ----------------------------------------------------------------------------- 2: sglang-router


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
async def test_sglang_router_equals_colocated(env: Env, router: str, endpoint: str,
                                              stream: bool) -> None:
    pd, ref = await _compare(router, env.url("colocated"), endpoint, stream,
                             PROMPTS[endpoint] + " again")
    assert pd == ref
    assert pd.completion_tokens and pd.completion_tokens > 0


# ----------------------------------------------------------------------------- 3: logprobs


def _same(pd: Any, colo: Any, where: str = "") -> None:
    """Equal JSON, floats within 1e-4 (P's and the colocated worker's prefill batches may be
    padded differently, which moves float32 sums in the last places)."""
    if isinstance(colo, float) and isinstance(pd, float):
        assert pd == pytest.approx(colo, abs=1e-4), where
    elif isinstance(colo, dict):
        assert isinstance(pd, dict) and pd.keys() == colo.keys(), (where, pd, colo)
        for k in colo:
            _same(pd[k], colo[k], f"{where}.{k}")
    elif isinstance(colo, list):
        assert isinstance(pd, list) and len(pd) == len(colo), (where, pd, colo)
        for i, (a, b) in enumerate(zip(pd, colo, strict=True)):
            _same(a, b, f"{where}[{i}]")
    else:
        assert pd == colo, (where, pd, colo)


def _openai(base: str) -> Any:
    import openai  # the official client: a test dependency

    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)


def _logprob_calls(client: Any) -> dict[str, Any]:
    """What an evaluation harness and a chat client ask for, each whole and streamed."""
    prompt = "Once upon a time in a garden"
    out: dict[str, Any] = {}
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Tell me about rivers"}],
                max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    out["chat"] = client.chat.completions.create(**chat).choices[0].logprobs.model_dump()
    out["chat-stream"] = [c.choices[0].logprobs.model_dump()
                          for c in client.chat.completions.create(**chat, stream=True)
                          if c.choices and c.choices[0].logprobs is not None]
    for name, extra in (("top", {"logprobs": 2}), ("echo", {"logprobs": 2, "echo": True}),
                        ("harness", {"logprobs": 1, "echo": True, "max_tokens": 0})):
        call = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, **extra}
        whole = client.completions.create(**call).choices[0]
        out[name] = (whole.text, whole.logprobs.model_dump())
        out[f"{name}-stream"] = [(c.choices[0].text, c.choices[0].logprobs.model_dump())
                                 for c in client.completions.create(**call, stream=True)
                                 if c.choices and c.choices[0].logprobs is not None]
    return out


def test_openai_logprobs_through_pd_equal_colocated(env: Env) -> None:
    """Issue 17 §1 with the official client: top alternatives (the first token's come from P in
    READY), echo with the prompt's log-probs (P computes them, the proxy puts them into D's
    answer, whole and streamed) and the harness call (echo, max_tokens=0)."""
    pd = _logprob_calls(_openai(env.proxy_1p1d))
    colo = _logprob_calls(_openai(env.url("colocated")))
    _same(pd, colo)
    assert len(colo["chat"]["content"]) == 6
    assert all(len(t["top_logprobs"]) == 3 for t in colo["chat"]["content"])
    text, harness = colo["harness"]
    assert text == "Once upon a time in a garden"  # the prompt alone: no token generated
    assert harness["token_logprobs"][0] is None and len(harness["token_logprobs"]) > 5
    assert all(isinstance(lp, float) for lp in harness["token_logprobs"][1:])
    echo_text, echo = colo["echo"]
    assert echo_text.startswith(text) and len(echo["tokens"]) == len(harness["tokens"]) + 5
    assert echo["text_offset"] == sorted(echo["text_offset"])


def _generate_logprobs(base: str, stream: bool) -> Any:
    body = {"text": "The history of the river city", "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True,
            "stream": stream, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    with httpx.Client(timeout=120) as http:
        r = http.post(f"{base}/generate", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        return r.json()["meta_info"]
    events = [e for e in sse_events(r.text) if e != "[DONE]"]
    assert all("input_token_logprobs" in e["meta_info"] for e in events)
    return events[-1]["meta_info"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_generate_logprobs_through_pd_equal_colocated(env: Env, stream: bool) -> None:
    """sglang's fields on /generate: input and output log-probs, their top alternatives, and
    each entry's text."""
    pd = _generate_logprobs(env.proxy_1p1d, stream)
    colo = _generate_logprobs(env.url("colocated"), stream)
    for meta in (pd, colo):
        meta.pop("id")
    _same(pd, colo)
    assert colo["input_token_logprobs"][0][0] is None
    assert len(colo["input_top_logprobs"]) == colo["prompt_tokens"]
    assert len(colo["output_top_logprobs"]) == 5
    assert all(isinstance(e[2], str) for e in colo["output_token_logprobs"])


def test_sglang_router_carries_output_alternatives_and_input_logprobs(
    env: Env, router: str
) -> None:
    """Through sglang-router 0.3.2: output log-probs and their alternatives are D's own (the
    first position's from P, in READY), so they equal colocated; of the prompt's, the router
    prepends P's ``input_token_logprobs`` and not ``input_top_logprobs`` (docs/api.md: use our
    proxy for those)."""
    pd = _generate_logprobs(router, stream=False)
    colo = _generate_logprobs(env.url("colocated"), stream=False)
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs"):
        _same(pd[key], colo[key], key)


def _n_calls(base: str) -> dict[str, Any]:
    """n > 1 and best_of, seeded sampling, through each endpoint, whole and streamed."""
    client = _openai(base)
    out: dict[str, Any] = {}
    chat = dict(model="tiny", messages=[{"role": "user", "content": "Tell me about rivers"}],
                max_tokens=6, temperature=1.0, seed=5, n=3)
    out["chat"] = [c.message.content for c in client.chat.completions.create(**chat).choices]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    out["chat-stream"] = texts
    done = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5,
                                     temperature=1.0, seed=9, n=2, best_of=4)
    out["best_of"] = [c.text for c in done.choices]
    out["usage"] = done.usage.model_dump()
    # Cached tokens are the answering worker's own: D's under PD (its cache is off by default),
    # the colocated worker's own cache hits here.
    out["usage"].pop("prompt_tokens_details")
    with httpx.Client(timeout=120) as http:
        r = http.post(f"{base}/generate", json={"text": "The river city", "sampling_params": {
            "max_new_tokens": 5, "temperature": 1.0, "sampling_seed": 3, "n": 2}})
    assert r.status_code == 200, r.text
    out["generate"] = [b["output_ids"] for b in r.json()]
    return out


def test_n_sequences_through_pd_equal_colocated(env: Env) -> None:
    """Issue 17 §2: the prompt is prefilled on P and transferred once; D forks the n sequences
    from its pages (sequence 0 goes on from P's first token); with the same seed the answers
    are the colocated worker's. Then every worker is idle again (pages all back)."""
    pd = _n_calls(env.proxy_1p1d)
    colo = _n_calls(env.url("colocated"))
    assert pd == colo
    assert len(colo["chat"]) == 3 and len(set(colo["chat"])) > 1
    assert colo["chat-stream"] == dict(enumerate(colo["chat"]))
    assert len(colo["best_of"]) == 2 and colo["usage"]["completion_tokens"] == 20
    assert len(colo["generate"]) == 2


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "n", "tag"],
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["red", "green", "blue"]}}}


def _structured_calls(base: str) -> dict[str, Any]:
    client = _openai(base)
    out: dict[str, Any] = {}
    messages = [{"role": "user", "content": "Describe a river as JSON"}]
    formats = {"schema": {"type": "json_schema",
                          "json_schema": {"name": "river", "schema": SCHEMA, "strict": True}},
               "object": {"type": "json_object"}}
    for name, fmt in formats.items():
        chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=80,
                                              temperature=1.0, seed=4, n=2, response_format=fmt)
        out[name] = [c.message.content for c in chat.choices]
        text = ""
        for chunk in client.chat.completions.create(model="tiny", messages=messages,
                                                    max_tokens=80, temperature=1.0, seed=4,
                                                    response_format=fmt, stream=True):
            text += "".join(c.delta.content or "" for c in chunk.choices)
        out[f"{name}-stream"] = text
    with httpx.Client(timeout=120) as http:
        for key, source in (("regex", "(red|green)-[0-9]{2}"),
                            ("ebnf", 'root ::= "yes" | "no" | "maybe"')):
            r = http.post(f"{base}/generate", json={"text": "Answer:", "sampling_params": {
                "max_new_tokens": 20, "temperature": 1.0, "sampling_seed": 8, key: source}})
            assert r.status_code == 200, r.text
            out[key] = r.json()["text"]
        bad = http.post(f"{base}/generate", json={"text": "x", "sampling_params": {
            "max_new_tokens": 4, "regex": "[a-"}})
        out["bad"] = (bad.status_code, "unclosed character class" in bad.text)
    return out


def test_structured_output_through_pd_equals_colocated(env: Env) -> None:
    """Issue 17 §4: P's first token obeys the grammar (P gets the same constraint), D's matcher
    takes it and goes on; every answer parses against its schema, and equals colocated."""
    import jsonschema

    pd = _structured_calls(env.proxy_1p1d)
    colo = _structured_calls(env.url("colocated"))
    assert pd == colo
    for text in [*colo["schema"], colo["schema-stream"]]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for text in [*colo["object"], colo["object-stream"]]:
        assert isinstance(json.loads(text), dict)
    assert re.fullmatch("(red|green)-[0-9]{2}", colo["regex"])
    assert colo["ebnf"] in ("yes", "no", "maybe")
    assert colo["bad"] == (400, True)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def _tool_calls(base: str) -> dict[str, Any]:
    client = _openai(base)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
    out: dict[str, Any] = {}
    for name, choice in (("required", "required"), ("auto", "auto"),
                         ("named", {"type": "function", "function": {"name": "get_time"}})):
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=150,
                                           temperature=1.0, seed=2, tools=[WEATHER, CLOCK],
                                           tool_choice=choice)
        c = r.choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments))
                 for t in c.message.tool_calls or []]
        out[name] = (c.finish_reason, c.message.content, calls)
        streamed: list[Any] = []
        finish = None
        for chunk in client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=150, temperature=1.0, seed=2,
                tools=[WEATHER, CLOCK], tool_choice=choice, stream=True):
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for t in ch.delta.tool_calls or []:
                    streamed.append((t.function.name, json.loads(t.function.arguments)))
        out[f"{name}-stream"] = (finish, streamed)
    # A second turn: the call and the tool's answer go back through the chat template.
    call = r.choices[0].message.tool_calls
    if call:
        follow = [*messages, {"role": "assistant", "content": None,
                              "tool_calls": [t.model_dump() for t in call]},
                  {"role": "tool", "tool_call_id": call[0].id, "content": "12 C"}]
        r2 = client.chat.completions.create(model="tiny", messages=follow, max_tokens=5,
                                            temperature=0, tools=[WEATHER, CLOCK],
                                            tool_choice="none")
        out["second-turn"] = r2.choices[0].finish_reason
    return out


def test_tool_calls_through_pd_equal_colocated(env: Env) -> None:
    """Issue 17 §5: tools by grammar — required, a named tool and auto (text or a Hermes-form
    call) — with calls whose arguments match the tool's schema, whole and streamed, PD equal
    to colocated."""
    import jsonschema

    pd = _tool_calls(env.proxy_1p1d)
    colo = _tool_calls(env.url("colocated"))
    assert pd == colo
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for name in ("required", "named"):
        finish, content, calls = colo[name]
        assert finish == "tool_calls" and content is None and len(calls) == 1, colo[name]
        assert colo[f"{name}-stream"] == (finish, calls)
        jsonschema.validate(calls[0][1], schemas[calls[0][0]])
    assert colo["named"][2][0][0] == "get_time"
    finish, content, calls = colo["auto"]
    assert (finish, content is None, len(calls)) in (("tool_calls", True, 1), ("length", False, 0),
                                                     ("stop", False, 0))


def _router_calls(base: str) -> dict[str, Any]:
    """What sglang-router 0.3.2 relays to PD legs as lists of bootstrap values (a batch of
    prompts, n > 1) and the features D answers alone (alternatives, grammars, tools)."""
    client = _openai(base)
    out: dict[str, Any] = {}
    done = client.completions.create(model="tiny", prompt=BATCH, max_tokens=5, temperature=0)
    out["batch"] = [(c.index, c.text) for c in done.choices]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Tell me about rivers"}],
        max_tokens=6, temperature=1.0, seed=5, n=2, logprobs=True, top_logprobs=2)
    out["n"] = [(c.message.content, [(t.token, [a.token for a in t.top_logprobs])
                                     for t in c.logprobs.content]) for c in chat.choices]
    fmt = {"type": "json_schema", "json_schema": {"name": "river", "schema": SCHEMA}}
    out["schema"] = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "JSON"}], max_tokens=80,
        temperature=1.0, seed=4, response_format=fmt).choices[0].message.content
    call = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Weather?"}], max_tokens=150,
        temperature=1.0, seed=2, tools=[WEATHER, CLOCK], tool_choice="required").choices[0]
    out["tools"] = [(t.function.name, t.function.arguments) for t in call.message.tool_calls]
    return out


def test_sglang_router_relays_the_api_surface(env: Env, router: str) -> None:
    """Issue 17 through the real sglang-router in PD mode: batches and n > 1 arrive with a
    bootstrap value per sequence (a batch: a room per prompt; n: the first room, D forks), and
    the answers equal the colocated worker's. (A /generate batch the router refuses itself.)"""
    pd = _router_calls(router)
    assert pd == _router_calls(env.url("colocated"))
    assert len(pd["batch"]) == len(BATCH) and len(pd["n"]) == 2 and pd["tools"]


# ----------------------------------------------------------------------------- 4: bad input


BATCH = ["The river city", "A garden by the ocean", "Mountain music"]


def _batch_answers(base: str, path: str, stream: bool) -> list[Any]:
    """Each prompt's answer out of a batched request: (text, token ids or finish reason)."""
    if path == "/generate":
        body: dict[str, Any] = {"text": BATCH, "sampling_params": {
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
    else:
        body = {"prompt": BATCH, "model": "tiny", "max_tokens": 5, "temperature": 0,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=120) as http:
        r = http.post(base + path, json={**body, "stream": stream})
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        if path == "/generate":
            return [(b["text"], b["output_ids"]) for b in out]
        assert out["usage"]["completion_tokens"] == 15
        return [(c["text"], c["index"]) for c in out["choices"]]
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = {}
    if path == "/generate":
        for e in events[:-1]:
            texts[e["index"]] = e["text"]  # cumulative
    else:
        usage = [e for e in events[:-1] if not e["choices"]]
        assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 15
        for e in events[:-1]:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    return [texts[i] for i in range(len(BATCH))]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_batch_of_prompts_through_pd_equals_colocated(env: Env, path: str,
                                                       stream: bool) -> None:
    """Issue 17 §3: the proxy opens a room per prompt (proxy/batch.py) and answers once, in the
    prompts' order, as the colocated worker answers the same batch."""
    pd = _batch_answers(env.proxy_1p1d, path, stream)
    assert pd == _batch_answers(env.url("colocated"), path, stream)
    assert len(pd) == len(BATCH)


def _bootstrap(env: Env, room: int) -> dict[str, Any]:
    return {"bootstrap_host": HOST, "bootstrap_port": env.cluster.bootstrap_ports["prefill-0"],
            "bootstrap_room": room}


async def _rooms_live(http: httpx.AsyncClient, url: str) -> int:
    return int((await worker_stats(http, url))["pd_events"]["rooms_live"])


async def _wait_rooms_live(http: httpx.AsyncClient, url: str, n: int) -> None:
    with trio.fail_after(30):
        while await _rooms_live(http, url) < n:
            await trio.sleep(0.02)


async def test_legs_without_bootstrap_fields(env: Env) -> None:
    """P refuses a leg without the router's bootstrap fields (400 naming them); D prefills such
    a request itself (conditional disaggregation's D-alone rooms) and answers as the colocated
    worker does."""
    async with httpx.AsyncClient(timeout=60) as http:
        local = (await worker_stats(http, env.url("decode-0")))["local_prefills_total"]
        for endpoint in ENDPOINTS:
            for stream in (False, True):
                body = request_body(endpoint, "no room", 4, stream=stream)
                r = await http.post(env.url("prefill-0") + PATHS[endpoint], json=body)
                assert r.status_code == 400, (endpoint, stream, r.text)
                assert r.headers["content-type"].startswith("application/json")
                assert "bootstrap" in r.json()["error"]["message"]
                answers = [await fetch_answer(http, env.url(name), endpoint, body)
                           for name in ("decode-0", "colocated")]
                assert answers[0] == answers[1], (endpoint, stream)
        assert (await worker_stats(http, env.url("decode-0")))["local_prefills_total"] == (
            local + 2 * len(ENDPOINTS))
        for name in ("prefill-0", "decode-0"):
            assert (await http.get(env.url(name) + "/health")).status_code == 200


@pytest.mark.parametrize("first_leg", ["prefill", "decode"])
async def test_duplicate_live_room_is_409_and_first_request_unaffected(
    env: Env, first_leg: str
) -> None:
    """One leg of room R is live (its peer leg not posted yet); a second request naming R at
    the same worker is refused with 409; then the peer leg comes and the first request finishes
    with the colocated answer."""
    room = random.Random(first_leg).randrange(1 << 63)
    prompt = f"duplicate room check for {first_leg}"
    body = {**request_body("generate", prompt, 8, stream=False), **_bootstrap(env, room)}
    p_url, d_url = env.url("prefill-0"), env.url("decode-0")
    first_url, other_url = (p_url, d_url) if first_leg == "prefill" else (d_url, p_url)
    results: dict[str, httpx.Response] = {}

    async with httpx.AsyncClient(timeout=120) as http:
        async def post(name: str, url: str, rid: str) -> None:
            results[name] = await http.post(f"{url}/generate", json={**body, "rid": rid})

        before = await _rooms_live(http, first_url)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "first", first_url, f"dup-{first_leg}-1")
            await _wait_rooms_live(http, first_url, before + 1)
            dup = await http.post(f"{first_url}/generate",
                                  json={**body, "rid": f"dup-{first_leg}-2"})
            assert dup.status_code == 409, dup.text
            assert dup.headers["content-type"].startswith("application/json")
            assert str(room) in dup.json()["error"]["message"]
            assert (await http.get(f"{first_url}/health")).status_code == 200
            assert "first" not in results  # still waiting for its peer leg
            nursery.start_soon(post, "peer", other_url, f"dup-{first_leg}-peer")
        ref = await fetch_answer(http, env.url("colocated"), "generate",
                                 request_body("generate", prompt, 8, stream=False))
    for name in ("first", "peer"):
        assert results[name].status_code == 200, (name, results[name].text)
    d_body = results["peer" if first_leg == "prefill" else "first"].json()
    assert (d_body["text"], tuple(d_body["output_ids"])) == (ref.text, ref.output_ids)


# ----------------------------------------------------------------------------- 5: disconnect


def _metric(text: str, name: str, key: str) -> float:
    m = re.search(rf'^{name}\{{key="{key}"\}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_client_leaving_mid_stream_aborts_both_real_legs(env: Env) -> None:
    d_url = env.url("decode-0")
    async with httpx.AsyncClient(timeout=60) as http:
        metrics = (await http.get(f"{env.proxy_1p1d}/metrics")).text
        sent = {leg: _metric(metrics, "pd_fsm_proxy_aborts_sent_total", leg)
                for leg in ("prefill", "decode")}
        d_before = (await worker_stats(http, d_url))["requests_total"]
        # Long enough that D is still generating when the client hangs up after one chunk.
        body = request_body("generate", "a", 240, stream=True)
        body["sampling_params"]["ignore_eos"] = True
        async with http.stream("POST", f"{env.proxy_1p1d}/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        with trio.fail_after(30):
            while True:
                metrics = (await http.get(f"{env.proxy_1p1d}/metrics")).text
                now = {leg: _metric(metrics, "pd_fsm_proxy_aborts_sent_total", leg)
                       for leg in ("prefill", "decode")}
                if all(now[leg] >= sent[leg] + 1 for leg in now):
                    break
                await trio.sleep(0.05)
        assert _metric(metrics, "pd_fsm_proxy_rooms_total", "CANCELLED") >= 1
        with trio.fail_after(30):
            while True:
                d_after = (await worker_stats(http, d_url))["requests_total"]
                if d_after["abort"] + d_after["error"] > d_before["abort"] + d_before["error"]:
                    break
                await trio.sleep(0.05)
        assert d_after["length"] == d_before["length"]  # it did not run to its 240 tokens


async def test_client_leaving_a_streamed_batch_and_n_frees_everything(env: Env) -> None:
    """A client that leaves a streamed batch (a room per prompt) and a streamed n=4 (forked
    pages shared on D) after the first event: every room is aborted, every worker gets every
    page, room and transfer registration back."""
    async with httpx.AsyncClient(timeout=60) as http:
        for body in ({"prompt": BATCH, "model": "tiny", "max_tokens": 200, "ignore_eos": True,
                      "stream": True},
                     {"prompt": "Once upon a time", "model": "tiny", "max_tokens": 200,
                      "ignore_eos": True, "n": 4, "temperature": 1.0, "stream": True}):
            async with http.stream("POST", f"{env.proxy_1p1d}/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
        await _all_idle(http, env)


# ----------------------------------------------------------------------------- 3: 2P+2D burst


def _prompts(n: int) -> list[tuple[str, str]]:
    rng = random.Random(32)
    out = []
    for i in range(n):
        # The tiny model's tokenizer makes ~4.5 tokens of a word; its context is 256 here.
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 36)))
        out.append((ENDPOINTS[i % 3], words))
    return out


async def _all_idle(http: httpx.AsyncClient, env: Env) -> dict[str, dict[str, Any]]:
    """Every worker's /get_load and stats once nothing is held anywhere (or fail)."""
    seen: dict[str, dict[str, Any]] = {}
    with trio.move_on_after(60):
        while True:
            for name in WORKERS:
                load = (await http.get(env.url(name) + "/get_load")).json()[0]
                stats = await worker_stats(http, env.url(name))
                seen[name] = {"load": load, "stats": stats}
            if all(_idle(v) for v in seen.values()):
                return seen
            await trio.sleep(0.1)
    pytest.fail(f"workers not idle: {seen}")


def _idle(v: dict[str, Any]) -> bool:
    load, stats = v["load"], v["stats"]
    queues = stats.get("pd_queues", {})
    transfer = stats.get("transfer", {})
    return (
        idle_pages(load)
        and load["num_reqs"] == 0
        and load["num_waiting_reqs"] == 0
        and stats["live_requests"] == 0
        and stats["queued"] == 0
        and stats.get("pd_events", {}).get("rooms_live", 0) == 0
        and not stats.get("kvpoll")
        and all(n == 0 for n in queues.values())
        # P: every KV registration was released (the transfer server holds nothing)
        and stats.get("transfer_registrations", 0) == 0
        and transfer.get("registered", 0) == transfer.get("released", 0)
    )


async def test_2p2d_32_concurrent_equal_colocated_then_all_idle(env: Env) -> None:
    prompts = _prompts(32)
    proxy = env.url("proxy")
    pd: list[Answer | None] = [None] * len(prompts)
    ref: list[Answer | None] = [None] * len(prompts)
    async with httpx.AsyncClient(timeout=300,
                                 limits=httpx.Limits(max_connections=80)) as http:
        async def one(i: int, base: str, out: list[Answer | None]) -> None:
            endpoint, prompt = prompts[i]
            body = request_body(endpoint, prompt, 10, stream=i % 2 == 1)
            out[i] = await fetch_answer(http, base, endpoint, body)

        with trio.fail_after(240):
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i, proxy, pd)
            async with trio.open_nursery() as nursery:
                for i in range(len(prompts)):
                    nursery.start_soon(one, i, env.url("colocated"), ref)
        mismatched = [i for i in range(len(prompts)) if pd[i] != ref[i]]
        assert not mismatched, [(prompts[i], pd[i], ref[i]) for i in mismatched]
        # Both P and both D served (round-robin P, rooms spread over D).
        seen = await _all_idle(http, env)
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            assert seen[name]["stats"]["prompt_tokens_total"] > 0, name
        for name in ("prefill-0", "prefill-1"):
            transfer = seen[name]["stats"]["transfer"]
            assert transfer["registered"] > 0 and transfer["release_unverified"] == 0
            assert seen[name]["stats"].get("transfer_registrations", 0) == 0
        for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
            # The transfer threads (a pair per server, one per connection) were raised above
            # compute where this process may (root here; elsewhere the refusal is recorded).
            priority = seen[name]["stats"]["transfer_thread_priority"]
            assert priority["nice"] == -10, priority
            if os.geteuid() == 0:
                assert priority["refused"] is None and priority["raised_total"] >= 2, priority
            else:
                assert priority["refused"], priority
        for name in WORKERS:
            assert (await http.get(env.url(name) + "/health")).status_code == 200
    metrics = httpx.get(f"{proxy}/metrics").text
    assert _metric(metrics, "pd_fsm_proxy_rooms_total", "COMPLETED") >= 32
    assert _metric(metrics, "pd_fsm_proxy_rooms_total", "FAILED") == 0


# ----------------------------------------------------------------------------- unix sockets


async def test_the_cluster_on_unix_sockets_answers_as_the_tcp_one(env: Env) -> None:
    """`pd-fsm cluster --uds DIR`: every server on a socket in DIR (the registry too: the
    workers register over it and D finds P's ipc:// side channel through it); greedy answers
    through its proxy equal this module's TCP cluster's colocated worker, streamed or not, on
    every endpoint; `pd-fsm bench` and `switch-role` reach it over its sockets; stopped, it
    leaves no socket behind."""
    folder = Path(tempfile.mkdtemp(prefix="pd-uds-"))
    cluster = PDCluster.start(["--uds", str(folder), "--prefill", "1", "--decode", "1",
                               "--colocated", *CLUSTER_ARGS[5:]])
    try:
        assert set(cluster.urls) == {"bootstrap", "prefill-0", "decode-0", "colocated", "proxy"}
        for name, url in cluster.urls.items():
            assert url == unix_url(f"{folder}/{name}.sock"), (name, url)
        proxy = cluster.urls["proxy"]
        async with http_client(timeout=120) as http:
            for endpoint in ENDPOINTS:
                for stream in (False, True):
                    body = request_body(endpoint, PROMPTS[endpoint], 12, stream=stream)
                    over_uds = await fetch_answer(http, proxy, endpoint, body)
                    assert over_uds == await fetch_answer(http, env.url("colocated"), endpoint,
                                                          body)
                    assert over_uds == await fetch_answer(http, cluster.urls["colocated"],
                                                          endpoint, body)
            listed = (await http.get(f"{cluster.urls['bootstrap']}/list")).json()["instances"]
            p = next(r for r in listed if r["role"] == "prefill")
            assert p["zmq_addr"] == f"ipc://{folder}/prefill-0.sock.zmq"
            assert p["scheduler_addr"] == cluster.urls["prefill-0"]
            # A proxy that finds P and D in the registry (over its socket) routes them too.
            found = Proc.start("proxy-registry", cli(
                "proxy", "--uds", f"{folder}/found.sock",
                "--bootstrap-url", f"unix:{folder}/bootstrap.sock"))
            try:
                found_url = unix_url(f"{folder}/found.sock")
                with trio.fail_after(60):
                    while True:
                        with contextlib.suppress(httpx.HTTPError):
                            if (await http.get(f"{found_url}/health")).status_code == 200:
                                break
                        assert found.alive(), found.tail()
                        await trio.sleep(0.2)
                body = request_body("generate", PROMPTS["generate"], 12, stream=False)
                assert await fetch_answer(http, found_url, "generate", body) == (
                    await fetch_answer(http, env.url("colocated"), "generate", body))
            finally:
                found.stop()
        bench = await trio.run_process(
            cli("bench", "--url", f"unix:{folder}/proxy.sock", "--num-prompts", "4",
                "--max-tokens", "4", "--dataset", "short", "--model", "tiny"),
            capture_stdout=True, capture_stderr=True, check=False)
        out = bench.stdout.decode()
        assert bench.returncode == 0, out + bench.stderr.decode()
        # P's and D's /metrics, found at the proxy's /workers and scraped over their sockets.
        assert re.search(r"^P\s+prefill_forward\s", out, re.M), out
        assert re.search(r"^D\s+kv_pull\s", out, re.M), out
        switch = await trio.run_process(
            cli("switch-role", f"unix:{folder}/colocated.sock", "null", "--wait", "0"),
            capture_stdout=True, capture_stderr=True, check=False)
        assert switch.returncode == 0 and b"already serves as null" in switch.stdout
    finally:
        cluster.stop()
    assert not list(folder.glob("*")), list(folder.glob("*"))
    folder.rmdir()
