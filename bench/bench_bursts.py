"""Concurrent bursts against a running cluster, then what every worker compiled after ready.

A decode worker whose batch outgrows the shapes its warm-up compiled compiles them while the
requests wait (``/server_info`` ``compiles_after_ready_total``). This sends bursts of mixed
``/v1/completions`` requests at once (prompts of 16-600 words, 20-120 tokens out, greedy) and
prints the answers' status codes per burst and each worker's compiles after ready and free pages.

    .venv/bin/pd-fsm cluster --model smollm2 --prefill 1 --decode 1 --pd-cores shared \\
        --num-pages 256 &
    .venv/bin/python bench/bench_bursts.py PROXY_URL --workers P_URL D_URL

Measured 2026-12-05 (bench/RESULTS_adaptive.md, run 14): before D held its rooms to
``--max-running``, a burst of 16 ran a decode batch of 16 beside a bound of 8 and compiled 4
executables; after, bursts of 4-32 (96 requests): all 200, 0 compiles after ready on P and D.
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter

import httpx
import trio

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "river", "mountain",
         "cloud", "stone", "paper", "light"]


async def _one(http: httpx.AsyncClient, url: str, model: str, rng: random.Random,
               out: list[tuple[int, float]]) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 600)))
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(20, 120),
            "temperature": 0}
    start = time.monotonic()
    response = await http.post(f"{url}/v1/completions", json=body)
    out.append((response.status_code, time.monotonic() - start))


async def _main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    async with httpx.AsyncClient(timeout=args.timeout) as http:
        for burst in args.bursts:
            answers: list[tuple[int, float]] = []
            async with trio.open_nursery() as nursery:
                for _ in range(burst):
                    nursery.start_soon(_one, http, args.url, args.model, rng, answers)
            codes = dict(Counter(code for code, _ in answers))
            print(f"burst of {burst}: {codes}, slowest {max(t for _, t in answers):.1f} s",
                  flush=True)
        for worker in args.workers:
            info = (await http.get(f"{worker}/server_info")).json()
            stats = info.get("internal_states", [{}])[0]
            print(f"{worker}: compiles_after_ready_total {stats.get('compiles_after_ready_total')}"
                  f", free pages {stats.get('free_pages')} of {stats.get('total_pages')}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url", help="the proxy (or a colocated worker)")
    p.add_argument("--workers", nargs="*", default=[], help="workers whose /server_info to read")
    p.add_argument("--bursts", type=int, nargs="+", default=[4, 8, 12, 16, 24, 32])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300.0)
    trio.run(_main, p.parse_args())


if __name__ == "__main__":
    main()
