"""The edge's strict JSON parse (``pd_fsm.io_trio.strict_json.loads``) against ``json.loads`` on
the same bodies, alternated in one run (the baseline). Bodies: a short /generate, a chat with
2,000 messages (enough objects that the walk runs), 1M token ids (8 MB: the proxy's body bound),
and a 2,000-deep body refused. Asserts nothing; prints ms per parse and the ratio.

    .venv/bin/python bench/bench_strict_json.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import plots

from pd_fsm.io_trio.strict_json import JsonError, loads

BODIES: dict[str, bytes] = {
    "short /generate (96 B)": json.dumps({"text": "The capital of France is", "sampling_params": {
        "max_new_tokens": 8, "temperature": 0}}).encode(),
    "chat, 2,000 messages (86 KB)": json.dumps({"model": "x", "messages": [
        {"role": "user", "content": "x" * 10}] * 2000}).encode(),
    "1M token ids (7.9 MB)": json.dumps({"input_ids": list(range(1_000_000)),
                                         "sampling_params": {"temperature": 0.5}}).encode(),
}
DEEP = b'{"text":' + b"[" * 2000 + b"]" * 2000 + b"}"


def _best_ms(parse: Callable[[bytes], object], body: bytes, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        parse(body)
    return (time.perf_counter() - start) / repeat * 1e3


def _refuse(body: bytes) -> object:
    try:
        return loads(body)
    except JsonError as exc:
        return exc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print("| body | json.loads ms | strict ms | strict / json |")
    print("|---|---|---|---|")
    measured: dict[str, tuple[float, float]] = {}
    for name, body in BODIES.items():
        repeat = max(1, 200_000 // len(body))
        base, strict = float("inf"), float("inf")
        for _ in range(args.rounds):  # alternated: both see the same machine
            base = min(base, _best_ms(json.loads, body, repeat))
            strict = min(strict, _best_ms(loads, body, repeat))
        print(f"| {name} | {base:.4f} | {strict:.4f} | {strict / base:.2f}x |")
        measured[name] = (base, strict)
    refused = min(_best_ms(_refuse, DEEP, 100) for _ in range(args.rounds))
    print(f"| 2,000-deep body, refused (json.loads: RecursionError) | — | {refused:.4f} | — |")
    plots.ratio_bars("strict_json", "The edge's strict JSON parse vs json.loads", measured,
                     ("json.loads", "strict_json.loads"), "ms per parse")


if __name__ == "__main__":
    main()
