"""What ``--disaggregation-kv-checksum`` costs (issue 31 §3): the checksum of a room's KV on P (of
the array it registers) and on D (of the array it pulled), against the pull of the same bytes,
at 1, 4, 16 and 64 MiB, in one run. The issue's goal: both checksums within 5 % of the pull at
16 MiB. Prints a table; asserts nothing.

    .venv/bin/python bench/bench_kv_checksum.py [--reps 9] [--sizes 1 4 16 64]
    .venv/bin/python bench/bench_kv_checksum.py --links loopback 10 1    # root: namespaces, tc

``--links``: where the pulls go, each measured in the same run, the links interleaved per
repetition (their order rotated). ``loopback``: P and D on 127.0.0.1 (the default, alone).
A number: Gbit/s, P in network namespace A and D in B, joined by a veth pair shaped with ``tc``'s
``tbf`` at that rate on both ends (``tests/integration/netns_support.py``: ``Hosts.shape``, the
rate changed in place between links); ``unshaped``: the same veth pair without a ``tbf``. Where
namespaces or ``tc`` are unavailable (not root, no iproute2, the kernel refuses ``tbf``), the
shaped links are skipped with the reason printed, and loopback runs alone. The header names each
veth link's plain TCP stream rate (64 MiB, median of 3), the ceiling a pull on it can reach.

A P and a D process (spawned; host heap on huge pages, as ``pd-fsm serve`` starts a worker), each
with a ``JaxTransferKVEngine``. For each size and repetition: P makes a fresh float32 array (a
gather's output stands in: just written, so as warm in the caches as one), times its checksum
(``pd_fsm.jax_engine.kv.checksum``, the code P runs) and registers it; D times the pull (request
to every byte ready) and then the checksum of what it pulled (the code D's pull thread runs).
D also times XLA:CPU's jitted form of the same checksum (what an accelerator would run; on bytes
the numpy form has just read, so a lower bound), to show why the CPU path is numpy; and a plain
sum of the words of a second pull of the same array (P registers it twice, as it does for the
re-pull), as cold in the caches as the first, to show what the per-row weights (which catch
misplaced chunks) cost on top. Medians; the ratios are of medians measured side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
ROW = 4096  # float32 words per row of the benchmark's arrays (their shape does not matter)
SECOND = 1 << 40  # uuid offset of the second registration of each array
LOOPBACK, UNSHAPED = "loopback", "unshaped"
COLUMNS = ("pull", "p", "d", "xla", "plain")  # what each measurement returns, in seconds


def _shape(mib: int) -> tuple[int, int]:
    return (mib * MIB // 4 // ROW, ROW)


def parse_link(text: str) -> str:
    """A ``--links`` value, normalised: ``loopback``, ``unshaped`` or a positive rate in Gbit/s
    (``"10"``, ``"2.5"``; written back without a trailing ``.0``)."""
    if text in (LOOPBACK, UNSHAPED):
        return text
    try:
        gbps = float(text)
    except ValueError:
        gbps = 0.0
    if not gbps > 0 or gbps == float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a link is {LOOPBACK!r}, {UNSHAPED!r} or a rate in Gbit/s (e.g. 10)")
    return f"{gbps:g}"


def link_bps(link: str) -> float | None:
    """The ``tbf`` rate of a veth link in bits/s; None: no ``tbf`` (unshaped; loopback has no
    veth at all)."""
    return None if link in (LOOPBACK, UNSHAPED) else float(link) * 1e9


def link_label(link: str) -> str:
    return link if link in (LOOPBACK, UNSHAPED) else f"{link} Gbit/s"


def rotated(links: list[str], rep: int) -> list[str]:
    """The links in repetition ``rep``'s order: rotated by one each repetition, so that none is
    always measured first (after the shaping changed, or after the other pair sat idle)."""
    k = rep % len(links) if links else 0
    return links[k:] + links[:k]


def table_row(link: str, mib: int, med: dict[str, float]) -> str:
    """One row of the table from the medians (seconds) of ``COLUMNS``."""
    pull = med["pull"]
    share = 100 * (med["p"] + med["d"]) / pull
    return (f"| {link_label(link)} | {mib} MiB | {pull * 1e3:.2f} ({mib * MIB / pull / 1e9:.3f}) | "
            f"{med['p'] * 1e3:.3f} ({100 * med['p'] / pull:.1f} %) | "
            f"{med['d'] * 1e3:.3f} ({100 * med['d'] / pull:.1f} %) | {share:.1f} % | "
            f"{med['xla'] * 1e3:.2f} | {med['plain'] * 1e3:.3f} |")


TABLE_HEAD = ("| link | size | pull ms (GB/s) | P checksum ms | D checksum ms | P + D, % of pull | "
              "XLA:CPU form ms (D) | plain word sum ms (D) |\n"
              "|---|---|---|---|---|---|---|---|")


def _enter(ns: str | None) -> None:
    """A spawned P or D's first step: into its namespace, before jax starts any thread."""
    if ns is not None:
        from tests.integration.netns_support import enter_namespace

        enter_namespace(ns)


def _p_main(pipe: Connection, host: str, ns: str | None) -> None:
    _enter(ns)
    import jax
    import jax.numpy as jnp

    from pd_fsm.jax_engine.kv.checksum import kv_checksum
    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine(host, reaper_interval_s=None)
    fresh = jax.jit(lambda key, shape: jax.random.uniform(key, shape, jnp.float32),
                    static_argnums=1)

    def register(uuid: int, mib: int) -> tuple[float, int]:
        array = fresh(jax.random.key(uuid), _shape(mib))
        array.block_until_ready()  # the gather is done: only the checksum is timed
        t = time.perf_counter()
        checksum = kv_checksum(array)
        took = time.perf_counter() - t
        engine.register(uuid, [array], lease_s=600)
        engine.register(uuid + SECOND, [array], lease_s=600)
        return took, checksum

    _serve(pipe, engine.address, register)
    engine.close()


def _d_main(pipe: Connection, host: str, ns: str | None, p_addr: str) -> None:
    _enter(ns)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pd_fsm.jax_engine.kv.checksum import kv_checksum
    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine

    engine = JaxTransferKVEngine(host, reaper_interval_s=None)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def pull(uuid: int, mib: int) -> tuple[float, float, float, float, int]:
        spec = jax.ShapeDtypeStruct(_shape(mib), jnp.float32, sharding=sharding)
        t = time.perf_counter()
        pending = engine.start_pull(p_addr, uuid, [spec], deadline_s=120)
        pending.wait()
        pulled = time.perf_counter()
        (array,) = pending.arrays
        checksum = kv_checksum(array)
        verified = time.perf_counter()
        on_device = kv_checksum(array, on_device=True)
        xla = time.perf_counter() - verified
        assert on_device == checksum, "the two forms of the checksum disagree"
        again = engine.start_pull(p_addr, uuid + SECOND, [spec], deadline_s=120)
        again.wait()
        summed = time.perf_counter()
        np.add.reduce(np.asarray(again.arrays[0]).reshape(-1).view(np.uint32), dtype=np.uint32)
        plain = time.perf_counter() - summed
        return pulled - t, verified - pulled, xla, plain, checksum

    _serve(pipe, "ready", pull)
    engine.close()


def _serve(pipe: Connection, hello: str, answer: Callable[[int, int], object]) -> None:
    """A P or D process's loop: say ``hello``, then answer (uuid, MiB) requests until "quit"."""
    pipe.send(hello)
    while (msg := pipe.recv())[0] != "quit":
        _, uuid, mib = msg
        pipe.send(answer(uuid, mib))


def _spawn(target: Callable[..., object], *args: object
           ) -> tuple[Connection, mp.process.BaseProcess]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=target, args=(there, *args), daemon=True)
    proc.start()
    return here, proc


class Pair:
    """A P and a D process, P's on ``p_host`` (in namespace ``p_ns``, None: this one), D's on
    ``d_host``; ``measure`` times one (uuid, MiB) on them."""

    def __init__(self, p_host: str, d_host: str, p_ns: str | None = None,
                 d_ns: str | None = None) -> None:
        self.procs: list[tuple[Connection, mp.process.BaseProcess]] = []
        self.p = self._start(_p_main, p_host, p_ns)
        if not self.p.poll(180):
            raise SystemExit("P did not start")
        p_addr = self.p.recv()
        self.d = self._start(_d_main, d_host, d_ns, p_addr)
        if not self.d.poll(180) or self.d.recv() != "ready":
            raise SystemExit("D did not start")

    def _start(self, target: Callable[..., object], *args: object) -> Connection:
        pipe, proc = _spawn(target, *args)
        self.procs.append((pipe, proc))
        return pipe

    def measure(self, uuid: int, mib: int) -> dict[str, float]:
        self.p.send(("register", uuid, mib))
        p_s, p_sum = self.p.recv()
        self.d.send(("pull", uuid, mib))
        pull_s, d_s, xla_s, plain_s, d_sum = self.d.recv()
        if p_sum != d_sum:
            raise SystemExit(f"{mib} MiB: P's checksum {p_sum:#x}, D's {d_sum:#x}")
        return dict(zip(COLUMNS, (pull_s, p_s, d_s, xla_s, plain_s), strict=True))

    def close(self) -> None:
        for pipe, proc in self.procs:
            with contextlib.suppress(OSError):
                pipe.send(("quit",))
            proc.join(10)


def _veth(links: list[str]) -> tuple[Any, list[str], str | None]:
    """Namespaces joined by a veth pair for the veth links, the links that will run, and why the
    veth links were skipped (no namespaces joined: this machine cannot make them or shape them)."""
    veth = [link for link in links if link != LOOPBACK]
    if not veth:
        return None, links, None
    from tests.integration.netns_support import (
        Hosts,
        ShapingUnavailable,
        namespaces_unavailable,
    )

    why = namespaces_unavailable()
    hosts = None
    if why is None:
        hosts = Hosts.make()
        try:
            for link in veth:
                hosts.shape(link_bps(link))  # a probe: tc there, the kernel takes tbf
        except ShapingUnavailable as exc:
            hosts.remove()
            hosts, why = None, str(exc)
    if hosts is None:
        skipped = f"# skipped, links {', '.join(map(link_label, veth))}: {why}"
        return None, [link for link in links if link == LOOPBACK], skipped
    return hosts, links, None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], metavar="MIB")
    ap.add_argument("--reps", type=int, default=9, help="per size, after one warm-up (9)")
    ap.add_argument("--links", type=parse_link, nargs="+", default=[LOOPBACK], metavar="LINK",
                    help="loopback, unshaped (veth) or Gbit/s of a tbf-shaped veth (loopback)")
    args = ap.parse_args()
    links = list(dict.fromkeys(args.links))

    from pd_fsm.jax_engine.kv.host_memory import hugepage_env

    load_start = os.getloadavg()[0]
    hosts, links, skipped = _veth(links)
    if not links:
        raise SystemExit(skipped)
    pairs: dict[str, Pair] = {}
    raw: dict[str, float] = {}
    saved = dict(os.environ)
    os.environ.update(hugepage_env(os.environ) or {})  # as pd-fsm serve starts its workers
    try:
        if LOOPBACK in links:
            pairs[LOOPBACK] = Pair("127.0.0.1", "127.0.0.1")
        if hosts is not None:
            veth = Pair(hosts.ip_a, hosts.ip_b, hosts.a, hosts.b)
            pairs.update({link: veth for link in links if link != LOOPBACK})
    finally:
        os.environ.clear()
        os.environ.update(saved)
    try:
        if hosts is not None:
            for link in links:
                if link != LOOPBACK:
                    hosts.shape(link_bps(link))
                    hosts.raw_socket_seconds(64 * MIB)  # unmeasured: warms both ends
                    raw[link] = statistics.median(hosts.raw_socket_seconds(64 * MIB)
                                                  for _ in range(3))
        rows = _measure(args, links, pairs, hosts)
    finally:
        for pair in {id(p): p for p in pairs.values()}.values():
            pair.close()
        if hosts is not None:
            hosts.remove()

    import jax

    print(f"# bench_kv_checksum; jax {jax.__version__}, {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs, load average {load_start:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; medians of {args.reps} after a warm-up")
    if skipped:
        print(skipped)
    for link, secs in raw.items():
        print(f"# {link_label(link)}: veth between two network namespaces; a plain TCP stream "
              f"of 64 MiB across it: {64 * MIB / secs / 1e9:.3f} GB/s")
    print()
    print(TABLE_HEAD)
    for link in links:
        for mib in args.sizes:
            med = {k: statistics.median(v) for k, v in rows[link, mib].items()}
            print(table_row(link, mib, med))


def _measure(args: argparse.Namespace, links: list[str], pairs: dict[str, Pair],
             hosts: Any) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Every (link, size)'s samples: sizes interleaved within a link and links within a
    repetition, so that machine noise hits all alike."""
    rows: dict[tuple[str, int], dict[str, list[float]]] = {
        (link, mib): {} for link in links for mib in args.sizes}
    uuid = 0
    for rep in range(args.reps + 1):
        for link in rotated(links, rep):
            if link != LOOPBACK:
                hosts.shape(link_bps(link))
            for mib in args.sizes:
                uuid += 1
                got = pairs[link].measure(uuid, mib)
                if rep == 0:
                    continue  # warm-up: connections, compiles, first touches of the heap
                for key, value in got.items():
                    rows[link, mib].setdefault(key, []).append(value)
    return rows


if __name__ == "__main__":
    main()
