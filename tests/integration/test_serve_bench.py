"""`pd-fsm bench` against an in-process tiny worker: a reproducible prompt set, every request
measured, a table with the comparison column."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest
import trio

from pd_fsm.io_trio.bench_client import (
    BenchPrompt,
    _main,
    add_parser,
    cache_lines,
    main,
    make_prompts,
    parse_goodput,
    prefix_reuse,
    random_prompts,
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


def test_random_prompts_are_token_ids_of_the_lengths_asked() -> None:
    a = random_prompts(8, seed=1, input_len=40, output_len=6, range_ratio=0.5)
    assert a == random_prompts(8, seed=1, input_len=40, output_len=6, range_ratio=0.5)
    assert all(p.ids is not None and 20 <= len(p.ids) == p.words <= 40 for p in a)
    assert all(p.max_tokens is not None and 3 <= p.max_tokens <= 6 for p in a)
    exact = random_prompts(4, seed=1, input_len=40, output_len=6)
    assert {(len(p.ids or ()), p.max_tokens) for p in exact} == {(40, 6)}
    assert parse_goodput(["ttft:1000", "tpot:50"]) == {"ttft": 1.0, "tpot": 0.05}
    assert max(max(p.ids or ()) for p in random_prompts(9, 0, 50, 1, ids=(3, 7))) <= 6
    for bad in ("itl:50", "ttft:x", "ttft:0"):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput([bad])


async def test_random_token_ids_and_goodput_through_the_command(
        nursery: trio.Nursery, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Token-id prompts of an exact length (sglang's random dataset) reach the worker as ids on
    both endpoints that take them; every request is counted within a loose target and none
    within an impossible one; --json keeps the figures."""
    url, _ = await start_worker(nursery, num_pages=256)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    for endpoint, tpot in (("generate", "60000"), ("completions", "0.000001")):
        out_json = tmp_path / f"{endpoint}.json"
        args = parser.parse_args(["bench", "--url", url, "--num-prompts", "3", "--dataset",
                                  "random", "--random-input-len", "12", "--random-output-len",
                                  "3", "--random-ids", "1-256", "--endpoint", endpoint,
                                  "--model", "tiny",
                                  "--goodput", "ttft:60000", f"tpot:{tpot}",
                                  "--json", str(out_json)])
        assert await _main(args) == 0
        rec = json.loads(out_json.read_text())
        assert rec["figures"]["completed"] == 3 and rec["figures"]["failed"] == 0
        assert rec["goodput"]["met"] == (3 if endpoint == "generate" else 0)
        assert rec["load"]["random_input_len"] == 12
        ttfts = rec["ttft_ms"]  # each request's, in the order sent
        assert len(ttfts) == 3 and all(t > 0 for t in ttfts)
        assert max(ttfts) == pytest.approx(rec["figures"]["TTFT p99 ms"], abs=0.01)
    assert "goodput" in capsys.readouterr().out
    bad = parser.parse_args(["bench", "--url", url, "--dataset", "random", "--endpoint", "chat"])
    assert main(bad) == 2


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
