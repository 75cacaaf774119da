"""P and D on separate hosts: two network namespaces joined by a veth pair (netns_support.py).

Host A (10.77.0.1) runs the bootstrap server and P; host B (10.77.0.2) runs D, the proxy and a
colocated worker (on B's loopback: the reference answer). Both workers bind the wildcard and
advertise an address (P by ``--advertise-host``, D by ``--advertise-interface``): the registry must
list only those, the proxy finds both through it, and a SmolLM2 answer through the proxy equals the
colocated one. Afterwards every page and every transfer registration is back to idle.

Skipped (with the reason) where network namespaces cannot be made: not root, no iproute2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.integration.failure_support import cli
from tests.integration.netns_support import Hosts, NsClient, NsFleet, namespaces_unavailable
from tests.integration.serve_support import idle_pages

pytestmark = [pytest.mark.slow]

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:
    pytest.skip(f"separate hosts need network namespaces: {_WHY_NOT}", allow_module_level=True)

SMOL = ["--model", "smollm2", "--num-pages", "64", "--page-size", "16", "--context-length",
        "1024", "--max-batched-tokens", "512", "--max-running", "4"]
BOOT_PORT, P_PORT, P_SIDE, D_PORT, COLOC_PORT, PROXY_PORT = 8998, 30000, 31000, 30001, 30002, 8000


@attrs.define
class TwoHosts:
    fleet: NsFleet

    @property
    def hosts(self) -> Hosts:
        return self.fleet.hosts

    @property
    def client_b(self) -> NsClient:
        return self.fleet.client

    @property
    def proxy(self) -> str:
        return f"http://{self.hosts.ip_b}:{PROXY_PORT}"

    @property
    def p_url(self) -> str:
        return f"http://{self.hosts.ip_a}:{P_PORT}"

    @property
    def d_url(self) -> str:
        return f"http://{self.hosts.ip_b}:{D_PORT}"

    @property
    def boot_url(self) -> str:
        return f"http://{self.hosts.ip_a}:{BOOT_PORT}"

    def tails(self) -> str:
        return self.fleet.tails(40)


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    fleet = NsFleet(Path(tmp_path_factory.mktemp("netns")))
    env = TwoHosts(fleet)
    hosts = fleet.hosts
    a, b = hosts.ip_a, hosts.ip_b
    try:
        fleet.start("bootstrap", hosts.a, cli("bootstrap", "--host", a, "--port", str(BOOT_PORT)))
        fleet.start("prefill", hosts.a, cli(
            "serve", *SMOL, "--disaggregation-mode", "prefill", "--host", "0.0.0.0",
            "--advertise-host", a, "--port", str(P_PORT),
            "--disaggregation-side-channel-port", str(P_SIDE),
            "--disaggregation-bootstrap-host", a,
            "--disaggregation-bootstrap-port", str(BOOT_PORT)))
        fleet.start("decode", hosts.b, cli(
            "serve", *SMOL, "--disaggregation-mode", "decode", "--host", "0.0.0.0",
            "--advertise-interface", hosts.if_b, "--port", str(D_PORT),
            "--disaggregation-bootstrap-host", a,
            "--disaggregation-bootstrap-port", str(BOOT_PORT)))
        fleet.start("colocated", hosts.b, cli(
            "serve", *SMOL, "--host", "127.0.0.1", "--port", str(COLOC_PORT)))
        fleet.wait_ok([f"{env.boot_url}/health", f"{env.p_url}/health", f"{env.d_url}/health",
                       f"http://127.0.0.1:{COLOC_PORT}/health"])
        # The proxy learns both workers from the registry: only advertised addresses in it.
        fleet.start("proxy", hosts.b, cli("proxy", "--host", b, "--port", str(PROXY_PORT),
                                          "--bootstrap-url", env.boot_url,
                                          "--refresh-interval", "1"))
        fleet.wait_ok([f"{env.proxy}/health"])
        yield env
    finally:
        fleet.close()


def _chat(prompt: str) -> dict[str, Any]:
    return {"model": "smollm2", "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24, "temperature": 0}


def test_the_registry_holds_only_advertised_addresses(two_hosts: TwoHosts) -> None:
    env = two_hosts
    listed = env.client_b.json("GET", f"{env.boot_url}/list")["instances"]
    by_role = {r["role"]: r for r in listed}
    assert set(by_role) == {"prefill", "decode"}, listed
    p, d = by_role["prefill"], by_role["decode"]
    assert p["transfer_addr"].startswith(f"{env.hosts.ip_a}:"), p
    assert p["zmq_addr"] == f"{env.hosts.ip_a}:{P_SIDE}", p
    assert p["scheduler_addr"] == env.p_url, p
    assert d["scheduler_addr"] == env.d_url and d["zmq_addr"] == f"{env.hosts.ip_b}:{D_PORT}", d
    assert d["transfer_addr"].startswith(f"{env.hosts.ip_b}:"), d
    # A record that advertises loopback, sent from host B over the link: refused by field.
    bad = {**p, "instance_id": "liar", "transfer_addr": "127.0.0.1:7001"}
    answer = env.client_b.call([{"method": "PUT", "url": f"{env.boot_url}/route", "json": bad}])[0]
    assert answer["status"] == 422, answer
    assert "registered from 10.77.0.2" in answer["body"] and "body.transfer_addr" in answer["body"]


def test_smollm2_through_the_proxy_across_hosts_equals_colocated(two_hosts: TwoHosts) -> None:
    env = two_hosts
    prompts = ["What is the capital of France?", "Name three primary colors.",
               "Write one sentence about the sea."]
    reqs = [{"method": "POST", "url": f"{base}/v1/chat/completions", "json": _chat(q),
             "timeout": 180}
            for base in (env.proxy, f"http://127.0.0.1:{COLOC_PORT}") for q in prompts]
    answers = env.client_b.call(reqs)
    assert all(a["status"] == 200 for a in answers), (answers, env.tails())
    texts = [json.loads(a["body"])["choices"][0]["message"]["content"] for a in answers]
    assert texts[: len(prompts)] == texts[len(prompts):], texts
    assert "Paris" in texts[0], texts[0]
    _all_idle(env)
    # P served the prefills and registered each room's KV once; D pulled them over the link.
    p_stats = _stats(env, env.p_url)
    assert p_stats["transfer"]["registered"] >= len(prompts), p_stats["transfer"]
    assert _stats(env, env.d_url)["prompt_tokens_total"] > 0


def _stats(env: TwoHosts, base: str) -> dict[str, Any]:
    info = env.client_b.json("GET", f"{base}/server_info")
    return dict(info["internal_states"][0])


def _all_idle(env: TwoHosts, timeout: float = 60) -> None:
    """P and D hold no page, no room and no transfer registration (or fail with both)."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        seen = {}
        for base in (env.p_url, env.d_url):
            load = env.client_b.json("GET", f"{base}/get_load")[0]
            stats = _stats(env, base)
            transfer = stats.get("transfer", {})
            seen[base] = (load, stats.get("transfer_registrations", 0), transfer)
        if all(
            idle_pages(load) and load["num_reqs"] == 0
            and regs == 0 and transfer.get("registered", 0) == transfer.get("released", 0)
            for load, regs, transfer in seen.values()
        ):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not idle: {seen}\n{env.tails()}")
        time.sleep(0.2)
