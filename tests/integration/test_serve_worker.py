"""The colocated worker over real HTTP on 127.0.0.1 (tiny model): the three generation endpoints,
streamed and not, against the Scheduler's own output; every bad input; disconnects and aborts."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from pd_fsm.jax_engine.model import load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Scheduler
from pd_fsm.text.tokenizer import ChatMessage
from tests.integration.serve_support import TINY, sse_events, start_worker, wait_idle

GREEDY = {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}


def _reference(prompt_ids: list[int], max_new: int = 10) -> list[int]:
    """What the Scheduler itself produces for the prompt, greedily."""
    from pd_fsm.io_trio.worker.config import ServeConfig

    sched = Scheduler(ServeConfig(**TINY).scheduler_args())
    req = sched.make_request(
        "ref", prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True)
    )
    sched.add_request(req)
    sched.run_until_idle()
    return list(req.output_ids)


@pytest.fixture
async def worker(nursery: trio.Nursery) -> tuple[str, Any]:
    return await start_worker(nursery)


async def test_three_endpoints_match_scheduler(worker: tuple[str, Any]) -> None:
    url, _ = worker
    tok = load_model("tiny").tokenizer
    prompt = "The quick brown fox"
    expected = _reference(tok.encode(prompt))
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/generate", json={"text": prompt, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["output_ids"] == expected
        assert body["text"] == tok.decode(expected)
        meta = body["meta_info"]
        assert meta["prompt_tokens"] == len(prompt)
        assert meta["completion_tokens"] == 10
        assert meta["finish_reason"] == {"type": "length", "length": 10}

        r = await http.post(
            "/generate",
            json={"input_ids": tok.encode(prompt), "sampling_params": GREEDY, "stream": True,
                  "return_logprob": True, "rid": "gen-stream"},
        )
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last["output_ids"] == expected and last["meta_info"]["id"] == "gen-stream"
        lps = last["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == expected and all(lp <= 0 for lp, _, _ in lps)
        # Cumulative text, as sglang streams it.
        assert all(e["text"].startswith(events[0]["text"]) for e in events[:-1])

        completion = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                      "model": "tiny"}
        r = await http.post("/v1/completions", json=completion)
        assert r.status_code == 200, r.text
        c = r.json()
        assert c["choices"][0]["text"] == tok.decode(expected)
        assert c["choices"][0]["finish_reason"] == "length"
        # /generate ran this prompt first: the prefix cache (on by default) serves its whole
        # pages but the one holding its last token, whose logits are computed (page size 4).
        assert c["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 10,
                              "total_tokens": len(prompt) + 10,
                              "prompt_tokens_details": {"cached_tokens": 16}}
        r = await http.post("/v1/completions", json={**completion, "stream": True,
                                                     "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-2]) == tok.decode(expected)
        assert events[-3]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["usage"]["completion_tokens"] == 10

        messages = [{"role": "user", "content": "hi there"}]
        chat_ids = tok.encode(tok.apply_chat_template([ChatMessage("user", "hi there")]))
        chat_expected = _reference(chat_ids)
        chat = {"messages": messages, "max_completion_tokens": 10, "temperature": 0,
                "ignore_eos": True}
        r = await http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg == {"role": "assistant", "content": tok.decode(chat_expected)}
        # max_tokens (OpenAI) and max_completion_tokens (what sglang-router sends) agree.
        r2 = await http.post("/v1/chat/completions",
                             json={"messages": messages, "max_tokens": 10, "temperature": 0,
                                   "ignore_eos": True})
        assert r2.json()["choices"][0]["message"] == msg
        r = await http.post("/v1/chat/completions", json={**chat, "stream": True})
        events = sse_events(r.text)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert content == tok.decode(chat_expected)
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        await wait_idle(http)


def _long(n: int) -> str:
    return "a" * n


BAD: list[tuple[str, str, Any, int]] = [
    ("/generate", "malformed", b'{"text": "x",', 400),
    ("/generate", "not an object", [1, 2], 400),
    ("/generate", "no prompt", {"sampling_params": {}}, 400),
    ("/generate", "both prompts", {"text": "a", "input_ids": [1]}, 400),
    ("/generate", "text not str", {"text": 5}, 400),
    ("/generate", "batch of mixed prompts", {"text": ["a", 5]}, 400),
    ("/generate", "empty batch", {"text": []}, 400),
    ("/generate", "batch with one rid", {"text": ["a", "b"], "rid": "x"}, 400),
    ("/generate", "batch as a PD leg",
     {"text": ["a", "b"], "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}, 400),
    ("/generate", "empty prompt", {"text": ""}, 400),
    ("/generate", "ids out of vocab", {"input_ids": [1, 999]}, 400),
    ("/generate", "ids as strings", {"input_ids": ["1"]}, 400),
    ("/generate", "negative max", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, 400),
    ("/generate", "huge max", {"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, 400),
    ("/generate", "string max", {"text": "a", "sampling_params": {"max_new_tokens": "5"}}, 400),
    ("/generate", "bool temperature", {"text": "a", "sampling_params": {"temperature": True}},
     400),
    ("/generate", "negative temperature", {"text": "a", "sampling_params": {"temperature": -1}},
     400),
    ("/generate", "top_p 0", {"text": "a", "sampling_params": {"top_p": 0}}, 400),
    ("/generate", "typo field", {"text": "a", "sampling_params": {"max_new_token": 5}}, 400),
    ("/generate", "unsupported penalty",
     {"text": "a", "sampling_params": {"min_p": 0.5}}, 400),
    ("/generate", "penalty out of range",
     {"text": "a", "sampling_params": {"frequency_penalty": 5}}, 400),
    ("/generate", "sampling not object", {"text": "a", "sampling_params": [1]}, 400),
    ("/generate", "stop not strings", {"text": "a", "sampling_params": {"stop": [1]}}, 400),
    ("/generate", "rid not string", {"text": "a", "rid": 7}, 400),
    ("/generate", "stream not bool", {"text": "a", "stream": "yes"}, 400),
    ("/generate", "room too big",
     {"text": "a", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 2**63}, 400),
    ("/generate", "room negative",
     {"text": "a", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": -1}, 400),
    ("/generate", "room string",
     {"text": "a", "bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": "5"}, 400),
    ("/generate", "port string",
     {"text": "a", "bootstrap_host": "h", "bootstrap_port": "1", "bootstrap_room": 5}, 400),
    ("/generate", "host missing", {"text": "a", "bootstrap_room": 5}, 400),
    ("/generate", "prompt too long", {"text": _long(300)}, 413),
    ("/generate", "body too large", {"text": _long(70 * 1024)}, 413),
    ("/v1/completions", "malformed", b"{", 400),
    ("/v1/completions", "no prompt", {"max_tokens": 3}, 400),
    ("/v1/completions", "n=17", {"prompt": "a", "n": 17}, 400),
    ("/v1/completions", "best_of below n", {"prompt": "a", "n": 3, "best_of": 2}, 400),
    ("/v1/completions", "best_of streamed", {"prompt": "a", "best_of": 2, "stream": True}, 400),
    ("/v1/completions", "negative max", {"prompt": "a", "max_tokens": -5}, 400),
    ("/v1/completions", "huge max", {"prompt": "a", "max_tokens": 10**12}, 400),
    ("/v1/completions", "float max", {"prompt": "a", "max_tokens": 2.5}, 400),
    ("/v1/completions", "unknown model", {"prompt": "a", "model": "gpt-4"}, 404),
    ("/v1/completions", "model not str", {"prompt": "a", "model": 3}, 400),
    ("/v1/completions", "batch of mixed prompts", {"prompt": ["a", [1, 2]]}, 400),
    ("/v1/completions", "batch of 65", {"prompt": ["a"] * 65}, 400),
    ("/v1/completions", "logprobs", {"prompt": "a", "logprobs": 21}, 400),
    ("/v1/completions", "prompt too long", {"prompt": _long(300)}, 413),
    ("/v1/chat/completions", "malformed", b"not json", 400),
    ("/v1/chat/completions", "no messages", {"messages": []}, 400),
    ("/v1/chat/completions", "bad role", {"messages": [{"role": "x", "content": "a"}]}, 400),
    ("/v1/chat/completions", "content not str",
     {"messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", "image part",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", "n=0", {"messages": [{"role": "user", "content": "a"}], "n": 0}, 400),
    ("/v1/chat/completions", "best_of", {"messages": [{"role": "user", "content": "a"}],
                                         "best_of": 2}, 400),
    ("/v1/chat/completions", "unknown model",
     {"messages": [{"role": "user", "content": "a"}], "model": "llama"}, 404),
    ("/v1/chat/completions", "negative max",
     {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": -1}, 400),
    ("/v1/chat/completions", "maxes disagree",
     {"messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
      "max_completion_tokens": 4}, 400),
    ("/v1/chat/completions", "prompt too long",
     {"messages": [{"role": "user", "content": _long(300)}]}, 413),
    ("/abort_request", "malformed", b"{{", 400),
    ("/abort_request", "no rid", {}, 400),
    ("/abort_request", "rid not str", {"rid": 1}, 400),
]


async def test_bad_input_everywhere(worker: tuple[str, Any]) -> None:
    url, w = worker
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for path, what, body, status in BAD:
            for stream in (False, True):
                if stream and (not isinstance(body, dict) or path == "/abort_request"
                               or "stream" in body):
                    continue
                payload = {**body, "stream": True} if stream else body
                if isinstance(payload, bytes):
                    r = await http.post(path, content=payload)
                else:
                    r = await http.post(path, json=payload)
                label = f"{path} {what} stream={stream}"
                assert r.status_code == status, f"{label}: {r.status_code} {r.text}"
                err = r.json()["error"]
                assert err["code"] == status and err["message"] and err["type"], label
        r = await http.get("/nowhere")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        r = await http.get("/generate")
        assert r.status_code == 405
        assert (await http.get("/health")).status_code == 200
        load = await wait_idle(http)
        assert load["num_pages_free"] + load["num_pages_cached"] == 95
        # Still serves after all that.
        r = await http.post("/generate", json={"text": "ok", "sampling_params": GREEDY})
        assert r.status_code == 200
    assert w.bad_requests >= len(BAD)


async def test_a_batch_of_prompts_answers_each_as_alone(worker: tuple[str, Any]) -> None:
    """Issue 17 §3: a list of prompts (strings or token ids) is one request per prompt, all in
    the scheduler at once; the answer keeps the prompts' order (and ids, when given)."""
    url, _ = worker
    tok = load_model("tiny").tokenizer
    prompts = ["The quick brown fox", "A cat", "Rivers run to the sea"]
    expected = [_reference(tok.encode(p), 6) for p in prompts]
    sp = {**GREEDY, "max_new_tokens": 6}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/generate", json={"text": prompts, "sampling_params": sp,
                                               "rid": ["b0", "b1", "b2"]})
        assert r.status_code == 200, r.text
        assert [b["output_ids"] for b in r.json()] == expected
        assert [b["meta_info"]["id"] for b in r.json()] == ["b0", "b1", "b2"]
        ids = [tok.encode(p) for p in prompts]
        r = await http.post("/generate", json={"input_ids": ids, "sampling_params": sp})
        assert [b["output_ids"] for b in r.json()] == expected
        r = await http.post("/v1/completions", json={
            "prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2]
        assert [c["text"] for c in body["choices"]] == [tok.decode(e) for e in expected]
        assert body["usage"]["completion_tokens"] == 18
        assert body["usage"]["prompt_tokens"] == sum(len(i) for i in ids)
        r = await http.post("/v1/completions", json={
            "prompt": prompts, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        usage = [e for e in events[:-1] if not e["choices"]]
        assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 18
        texts = ["", "", ""]
        for e in events[:-1]:
            for c in e["choices"]:
                texts[c["index"]] += c["text"]
        assert texts == [tok.decode(e) for e in expected]
        r = await http.post("/generate", json={"text": prompts, "sampling_params": sp,
                                               "stream": True})
        last: dict[int, Any] = {}
        for e in sse_events(r.text)[:-1]:
            last[e["index"]] = e  # cumulative: each item's last chunk has its whole output
        assert [last[i]["output_ids"] for i in range(3)] == expected
        await wait_idle(http)


async def test_openai_logprobs_are_the_sampled_tokens_own(worker: tuple[str, Any]) -> None:
    """chat ``logprobs: true`` and completions ``logprobs: 0``, whole and streamed: the same
    values as /generate's ``output_token_logprobs`` for the same prompt, one entry per token."""
    url, _ = worker
    prompt = "The quick brown fox"
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/generate", json={"text": prompt, "sampling_params": GREEDY,
                                               "return_logprob": True})
        want = [lp for lp, _, _ in r.json()["meta_info"]["output_token_logprobs"]]
        completion = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                      "logprobs": 0}
        c = (await http.post("/v1/completions", json=completion)).json()["choices"][0]
        lp = c["logprobs"]
        # The prompt's cached prefix (from the /generate above) changes the float rounding of
        # the rest's prefill, not the tokens: the values agree to ~1e-6.
        want = pytest.approx(want, abs=1e-5)
        assert lp["token_logprobs"] == want and lp["top_logprobs"] is None
        assert "".join(lp["tokens"]) == c["text"]
        assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(10)]
        r = await http.post("/v1/completions", json={**completion, "stream": True})
        streamed = [e["choices"][0]["logprobs"] for e in sse_events(r.text)[:-1]]
        assert [x for e in streamed if e for x in e["token_logprobs"]] == want

        chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 10,
                "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 0}
        c = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]
        content = c["logprobs"]["content"]
        assert len(content) == 10 and all(t["logprob"] <= 0 and t["top_logprobs"] == []
                                          for t in content)
        assert "".join(t["token"] for t in content) == c["message"]["content"]
        assert all(bytes(t["bytes"]).decode() == t["token"] for t in content)
        r = await http.post("/v1/chat/completions", json={**chat, "stream": True})
        chunks = [e["choices"][0] for e in sse_events(r.text)[:-1] if e["choices"]]
        streamed_content = [t for ch in chunks if ch["logprobs"] for t in ch["logprobs"]["content"]]
        assert [t["token"] for t in streamed_content] == [t["token"] for t in content]
        assert [t["logprob"] for t in streamed_content] == pytest.approx(
            [t["logprob"] for t in content], abs=1e-5)  # the cache: rounding only, as above
        # Without asking, none.
        r = await http.post("/v1/chat/completions", json={**chat, "logprobs": False})
        assert r.json()["choices"][0]["logprobs"] is None


async def test_disconnect_mid_stream_aborts(worker: tuple[str, Any]) -> None:
    url, w = worker
    body = {"text": "stream me", "stream": True, "rid": "leaver",
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen == 3:
                    break
        # The response is closed with ~197 tokens still to go.
        await wait_idle(http)
        assert w.backend.outcomes["abort"] == 1
        metrics = (await http.get("/metrics")).text
        assert 'outcome="disconnected"' in metrics


async def test_disconnect_non_streaming_aborts(worker: tuple[str, Any]) -> None:
    url, w = worker
    body = {"text": "wait for me", "sampling_params": {"max_new_tokens": 240, "temperature": 0,
                                                       "ignore_eos": True}}
    finished: list[int] = []

    async def leaver(cancel: trio.CancelScope) -> None:
        with cancel:
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                finished.append((await http.post("/generate", json=body)).status_code)

    # The client leaves as soon as the worker reports the request running: a fixed delay raced
    # the decode (240 tiny-model tokens took under 0.5 s on CI once warm-up compiled them).
    cancel = trio.CancelScope()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leaver, cancel)
            with trio.fail_after(30):
                while (await http.get("/get_load")).json()[0]["num_reqs"] == 0:
                    await trio.sleep(0.002)
            cancel.cancel()
        assert not finished, "the request finished before the client left"
        await wait_idle(http)
    assert w.backend.outcomes["abort"] == 1


async def test_client_leaving_mid_body_is_counted_not_a_traceback(
    worker: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18: a client that disconnects while its body is being read is a 499 outcome in the
    metrics and at most one log line, never an "Error in ASGI Framework" traceback."""
    url, w = worker
    host, port = url.removeprefix("http://").split(":")
    for path in ("/generate", "/v1/chat/completions"):
        stream = await trio.open_tcp_stream(host, int(port))
        head = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                "content-length: 5000\r\n\r\n")
        await stream.send_all(head.encode() + b'{"text": "half a bo')
        await trio.sleep(0.2)  # the app is now waiting for the rest of the body
        await stream.aclose()
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        with trio.fail_after(10):
            while True:
                metrics = (await http.get("/metrics")).text
                if metrics.count('outcome="disconnected"') >= 2:
                    break
                await trio.sleep(0.05)
        assert 'endpoint="/generate",outcome="disconnected"} 1.0' in metrics
        r = await http.post("/generate", json={"text": "still here", "sampling_params": GREEDY})
        assert r.status_code == 200
    assert w.bad_requests == 0
    errors = [rec for rec in caplog.records if rec.levelno >= 40]  # ERROR and up
    assert not errors, [rec.getMessage() for rec in errors]
    assert not any(rec.exc_info for rec in caplog.records)


async def test_abort_request(worker: tuple[str, Any], nursery: trio.Nursery) -> None:
    url, w = worker
    long = {"temperature": 0, "max_new_tokens": 240, "ignore_eos": True}
    results: dict[str, Any] = {}

    async def post(rid: str, http: httpx.AsyncClient) -> None:
        r = await http.post("/generate", json={"text": rid, "rid": rid, "sampling_params": long})
        results[rid] = r

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        async with trio.open_nursery() as n:
            for rid in ("a1", "a2", "a3"):
                n.start_soon(post, rid, http)
            with trio.fail_after(10):
                while len(w.state.live) < 3:
                    await trio.sleep(0.02)
            r = await http.post("/abort_request", json={"rid": "a1"})
            assert r.json() == {"aborted": ["a1"]}
            r = await http.post("/abort_request", json={"rid": "nobody"})
            assert r.status_code == 200 and r.json() == {"aborted": []}
            r = await http.post("/abort_request", json={"abort_all": True})
            assert sorted(r.json()["aborted"]) == ["a2", "a3"]
        for rid in ("a1", "a2", "a3"):
            meta = results[rid].json()["meta_info"]
            assert meta["finish_reason"]["type"] == "abort", meta
            assert meta["completion_tokens"] < 240
        await wait_idle(http)
        assert (await http.get("/health")).status_code == 200


async def test_info_endpoints(worker: tuple[str, Any]) -> None:
    url, _ = worker
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for path in ("/server_info", "/get_server_info"):
            info = (await http.get(path)).json()
            assert info["disaggregation_mode"] == "null"
            assert info["page_size"] == 4 and info["max_total_num_tokens"] == 95 * 4
            from pathlib import Path

            assert Path(info["model_path"]).exists()
        for path in ("/model_info", "/get_model_info"):
            info = (await http.get(path)).json()
            assert info["is_generation"] is True and Path(info["model_path"]).exists()
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        hg = await http.get("/health_generate")
        assert hg.status_code == 200 and hg.json()["tokens"] == 1
        metrics = (await http.get("/metrics")).text
        for name in ("pd_fsm_worker_backend_free_pages", "pd_fsm_worker_backend_total_pages",
                     "pd_fsm_worker_backend_waiting", "pd_fsm_worker_backend_running",
                     "pd_fsm_worker_http_requests_total",
                     'pd_fsm_worker_backend_requests_total{key="stop"}'):
            assert name in metrics, name


async def test_model_default_and_the_served_name_are_accepted(worker: tuple[str, Any]) -> None:
    """sglang's documentation sends "model": "default" everywhere; any other name is a 404."""
    url, _ = worker
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for model in ("default", "tiny"):
            r = await http.post("/v1/completions", json={"model": model, "prompt": "hi",
                                                         "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, (model, r.text)
        r = await http.post("/v1/chat/completions", json={
            "model": "gpt-4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["type"] == "model_not_found"


async def test_radix_cache_reports_hits_and_changes_no_token(nursery: trio.Nursery) -> None:
    """Issue 16 §1 over HTTP: with --radix-cache, a prompt sharing a cached prefix prefills
    only the rest (usage.prompt_tokens_details.cached_tokens, meta_info.cached_tokens), and the
    answers equal a worker without the cache; idle, its pages are free or evictable."""
    cached_url, _ = await start_worker(nursery, radix_cache=True)
    plain_url, _ = await start_worker(nursery, radix_cache=False)
    system = "You are a careful assistant who answers in one short line. " * 2
    async with httpx.AsyncClient(timeout=60) as http:
        answers: dict[str, list[Any]] = {"cached": [], "plain": []}
        for question in ("Where is Paris?", "Where is Rome?", "Where is Paris?"):
            for name, url in (("cached", cached_url), ("plain", plain_url)):
                r = await http.post(f"{url}/v1/completions", json={
                    "prompt": system + question, "max_tokens": 6, "temperature": 0})
                assert r.status_code == 200, r.text
                body = r.json()
                answers[name].append((body["choices"][0]["text"],
                                      body["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert [t for t, _ in answers["cached"]] == [t for t, _ in answers["plain"]]
        hits = [c for _, c in answers["cached"]]
        assert hits[0] == 0 and hits[1] >= len(system) - 16 and hits[2] > hits[1], hits
        assert all(c == 0 for _, c in answers["plain"])
        r = await http.post(f"{cached_url}/generate", json={
            "text": system + "Where is Oslo?", "sampling_params": {"max_new_tokens": 2}})
        assert r.json()["meta_info"]["cached_tokens"] >= len(system) - 16
        stats = (await http.get(f"{cached_url}/metrics")).text
        assert "cached_pages" in stats
