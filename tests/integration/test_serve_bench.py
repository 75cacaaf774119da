"""`pd-fsm bench` against an in-process tiny worker: a reproducible prompt set, every request
measured, a table with the comparison column."""

from __future__ import annotations

import argparse
import math
import random

import pytest
import trio

from pd_fsm.io_trio.bench_client import (
    BenchPrompt,
    _main,
    add_parser,
    cache_lines,
    make_prompts,
    prefix_reuse,
    render,
    run_load,
)
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


async def test_poisson_arrivals_are_measured_as_they_came(nursery: trio.Nursery) -> None:
    """A few Poisson arrivals stray from their nominal rate: the summary keeps the span they
    came in (the seeded gaps, the last one included), what a goodput plot's x axis is."""
    url, _ = await start_worker(nursery, num_pages=256)
    args = argparse.Namespace(endpoint="generate", max_tokens=2, model="tiny", request_rate=20.0,
                              max_concurrency=None, timeout=60, seed=0)
    summary = await run_load(url, args, make_prompts("short", 4, seed=0))
    rng = random.Random(args.seed + 1)  # run_load's schedule
    gaps = sum(rng.expovariate(args.request_rate) for _ in range(4))
    assert gaps <= summary.arrivals <= summary.duration
    assert summary.arrival_rate() == 4 / summary.arrivals


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


def test_shared_prefix_datasets_share_what_they_say() -> None:
    shared = make_prompts("shared-prefix", 12, seed=1, groups=3, prefix_words=50)
    system = [p.text.split(" Question: ")[0] for p in shared]
    assert system[:3] == system[3:6] == system[9:12] and len(set(system[:3])) == 3
    turns = make_prompts("multi-turn", 9, seed=1, groups=3, prefix_words=20)
    for i in range(6):  # each turn resends its conversation's previous turn and answer
        assert turns[i + 3].text.startswith(turns[i].text + " Answer: ")
    assert prefix_reuse([BenchPrompt("abcd", 1), BenchPrompt("abxy", 1)]) == 2 / 8
    assert prefix_reuse(make_prompts("mixed", 8, seed=0)) < 0.05
    assert prefix_reuse(make_prompts("shared-prefix", 32, seed=0)) > 0.8


def test_cache_lines_report_this_run_per_side() -> None:
    before = {"http://d": {"kv_bytes": 1e6, "prompt_tokens": 10.0},
              "http://p": {"prompt_tokens": 100.0, "cached_tokens": 0.0},
              "http://x": {"route:prefill:cache_hit": 2.0}}
    after = {"http://d": {"kv_bytes": 5e6, "prompt_tokens": 10.0},
             "http://p": {"prompt_tokens": 300.0, "cached_tokens": 150.0},
             "http://x": {"route:prefill:cache_hit": 6.0, "route:prefill:cache_miss": 1.0}}
    sides = {"http://d": "D", "http://p": "P", "http://x": "proxy"}
    text = cache_lines([BenchPrompt("a", 1)], 4, sides, before, after)
    assert "KV bytes pulled per request: 1.000 MB" in text
    assert "P: prompt tokens from its prefix cache 75.0 % (150 of 200)" in text
    assert "routing: prefill:cache_hit 4, prefill:cache_miss 1" in text
