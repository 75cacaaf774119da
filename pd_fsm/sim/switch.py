"""The simulated cluster's worker processes: crash, restart, and a role switched at runtime
(the core's table role_switch).

Every worker is a :class:`Process`: its name (its address, kept across a switch as a real worker
keeps its URL: the switch happens inside the process), the role its command line names (``home``:
a restart serves that one again, as a supervisor restarts ``pd-fsm serve`` with its flags), the
node serving now (a ``PrefillWorker`` or a ``DecodeWorker``, or their real-scheduler kin), and the
process's ``RoleSwitch``, fed through the core's one driver (``core/drive.py``) as every other
endpoint is. :class:`Processes` carries out its effects in the world:

- WithdrawRecord: the record leaves the registry (a P's; its heartbeats stop), and the proxy drops
  the worker from its role's list within one discovery interval (``DISCOVERY``);
- RefuseLegs: a leg that reaches it gets a draining worker's 503 (refused, retryable), so the
  proxy routes around it; a modelled D hands its running streams off to another D when one is
  listed and answers its ``/health`` (up, not draining, reachable; ``workers.py``'s hand-off
  part);
- RoleDrained is fed once the node holds nothing: no room, page, registration, leg or queue
  (``Node.leftovers``);
- FailInFlight (the drain deadline, on the virtual clock): what is left fails as the worker
  fails it, every room aborted and freed (``Node.fail_in_flight``);
- StopRole: the old node must hold nothing (a ``Violation`` names what leaked); it is dropped;
- StartRole: after a build delay, a fresh node of the role under the same name (registered, a new
  transfer port), then RoleStarted — or, by a seeded chance, RoleStartFailed: RESTORING, and if
  the old role fails to start too, ExitProcess (the process is down until its supervisor
  restarts it in its home role);
- AcceptLegs: back in the proxy's list for its role.

A leg for a role the worker no longer serves gets the 409 of a stale role (refused). A crash
during a switch loses the switch with the process, and so does a SIGTERM (``abandon``: the
process drains to exit, ``sigterm.py``); a switch requested of a worker draining for SIGTERM
gets its 503. The switch draws (which worker, when, its
drain deadline, the build delays and failures, the client that disconnects) come from a random
stream of their own: a seed that draws no switch runs exactly as it did before switches existed.

Which worker may switch: one whose role keeps at least one other worker listed for it (the
proxy always has a P and a D to route to, unless faults take them); otherwise the request is
declined, as an operator or planner would decline it.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from typing import Protocol, assert_never

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import drive
from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.core.tables import ROLE_SWITCH
from pd_fsm.sim import gate
from pd_fsm.sim.config import SWITCH_BUILD, SWITCH_START_FAILS, Violation
from pd_fsm.sim.process import Process
from pd_fsm.sim.workers import Node, WorldView

ROLES = ("prefill", "decode")  # the roles a simulated worker compiled at start (--roles)
# What a switch can race, counted per switch that raced it (SimResult.races): a P or a D crashing
# or restarting (the switching worker itself included), a P-D partition in force, an
# /abort_request reaching the switching worker (a client abort or the proxy's abort of the other
# leg), a client of the switching worker disconnecting, the registry or the proxy restarting,
# the switching worker itself crashing mid-switch, and a SIGTERM to any worker (the switching
# one included: its switch then ends with the process, sigterm.py).
RACES = ("prefill restart", "decode restart", "partition", "abort", "client disconnect",
         "registry restart", "proxy restart", "own crash", "sigterm")


class SwitchWorld(WorldView, Protocol):
    """What the processes need of the world beyond a worker's view (``world.World``)."""

    seed: int

    def replace_node(self, proc: Process, role: str) -> None: ...


class Processes:
    def __init__(self, world: SwitchWorld, nodes: list[Node]) -> None:
        self.world = world
        self.rng = random.Random(f"role switch {world.seed}")
        self._machines: list[RoleSwitch] = []  # every process's, restarts' included
        self.procs = {n.name: Process(n.name, n.role, n, self._machine(n.role), n.role)
                      for n in nodes}
        self._draining: set[str] = set()
        self.outcomes: Counter[str] = Counter()  # the world's own: unreachable, declined, crashed
        self.races: Counter[str] = Counter()

    def _machine(self, role: str) -> RoleSwitch:
        rs = RoleSwitch(role, ROLES)
        self._machines.append(rs)
        return rs

    # -- faults ---------------------------------------------------------------------------------

    def draw(self, window: float) -> None:
        """Up to two switch requests, each to a worker drawn at a time drawn, and half the time
        a client of that worker disconnecting during its drain."""
        w, rng = self.world, self.rng
        for _ in range(2):
            if rng.random() >= w.config.switch_chance:
                continue
            name = rng.choice(sorted(self.procs))
            at = rng.uniform(0.0, window)
            w.at(at, f"{name}: role switch requested", self.request, name,
                 rng.uniform(*w.config.drain_range))
            if rng.random() < 0.5:
                w.at(at + rng.uniform(0.0, 1.0), f"a client of {name} disconnects",
                     self._disconnect, name)

    def crash(self, name: str, down: float) -> None:
        proc = self.procs[name]
        if proc.switch is None:
            return  # down already (it exited after a failed switch)
        if proc.races is not None:
            self.outcomes["crashed"] += 1
            proc.races.add("own crash")
        self.raced(f"{proc.node.role} restart")
        self._close(proc)
        # The proxy keeps listing it as it was (it cannot tell a crash from a slow worker) until
        # it comes back, in its home role (``restart``).
        proc.switch, proc.refusing, proc.life = None, "", proc.life + 1
        proc.stopping = False  # a SIGTERM drain under way ends with the process
        proc.node.crash()
        self.world.at(down, f"{name} restarts", self.restart, name)

    def restart(self, name: str) -> None:
        proc = self.procs[name]
        if proc.switch is not None:
            return
        if proc.node.role != proc.home:
            self.world.replace_node(proc, proc.home)
        proc.node.start()
        proc.switch, proc.life = self._machine(proc.home), proc.life + 1
        self.raced(f"{proc.home} restart")
        if proc.listed != proc.home:
            proc.listed = proc.home
            self.world.proxy.show_workers(self.rng)

    def raced(self, kind: str, name: str | None = None) -> None:
        """``kind`` happened: every switch under way (or only ``name``'s) raced it."""
        for proc in self.procs.values():
            if proc.races is not None and name in (None, proc.name):
                proc.races.add(kind)

    def _close(self, proc: Process) -> None:
        if proc.races is not None:
            self.races.update(proc.races)
            proc.races = None

    def _disconnect(self, name: str) -> None:
        if self.world.proxy.disconnect_a_client_of(name, self.rng):
            self.raced("client disconnect", name)

    # -- the switch -----------------------------------------------------------------------------

    def request(self, name: str, drain_s: float) -> None:
        """An operator (or the planner) asks ``name`` for the other role (POST /switch_role)."""
        w, proc = self.world, self.procs[name]
        rs = proc.switch
        if rs is None:
            self.outcomes["unreachable"] += 1  # the process is down: the POST is refused
            w.trace_line(f"  {name}: down, the switch request is refused")
            return
        if proc.stopping:  # draining for SIGTERM (admin_routes.py): 503, it is leaving
            self.outcomes["refused_stopping"] += 1
            w.trace_line(f"  {name}: 503 draining (shutting down), the switch is refused")
            return
        if not rs.serving:  # a switch is under way: the worker answers 409 (RefuseSwitch)
            self._feed(proc, ev.SwitchRequested(rs.source, drain_s))
            return
        others = [p for p in self.procs.values() if p is not proc and p.listed == rs.role]
        if not others:
            self.outcomes["declined"] += 1
            w.trace_line(f"  {name}: the last {rs.role} worker listed, the switch is declined")
            return
        proc.races = set()
        if w.network.cut:
            proc.races.add("partition")
        if not w.registry.up:
            proc.races.add("registry restart")
        for p in self.procs.values():
            if p.switch is None:
                proc.races.add(f"{p.node.role} restart")
        self._feed(proc, ev.SwitchRequested("decode" if rs.role == "prefill" else "prefill",
                                            drain_s))

    def abandon(self, proc: Process) -> None:
        """``proc`` got SIGTERM during its switch (``sigterm.py``): the switch ends with the
        process, as with a crash; its drain deadline's wake and its role's build are dropped (a
        new ``life``), and nothing feeds its machine again. The SIGTERM drain takes over the
        node as it is (draining, stopped or building)."""
        if proc.switch is None or proc.switch.serving:
            return
        self.outcomes["sigtermed"] += 1
        self._draining.discard(proc.name)
        proc.life += 1
        self._close(proc)

    def check_drains(self) -> None:
        """After every step: a draining worker whose node holds nothing any more is drained."""
        for name in sorted(self._draining):
            proc = self.procs[name]
            rs = proc.switch
            if rs is None or rs.state != ROLE_SWITCH.S.DRAINING:
                self._draining.discard(name)
            elif proc.node.alive and not self._holds(proc.node):
                self._draining.discard(name)
                # With the deadline due and its wake not yet run, the machine fires DrainTimedOut
                # first and the Drained is then a no-op row (table role_switch).
                self._feed(proc, ev.RoleDrained())

    def _holds(self, node: Node) -> str:
        left = node.leftovers(switching=True)
        if self.world.plant("switch-skips-drain"):
            # Planted bug: the drain waits only for the core's rooms (listed first), not for the
            # scheduler's own (D's decoding rooms and its queue) nor the pages.
            return left if left.startswith("rooms") else ""
        return left

    def check_settled(self) -> None:
        """After the drain: every process is up and serving (no switch hangs)."""
        for proc in self.procs.values():
            if proc.switch is not None and not proc.switch.serving:
                raise Violation(f"{proc.name}: its role switch never ended "
                                f"({proc.switch.state})")
        for proc in self.procs.values():
            self._close(proc)

    def summary(self) -> dict[str, int]:
        out = Counter(self.outcomes)
        for rs in self._machines:
            for (_, _, outcome), n in rs.outcomes.items():
                out[outcome] += n
        return dict(sorted(out.items()))

    def _feed(self, proc: Process, event: ev.RoleSwitchEvent) -> None:
        w, rs = self.world, proc.switch
        assert rs is not None
        drive(functools.partial(w.handle, proc.node, rs), event,
              w.now + w.skew[proc.name], functools.partial(self._carry_out, proc))
        deadline = rs.next_deadline()
        if deadline is not None and proc.switch is rs and deadline != proc.wake_at:
            proc.wake_at = deadline
            w.at_time(deadline - w.skew[proc.name] + 1e-6, f"{proc.name} drain deadline",
                      self._wake, proc, proc.life)

    def _wake(self, proc: Process, life: int) -> None:
        if proc.life == life and proc.switch is not None:
            self._feed(proc, ev.TimeAdvanced())

    def _carry_out(self, proc: Process, e: fx.RoleSwitchEffect) -> tuple[ev.RoleSwitchEvent, ...]:
        w, node = self.world, proc.node
        match e:
            case fx.WithdrawRecord():
                node.withdrawn = True
                w.registry.deregister(node)
                proc.listed = None
                w.proxy.show_workers(self.rng)
            case fx.RefuseLegs():
                proc.refusing = e.reason
                self._draining.add(proc.name)
                deadline = None if proc.switch is None else proc.switch.next_deadline()
                gate.hand_off(w, self.procs.values(), proc, deadline, self.rng, self.crash)
            case fx.FailInFlight():
                node.fail_in_flight(e.reason)
            case fx.StopRole():
                if node.role != e.role:
                    raise Violation(f"{proc.name}: StopRole of {e.role}, but it serves "
                                    f"{node.role}")
                left = node.leftovers(switching=True)
                if left:
                    raise Violation(f"{proc.name}: its role switch stopped {e.role} holding "
                                    f"{left}")
                node.stop()
            case fx.StartRole():
                proc.life += 1
                what = "restores" if e.restoring else "starts"
                w.at(self.rng.uniform(*SWITCH_BUILD), f"{proc.name} {what} {e.role}",
                     self._built, proc, proc.life, e.role)
            case fx.AcceptLegs():
                if node.role != e.role or not node.alive:
                    raise Violation(f"{proc.name}: AcceptLegs as {e.role}, but its node is "
                                    f"{node.role} ({'up' if node.alive else 'down'})")
                proc.refusing, proc.listed = "", e.role
                w.proxy.show_workers(self.rng)
                self._close(proc)
            case fx.RefuseSwitch():
                w.trace_line(f"  {proc.name}: 409 {e.reason}")
            case fx.ExitProcess():
                # Both roles failed to start: the process exits; its supervisor restarts it.
                self._close(proc)
                proc.switch, proc.refusing, proc.life = None, "", proc.life + 1
                w.at(self.rng.uniform(0.5, 8.0), f"{proc.name} restarts", self.restart,
                     proc.name)
            case _:
                assert_never(e)
        return ()

    def _built(self, proc: Process, life: int, role: str) -> None:
        """The role's backend is built (or building it raised, by the seed's draw)."""
        if proc.life != life or proc.switch is None:
            return  # the process crashed meanwhile
        if self.rng.random() < SWITCH_START_FAILS:
            self._feed(proc, ev.RoleStartFailed(f"building the {role} backend raised "
                                                "(injected)"))
            return
        self.world.replace_node(proc, role)
        proc.node.start()
        self._feed(proc, ev.RoleStarted())
