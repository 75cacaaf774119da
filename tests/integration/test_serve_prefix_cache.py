"""Issue 16 with real processes: `pd-fsm cluster` (two P, one D) whose workers all run
`--radix-cache`, behind our proxy routing P by `cache_aware` with conditional disaggregation on.
Shared-prefix prompts through PD answer as the colocated worker does; they all reach one P, and
P prefills, and D pulls, only what their caches lack; a short prompt goes to D alone; afterwards
every worker is idle with its pages free or held by its cache alone, and no registration is
left."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.serve_support import PDCluster

pytestmark = pytest.mark.slow

SYSTEM = "You are a museum guide in Paris; answer in one short line and be polite. " * 2
QUESTIONS = ["Where is the Mona Lisa?", "When do you close?", "Is there a cafe?",
             "How much is a ticket?"]
LOCAL_TOKENS = 12  # prompts of up to 48 characters (4 a token) go to D alone


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    c = PDCluster.start(["--prefill", "2", "--decode", "1", "--colocated", "--model", "tiny",
                         "--page-size", "4", "--num-pages", "256", "--context-length", "512",
                         "--worker-args=--decode-radix-cache", "--startup-timeout", "240",
                         f"--proxy-args=--prefill-policy cache_aware --local-prefill-tokens "
                         f"{LOCAL_TOKENS}"])
    try:
        yield c
    finally:
        c.stop()


def _ask(http: httpx.Client, base: str, question: str, system: str = SYSTEM) -> tuple[str, int]:
    r = http.post(f"{base}/v1/completions", json={
        "model": "tiny", "prompt": system + question, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_shared_prefixes_through_pd_equal_colocated_and_move_less(cluster: PDCluster) -> None:
    with httpx.Client(timeout=120) as http:
        pulled = []
        for question in QUESTIONS:
            before = _pulled_bytes(http, cluster)
            pd_text, d_cached = _ask(http, cluster.urls["proxy"], question)
            pulled.append(_pulled_bytes(http, cluster) - before)
            colo_text, colo_cached = _ask(http, cluster.urls["colocated"], question)
            assert pd_text == colo_text
            assert d_cached == colo_cached  # D's cache holds what the colocated one does
        assert pulled[0] > 0 and all(0 < b < pulled[0] / 4 for b in pulled[1:]), pulled
        _check_idle(http, cluster)


def test_cache_aware_sends_a_shared_prefix_to_one_prefill(cluster: PDCluster) -> None:
    """Two system prompts, interleaved: each one's requests all reach the same P (the first
    of the new one is a miss, sent to the P whose index is smaller), so each P's cache serves
    them."""
    systems = (SYSTEM + "Today: ",
               "You are a librarian in Lyon; you answer in one short line, kindly. " * 2)
    with httpx.Client(timeout=120) as http:
        before = {p: _prompt_tokens(http, cluster, p) for p in ("prefill-0", "prefill-1")}
        decisions = _decisions(http, cluster)
        polls_before = _metric(http, cluster, "pd_fsm_proxy_load_polls_total")
        sent = [0, 0]  # prompt tokens of each system prompt's requests
        for question in QUESTIONS[:3]:
            for i, system in enumerate(systems):
                pd_text, _ = _ask(http, cluster.urls["proxy"], question, system)
                r = http.post(cluster.urls["colocated"] + "/v1/completions", json={
                    "model": "tiny", "prompt": system + question, "max_tokens": 8,
                    "temperature": 0}).json()
                assert pd_text == r["choices"][0]["text"]
                sent[i] += r["usage"]["prompt_tokens"]
        grew = sorted(_prompt_tokens(http, cluster, p) - before[p] for p in before)
        assert grew == sorted(sent), (grew, sent)  # each P got one system prompt's requests
        after = _decisions(http, cluster)
        delta = {k: after.get(k, 0) - decisions.get(k, 0) for k in after}
        assert delta["prefill:cache_hit"] == 5 and delta.get("prefill:cache_miss") == 1, delta
        # cache_aware polls every worker's /get_load (its load balance); none failed while the
        # requests ran (a poll before a worker listened, at start, is counted and harmless).
        deadline = time.monotonic() + 10  # the proxy polls every second (--load-interval)
        while (polls := _metric(http, cluster, "pd_fsm_proxy_load_polls_total")).get(
                "ok", 0) <= polls_before.get("ok", 0):
            assert time.monotonic() < deadline, polls
            time.sleep(0.2)
        assert polls.get("failed", 0) == polls_before.get("failed", 0), polls
        _check_idle(http, cluster)


def test_a_short_prompt_is_prefilled_by_decode_alone(cluster: PDCluster) -> None:
    """Conditional disaggregation: a prompt under the threshold never reaches a P; D prefills
    it (streamed and whole, prompt log-probs included) and answers as the colocated worker."""
    with httpx.Client(timeout=120) as http:
        p_before = {p: _prompt_tokens(http, cluster, p) for p in ("prefill-0", "prefill-1")}
        d_before = worker_stats(http, cluster.urls["decode-0"])["local_prefills_total"]
        body = {"model": "tiny", "prompt": "Paris is the capital of", "max_tokens": 6,
                "temperature": 0, "logprobs": 2, "echo": True}
        answers = {name: http.post(cluster.urls[name] + "/v1/completions", json=body).json()
                   for name in ("proxy", "colocated")}
        choice = answers["proxy"]["choices"][0]
        assert choice["text"] == answers["colocated"]["choices"][0]["text"]
        assert choice["logprobs"]["tokens"] == answers["colocated"]["choices"][0][
            "logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][0] is None  # echo: the first prompt token
        streamed = http.post(cluster.urls["proxy"] + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "Hi!"}],
            "max_tokens": 6, "temperature": 0, "stream": True})
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")
        assert {p: _prompt_tokens(http, cluster, p) for p in p_before} == p_before
        d_after = worker_stats(http, cluster.urls["decode-0"])["local_prefills_total"]
        assert d_after == d_before + 2
        assert _decisions(http, cluster)["local:short_prompt"] >= 2
        _check_idle(http, cluster)


def _check_idle(http: httpx.Client, cluster: PDCluster) -> None:
    for name in ("prefill-0", "prefill-1", "decode-0", "colocated"):
        load = http.get(cluster.urls[name] + "/get_load").json()[0]
        assert load["num_reqs"] == 0, name
        assert load["num_pages_free"] + load["num_pages_cached"] == load["num_pages_total"]
    for name in ("prefill-0", "prefill-1"):
        p = worker_stats(http, cluster.urls[name])
        assert p["transfer_registrations"] == 0
        assert p["transfer"]["registered"] == p["transfer"]["released"]


def _prompt_tokens(http: httpx.Client, cluster: PDCluster, name: str) -> int:
    return int(worker_stats(http, cluster.urls[name])["prompt_tokens_total"])


def _decisions(http: httpx.Client, cluster: PDCluster) -> dict[str, float]:
    """The proxy's route_decisions_total counter, by key."""
    return _metric(http, cluster, "pd_fsm_proxy_route_decisions_total")


def _metric(http: httpx.Client, cluster: PDCluster, name: str) -> dict[str, float]:
    """A labelled counter of the proxy's /metrics, by its key label."""
    out = {}
    for line in http.get(cluster.urls["proxy"] + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            key = line.split('key="', 1)[1].split('"', 1)[0]
            out[key] = float(line.rsplit(" ", 1)[1])
    return out


def worker_stats(http: httpx.Client, base: str) -> dict[str, Any]:
    return dict(http.get(f"{base}/server_info").json()["internal_states"][0])


def _pulled_bytes(http: httpx.Client, cluster: PDCluster) -> int:
    return int(worker_stats(http, cluster.urls["decode-0"])["transfer"]["bytes"])
