"""The drain gate of a simulated decode worker (``io_trio/worker/drain_gate.py``):
whether a D that starts to drain, for a role switch (``switch.py``) or on SIGTERM
(``sigterm.py``), hands its running streams off to another D, and the faults a hand-off races.
Both drains run the one gate, as the real worker's both call ``drain_streams``."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable

from pd_fsm.sim.config import HANDOFF_CRASH, HANDOFF_MARGIN, HANDOFF_MIN_LEASE, HANDOFF_PARTITION
from pd_fsm.sim.process import Process
from pd_fsm.sim.workers import DecodeWorker, WorldView


def healthy(world: WorldView, proc: Process, other: Process) -> bool:
    """Whether ``other``'s ``/health`` answers ``proc`` 200 (the drain gate's probe): up, a D,
    neither draining nor switching (``refusing``), and reachable. A crashed process stays
    listed (its record lives until its TTL) but answers nothing."""
    return (other.switch is not None and other.node.alive and other.node.role == "decode"
            and not other.refusing and world.network.reachable(proc.name, other.name))


def hand_off(world: WorldView, procs: Iterable[Process], proc: Process, deadline: float | None,
             rng: random.Random, crash: Callable[[str, float], None]) -> None:
    """A D draining (its drain deadline ``deadline``, on its own clock) hands its running streams
    off (``workers.py``'s hand-off part) when another D is listed and answers its ``/health``,
    its offers leased until ``HANDOFF_MARGIN`` before the deadline; with too little time left,
    or with every listed D down, they finish here. With faults, a drain that handed streams off
    may crash (``crash``) while they are pulled, or be cut from another D for a while (chances
    drawn from ``rng``, the drain's own stream): those pulls fail and fall back to a
    re-prefill."""
    w, node = world, proc.node
    listed = [p for p in procs if p is not proc and p.listed == "decode"]
    others = sorted(p.name for p in listed if healthy(w, proc, p))
    if not isinstance(node, DecodeWorker) or deadline is None:
        return
    if listed and not others:
        w.handoffs["in_place_no_healthy_decode"] += 1
        w.trace_line(f"  {proc.name}: no listed D answers /health, streams finish here")
    if not others:
        return
    lease = deadline - (w.now + w.skew[proc.name]) - HANDOFF_MARGIN
    if lease < HANDOFF_MIN_LEASE or not node.desk.hand_off(lease) or not w.config.faults:
        return
    if rng.random() < HANDOFF_CRASH:
        w.at(rng.uniform(0.0, 0.03), f"{proc.name} crashes during its hand-offs", crash,
             proc.name, rng.uniform(0.5, 8.0))
    pair = frozenset((proc.name, rng.choice(others)))
    if rng.random() < HANDOFF_PARTITION and pair not in w.network.cut:
        # (A pair cut already is the seed's own partition, which heals it.)
        w.trace_line(f"  partition {sorted(pair)} during the hand-off")
        w.network.cut.add(pair)
        w.at(rng.uniform(0.5, 5.0), f"heal {sorted(pair)}", w.network.cut.discard, pair)
