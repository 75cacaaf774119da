"""`pd-fsm bench` against an in-process tiny worker: a reproducible prompt set, every request
measured, a table with the comparison column."""

from __future__ import annotations

import argparse
import math

import trio

from pd_fsm.io_trio.bench_client import make_prompts, render, run_load
from tests.integration.serve_support import start_worker


def test_prompt_set_is_fixed_by_seed() -> None:
    a, b = make_prompts("mixed", 6, seed=3), make_prompts("mixed", 6, seed=3)
    assert a == b and a != make_prompts("mixed", 6, seed=4)
    assert [p.words <= 32 for p in a] == [True, False] * 3


async def test_bench_measures_every_request(nursery: trio.Nursery) -> None:
    url, _ = await start_worker(nursery, num_pages=256)
    args = argparse.Namespace(endpoint="completions", max_tokens=4, model="tiny",
                              request_rate=math.inf, max_concurrency=2, timeout=60, seed=0)
    prompts = make_prompts("short", 4, seed=0)
    for endpoint in ("completions", "generate", "chat"):
        args.endpoint = endpoint
        summary = await run_load(url, args, prompts)
        assert all(r.ok for r in summary.results), [r.error for r in summary.results]
        # ITL counts gaps between chunks that carry text (a token may decode to nothing).
        assert all(r.output_tokens == 4 and len(r.itl) <= 3 for r in summary.results), endpoint
        assert sum(len(r.itl) for r in summary.results) > 0
        rows = summary.rows()
        assert rows["completed"] == 4 and rows["failed"] == 0
        assert 0 < rows["TTFT p50 ms"] <= rows["E2E p99 ms"]
    table = render(summary, summary, url, url)
    assert "TTFT p90 ms" in table and "target/compare" in table
