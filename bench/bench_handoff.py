"""Issue 32 §2: a live KV hand-off against a re-prefill migration, by context length.

One P and two D (both ``--drain-handoff``) behind ``pd-fsm proxy``, production windows. Per
context length and round, two streams of ``--max-tokens`` tokens after a prompt of (length - max
tokens) random token ids:

* hand-off: the D that streams gets SIGTERM after the stream's 8th event; it registers the
  stream's KV and ends its leg with a ticket, the proxy posts the request to the other D alone,
  which pulls the KV and goes on (no prefill);
* migration: the D that streams gets SIGKILL after the 8th event; the proxy opens a new room for
  prompt + tokens so far, which P prefills again (its prefix cache off unless ``--radix``: the
  whole context) and the other D pulls.

What the client sees is the stall: the longest gap between two consecutive events from the
signal on (the same freeze of every D to find the streaming one precedes both signals). Also
printed: the uninterrupted inter-token gap of the same streams before the signal. The signalled
D is restarted between streams. Asserts nothing but that every stream is whole; the machine is
shared, so compare the two columns of one run.

Run: ``.venv/bin/python bench/bench_handoff.py [--model tiny] [--lengths 512 2048 4000]``
(both models' positions end at 8,192; the default lengths are those of ``RESULTS_handoff.md``'s
runs, made when the tiny model's ended at 4,096; ``--model smollm2`` prefills slowly on CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.integration.failure_support import Fleet, signal_streaming_decode

SIGNAL_AFTER = 8  # events before the decode worker is signalled
VOCAB = {"tiny": 256, "smollm2": 40000}


def _body(args: argparse.Namespace, length: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    ids = [rng.randrange(1, VOCAB[args.model]) for _ in range(length - args.max_tokens)]
    return {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0,
                                "ignore_eos": True}}


async def _stream(http: httpx.AsyncClient, fleet: Fleet, body: dict[str, Any],
                  how: signal.Signals | None) -> dict[str, float]:
    """One stream through the proxy; with ``how``, the streaming D gets that signal after the
    8th event: its inter-token gap before, and the stall from the signal on (seconds)."""
    start = trio.current_time()
    times: list[float] = []
    victim = None
    tokens = 0
    async with http.stream("POST", f"{fleet['proxy'].url}/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue  # [DONE], or a blank line between events
            tokens = len(json.loads(line[len("data: "):])["output_ids"])
            times.append(trio.current_time() - start)
            if how is not None and victim is None and len(times) == SIGNAL_AFTER:
                victim = await signal_streaming_decode(
                    http, [fleet["d0"], fleet["d1"]], how)
    assert tokens == body["sampling_params"]["max_new_tokens"], tokens
    gaps = [b - a for a, b in itertools.pairwise(times)]
    out = {"itl": statistics.mean(gaps[: SIGNAL_AFTER - 1])}
    if how is not None:
        assert victim is not None
        out["stall"] = max(gaps[SIGNAL_AFTER - 1:])
        if victim.popen is not None and how == signal.SIGTERM:
            # It drains by itself: wait for its exit (0) before restarting it.
            assert await trio.to_thread.run_sync(victim.popen.wait, 120) == 0
        await trio.to_thread.run_sync(fleet.restart, victim.name, 600.0)
    return out


def _start(workdir: Path, args: argparse.Namespace) -> Fleet:
    longest = max(args.lengths)
    model = ["--model", args.model, "--page-size", str(args.page_size), "--max-running", "4",
             "--context-length", str(longest + 16)]
    fleet = Fleet(workdir, windows={}, model=model)
    fleet.bootstrap()
    pages = 2 * longest // args.page_size + 64
    p = fleet.prefill("p", num_pages=pages, extra=[] if args.radix else ["--disable-radix-cache"])
    drain = ["--drain-handoff", "--drain-timeout", "60"]
    d0 = fleet.decode("d0", num_pages=pages, extra=drain)
    d1 = fleet.decode("d1", num_pages=pages, extra=drain)
    fleet.proxy("proxy", [p], [d0, d1])
    fleet.start(timeout=1500)
    return fleet


async def _measure(fleet: Fleet, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(timeout=900) as http:
        for length in args.lengths:
            # Unmeasured, one per D (round robin): every shape this length needs is compiled.
            for seed in (3000, 3001):
                await _stream(http, fleet, _body(args, length, seed), None)
            handoff, migration = [], []
            for rnd in range(args.rounds):
                handoff.append(await _stream(http, fleet, _body(args, length, 1000 + rnd),
                                             signal.SIGTERM))
                migration.append(await _stream(http, fleet, _body(args, length, 2000 + rnd),
                                               signal.SIGKILL))
            itl = statistics.median(s["itl"] for s in handoff + migration)
            h = statistics.median(s["stall"] for s in handoff)
            m = statistics.median(s["stall"] for s in migration)
            each = "; ".join(", ".join(f"{s['stall'] * 1e3:.0f}" for s in runs)
                             for runs in (handoff, migration))
            print(f"| {length} | {itl * 1e3:.1f} | {h * 1e3:.0f} | {m * 1e3:.0f} | "
                  f"{m / h:.1f} | {each} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(VOCAB), default="tiny")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 4000])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--radix", action="store_true", help="P's prefix cache on")
    args = ap.parse_args()
    print("| context (tokens) | ITL before (ms) | stall, hand-off (ms) | stall, re-prefill "
          "migration (ms) | migration / hand-off | per round (ms): hand-off; migration |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        fleet = _start(Path(tmp), args)
        try:
            trio.run(_measure, fleet, args)
        finally:
            fleet.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
