"""What an idle decode worker beside a colocated worker costs it (issue 30, runs 20 and 26 of
RESULTS_adaptive.md: the adaptive cluster's colocated worker ran each token 3-10 % slower than
the static colocated worker; beside it sat the standby D, one XLA thread at nice -5, idle).
Prints both with the baseline measured in the same run; asserts nothing.

One colocated worker (SmolLM2 by default, every core) and, beside it, a decode worker as
``pd-fsm cluster --planner`` starts its D (``--cpu-pools 1 --nice -5``), with no prefill worker:
it only waits. The same kind of load as ``bench_proxy_relay.py`` (short prompts, long answers,
``--concurrency`` streams) goes to the colocated worker in rounds, alternately with the D
stopped (SIGSTOP: not scheduled at all) and running idle (SIGCONT), the order rotating each
round, fresh prompts each round.

    .venv/bin/python bench/bench_idle_neighbour.py [--rounds 4 --num-prompts 24
        --concurrency 6 --max-tokens 96] [--busy-nice N]

With ``--busy-nice N`` the neighbour is not a decode worker but one thread that never sleeps, at
nice N: a standby D decoding the streams P handed it before a merge, as a load on one core
(runs 34-37 of RESULTS_adaptive.md: the new colocated worker ran 15-40 % slower a token for
10-20 s beside it, at D's nice -5 and at 10 alike). It runs stopped (SIGSTOP) and spinning.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_proxy_relay import round_arguments, short_load  # (this folder: sys.path[0])

from pd_fsm.io_trio.bench_client import Summary, make_prompts, render, run_load
from pd_fsm.io_trio.ports import free_ports
from tests.integration.serve_support import Proc, cli, wait_http_ok

HOST = "127.0.0.1"
STATES = {"D stopped": signal.SIGSTOP, "D idle beside it": signal.SIGCONT}


def states(args: argparse.Namespace) -> dict[str, signal.Signals]:
    """The two states' names, each with the signal that puts the neighbour in it."""
    if args.busy_nice is None:
        return STATES
    return {"neighbour stopped": signal.SIGSTOP,
            f"a busy thread beside it at nice {args.busy_nice}": signal.SIGCONT}


async def measure(url: str, d_pid: int, args: argparse.Namespace) -> dict[str, Summary]:
    load = short_load(args)
    await run_load(url, load, make_prompts("short", args.concurrency, args.seed))  # warm-up
    signals = states(args)
    names = list(signals)
    runs: dict[str, list[Summary]] = {name: [] for name in names}
    for r in range(args.rounds):
        for i, name in enumerate(names[r % 2:] + names[:r % 2]):
            os.kill(d_pid, signals[name])
            await trio.sleep(1.0)  # let a resumed D settle back to idle
            prompts = make_prompts("short", args.num_prompts, args.seed + 1 + 2 * r + i)
            runs[name].append(await run_load(url, load, prompts))
    os.kill(d_pid, signal.SIGCONT)
    return {name: Summary([x for s in ss for x in s.results], sum(s.duration for s in ss))
            for name, ss in runs.items()}


def main() -> int:
    parser = round_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--busy-nice", type=int, default=None, metavar="N",
                        help="the neighbour: one thread that never sleeps, at nice N (-20..19; "
                             "below 0 needs root), instead of an idle decode worker")
    args = parser.parse_args()
    if args.busy_nice is not None and not -20 <= args.busy_nice <= 19:
        parser.error(f"--busy-nice {args.busy_nice}: must be in -20..19")
    procs: list[Proc] = []
    try:
        c_port, d_port, b_port = free_ports(3)
        # D registers with a registry before it reports ready (as the cluster's standby has).
        registry = Proc.start("bootstrap", cli("bootstrap", "--host", HOST, "--port",
                                               str(b_port)))
        procs.append(registry)
        wait_http_ok(f"http://{HOST}:{b_port}/health", registry, timeout=120)
        colocated = Proc.start("colocated", cli(
            "serve", "--model", args.model, "--host", HOST, "--port", str(c_port),
            "--disaggregation-mode", "null"))
        procs.append(colocated)
        if args.busy_nice is None:
            decode = Proc.start("decode", cli(
                "serve", "--model", args.model, "--host", HOST, "--port", str(d_port),
                "--disaggregation-mode", "decode", "--cpus", f"0-{(os.cpu_count() or 1) - 1}",
                "--cpu-pools", "1", "--nice", "-5", "--disaggregation-bootstrap-host", HOST,
                "--disaggregation-bootstrap-port", str(b_port)))
        else:  # (nice execs the interpreter: the pid signalled is the spinning one)
            decode = Proc.start("busy", ["nice", "-n", str(args.busy_nice), sys.executable,
                                         "-c", "while True: pass"])
        procs.append(decode)
        url = f"http://{HOST}:{c_port}"
        wait_http_ok(f"{url}/health", colocated, timeout=600)
        if args.busy_nice is None:
            wait_http_ok(f"http://{HOST}:{d_port}/health", decode, timeout=600)
        results = trio.run(measure, url, decode.popen.pid, args)
    finally:
        for proc in reversed(procs):
            if proc.popen.poll() is None:  # a stopped D would not see the stop's SIGTERM
                os.kill(proc.popen.pid, signal.SIGCONT)
            proc.stop()
    print(f"{args.model}, one colocated worker on every core ({os.cpu_count()} here), short "
          f"prompts, {args.num_prompts} requests x {args.rounds} rounds per state, concurrency "
          f"{args.concurrency}, {args.max_tokens} tokens out; beside it "
          + ("a decode worker (--cpu-pools 1 --nice -5, no P)\n" if args.busy_nice is None else
             f"one thread that never sleeps (nice {args.busy_nice})\n"))
    a, b = states(args)
    print(render(results[b], results[a], b, a))
    for name in states(args):
        gaps = [g for r in results[name].results if r.ok for g in r.itl]
        print(f"{name}: mean inter-token gap {sum(gaps) / len(gaps) * 1000:.1f} ms over "
              f"{len(gaps)} gaps" if gaps else f"{name}: no gaps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
