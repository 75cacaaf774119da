"""The dashboard and the Prometheus rules against a real Prometheus scraping a real cluster.

`pd-fsm cluster --prefill 1 --decode 2 --colocated --model tiny --prometheus --planner` starts
Debian's Prometheus beside the cluster with the shipped configuration (``deploy/prometheus``:
file-based service discovery, recording and alert rules). After some traffic (greedy requests
through the proxy and to the colocated worker, streamed and not, and a bad one), every query of
every panel of ``deploy/grafana/pd_fsm.json`` is evaluated through Prometheus' HTTP API and must
return series — a panel naming a metric that no longer exists fails here — and every recording and
alert rule's expression must parse and evaluate; Prometheus must have loaded every rule, none
failing. ``promtool check config`` and ``promtool check rules`` pass on the shipped files.

Skipped, saying why, where Prometheus is not installed (`make test` installs it where apt-get
works)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pd_fsm.io_trio.cluster import observability
from tests.integration.serve_support import PDCluster, request_body

pytestmark = pytest.mark.slow

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
CLUSTER_ARGS = ["--prefill", "1", "--decode", "2", "--colocated", "--model", "tiny",
                "--page-size", "4", "--num-pages", "512", "--max-running", "16",
                "--context-length", "256", "--startup-timeout", "240", "--prometheus",
                # Switchable workers and a planner whose TTFT target the traffic cannot meet:
                # its decision to move one of the two Ds to P (a dry run: nothing switches)
                # gives the roles row its series.
                "--planner", "--planner-args",
                "--dry-run --ttft-slo 0.0001 --patience 1 --interval 1"]
DEPLOY = observability.deploy_dir()
WINDOW = "1m"  # what the test puts for Grafana's $__rate_interval


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    if PROMETHEUS is None:
        pytest.skip("Prometheus is not installed (Debian's `prometheus` package; `make test` "
                    "installs it where apt-get can)")
    cluster = PDCluster.start(CLUSTER_ARGS)
    try:
        yield cluster
    finally:
        cluster.stop()


def _traffic(cluster: PDCluster) -> None:
    with httpx.Client(timeout=60) as http:
        for i in range(4):
            for name, endpoint in (("proxy", "generate"), ("proxy", "chat"),
                                   ("colocated", "completions")):
                body = request_body(endpoint, f"tell me about {i} things", 6, stream=i % 2 == 1)
                path = {"generate": "/generate", "chat": "/v1/chat/completions",
                        "completions": "/v1/completions"}[endpoint]
                r = http.post(cluster.urls[name] + path, json=body)
                assert r.status_code == 200, r.text[:300]
        for name in ("proxy", "colocated"):  # errors, so that the error panels have series
            r = http.post(cluster.urls[name] + "/generate", json={"text": "x", "n": "two"})
            assert r.status_code == 400


def _query(http: httpx.Client, base: str, expr: str) -> dict[str, Any]:
    r = http.get(f"{base}/api/v1/query", params={"query": expr})
    body: dict[str, Any] = r.json()
    return body


def _dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads((DEPLOY / "grafana" / "pd_fsm.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] if p["type"] != "row"
            for t in p["targets"]]


def test_every_panel_query_returns_series_and_every_rule_evaluates(cluster: PDCluster) -> None:
    prometheus = cluster.urls["prometheus"]
    _traffic(cluster)
    panels = [(title, expr.replace("$__rate_interval", WINDOW))
              for title, expr in _dashboard_exprs()]
    assert len(panels) >= 30
    empty: list[str] = []
    with httpx.Client(timeout=30) as http:
        deadline = time.monotonic() + 90  # scrapes every 5 s; rates need two samples
        while True:
            empty = []
            for title, expr in panels:
                answer = _query(http, prometheus, expr)
                assert answer["status"] == "success", (title, expr, answer)
                if not answer["data"]["result"]:
                    empty.append(f"{title}: {expr}")
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert not empty, "panels whose query returns no series:\n" + "\n".join(empty)
        for rule in observability.rules():
            answer = _query(http, prometheus, rule.expr)
            assert answer["status"] == "success", (rule.name, rule.expr, answer)
        # The values behind the figures are the traffic's: 8 PD rooms completed, one failed.
        rooms = _query(http, prometheus, 'pd_fsm_proxy_rooms_total{key="COMPLETED"}')
        assert float(rooms["data"]["result"][0]["value"][1]) == 8
        met = _query(http, prometheus, 'sum(pd_fsm_worker_requests_slo_total{role="decode"})')
        assert float(met["data"]["result"][0]["value"][1]) == 8
        targets = http.get(f"{prometheus}/api/v1/targets").json()["data"]["activeTargets"]
        assert sorted(t["labels"]["name"] for t in targets) == sorted(
            n for n in cluster.urls if n != "prometheus")
        assert all(t["health"] == "up" for t in targets), targets
        groups = http.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == {r.name for r in observability.rules()}
    failing = {n: r.get("lastError") for n, r in loaded.items() if r.get("health") == "err"}
    assert not failing, failing


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian's `prometheus`)")
def test_promtool_accepts_the_shipped_config_and_rules() -> None:
    assert PROMTOOL is not None
    for args in (["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                 ["check", "rules", *map(str, (DEPLOY / "prometheus" / "rules").glob("*.yml"))]):
        done = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
