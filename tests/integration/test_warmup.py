"""The full warm-up, the production default (issue 13 §3): a `pd-fsm serve` process compiles every
shape its scheduler can run before /health says ready, so no request after that waits for a
compile; and a second start of the same configuration loads every executable from the compilation
cache (``executable_store``) instead of compiling it.

A small configuration keeps the shape plan small (2 rows, 32 batched tokens: 7 forward shapes),
because every executable costs ~0.5-1.5 s to compile on this CPU even for the tiny model.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import trio

from pd_fsm.io_trio.ports import free_ports
from tests.integration.serve_support import Proc, cli, wait_http_ok

HOST = "127.0.0.1"


def _serve(port: int, cache: Path) -> Proc:
    return Proc.start("serve", cli(
        "serve", "--model", "tiny", "--host", HOST, "--port", str(port),
        "--num-pages", "48", "--page-size", "4", "--max-running", "2",
        "--max-batched-tokens", "32", "--context-length", "64",
        "--warmup", "full", "--compilation-cache-dir", str(cache),
    ))


def _metric(text: str, name: str, key: str | None = None) -> float:
    label = "" if key is None else rf'\{{key="{re.escape(key)}"\}}'
    m = re.search(rf"^{re.escape(name)}{label} (\S+)$", text, re.M)
    assert m is not None, f"{name} {key or ''} missing from /metrics"
    return float(m.group(1))


async def _varied_load(url: str) -> None:
    """Prompts of 1..60 tokens (longer than the 32-token budget: chunked), one and two at a
    time, greedy and sampled: every kind of step the scheduler has."""
    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {
            "input_ids": [(7 * i + j) % 50 + 1 for j in range(1 + (i * 13) % 60)],
            "sampling_params": {"max_new_tokens": 1 + i % 5, "temperature": 0.7 * (i % 2),
                                "ignore_eos": True},
        }
        r = await http.post("/generate", json=body)
        assert r.status_code == 200, r.text

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        for wave in range(4):
            async with trio.open_nursery() as nursery:
                for i in range(3):
                    nursery.start_soon(one, http, 3 * wave + i)


def test_no_request_compiles_after_a_full_warmup_and_a_restart_compiles_nothing(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "xla"
    (port,) = free_ports(1)
    url = f"http://{HOST}:{port}"
    metrics: list[str] = []
    for _start in ("cold", "restart"):
        proc = _serve(port, cache)
        try:
            wait_http_ok(f"{url}/health", proc, timeout=300)
            trio.run(_varied_load, url)
            metrics.append(httpx.get(f"{url}/metrics", timeout=10).text)
        finally:
            proc.stop()
        assert any("ready after" in line for line in proc.lines), proc.tail()

    cold, restart = metrics
    prefix = "pd_fsm_worker_backend_"
    assert _metric(cold, f"{prefix}compiles_total") > 20  # the plan, compiled before ready
    for text in metrics:
        assert _metric(text, f"{prefix}compiles_after_ready_total") == 0
        for phase in ("model_load", "forward_compile", "first_request"):
            assert _metric(text, f"{prefix}ready_seconds", phase) >= 0
    # The first start compiled and stored; the second loaded every executable of its start-up
    # from the compilation cache and compiled none.
    assert _metric(cold, f"{prefix}compilation_cache_misses_before_ready") > 20
    assert _metric(cold, f"{prefix}compilation_cache_writes_total") > 20
    assert _metric(restart, f"{prefix}compilation_cache_misses_before_ready") == 0
    assert _metric(restart, f"{prefix}compiles_total") == 0
    assert _metric(restart, f"{prefix}compilation_cache_hits_before_ready") == _metric(
        cold, f"{prefix}compilation_cache_misses_before_ready"
    )
    for text in metrics:
        assert _metric(text, f"{prefix}compilation_cache_corrupt_total") == 0
    assert any(p.suffix == ".exe" for p in cache.iterdir())
