"""Does a pull wait for compute? One pull of a room's KV between a P and a D process, alone and
while both processes compute flat out, with the transfer threads at normal priority and raised
(``--transfer-nice``, pd_fsm/jax_engine/transfer/thread_priority.py). Prints a table; asserts
nothing.

    .venv/bin/python bench/bench_pull_priority.py [--mib 16] [--rounds 12]

Two P/D pairs of processes, each with a ``JaxTransferKVEngine`` as a worker has: pair A leaves
every thread at nice 0; pair B raises the transfer threads and D's pulling thread as a worker does
(``--nice``, -10 by default). "Compute" is a thread in each process of the measured pair running a
jitted matrix chain without pause (XLA's intra-op threads and its execution thread, as a forward
step uses them): with both processes of a pair at it, 2 cores carry about twice the runnable
threads they have, as in a loaded 1P1D cluster. The cases are interleaved round by round so that
machine noise hits them alike; one pull per case per round. Raising a priority needs root
(CAP_SYS_NICE): without it pair B's threads stay at 0, and the table says so.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plots  # bench/, beside this script

MIB = 1 << 20


def _compute_loop(stop: threading.Event, busy: threading.Event) -> None:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((768, 768), jnp.float32)
    chain = jax.jit(lambda a: jnp.tanh(jnp.tanh(a @ a) @ a) @ a)
    chain(x).block_until_ready()
    while not stop.is_set():
        if not busy.wait(0.05):
            continue
        chain(x).block_until_ready()


def _main(pipe: Connection, role: str, nice: int, mib: int) -> None:
    """P (registers a prepared array) or D (pulls it and reports the seconds)."""
    import jax
    import jax.numpy as jnp

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine
    from pd_fsm.jax_engine.transfer.thread_priority import DataPlanePriority, raise_this_thread

    engine = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    priority = DataPlanePriority(nice)
    if role == "D":  # this thread pulls, as a worker's pull threads do
        raise_this_thread(nice)
    stop, busy = threading.Event(), threading.Event()
    computing = threading.Thread(target=_compute_loop, args=(stop, busy), daemon=True)
    computing.start()
    n = mib * MIB // 4
    array = jax.jit(lambda: jnp.arange(n, dtype=jnp.float32))()
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    spec = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
    pipe.send(engine.address)
    while True:
        msg = pipe.recv()
        kind = msg[0]
        if kind == "quit":
            stop.set()
            computing.join(10)  # not mid-call when the interpreter exits
            engine.close()
            return
        if kind == "load":
            (busy.set if msg[1] else busy.clear)()
            reply: Any = "ok"
        elif kind == "register":
            engine.register(msg[1], [array], lease_s=600)
            reply = "ok"
        else:  # "pull", uuid, peer
            start = time.perf_counter()
            engine.start_pull(msg[2], msg[1], [spec], deadline_s=120).wait()
            reply = time.perf_counter() - start
        priority.apply()  # the connection's threads appear with the first pull
        pipe.send((reply, priority.as_dict()))


class _Pair:
    def __init__(self, nice: int, mib: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes: dict[str, Connection] = {}
        self.procs = []
        self.address = {}
        for role in ("P", "D"):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_main, args=(theirs, role, nice, mib), daemon=True)
            proc.start()
            if not mine.poll(180):
                raise SystemExit(f"{role} did not start")
            self.address[role] = mine.recv()
            self.pipes[role], self.procs = mine, [*self.procs, proc]
        self.uuid = 0
        self.priority: dict[str, Any] = {}

    def ask(self, role: str, *msg: Any) -> Any:
        self.pipes[role].send(msg)
        if not self.pipes[role].poll(180):
            raise SystemExit(f"{role} did not answer {msg[0]}")
        reply, self.priority[role] = self.pipes[role].recv()
        return reply

    def load(self, on: bool) -> None:
        for role in ("P", "D"):
            self.ask(role, "load", on)

    def pull(self) -> float:
        self.uuid += 1
        self.ask("P", "register", self.uuid)
        return float(self.ask("D", "pull", self.uuid, self.address["P"]))

    def close(self) -> None:
        for pipe in self.pipes.values():
            pipe.send(("quit",))
        for proc in self.procs:
            proc.join(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=16, help="bytes per pull (a room's KV), MiB")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--nice", type=int, default=-10, help="pair B's transfer threads (-20..-1)")
    args = p.parse_args()
    raised = f"nice {args.nice}"
    pairs = {"nice 0": _Pair(0, args.mib), raised: _Pair(args.nice, args.mib)}
    cases = [("alone", "nice 0", False), ("alone", raised, False),
             ("computing", "nice 0", True), ("computing", raised, True)]
    times: dict[tuple[str, str], list[float]] = {(c, n): [] for c, n, _ in cases}
    try:
        for pair in pairs.values():
            pair.pull()  # connect (the connection's threads start) and warm up
            pair.pull()
        for _ in range(args.rounds):
            for case, name, loaded in cases:
                pair = pairs[name]
                if loaded:
                    pair.load(True)
                    time.sleep(0.3)  # let the compute threads fill the cores
                times[(case, name)].append(pair.pull())
                if loaded:
                    pair.load(False)
                    time.sleep(0.1)
        print(f"one {args.mib} MiB pull P -> D, {args.rounds} rounds, cases interleaved")
        for name, pair in pairs.items():
            print(f"  pair '{name}': transfer threads {pair.priority}")
        base = statistics.median(times[("alone", "nice 0")])
        print(f"\n{'case':<12}{'threads':<10}{'p50 ms':>9}{'p90 ms':>9}{'max ms':>9}"
              f"{'p50 / alone':>13}")
        for case, name, _ in cases:
            ts = sorted(times[(case, name)])
            p90 = ts[min(len(ts) - 1, int(0.9 * len(ts)))]
            print(f"{case:<12}{name:<10}{statistics.median(ts) * 1e3:>9.1f}{p90 * 1e3:>9.1f}"
                  f"{ts[-1] * 1e3:>9.1f}{statistics.median(ts) / base:>13.2f}")
        plots.latency_cdf("pull_priority", f"One {args.mib} MiB pull P -> D, alone and under "
                          "compute", {f"{case}, {name}": times[(case, name)]
                                      for case, name, _ in cases}, "pull time")
    finally:
        for pair in pairs.values():
            pair.close()


if __name__ == "__main__":
    main()
