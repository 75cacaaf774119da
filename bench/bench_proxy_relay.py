"""What the proxy's relay costs a colocated worker on a busy machine: the adaptive cluster's
colocated mode (issue 30) answers through ``pd-fsm proxy``, the static colocated placement of
``bench_adaptive.py`` straight from its worker. Prints a table with the direct baseline measured
in the same run; asserts nothing.

One colocated worker (SmolLM2 by default, every core) and ``pd-fsm proxy --colocated URL`` in
front of it; the same kind of load (short prompts, long answers, ``--concurrency`` streams at
once, as in the adaptive bench's short-prompt phases) goes in rounds to the proxy and straight
to the worker, the order rotating each round. Each round draws prompts of its own (another seed)
so that no round finds another's prompts in the worker's prefix cache. Besides TTFT / ITL /
throughput, the proxy's CPU seconds (its process's user + system time across the proxied rounds)
per relayed output token.

    .venv/bin/python bench/bench_proxy_relay.py [--rounds 4 --num-prompts 24 --concurrency 6
        --max-tokens 96]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_fsm.io_trio.bench_client import Summary, make_prompts, render, run_load
from pd_fsm.io_trio.ports import free_ports
from tests.integration.serve_support import Proc, cli, wait_http_ok

HOST = "127.0.0.1"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def round_arguments(description: str) -> argparse.ArgumentParser:
    """The rounds of short-prompt load this bench and bench_idle_neighbour.py send."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    return p


def short_load(args: argparse.Namespace) -> argparse.Namespace:
    """run_load's settings for those rounds: closed loop, ``--concurrency`` streams."""
    return argparse.Namespace(endpoint="completions", max_tokens=args.max_tokens, model=None,
                              request_rate=math.inf, max_concurrency=args.concurrency,
                              timeout=600.0, seed=args.seed)


async def measure(targets: dict[str, str], proxy_pid: int, args: argparse.Namespace
                  ) -> tuple[dict[str, Summary], float]:
    load = short_load(args)
    warm = make_prompts("short", args.concurrency, args.seed)
    for url in targets.values():  # unmeasured: every batch shape this load will use
        await run_load(url, load, warm)
    names = list(targets)
    runs: dict[str, list[Summary]] = {name: [] for name in names}
    proxy_cpu = 0.0
    for r in range(args.rounds):
        for i, name in enumerate(names[r % len(names):] + names[: r % len(names)]):
            prompts = make_prompts("short", args.num_prompts, args.seed + 1 + 2 * r + i)
            before = cpu_seconds(proxy_pid)
            runs[name].append(await run_load(targets[name], load, prompts))
            if name == "proxy":
                proxy_cpu += cpu_seconds(proxy_pid) - before
    merged = {name: Summary([x for s in ss for x in s.results], sum(s.duration for s in ss))
              for name, ss in runs.items()}
    return merged, proxy_cpu


def main() -> int:
    args = round_arguments(__doc__.split("\n\n")[0]).parse_args()
    procs: list[Proc] = []
    try:
        w_port, proxy_port = free_ports(2)
        worker = Proc.start("colocated", cli("serve", "--model", args.model, "--host", HOST,
                                             "--port", str(w_port),
                                             "--disaggregation-mode", "null"))
        procs.append(worker)
        w_url = f"http://{HOST}:{w_port}"
        wait_http_ok(f"{w_url}/health", worker, timeout=600)
        proxy = Proc.start("proxy", cli("proxy", "--host", HOST, "--port", str(proxy_port),
                                        "--colocated", w_url))
        procs.append(proxy)
        proxy_url = f"http://{HOST}:{proxy_port}"
        wait_http_ok(f"{proxy_url}/health", proxy, timeout=120)
        results, cpu = trio.run(measure, {"proxy": proxy_url, "direct": w_url},
                                proxy.popen.pid, args)
    finally:
        for proc in reversed(procs):
            proc.stop()
    relayed = sum(r.output_tokens for r in results["proxy"].results if r.ok)
    print(f"{args.model}, one colocated worker on every core ({os.cpu_count()} here), short "
          f"prompts, {args.num_prompts} requests x {args.rounds} rounds per target, "
          f"concurrency {args.concurrency}, {args.max_tokens} tokens out, completions, "
          f"streamed\n")
    print(render(results["proxy"], results["direct"], "pd-fsm proxy --colocated", "direct"))
    for name in ("proxy", "direct"):
        gaps = [g for r in results[name].results if r.ok for g in r.itl]
        print(f"{name}: mean inter-token gap {sum(gaps) / len(gaps) * 1000:.1f} ms over "
              f"{len(gaps)} gaps" if gaps else f"{name}: no gaps")
    per_token = cpu / relayed * 1000 if relayed else math.nan
    print(f"proxy CPU: {cpu:.2f} s over {relayed} relayed tokens = {per_token:.3f} ms a token "
          f"({cpu / results['proxy'].duration:.1%} of one core over the proxied rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
