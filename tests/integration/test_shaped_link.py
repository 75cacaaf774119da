"""P and D across a link as slow as a real one (issue 31 §2): a veth pair shaped to 1 Gbit/s.

Host A (10.77.0.1) runs the bootstrap server and P; host B (10.77.0.2) runs D, the proxy and a
colocated worker (on B's loopback: the reference answer). Both veth ends carry a ``tbf`` at
1 Gbit/s (``Hosts.shape``). A request through the proxy must answer what colocated answers, and
the link must really be the one shaped: a plain TCP stream across it is slower than across the
unshaped veth, and no faster than the token bucket lets through, nor is D's pull of the KV. Those
are upper bounds the kernel enforces; nothing here asserts how fast our code is.

Skipped (with the reason) where namespaces cannot be made (not root, no iproute2) or the link
cannot be shaped (no ``tc``, or the kernel refused the qdisc).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.failure_support import cli
from tests.integration.netns_support import (
    NsFleet,
    ShapingUnavailable,
    namespaces_unavailable,
    tbf_burst_bytes,
)

pytestmark = [pytest.mark.slow]

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:
    pytest.skip(f"separate hosts need network namespaces: {_WHY_NOT}", allow_module_level=True)

RATE_BPS = 1e9
TINY_2K = ["--model", "tiny", "--page-size", "16", "--context-length", "2048", "--num-pages", "300",
        "--max-batched-tokens", "1024", "--warmup", "minimal"]
BOOT_PORT, P_PORT, D_PORT, COLOC_PORT, PROXY_PORT = 8998, 30000, 30001, 30002, 8000
RAW_BYTES = 16 << 20  # 134 ms at 1 Gbit/s: long enough that the bucket's depth is 1 % of it
PROMPT = 2000  # tokens: ~1 MB of the tiny model's KV (512 bytes a token), 8 ms at 1 Gbit/s
D_SUMS = {"bytes": "pd_fsm_worker_kv_transfer_bytes_sum",
          "pull_s": "pd_fsm_worker_kv_pull_seconds_sum",
          "pulls": "pd_fsm_worker_kv_pull_seconds_count"}


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NsFleet, float]]:
    """The fleet across the shaped link, and the raw stream's bytes/s across it unshaped."""
    fleet = NsFleet(Path(tmp_path_factory.mktemp("shaped")))
    hosts = fleet.hosts
    a, b = hosts.ip_a, hosts.ip_b
    try:
        unshaped_Bps = RAW_BYTES / hosts.raw_socket_seconds(RAW_BYTES)
        try:
            hosts.shape(RATE_BPS)
        except ShapingUnavailable as exc:
            pytest.skip(f"a shaped link needs tc: {exc}")
        pd = ["--disaggregation-bootstrap-host", a, "--disaggregation-bootstrap-port",
              str(BOOT_PORT)]
        fleet.start("bootstrap", hosts.a, cli("bootstrap", "--host", a, "--port", str(BOOT_PORT)))
        fleet.start("prefill", hosts.a, cli("serve", *TINY_2K, "--disaggregation-mode", "prefill",
                                            "--host", a, "--port", str(P_PORT), *pd))
        fleet.start("decode", hosts.b, cli("serve", *TINY_2K, "--disaggregation-mode", "decode",
                                           "--host", b, "--port", str(D_PORT), *pd))
        fleet.start("colocated", hosts.b, cli("serve", *TINY_2K, "--host", "127.0.0.1",
                                              "--port", str(COLOC_PORT)))
        fleet.wait_ok([f"http://{a}:{BOOT_PORT}/health", f"http://{a}:{P_PORT}/health",
                       f"http://{b}:{D_PORT}/health", f"http://127.0.0.1:{COLOC_PORT}/health"])
        fleet.start("proxy", hosts.b, cli("proxy", "--host", b, "--port", str(PROXY_PORT),
                                          "--bootstrap-url", f"http://{a}:{BOOT_PORT}",
                                          "--refresh-interval", "1"))
        fleet.wait_ok([f"http://{b}:{PROXY_PORT}/health"])
        yield fleet, unshaped_Bps
    finally:
        fleet.close()


def _bound_Bps(seconds: float) -> float:
    """The most bytes per second a token bucket at ``RATE_BPS`` lets through in ``seconds``: its
    rate, plus its full bucket spent at once (5 % on top for the clocks' granularity)."""
    return 1.05 * (RATE_BPS / 8 + tbf_burst_bytes(RATE_BPS) / seconds)


def test_a_request_across_the_shaped_link_equals_colocated(shaped: tuple[NsFleet, float]) -> None:
    fleet, unshaped_Bps = shaped
    hosts = fleet.hosts
    # The link is shaped: a plain stream is slower than on the bare veth, and within the bucket.
    raw_s = hosts.raw_socket_seconds(RAW_BYTES)
    raw_Bps = RAW_BYTES / raw_s
    assert raw_Bps < unshaped_Bps, (raw_Bps, unshaped_Bps)
    assert raw_Bps <= _bound_Bps(raw_s), f"{raw_Bps * 8 / 1e9:.2f} Gbit/s on a 1 Gbit/s link"

    rng = random.Random(31)
    body = {"input_ids": [rng.randrange(1, 256) for _ in range(PROMPT)],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    d_url = f"http://{hosts.ip_b}:{D_PORT}"
    before = fleet.client.metric_sums(d_url, D_SUMS)
    answers = fleet.client.call([
        {"method": "POST", "url": f"{base}/generate", "json": body, "timeout": 120}
        for base in (f"http://{hosts.ip_b}:{PROXY_PORT}", f"http://127.0.0.1:{COLOC_PORT}")])
    after = fleet.client.metric_sums(d_url, D_SUMS)
    assert all(a["status"] == 200 for a in answers), (answers, fleet.tails())
    pd_ids, coloc_ids = (json.loads(a["body"])["output_ids"] for a in answers)
    assert pd_ids == coloc_ids and len(pd_ids) == 8, (pd_ids, coloc_ids)

    # D pulled the room's KV across this link, no faster than the bucket allows: in parts while
    # P prefilled (the default --disaggregation-stream-tokens 256: a part per chunk of the 2,000
    # tokens that P ran after D's hello), then READY's rest.
    pulled = {k: after[k] - before[k] for k in D_SUMS}
    assert 2 <= pulled["pulls"] <= 8, pulled
    assert pulled["bytes"] >= 512 * (PROMPT - 16), pulled  # the prompt's KV, whole pages
    assert pulled["bytes"] / pulled["pull_s"] <= _bound_Bps(pulled["pull_s"]), pulled
