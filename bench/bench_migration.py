"""Issue 32 §1: what a request migration costs the client, by context length (SmolLM2).

One P and two D behind ``pd-fsm proxy`` (production windows). Per context length and round:
a stream of ``--max-tokens`` tokens after a prompt of (length - max tokens) random token ids,
through the proxy, uninterrupted (its TTFT and mean inter-token gap are the baseline); then a
stream of another prompt of the same length whose decode worker is SIGKILLed after its 8th
event: the stall the client sees is the time from its last event before the kill to its first
event after it (the proxy migrates the stream: a new room for prompt + tokens so far, prefilled
on P, where the prompt's KV is usually still in P's prefix cache, and pulled by the other D).
Also printed: the re-prefill the migration needed, and the stall with P's prefix cache off
(``--no-radix-cache``: the whole prompt prefilled again). The killed D is restarted between
rounds. Asserts nothing; the machine is shared, so the figures to read are the ratios to the
same run's baseline.

Run: ``.venv/bin/python bench/bench_migration.py [--lengths 512 2048 8192] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.failure_support import Fleet, signal_streaming_decode

KILL_AFTER = 8  # events before the decode worker dies


def _model(page_size: int) -> list[str]:
    return ["--model", "smollm2", "--page-size", str(page_size), "--max-running", "4"]


def _body(length: int, max_tokens: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = [rng.randrange(100, 40000) for _ in range(length - max_tokens)]
    return {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                "ignore_eos": True}}


async def _stream(http: httpx.AsyncClient, fleet: Fleet, body: dict[str, Any],
                  kill: bool) -> dict[str, float]:
    """Event times of one stream (seconds since it was sent); with ``kill``, the stall."""
    start = trio.current_time()
    times: list[float] = []
    killed_at = None
    victim = None
    async with http.stream("POST", f"{fleet['proxy'].url}/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            times.append(trio.current_time() - start)
            if kill and victim is None and len(times) == KILL_AFTER:
                killed_at = trio.current_time() - start
                victim = await signal_streaming_decode(http, [fleet["d0"], fleet["d1"]])
    gaps = [b - a for a, b in itertools.pairwise(times)]
    out = {"ttft": times[0], "itl": statistics.mean(gaps[: KILL_AFTER - 1])}
    if kill:
        assert killed_at is not None and victim is not None
        after = next(t for t in times if t > killed_at)
        out["stall"] = after - times[KILL_AFTER - 1]
        await trio.to_thread.run_sync(fleet.restart, victim.name, 600.0)
    return out


def _start(workdir: Path, args: argparse.Namespace, radix: bool) -> Fleet:
    fleet = Fleet(workdir, windows={}, model=_model(args.page_size))
    fleet.bootstrap()
    pages = str(2 * max(args.lengths) // args.page_size + 64)
    p = fleet.prefill("p", num_pages=int(pages),
                      extra=[] if radix else ["--disable-radix-cache"])
    d0, d1 = fleet.decode("d0", num_pages=int(pages)), fleet.decode("d1", num_pages=int(pages))
    fleet.proxy("proxy", [p], [d0, d1])
    fleet.start(timeout=1500)
    return fleet


async def _measure(fleet: Fleet, args: argparse.Namespace, label: str) -> list[str]:
    rows = []
    async with httpx.AsyncClient(timeout=900) as http:
        await _stream(http, fleet, _body(64 + args.max_tokens, args.max_tokens, 0), False)
        for length in args.lengths:
            # Unmeasured: any shape this length needs is compiled before the figures.
            await _stream(http, fleet, _body(length, args.max_tokens, 3000), False)
            base, mig = [], []
            for rnd in range(args.rounds):
                base.append(await _stream(http, fleet,
                                          _body(length, args.max_tokens, 1000 + rnd), False))
                mig.append(await _stream(http, fleet,
                                         _body(length, args.max_tokens, 2000 + rnd), True))
            ttft = statistics.median(b["ttft"] for b in base)
            itl = statistics.median(b["itl"] for b in base)
            stall = statistics.median(m["stall"] for m in mig)
            each = ", ".join(f"{m['stall'] * 1e3:.0f}" for m in mig)
            rows.append(f"| {label} | {length} | {ttft * 1e3:.0f} | {itl * 1e3:.0f} | "
                        f"{stall * 1e3:.0f} | {stall / ttft:.2f} | {each} |")
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    args = ap.parse_args()
    print("| P's prefix cache | context (tokens) | TTFT uninterrupted (ms) | ITL (ms) | "
          "stall at the migration (ms) | stall / TTFT | stalls per round (ms) |")
    print("|---|---|---|---|---|---|---|")
    rows: list[str] = []
    for radix in (True, False):
        with tempfile.TemporaryDirectory() as tmp:
            fleet = _start(Path(tmp), args, radix)
            try:
                rows += trio.run(_measure, fleet, args, "on" if radix else "off")
            finally:
                fleet.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
