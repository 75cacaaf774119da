"""SIGTERM in the simulated cluster : a worker's graceful stop.

The real worker (``io_trio/worker/cli.py``'s ``_run``, ``WorkerApp.drain``) on SIGTERM leaves the
registry first, answers new requests 503 with Retry-After (the proxy retries them elsewhere), and,
a decode worker, runs the drain gate (``drain_gate.py``): another D listed and answering its
``/health``, its running streams are handed off; else they finish in place. It waits until
nothing is in flight (rooms, queues, transfer registrations, hand-offs' included), at most
``--drain-timeout``; past it the rest fails (a stream then migrates). Then the process exits 0.

Here each is modelled on a worker process (``process.Process``), by :class:`Stops`:

- the record leaves the registry and the proxy's lists (within one discovery interval), and a
  leg that still reaches the worker gets its 503 (``Process.refusing``: the proxy retries it);
- a D runs the same gate as a role switch's drain (``gate.py``), its offers leased until just
  before the SIGTERM's drain deadline;
- after every step, a worker that holds nothing (``Node.leftovers``: what a role switch's drain
  waits for too) exits; at the drain deadline what is left fails (``Node.fail_in_flight``: rooms
  aborted, pulls cancelled, the transfer server closed, streams broken off) and it exits;
- the exit **checks** that the worker holds nothing (a ``Violation`` names what it kept), then
  the process is down, and restarts in its home role 0.5-8 s later, as after a crash (a
  supervisor, or a rolling restart, starts it again);
- a SIGTERM during a role switch ends the switch with the process (``Processes.abandon``); a
  second SIGTERM during the drain kills the process (a crash: the worker handles the first
  only, its signal receiver then closed, so the default action ends it); one to a process
  that is down finds nobody.

The draws (how many, which worker, when, its drain deadline, the restart's delay, and the
faults of its hand-offs) come from a random stream of their own: a seed that draws no SIGTERM
runs exactly as it did before SIGTERM was simulated.
"""

from __future__ import annotations

import random
from collections import Counter

from pd_fsm.sim import gate
from pd_fsm.sim.config import Violation
from pd_fsm.sim.process import Process
from pd_fsm.sim.switch import Processes, SwitchWorld
from pd_fsm.sim.workers import Node

RESTART = (0.5, 8.0)  # seconds until the supervisor starts the process again, as after a crash


class Stops:
    """The seed's SIGTERMs and each drain they start. ``outcomes``: ``<role> exited`` (drained
    before the deadline), ``<role> exited_after_drain_timeout`` (what was left failed), ``down``
    (no process to signal), ``killed`` (a second SIGTERM mid-drain), ``crashed`` (the process
    died during its drain: the killed ones included)."""

    def __init__(self, world: SwitchWorld, processes: Processes) -> None:
        self.world, self.processes = world, processes
        self.procs = processes.procs
        self.rng = random.Random(f"sigterm {world.seed}")
        self.outcomes: Counter[str] = Counter()
        self._stopping: dict[str, int] = {}  # name -> its process's life when it got SIGTERM

    def draw(self, window: float) -> None:
        """Up to two SIGTERMs, each to a worker drawn, at a time drawn, with a drain deadline
        drawn (``SimConfig.sigterm_drain``: ``--drain-timeout``, scaled as the switches' are)."""
        w, rng = self.world, self.rng
        for _ in range(2):
            if rng.random() >= w.config.sigterms:
                continue
            name = rng.choice(sorted(self.procs))
            w.at(rng.uniform(0.0, window), f"{name}: SIGTERM", self.sigterm, name,
                 rng.uniform(*w.config.sigterm_drain))

    def sigterm(self, name: str, drain_s: float) -> None:
        """``name`` gets SIGTERM: it starts to drain for ``drain_s`` seconds, then exits."""
        w, proc = self.world, self.procs[name]
        if proc.switch is None:
            self.outcomes["down"] += 1
            w.trace_line(f"  {name}: down, nobody gets the SIGTERM")
            return
        if proc.stopping:
            self.outcomes["killed"] += 1
            self.processes.crash(name, self.rng.uniform(*RESTART))
            return
        self.processes.raced("sigterm")
        self.processes.abandon(proc)
        node = proc.node
        proc.stopping, proc.refusing = True, f"the {node.role} worker is draining (shutting down)"
        if proc.listed is not None:  # (a switch's drain withdrew it already)
            node.withdrawn = True
            w.registry.deregister(node)
            proc.listed = None
            w.proxy.show_workers(self.rng)
        self._stopping[name] = proc.life
        w.at(drain_s, f"{name} SIGTERM drain deadline", self._deadline, name, proc.life)
        if node.alive:
            gate.hand_off(w, self.procs.values(), proc, node.local() + drain_s, self.rng,
                          self.processes.crash)

    def holds(self, node: Node) -> str:
        """What the drain waits for ("" once nothing): what a role switch's drain waits for
        (``Node.leftovers``: rooms, pages, legs, queue, registrations, hand-offs' included)."""
        return node.leftovers(switching=True)

    def check(self) -> None:
        """After every step: a worker draining for SIGTERM that holds nothing exits."""
        for name in sorted(self._stopping):
            proc = self.procs[name]
            if proc.life != self._stopping[name] or not proc.stopping:
                del self._stopping[name]
                self.outcomes["crashed"] += 1
            elif not proc.node.alive or not self.holds(proc.node):
                self._exit(proc, "exited")

    def _deadline(self, name: str, life: int) -> None:
        proc = self.procs[name]
        if proc.life != life or not proc.stopping:
            return  # it exited (or crashed) before
        node = proc.node
        if node.alive:
            node.fail_in_flight(f"the {node.role} worker shut down (SIGTERM): its drain "
                                "deadline passed")
        self._exit(proc, "exited_after_drain_timeout")

    def _exit(self, proc: Process, outcome: str) -> None:
        """The process exits 0, holding nothing: everything a peer can see (rooms, pages,
        registrations, hand-off offers) was released before (the real worker's drain checks
        them before ``exit_now``); a ``Violation`` names what it kept. Its supervisor starts it
        again later."""
        node = proc.node
        left = node.leftovers(switching=True) if node.alive else ""
        if left:
            raise Violation(f"{proc.name}: exited on SIGTERM holding {left}")
        del self._stopping[proc.name]
        self.outcomes[f"{node.role} {outcome}"] += 1
        self.world.trace_line(f"  {proc.name}: exits ({outcome.replace('_', ' ')})")
        node.stop()
        proc.switch, proc.refusing, proc.stopping = None, "", False
        proc.life += 1
        self.world.at(self.rng.uniform(*RESTART), f"{proc.name} restarts after SIGTERM",
                      self.processes.restart, proc.name)

    def summary(self) -> dict[str, int]:
        return dict(sorted(self.outcomes.items()))
