"""One simulated cluster: the real cores of every worker, the proxy's router and the registry,
driven on a virtual clock by one seeded random generator (``pd_fsm.sim``).

With ``SimConfig.schedulers == "real"`` the workers are the real PD schedulers (``real.py``);
otherwise they are modelled, not run: the schedulers (a page pool per worker; a prefill or a
decode takes time proportional to its tokens; P's first token and D's continuation are
functions of the prompt, so an answer built from another room's KV is wrong), the transfer
server (a dict of registrations; a pull succeeds only if P's process that registered it is
alive and still holds it, and always reports by its deadline, as the pull executor's contract
says). Either way HTTP is modelled (legs and aborts take a millisecond or two, and fail at once
against a dead process), and the side channel is the real codec's signed frames, each delayed,
dropped, duplicated, delayed out of order or corrupted as the seed says; partitions cut P from
D for a while.

Faults drawn from the seed: crash and restart of a P, a D, the registry or the proxy; a
partition; slow, failing and hung steps; clock skew between hosts (each host reads the global
clock plus its offset); a worker's role switched at runtime, P to D or D to P, with a client of
that worker disconnecting during the drain half the time (``switch.py``: each worker is a
process whose ``RoleSwitch`` runs through the core's driver; the switch draws have a random
stream of their own, so a seed that draws none runs as it did before switches existed); a
draining D handing its running streams off to another D, which pulls their KV and goes on
(``workers.py``'s hand-off part), racing all of these, with faults of its own (pulls slow or
failing, the draining D crashing or cut off during the pulls); a worker's SIGTERM
(``sigterm.py``: it drains, a D handing its streams off through the same gate, then exits and
restarts), from a random stream of its own too.

Invariants, checked after every step (``Violation`` names the first broken one): every page and
every registration is freed exactly once; a client is answered at most once, and a 200 carries
the right tokens; KVPoll only moves forward; P's lease is never shortened; no room outlives its
deadline (the router's room timeout, P's lease, D's state timeouts); a role switch stops the old
role only once it holds nothing (StopRole), and a SIGTERMed worker exits only holding nothing;
a D's hand-off books agree and a stream handed off gets no answer from its old D. After the
last arrival the world drains: every client has exactly one answer, every worker is back to no
room, no page and no registration, and every switch has ended (each worker serves a role).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import attrs

from pd_fsm.core.drive import Endpoint, Ev, Fx
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.sim.config import DRAIN, PLANTS, SimConfig, SimResult, Violation
from pd_fsm.sim.invariants import Invariants
from pd_fsm.sim.network import Network
from pd_fsm.sim.process import Process
from pd_fsm.sim.proxy import Proxy
from pd_fsm.sim.registry import Registry
from pd_fsm.sim.scenarios import make as make_scenario
from pd_fsm.sim.sigterm import Stops
from pd_fsm.sim.switch import Processes
from pd_fsm.sim.workers import Client, DecodeWorker, Node, PrefillWorker


class World:
    """The clock and its queue, the clients, the worker processes, and the hosts around them:
    the proxy (``proxy.py``), the registry (``registry.py``), the network (``network.py``)."""

    def __init__(self, seed: int, config: SimConfig | None = None, trace: bool = False) -> None:
        self.seed = seed
        self.config = config or SimConfig()
        if self.config.plant is not None and self.config.plant not in PLANTS:
            raise ValueError(f"unknown plant {self.config.plant!r}: one of {', '.join(PLANTS)}")
        self.rng = random.Random(seed)
        self.tracing = trace
        self.trace: list[str] = []
        self.now = 0.0
        self.steps = 0
        self._queue: list[tuple[float, int, str, Callable[..., None], tuple[Any, ...]]] = []
        # One counter for the queue's order and the side channel's nonces (network.py).
        self._serial = itertools.count()
        c = self.config
        nodes = [*(self._node("prefill", f"p{i}") for i in range(c.prefill)),
                 *(self._node("decode", f"d{i}") for i in range(c.decode))]
        # The worker processes by name (switch.py): each serves one role at a time; a role
        # switch replaces its node. ``prefills`` and ``decodes`` are the nodes serving each now.
        self.workers = Processes(self, nodes)
        self.procs: dict[str, Process] = self.workers.procs
        self.prefills: list[Any] = []  # Any: modelled or real (real.py) nodes
        self.decodes: list[Any] = []
        self._relist()
        hosts = [n.name for n in nodes] + ["registry", "proxy"]
        self.skew = {h: self.rng.uniform(-c.skew, c.skew) for h in hosts}
        self.registry = Registry(self)
        self.proxy = Proxy(self, self.procs)
        self.network = Network(self, self.procs, self._serial)
        self.clients: list[Client] = []
        self.handoffs: Counter[str] = Counter()  # live KV hand-offs by outcome (handoff.py)
        self.invariants = Invariants()
        self.stops = Stops(self, self.workers)  # SIGTERMs (sigterm.py)
        self.scenario = (None if c.scenario is None
                         else make_scenario(c.scenario, self, self.workers))
        for node in (*self.prefills, *self.decodes):
            node.start()

    # -- the clock ----------------------------------------------------------------------------

    def at(self, delay: float, what: str, fn: Callable[..., None], *args: Any) -> None:
        self.at_time(self.now + delay, what, fn, *args)

    def at_time(self, t: float, what: str, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._serial), what, fn, args))

    def trace_line(self, line: str) -> None:
        if self.tracing:
            self.trace.append(f"{self.now:9.3f}  {line}")

    def plant(self, name: str) -> bool:
        return self.config.plant == name

    # -- running ------------------------------------------------------------------------------

    def run(self) -> None:
        c = self.config
        if c.workload is not None:
            t, i = self.rng.expovariate(c.workload.rate), 0
            while t < c.workload.duration:
                self.at(t, f"client {i} arrives", self._arrive, i)
                t += self.rng.expovariate(c.workload.rate)
                i += 1
            window = c.workload.duration
        else:
            for i in range(c.requests):
                self.at(self.rng.uniform(0.0, c.arrival_window), f"client {i} arrives",
                        self._arrive, i)
            window = c.arrival_window
        if c.faults:
            self._draw_faults()
        end = window + DRAIN
        while self._queue and self._queue[0][0] <= end:
            t, _, what, fn, args = heapq.heappop(self._queue)
            self.now = t
            self.steps += 1
            self.trace_line(what)
            fn(*args)
            self.workers.check_drains()
            self.stops.check()
            if self.scenario is not None:
                self.scenario.check()
            self._check()
        self.now = end
        self._check_drained()

    def _draw_faults(self) -> None:
        c, rng = self.config, self.rng
        window = c.arrival_window
        for node in (*self.prefills, *self.decodes):
            if rng.random() < 0.25:
                self.at(rng.uniform(0, window), f"{node.name} crashes", self.workers.crash,
                        node.name, rng.uniform(0.5, 8.0))
        if rng.random() < 0.2:
            self.at(rng.uniform(0, window), "registry crashes", self._raced, "registry restart",
                    self.registry.crash, rng.uniform(0.5, 8.0))
        if rng.random() < 0.15:
            self.at(rng.uniform(0, window), "proxy crashes", self._raced, "proxy restart",
                    self.proxy.crash)
        if rng.random() < 0.3 and self.prefills and self.decodes:
            pair = frozenset((rng.choice(self.prefills).name, rng.choice(self.decodes).name))
            self.at(rng.uniform(0, window), f"partition {sorted(pair)}", self._raced,
                    "partition", self.network.cut.add, pair)
            self.at(window + rng.uniform(1.0, 20.0), f"heal {sorted(pair)}",
                    self.network.cut.discard, pair)
        if c.switch_chance > 0:
            self.workers.draw(window)  # their own random stream (switch.py)
        if c.sigterms > 0:
            self.stops.draw(window)  # theirs too (sigterm.py)

    def _raced(self, kind: str, fault: Callable[..., None], *args: Any) -> None:
        """A fault that every role switch under way races (switch.py): ``kind`` happens."""
        fault(*args)
        self.workers.raced(kind)

    def _arrive(self, i: int) -> None:
        rng, w, c = self.rng, self.config.workload, self.config
        if w is None:
            words = rng.randint(4, 200)
            text = " ".join(f"w{rng.randint(0, 50)}" for _ in range(words))
            client = Client(i, text, words, rng.randint(1, 8))
        else:
            group = rng.randrange(w.groups) if w.groups else -1
            prefix = " ".join(f"s{group}.{k}" for k in range(w.prefix_tokens)) if w.groups else ""
            question = rng.randint(8, 64)
            text = prefix + " " + " ".join(f"q{rng.randint(0, 999)}" for _ in range(question))
            client = Client(i, text, (w.prefix_tokens if w.groups else 0) + question,
                            rng.randint(1, w.max_output), group=group,
                            prefix=w.prefix_tokens if w.groups else 0)
        client.arrived = self.now
        if c.schedulers == "real":
            from pd_fsm.sim.real import prompt_ids, reference  # JAX: only for real schedulers

            client.reference = reference().answer(prompt_ids(client), client.out)
        self.clients.append(client)
        self.proxy.request(client)

    # -- workers' world -----------------------------------------------------------------------

    # Workers are modelled (workers.py) or run the real schedulers (real.py): the same calls.
    def _node(self, role: str, name: str) -> Node:
        if self.config.schedulers == "real":
            # Imported here, not at the top: real.py brings JAX and the schedulers, which a
            # modelled run (the default, thousands of seeds) has no use for.
            from pd_fsm.sim.real import RealDecodeWorker, RealPrefillWorker

            return (RealPrefillWorker if role == "prefill" else RealDecodeWorker)(self, name)
        return (PrefillWorker if role == "prefill" else DecodeWorker)(self, name)

    def replace_node(self, proc: Process, role: str) -> None:
        """``proc`` serves ``role`` with a fresh node (not started), its generations going on
        from the old one's (the books key rooms by name and generation)."""
        node = self._node(role, proc.name)
        node.gen = proc.node.gen
        proc.node = node
        self._relist()

    def _relist(self) -> None:
        nodes = [proc.node for proc in self.procs.values()]
        self.prefills = [n for n in nodes if n.role == "prefill"]
        self.decodes = [n for n in nodes if n.role == "decode"]

    def handle(self, node: Node, core: Endpoint[Ev, Fx], event: Ev, now: float) -> list[Fx]:
        """``core.handle`` for ``node`` at its local time ``now``, a local protocol error made a
        violation, the effects traced."""
        try:
            effects = core.handle(event, now)
        except LocalProtocolError as exc:
            raise Violation(f"{node.name}: {exc} (event {event!r})") from None
        if self.tracing:
            for e in effects:
                room = getattr(e, "room", None)  # any endpoint's effects; some name no room
                self.trace_line(f"  {node.name} -> {type(e).__name__} "
                                f"{'' if room is None else room and hex(room)}")
        return effects

    def transfer_server(self, addr: str) -> PrefillWorker | None:
        p = next((p for p in self.prefills if p.transfer == addr), None)
        return p if p is not None and p.alive else None

    def handoff_source(self, name: str, gen: int) -> DecodeWorker | None:
        """The draining D a hand-off ticket names, if that process (of that generation, in
        that role) is up."""
        node = self.procs[name].node
        return node if isinstance(node, DecodeWorker) and node.alive and node.gen == gen else None

    # -- invariants ---------------------------------------------------------------------------

    def _check(self) -> None:
        self.invariants.check([*self.prefills, *self.decodes])
        self.proxy.check()

    def _check_drained(self) -> None:
        unanswered = [c.id for c in self.clients if c.answer is None]
        if unanswered:
            raise Violation(f"clients never answered: {unanswered}")
        for node in (*self.prefills, *self.decodes):
            left = node.leftovers() if node.alive else None
            if left:
                raise Violation(f"{node.name} not idle after the drain: {left}")
        self.proxy.check(drained=True)
        self.workers.check_settled()

    def handed_off_answers(self) -> dict[str, int]:
        """What the clients a draining D handed off got: ``client <status>`` each (a hand-off
        must not lose a stream that finishing in place would have served), and
        ``lost <status> <why>`` for each answer other than a 200 (``proxy.why_lost``)."""
        out = Counter(f"client {c.answer[0] if c.answer is not None else 'none'}"
                      for c in self.clients if c.handed_off)
        out.update(f"lost {c.answer[0]} {c.lost}" for c in self.clients
                   if c.handed_off and c.answer is not None and c.lost)
        return dict(out)

    def answered(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.clients:
            key = str(c.answer[0]) if c.answer is not None else "none"
            out[key] = out.get(key, 0) + 1
        return out


def run_seed(seed: int, config: SimConfig | None = None, trace: bool = False) -> SimResult:
    """One seed, whole: the first violation (or None), what the clients got, the steps taken."""
    world = World(seed, config, trace)
    violation = None
    try:
        world.run()
    except Violation as exc:
        violation = f"t={world.now:.3f}: {exc}"
    return SimResult(seed, violation, world.answered(), world.steps, world.trace,
                     world.workers.summary(), dict(sorted(world.workers.races.items())),
                     dict(sorted({**world.handoffs, **world.handed_off_answers()}.items())),
                     world.stops.summary(),
                     {} if world.scenario is None else dict(world.scenario.outcomes))


@attrs.frozen
class WorkloadResult:
    """One workload run's clients, as a serving benchmark sees them (virtual seconds)."""

    ttft: list[float]
    tpot: list[float]  # per client with more than one token: (last - first) / (tokens - 1)
    completed: int
    failed: int
    duration: float  # first arrival to last answer
    output_tokens: int
    good: int  # clients within both targets

    def rate(self, n: int) -> float:
        return n / self.duration if self.duration > 0 else math.nan


def run_workload(config: SimConfig, seed: int, ttft_target: float, tpot_target: float
                 ) -> WorkloadResult:
    """``config.workload`` (faults as ``config`` says) through the simulated cluster; a broken
    invariant raises ``Violation``."""
    assert config.workload is not None, "run_workload needs SimConfig.workload"
    world = World(seed, config)
    world.run()
    done = [c for c in world.clients if c.answer is not None and c.answer[0] == 200]
    ttft = [c.first_at - c.arrived for c in done]
    tpot_of = {c.id: (c.done_at - c.first_at) / (c.out - 1) for c in done if c.out > 1}
    good = sum(1 for c in done if c.first_at - c.arrived <= ttft_target
               and tpot_of.get(c.id, 0.0) <= tpot_target)
    start = min((c.arrived for c in world.clients), default=0.0)
    end = max((c.done_at for c in done), default=start)
    return WorkloadResult(ttft, list(tpot_of.values()), len(done),
                          len(world.clients) - len(done), end - start,
                          sum(c.out for c in done), good)
