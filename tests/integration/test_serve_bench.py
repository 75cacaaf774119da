"""`pd-fsm bench` against an in-process tiny worker: a reproducible prompt set, every request
measured, a table with the comparison column."""

from __future__ import annotations

import argparse
import math

import pytest
import trio

from pd_fsm.io_trio.bench_client import _main, add_parser, make_prompts, render, run_load
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


async def test_bench_prints_where_the_time_went(nursery: trio.Nursery,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The whole command against a colocated worker: its table, then the phase table from the
    worker's /metrics (a colocated worker has no PD phases, only its TTFT)."""
    url, _ = await start_worker(nursery, num_pages=256)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--url", url, "--num-prompts", "3", "--max-tokens", "2",
                              "--dataset", "short", "--model", "tiny",
                              "--metrics-url", url])  # the same URL twice: scraped once
    assert await _main(args) == 0
    out = capsys.readouterr().out
    assert "TTFT p50 ms" in out and "where the time went" in out
    ttft = [line.split() for line in out.splitlines() if "time_to_first_token" in line]
    assert len(ttft) == 1 and ttft[0][0] == "worker" and ttft[0][-1] == "3"
