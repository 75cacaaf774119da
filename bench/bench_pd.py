"""PD benchmark: does receiving other requests' KV stall decode?

D decodes a batch of 8 SmolLM2 requests; ITL (time between consecutive decode steps) is measured
(a) with no KV arriving and (b) while other rooms' KV arrives from P and is pulled, waited for
and scattered into D's pool by the pull executor, concurrently. The arrivals carry
max_new_tokens=1, so they finish on arrival and the decode batch stays at 8 in both phases. P runs
in its own thread (its side-channel handling and registration releases are not on D's thread),
with its KV prefilled before the measured phase. Baseline = phase (a), measured in the same run.

    .venv/bin/python bench/bench_pd.py [--steps 60] [--arrive-every 2]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import threading
import time
from typing import Any

import plots  # bench/, beside this script

from pd_fsm.core import codec
from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.jax_engine.kv import tiered
from pd_fsm.jax_engine.model import load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.disaggregation import DecodeScheduler, DisaggregationArgs, PrefillScheduler
from pd_fsm.schedulers.request import Req

BOOT = "127.0.0.1:8998"
P_ADDR = "tcp://prefill-0"


def _args(mode: str) -> DisaggregationArgs:
    return DisaggregationArgs(
        model="smollm2",
        num_pages=1024,
        page_size=16,
        max_running=16,
        max_batched_tokens=2048,
        disaggregation_mode=mode,
        instance_id=f"{mode}-0",
        # P prefills every arrival before D has heard of them: hold their KV long enough.
        lease_initial=3600.0,
    )


class PrefillThread:
    """P on its own thread: messages in through a queue, its outbox back through another."""

    def __init__(self, p: PrefillScheduler) -> None:
        self.p = p
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.inbox.get()
            if item is None:
                return
            self.p.role.deliver(item)
            for e in self.p.role.link.take_outbox():
                self.outbox.put(e)


def nxt_total(args: argparse.Namespace, n_arrivals: int) -> int:
    return min(n_arrivals, -(-args.steps // args.arrive_every))


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="measured decode steps per phase")
    ap.add_argument("--arrive-every", type=int, default=2, help="a room arrives every N steps")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="length of arriving prompts")
    args = ap.parse_args()

    model = load_model("smollm2")
    p = PrefillScheduler(_args("prefill"), model=model)
    d = DecodeScheduler(_args("decode"), model=model)
    n_arrivals = args.steps // args.arrive_every + 1
    arrival_ids = [[(i * 7 + j) % 4000 + 100 for j in range(args.prompt_tokens)]
                   for i in range(n_arrivals)]
    one = SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True)
    for i, ids in enumerate(arrival_ids):  # P prefills and registers every arrival up front
        p.role.add_pd_request(Req(f"a{i}", ids, one), 10_000 + i)
    while p.waiting or p.prefilling:
        p.step()
    assert len(p.role.send_queue) == n_arrivals
    p_thread = PrefillThread(p)

    long = SamplingParams(temperature=0.0, max_new_tokens=2 * args.steps + 40, ignore_eos=True)
    for i in range(8):
        d.add_request(Req(f"b{i}", [100 + i] * 64, long))
    while len(d.running) < 8:
        d.step()
    for _ in range(5):
        d.step()  # warm: every decode shape compiled

    def route_d_outbox() -> None:
        for e in d.role.link.take_outbox():
            if isinstance(e, fx.ResolvePeer):
                d.role.deliver(ev.PeerResolved(e.bootstrap_addr, P_ADDR, p.role.engine.address,
                                          p.role.kv_args.layout_hash))
            else:
                msg = codec.decode(codec.encode(e.message))
                p_thread.inbox.put(ev.MessageReceived(d.args.instance_id, msg))
        while True:
            try:
                e = p_thread.outbox.get_nowait()
            except queue.Empty:
                return
            d.role.deliver(ev.MessageReceived(P_ADDR, codec.decode(codec.encode(e.message))))

    def phase(arrivals: bool) -> list[float]:
        itl: list[float] = []
        nxt = 0
        last = time.perf_counter()
        for step in range(args.steps):
            if arrivals and step % args.arrive_every == 0 and nxt < n_arrivals:
                d.role.add_pd_request(Req(f"a{nxt}", arrival_ids[nxt], one), BOOT, 10_000 + nxt)
                nxt += 1
            route_d_outbox()
            d.step()
            route_d_outbox()
            now = time.perf_counter()
            itl.append((now - last) * 1e3)
            last = now
        return itl

    # Warm the arrival path once (the pull's scatter compiles per page bucket, off the pool lock
    # but still on this machine's two cores), then measure.
    d.role.add_pd_request(Req("warm", arrival_ids[-1], one), BOOT, 10_000 + n_arrivals - 1)
    while d.role.recv_queue or d.role.pull_executor.inflight:
        route_d_outbox()
        d.step()
    n_arrivals -= 1
    tiered.KV_COPIES.wait_idle(600)  # the run-based kernels finish compiling before we measure
    quiet = phase(arrivals=False)
    busy = phase(arrivals=True)
    deadline = time.time() + 60
    while (d.role.recv_queue or d.role.pull_executor.inflight) and time.time() < deadline:
        route_d_outbox()
        d.step()
        time.sleep(0.01)
    ok = d.role.transfer_stats["pulls_ok"] - 1  # the warm-up arrival is not part of the phase
    mb = d.role.transfer_stats["bytes"] / 2**20

    print(f"decode batch 8, SmolLM2, {args.steps} steps per phase; arrivals: "
          f"{args.prompt_tokens}-token prompts every {args.arrive_every} steps")
    print(f"{'phase':<28}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}")
    for name, xs in (("no KV arriving (baseline)", quiet), ("KV arriving concurrently", busy)):
        print(f"{name:<28}{percentile(xs, 0.5):>10.1f}{percentile(xs, 0.99):>10.1f}"
              f"{statistics.mean(xs):>10.1f}")
    print(f"p99 ratio (arriving / baseline): {percentile(busy, 0.99) / percentile(quiet, 0.99):.2f}"
          f"   p50 ratio: {percentile(busy, 0.5) / percentile(quiet, 0.5):.2f}")
    print(f"pulls completed in the arriving phase: {ok} of {nxt_total(args, n_arrivals)}, "
          f"{mb:.1f} MiB pulled in all, pull failures {d.role.transfer_stats['pulls_failed']}")
    plots.latency_cdf("pd_itl_kv_arriving",
                      "D's decode steps (batch 8, SmolLM2): KV arriving vs none",
                      {"no KV arriving (baseline)": [x / 1000 for x in quiet],
                       "KV arriving concurrently": [x / 1000 for x in busy]},
                      "time between decode steps")
    p_thread.inbox.put(None)
    d.role.close()


if __name__ == "__main__":
    main()
