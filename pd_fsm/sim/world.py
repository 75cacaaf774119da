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
stream of their own, so a seed that draws none runs as it did before switches existed).

Invariants, checked after every step (``Violation`` names the first broken one): every page and
every registration is freed exactly once; a client is answered at most once, and a 200 carries
the right tokens; KVPoll only moves forward; P's lease is never shortened; no room outlives its
deadline (the router's room timeout, P's lease, D's state timeouts); a role switch stops the old
role only once it holds nothing (StopRole). After the last arrival the world drains: every client
has exactly one answer, every worker is back to no room, no page and no registration, and every
switch has ended (each worker serves a role).
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from typing import Any, assert_never

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.codec import decode, encode
from pd_fsm.core.config import RegistryConfig, RouterConfig
from pd_fsm.core.drive import Endpoint, Ev, Fx
from pd_fsm.core.errors import LocalProtocolError, RemoteProtocolError
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.registry import BootstrapRegistry, RegistrationRequired
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.routing import Prompt
from pd_fsm.core.tables import KV_RECEIVER, ROOM
from pd_fsm.sim.config import (
    DECODE,
    DISCOVERY,
    DRAIN,
    LAYOUT,
    PAGE_TOKENS,
    PLANTS,
    REGISTRY_TTL,
    ROOM_TIMEOUT,
    SECRET,
    TOLERANCE,
    SimConfig,
    SimResult,
    Violation,
    bootstrap_addr,
)
from pd_fsm.sim.switch import Process, Processes
from pd_fsm.sim.workers import Client, DecodeWorker, Node, PrefillWorker


class World:
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
        self._seq = itertools.count()
        c = self.config
        nodes = [*(self._node("prefill", f"p{i}") for i in range(c.prefill)),
                 *(self._node("decode", f"d{i}") for i in range(c.decode))]
        # The worker processes by name (switch.py): each serves one role at a time; a role
        # switch replaces its node. ``prefills`` and ``decodes`` are the nodes serving each now.
        self.workers = Processes(self, nodes)
        self.procs: dict[str, Process] = self.workers.procs
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        self._relist()
        hosts = [n.name for n in nodes] + ["registry", "proxy"]
        self.skew = {h: self.rng.uniform(-c.skew, c.skew) for h in hosts}
        self.registry: BootstrapRegistry[tuple[str, str]] = BootstrapRegistry(
            RegistryConfig(ttl=REGISTRY_TTL))
        self.registry_up = True
        self.router_gen = 0
        self._shown = self._listed()  # the worker lists the proxy routes to now
        self.router = self._new_router()
        self.rooms: dict[tuple[int, int], tuple[Client, float]] = {}  # (gen, room) -> client
        self._errors: dict[int, str] = {}  # room -> the router's ReplyError reason
        # ReopenRoom effects by cause, and decode legs redirected within their room.
        self.reopened = {"retry": 0, "migration": 0, "redirect": 0, "handoff": 0}
        self.clients: list[Client] = []
        self.cut: set[frozenset[str]] = set()  # host pairs partitioned now
        # Invariant books.
        self._polls: dict[tuple[str, int, int], KVPoll] = {}
        self._leases: dict[tuple[str, int, int], float] = {}
        self._d_states: dict[tuple[str, int, int], tuple[str, float, float | None]] = {}
        for node in (*self.prefills, *self.decodes):
            node.start()

    # -- the clock ----------------------------------------------------------------------------

    def at(self, delay: float, what: str, fn: Callable[..., None], *args: Any) -> None:
        self.at_time(self.now + delay, what, fn, *args)

    def at_time(self, t: float, what: str, fn: Callable[..., None], *args: Any) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._seq), what, fn, args))

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
            self.at(rng.uniform(0, window), "registry crashes", self._crash_registry,
                    rng.uniform(0.5, 8.0))
        if rng.random() < 0.15:
            self.at(rng.uniform(0, window), "proxy crashes", self._crash_proxy)
        if rng.random() < 0.3 and self.prefills and self.decodes:
            pair = frozenset((rng.choice(self.prefills).name, rng.choice(self.decodes).name))
            self.at(rng.uniform(0, window), f"partition {sorted(pair)}", self._partition, pair)
            self.at(window + rng.uniform(1.0, 20.0), f"heal {sorted(pair)}", self.cut.discard,
                    pair)
        if c.switch_chance > 0:
            self.workers.draw(window)  # last: their own random stream (switch.py)

    def _partition(self, pair: frozenset[str]) -> None:
        self.cut.add(pair)
        self.workers.raced("partition")

    def _crash_registry(self, down: float) -> None:
        self.registry_up = False
        self.workers.raced("registry restart")

        def restart() -> None:  # an empty registry: workers register again on their next beat
            self.registry = BootstrapRegistry(RegistryConfig(ttl=REGISTRY_TTL))
            self.registry_up = True

        self.at(down, "registry restarts", restart)

    def _crash_proxy(self) -> None:
        """Every client of the old proxy loses its connection; a fresh proxy takes new ones."""
        self.workers.raced("proxy restart")
        for (gen, _), (client, _) in sorted(self.rooms.items(), key=lambda kv: kv[0]):
            if gen == self.router_gen and client.answer is None:
                self._answer(client, 502, "proxy connection reset")
        self.rooms = {k: v for k, v in self.rooms.items() if k[0] != self.router_gen}
        self.router_gen += 1
        self.router = self._new_router()

    def _new_router(self) -> RoomRouter:
        self._shown = self._listed()
        return RoomRouter(*self._shown, random.Random(self.rng.getrandbits(64)),
                          RouterConfig(room_timeout=ROOM_TIMEOUT,
                                       decode_recomputes=self.config.recompute),
                          self.config.routing)

    # -- clients and the proxy ----------------------------------------------------------------

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
        self._route(ev.RoomRequested(str(i), Prompt(text, client.tokens), migratable=True),
                    client)

    def _route(self, event: ev.RouterEvent, client: Client | None = None) -> None:
        gen = self.router_gen
        try:
            effects = self.router.handle(event, self.now + self.skew["proxy"])
        except LocalProtocolError as exc:
            raise Violation(f"router: {exc}") from None
        for e in effects:
            match e:
                case fx.DispatchRoom() | fx.DispatchLocal():
                    assert client is not None
                    self.rooms[(gen, e.room)] = (client, self.now)
                    p = e.prefill if isinstance(e, fx.DispatchRoom) else None
                    if p is not None:
                        self.at(self.rng.uniform(0.001, 0.003), f"P leg of room {e.room:x}",
                                self._post_leg, "prefill", p, gen, e.room, client,
                                bootstrap_addr(p))
                    self.at(self.rng.uniform(0.001, 0.003), f"D leg of room {e.room:x}",
                            self._post_leg, "decode", e.decode, gen, e.room, client,
                            None if p is None else bootstrap_addr(p))
                case fx.RelayDecode() | fx.BreakerChanged():
                    pass  # the relay ends with the decode worker's answer (relayed)
                case fx.AbortLeg():
                    self.at(0.002, f"abort {e.leg} leg of room {e.room:x}", self._abort_leg,
                            e.leg, e.url, e.room)
                case fx.ShedRequest():
                    assert client is not None
                    self._answer(client, 429, f"every {e.role} worker is full")
                case fx.NoWorkers():
                    assert client is not None
                    self._answer(client, 503, e.reason)
                case fx.ReplyError():
                    self._errors[e.room] = e.reason
                case fx.RedirectDecode():
                    got, _ = self.rooms[(gen, e.room)]
                    self.reopened["redirect"] += 1
                    self.at(self.rng.uniform(0.001, 0.003), f"D leg of room {e.room:x} again",
                            self._post_leg, "decode", e.decode, gen, e.room, got,
                            bootstrap_addr(e.prefill))
                case fx.ReopenRoom():
                    # The request goes on in a new room: its client is not answered now. A
                    # model answer is whole, so a migrated room relays all of it again.
                    got, _ = self.rooms.pop((gen, e.room))
                    self.reopened[e.cause] += 1
                    self.at(max(e.delay, 0.001), f"reopen {e.cause} of room {e.room:x}",
                            self._reopen, gen, e, got)
                case _:
                    assert_never(e)
        # A room that ended without relaying D's whole answer: its client gets the error (a
        # JSON error, or an error chunk in a stream whose headers were out).
        for key in [k for k in self.rooms if k[0] == gen]:
            if self.router.poll(key[1]) is None:
                got, _ = self.rooms.pop(key)
                if got.answer is None:
                    self._answer(got, 502, self._errors.pop(key[1], "relay broke off"))
        self._schedule_router()

    def _reopen(self, gen: int, e: fx.ReopenRoom, client: Client) -> None:
        if gen != self.router_gen:
            # The proxy restarted during the backoff: this client's connection went with it.
            self._answer(client, 502, "proxy connection reset")
            return
        prompt = Prompt(client.text, client.tokens)
        self._route(ev.RoomRequested(e.request_id, prompt, e.attempts, migratable=True), client)

    def _schedule_router(self) -> None:
        deadline = self.router.next_deadline()
        if deadline is not None:
            gen = self.router_gen
            self.at_time(deadline - self.skew["proxy"] + 1e-6, "proxy timers", self._router_wake,
                         gen)

    def _router_wake(self, gen: int) -> None:
        if gen == self.router_gen:
            self._route(ev.TimeAdvanced())

    def leg_answer(self, gen: int, room: int, leg: str, ok: bool, reason: str,
                   refused: bool = False, lost: bool = False) -> None:
        """A worker answered a leg (or its connection broke, or it refused the connection: a
        dead worker's port): the proxy hears it next."""
        self.at(0.001, f"{leg} leg of room {room:x} answers {'ok' if ok else reason}",
                self._leg_answered, gen, room, leg, ok, reason, refused, lost)

    def _leg_answered(self, gen: int, room: int, leg: str, ok: bool, reason: str,
                      refused: bool, lost: bool) -> None:
        if gen == self.router_gen:
            self._route(ev.LegResponded(room, leg, ok, reason, refused, refused, lost))

    def relayed(self, gen: int, room: int, client: Client, tokens: tuple[int, ...]) -> None:
        """D's whole answer reached the proxy, which relays it."""
        if gen != self.router_gen or (gen, room) not in self.rooms:
            return
        if self.router.poll(room) not in (ROOM.S.RELAYING, ROOM.S.LOCAL_RELAYING):
            return  # the room already failed (its client got that error)
        del self.rooms[(gen, room)]
        client.done_at = self.now
        self._answer(client, 200, tokens)
        self._route(ev.RelayFinished(room))

    def _answer(self, client: Client, status: int, body: tuple[int, ...] | str) -> None:
        if client.answer is not None:
            raise Violation(f"client {client.id} answered twice: {client.answer} then "
                            f"{(status, body)}")
        if status == 200 and body != client.expected():
            raise Violation(f"client {client.id} got {body}, expected {client.expected()}")
        client.answer = (status, body)
        self.trace_line(f"client {client.id} answered {status}")

    def _post_leg(self, leg: str, name: str, gen: int, room: int, client: Client,
                  bootstrap: str | None) -> None:
        """The proxy's ``leg`` reaches worker ``name`` (HTTP POST): a process that is down
        refuses the connection, one switching its role answers 503 (RefuseLegs), one that
        serves the other role now answers 409 (a stale role); else its node takes the leg."""
        proc = self.procs[name]
        node = proc.node
        if proc.switch is None:
            self.leg_answer(gen, room, leg, False, f"{leg} connection refused", refused=True)
        elif proc.refusing:
            self.leg_answer(gen, room, leg, False, f"503 {proc.refusing}", refused=True)
        elif node.role != leg:
            self.leg_answer(gen, room, leg, False,
                            f"409 {name} serves {node.role} now (role epoch "
                            f"{proc.switch.epoch}), not {leg}", refused=True)
        else:
            node.leg(gen, room, client, bootstrap)

    def _abort_leg(self, leg: str, name: str, room: int) -> None:
        """The proxy's /abort_request reaches ``name``: its node aborts the room if it has it."""
        proc = self.procs[name]
        if proc.node.role == leg:
            if proc.races is not None:
                proc.races.add("abort")
            proc.node.abort(room)

    def disconnect_a_client_of(self, name: str, rng: random.Random) -> bool:
        """A client whose room has a leg on ``name`` goes away (the switch's fault, switch.py):
        the proxy's ClientDisconnected aborts the room's legs; the client wants no answer
        (counted as 499). False if ``name`` has no such room now."""
        mine = [(room, client) for (gen, room), (client, _) in sorted(self.rooms.items())
                if gen == self.router_gen and client.answer is None
                and room in self.router.rooms
                and name in (self.router.rooms[room].prefill, self.router.rooms[room].decode)]
        if not mine:
            return False
        room, client = rng.choice(mine)
        self._answer(client, 499, "client disconnected")
        del self.rooms[(self.router_gen, room)]
        self._route(ev.ClientDisconnected(room))
        return True

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

    def _listed(self) -> tuple[list[str], list[str]]:
        """The workers as a discovering proxy would list them: by the role each advertises."""
        procs = self.procs.values()
        return ([p.name for p in procs if p.listed == "prefill"],
                [p.name for p in procs if p.listed == "decode"])

    def show_workers(self) -> None:
        """A worker left or joined a role: the proxy sees it within one discovery interval."""
        self.at(self.workers.rng.uniform(0.05, DISCOVERY), "proxy discovers its workers",
                self._discover, self.router_gen)

    def _discover(self, gen: int) -> None:
        listed = self._listed()
        if gen == self.router_gen and listed != self._shown:
            self._shown = listed
            self.router.set_workers(*listed)

    def deregister(self, node: Node) -> None:
        if node.role == "prefill" and self.registry_up:
            self.registry.handle(ev.InstanceDeregistered(self._key(node)),
                                 self.now + self.skew["registry"])

    def prompt_pages(self, client: Client) -> int:
        return max(1, math.ceil(client.tokens / PAGE_TOKENS))

    def pages_for(self, client: Client) -> int:
        return max(1, math.ceil((client.tokens + client.out) / PAGE_TOKENS))

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

    def reachable(self, a: str, b: str) -> bool:
        return frozenset((a.split(":")[0], b.split(":")[0])) not in self.cut

    def send(self, src: str, dst: str, message: Any) -> None:
        """One side-channel frame: signed, then delayed, dropped, duplicated or corrupted."""
        frame = encode(message, SECRET, sent_at=1.0, nonce=next(self._seq))
        copies, rng = 1, self.rng
        if self.config.faults:
            r = rng.random()
            if r < 0.02:
                copies = 0
            elif r < 0.04:
                copies = 2
            elif r < 0.05:
                i = rng.randrange(len(frame))
                frame = frame[:i] + bytes((frame[i] ^ 0x40,)) + frame[i + 1:]
        for _ in range(copies):
            delay = rng.uniform(0.0005, 0.003)
            if self.config.faults and rng.random() < 0.03:
                delay = rng.uniform(0.05, 2.0)  # overtaken by later frames
            self.at(delay, f"frame {type(message).__name__} {src} -> {dst}", self._deliver,
                    src, dst, frame)

    def _deliver(self, src: str, dst: str, frame: bytes) -> None:
        host = dst.split(":")[0]
        proc = self.procs.get(host)
        node = None if proc is None else proc.node
        # P listens at "name:side", D at its name: a frame for the role the worker left finds
        # that role's side channel closed (a switch stopped it).
        if node is None or not node.alive or not self.reachable(src, dst) or (
                (dst != host) != (node.role == "prefill")):
            return
        try:
            message = decode(frame, SECRET)
        except RemoteProtocolError:
            self.trace_line(f"  {host}: corrupt frame refused")
            return
        node.receive(src, message)

    def transfer_server(self, addr: str) -> PrefillWorker | None:
        p = next((p for p in self.prefills if p.transfer == addr), None)
        return p if p is not None and p.alive else None

    def register(self, p: PrefillWorker) -> None:
        if self.registry_up:
            self.registry.handle(ev.InstanceRegistered(self._key(p), (p.side, p.transfer),
                                                       p.advertised, REGISTRY_TTL),
                                 self.now + self.skew["registry"])

    def registry_heartbeat(self, p: PrefillWorker) -> None:
        if not self.registry_up:
            return
        out = self.registry.handle(ev.InstanceHeartbeat(self._key(p)),
                                   self.now + self.skew["registry"])
        if any(isinstance(e, RegistrationRequired) for e in out):
            self.register(p)

    @staticmethod
    def _key(p: Node) -> tuple[str, str, int, int, int, int]:
        return ("prefill", p.name, 0, 0, 0, 0)

    def resolve(self, d: DecodeWorker, bootstrap_addr: str) -> None:
        answer: Any
        if not self.registry_up:
            answer = ev.PeerResolutionFailed(bootstrap_addr, "bootstrap server unreachable")
        else:
            self.registry.handle(ev.TimeAdvanced(), self.now + self.skew["registry"])
            found = self.registry.resolve(bootstrap_addr)
            if found:
                side, transfer = found[0][1]
                answer = ev.PeerResolved(bootstrap_addr, side, transfer, LAYOUT)
            else:
                answer = ev.PeerResolutionFailed(bootstrap_addr, "not registered")
        self.at(0.002, f"{d.name} lookup of {bootstrap_addr}", d.resolved, d.gen, answer)

    # -- invariants ---------------------------------------------------------------------------

    def _check(self) -> None:
        nodes: list[Any] = [*self.prefills, *self.decodes]
        for node in nodes:
            if not node.alive:
                continue
            now = node.local()
            for room in list(node.core.rooms):
                self._monotonic(node.name, node.gen, room, node.core.poll(room))
                if node.role == "prefill":
                    self._check_lease(node, room, now)
                else:
                    self._check_state(node, room, now)
        for (gen, room), (_, since) in self.rooms.items():
            if gen == self.router_gen and self.now - since > ROOM_TIMEOUT + TOLERANCE:
                raise Violation(f"proxy: room {room:x} live {self.now - since:.1f} s")

    def _check_lease(self, p: PrefillWorker, room: int, now: float) -> None:
        """P's lease is never shortened, and no room lives past it."""
        expiry = p.core.lease_expiry(room)
        if expiry is None:
            return
        key = (p.name, p.gen, room)
        if expiry < self._leases.get(key, -math.inf):
            raise Violation(f"{p.name}: lease of room {room:x} shortened from "
                            f"{self._leases[key]:.3f} to {expiry:.3f}")
        self._leases[key] = expiry
        if now > expiry + TOLERANCE:
            raise Violation(f"{p.name}: room {room:x} live {now - expiry:.1f} s past its lease")

    def _check_state(self, d: DecodeWorker, room: int, now: float) -> None:
        """No D room stays in a waiting state past that state's deadline (kv_receiver's
        [timeouts], with the windows the simulated cluster was given)."""
        state = d.core.state_of(room)
        assert state is not None
        key = (d.name, d.gen, room)
        seen = self._d_states.get(key)
        # A re-armed deadline is a state entered again within one event (STREAMING -> a part
        # lands -> WAITING_FOR_READY -> the next part -> STREAMING): measured from then.
        deadline = d.core.room_deadline(room)
        if seen is None or seen[0] != state or seen[2] != deadline:
            self._d_states[key] = (state, now, deadline)
            return
        timeout = KV_RECEIVER.timeouts.get(state)
        if timeout is None:
            return
        window = float(getattr(DECODE, timeout.window))
        if now - seen[1] > window + TOLERANCE:
            raise Violation(f"{d.name}: room {room:x} in {state} for {now - seen[1]:.1f} s, "
                            f"past its {window:g} s deadline")

    def _monotonic(self, node: str, gen: int, room: int, poll: KVPoll | None) -> None:
        if poll is None:
            return
        key = (node, gen, room)
        prev = self._polls.get(key)
        if prev is not None and poll < prev and poll != KVPoll.Failed:
            raise Violation(f"{node}: KVPoll of room {room:x} went {prev.name} -> {poll.name}")
        self._polls[key] = poll

    def _check_drained(self) -> None:
        unanswered = [c.id for c in self.clients if c.answer is None]
        if unanswered:
            raise Violation(f"clients never answered: {unanswered}")
        for node in (*self.prefills, *self.decodes):
            left = node.leftovers() if node.alive else None
            if left:
                raise Violation(f"{node.name} not idle after the drain: {left}")
        if any(gen == self.router_gen for gen, _ in self.rooms) or self.router.rooms:
            raise Violation(f"proxy rooms live after the drain: {len(self.router.rooms)}")
        self.workers.check_settled()

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
                     world.workers.summary(), dict(sorted(world.workers.races.items())))


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
