"""Why the adaptive cluster's colocated worker ran each token slower than the static colocated
worker (issue 30, RESULTS_adaptive.md runs 20 and 26: TPOT 0.100-0.103 s against 0.092-0.094 s
at the same load): the two side by side, and the planner's and the bench's scrapes on and off.
Prints each with the static baseline measured in the same run; asserts nothing.

Two clusters as ``bench_adaptive.py`` starts them (its flags: ``chosen_placements``), both up
throughout, as there: the static colocated one, and the adaptive one (``pd-fsm cluster
--planner``, P and D sharing the cores, P at nice 10, D at nice -5 on one XLA thread) whose
planner only decides (``--dry-run``) and starts paused. Its P is switched to colocated (``POST
/switch_role null``), as the planner's wide merge does, and D waits beside it as the standby.
Then the same kind of load as ``bench_proxy_relay.py`` (short prompts, long answers,
``--concurrency`` streams) goes in rounds to three states, the order rotating each round, fresh
prompts each round:

    static colocated        the static cluster's worker, straight (as bench_adaptive measures it)
    merged                  the adaptive cluster through its proxy, its planner paused
    merged, planner         the same with its planner resumed: it scrapes every worker's
                            /server_info and /metrics every --interval (2 s)
    merged, planner, watch  and the bench's own watch too (bench_adaptive's: every worker's
                            /server_info and the planner's /decisions and /metrics every
                            --poll-s, 1 s)

Besides the latencies, the CPU seconds each process of the two clusters (and this bench) spent in
each state's rounds, from /proc.

    .venv/bin/python bench/bench_merged_worker.py [--rounds 4 --num-prompts 24
        --concurrency 6 --max-tokens 96]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_adaptive import ADAPTIVE, WORKER_PREFIXES, Watch, chosen_placements  # bench/
from bench_placement import COLOCATED, start  # bench/
from bench_proxy_relay import cpu_seconds, round_arguments, short_load  # bench/

from pd_fsm.io_trio.bench_client import Summary, make_prompts, render, run_load
from pd_fsm.io_trio.worker.switch_cli import switch_role
from tests.integration.serve_support import PDCluster

STATIC, MERGED, PLANNED, WATCHED = ("static colocated", "merged", "merged, planner",
                                    "merged, planner, watch")
SWITCH_S = 300.0  # a drain of nothing and a switch: seconds, not minutes


async def merge(prefill: str) -> None:
    """P to colocated, as the planner's wide merge does (``pd-fsm switch-role``'s way: back
    once ``/server_info`` says it serves so)."""
    status, said = await switch_role(prefill, "null", None, SWITCH_S)
    print(said, flush=True)
    if status:
        raise RuntimeError(said)


def processes(cluster: PDCluster, prefix: str = "") -> dict[str, int]:
    """The processes of ``cluster`` by what they are: a worker by its name in the cluster's
    table (``prefill-0``...), else its pd-fsm subcommand (``proxy``, ``planner``...)."""
    root = cluster.proc.popen.pid
    named = {url.rsplit(":", 1)[1]: name for name, url in cluster.urls.items()}
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        children.setdefault(ppid, []).append(pid)
    out: dict[str, int] = {}
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        sub = next((a for a in argv if a in ("serve", "proxy", "planner", "bootstrap")), None)
        if sub is not None:
            port = argv[argv.index("--port") + 1] if "--port" in argv else "?"
            out[prefix + (named.get(port, f"serve :{port}") if sub == "serve" else sub)] = pid
    return out


def cpu_now(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()} | {
        "this bench": sum(os.times()[:2])}


async def measure(static: str, clusters: list[PDCluster], args: argparse.Namespace
                  ) -> tuple[dict[str, Summary], dict[str, dict[str, float]]]:
    load = short_load(args)
    adaptive = clusters[1]
    proxy, planner = adaptive.urls["proxy"], adaptive.urls["planner"]
    workers = {k: u for k, u in adaptive.urls.items() if k.startswith(WORKER_PREFIXES)}
    prefill = next(u for k, u in workers.items() if k.startswith("prefill-"))
    targets = {STATIC: static, MERGED: proxy, PLANNED: proxy, WATCHED: proxy}
    watch = Watch(list(workers.values()), planner, args.poll_s)
    pids = processes(adaptive) | processes(clusters[0], "static ")
    runs: dict[str, list[Summary]] = {name: [] for name in targets}
    cpu: dict[str, dict[str, float]] = {name: dict.fromkeys(cpu_now(pids), 0.0)
                                        for name in targets}
    async with httpx.AsyncClient(timeout=10) as http:
        await merge(prefill)
        warm = make_prompts("short", args.concurrency, args.seed)
        for url in (static, proxy):  # unmeasured: every batch shape; the proxy sees the merge
            await run_load(url, load, warm)
        names = list(targets)
        for r in range(args.rounds):
            for i, name in enumerate(names[r % len(names):] + names[: r % len(names)]):
                prompts = make_prompts("short", args.num_prompts, args.seed + 1 + 4 * r + i)
                if name in (PLANNED, WATCHED):
                    (await http.post(f"{planner}/resume")).raise_for_status()
                before = cpu_now(pids)
                async with trio.open_nursery() as nursery:
                    if name == WATCHED:
                        nursery.start_soon(watch.follow, http, trio.current_time())
                    runs[name].append(await run_load(targets[name], load, prompts))
                    nursery.cancel_scope.cancel()
                for proc, seconds in cpu_now(pids).items():
                    cpu[name][proc] += seconds - before[proc]
                if name in (PLANNED, WATCHED):
                    (await http.post(f"{planner}/pause")).raise_for_status()
        roles = [(await http.get(f"{u}/server_info")).json().get("disaggregation_mode")
                 for u in workers.values()]
    print(f"adaptive cluster's roles after the rounds: {roles} (the planner's --dry-run "
          f"switched nothing: {roles.count('null') == 1})")
    return ({name: Summary([x for s in ss for x in s.results], sum(s.duration for s in ss))
             for name, ss in runs.items()}, cpu)


def main() -> int:
    p = round_arguments(__doc__.split("\n\n")[0])
    p.add_argument("--num-pages", type=int, default=512, help="KV pages of every worker")
    p.add_argument("--poll-s", type=float, default=1.0, help="the bench's watch (as "
                                                             "bench_adaptive.py's)")
    p.add_argument("--planner-args", default="--interval 2 --patience 2 --cooldown 15")
    args = p.parse_args()
    chosen = chosen_placements(argparse.Namespace(
        nice="10,-5", adaptive_workers="1,1", adaptive_cores="shared", slo_ttft=2.0,
        slo_tpot=0.1, planner_args=f"{args.planner_args} --dry-run", control=False,
        only=["colocated", "adaptive"]))
    began = time.monotonic()
    clusters: list[PDCluster] = []
    try:
        for name in (COLOCATED, ADAPTIVE):
            flags, _ = chosen[name]
            clusters.append(start(["--num-pages", str(args.num_pages), *flags], args))
            print(f"started {name} after {time.monotonic() - began:.0f} s", flush=True)
        static = clusters[0].urls[chosen[COLOCATED][1]]
        results, cpu = trio.run(measure, static, clusters, args)
    finally:
        for c in clusters:
            c.proc.stop(grace=120)
    print(f"{args.model}, static colocated cluster and adaptive cluster (P merged to colocated, "
          f"standby D beside it; planner --dry-run), both up on every core ({os.cpu_count()} "
          f"here); short prompts, {args.num_prompts} requests x {args.rounds} rounds per state, "
          f"concurrency {args.concurrency}, {args.max_tokens} tokens out\n")
    for name in (MERGED, PLANNED, WATCHED):
        print(render(results[name], results[STATIC], name, STATIC))
    for name in results:
        gaps = [g for r in results[name].results if r.ok for g in r.itl]
        print(f"{name}: mean inter-token gap {sum(gaps) / len(gaps) * 1000:.1f} ms over "
              f"{len(gaps)} gaps" if gaps else f"{name}: no gaps")
    procs = sorted(next(iter(cpu.values())))
    print("\nCPU seconds per state's rounds (each cluster's processes and this bench):")
    print(f"{'state':24}" + "".join(f"{p:>18}" for p in procs) + f"{'duration s':>12}")
    for name, used in cpu.items():
        print(f"{name:24}" + "".join(f"{used[p]:18.1f}" for p in procs)
              + f"{results[name].duration:12.1f}")
    print(f"whole run: {time.monotonic() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
