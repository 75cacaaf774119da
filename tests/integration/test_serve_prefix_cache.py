"""Issue 16 with real processes: `pd-fsm cluster` whose P, D and colocated workers all run
`--radix-cache`, behind our proxy. Shared-prefix prompts through PD answer as the colocated
worker does; P prefills, and D pulls, only what their caches lack; afterwards every worker is
idle with its pages free or held by its cache alone, and no registration is left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.serve_support import PDCluster

pytestmark = pytest.mark.slow

SYSTEM = "You are a museum guide in Paris; answer in one short line and be polite. " * 2
QUESTIONS = ["Where is the Mona Lisa?", "When do you close?", "Is there a cafe?",
             "How much is a ticket?"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    c = PDCluster.start(["--prefill", "1", "--decode", "1", "--colocated", "--model", "tiny",
                         "--page-size", "4", "--num-pages", "256", "--context-length", "512",
                         "--worker-args=--radix-cache", "--startup-timeout", "240"])
    try:
        yield c
    finally:
        c.stop()


def _ask(http: httpx.Client, base: str, question: str) -> tuple[str, int]:
    r = http.post(f"{base}/v1/completions", json={
        "model": "tiny", "prompt": SYSTEM + question, "max_tokens": 8, "temperature": 0})
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
        for name in ("prefill-0", "decode-0", "colocated"):
            load = http.get(cluster.urls[name] + "/get_load").json()[0]
            assert load["num_pages_free"] + load["num_pages_cached"] == load["num_pages_total"]
            assert load["num_pages_cached"] > 0, name
        p = worker_stats(http, cluster.urls["prefill-0"])
        assert p["transfer_registrations"] == 0
        assert p["transfer"]["registered"] == p["transfer"]["released"]


def worker_stats(http: httpx.Client, base: str) -> dict[str, Any]:
    return dict(http.get(f"{base}/server_info").json()["internal_states"][0])


def _pulled_bytes(http: httpx.Client, cluster: PDCluster) -> int:
    return int(worker_stats(http, cluster.urls["decode-0"])["transfer"]["bytes"])
