"""The simulated workers (``pd_fsm.sim``): each runs its real core endpoint; its scheduler, its
transfer server and its HTTP legs are modelled here."""

from __future__ import annotations

import functools
import itertools
import math
import random
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, assert_never

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.drive import Endpoint, Ev, Fx, drive
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.messages import Done, Message
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.core.prefill_lease import Leases
from pd_fsm.core.prefill_room import SenderRoom
from pd_fsm.core.rooms import Cause
from pd_fsm.core.tables import KV_HANDOFF, KV_RECEIVER, KV_SENDER
from pd_fsm.sim.config import (
    DECODE,
    HANDOFF_PULL_FAILS,
    HANDOFF_PULL_SLOW,
    LAYOUT,
    LEASE,
    PAGE_TOKENS,
    PULL_DEADLINE,
    RECOMPUTABLE,
    REGISTRY_HEARTBEAT,
    VOCAB,
    SimConfig,
    Violation,
    bootstrap_addr,
)


@attrs.define(eq=False)
class Client:
    id: int
    text: str
    tokens: int
    out: int
    answer: tuple[int, tuple[int, ...] | str] | None = None
    group: int = -1  # the shared prefix it starts with (-1: none)
    prefix: int = 0  # that prefix's tokens
    arrived: float = 0.0
    first_at: float = math.nan  # when D's first token left (TTFT = first_at - arrived)
    done_at: float = math.nan
    # The colocated model's answer, when real schedulers compute the answers (sim/real.py).
    reference: tuple[int, ...] | None = None
    # What it has from a D that handed its stream off (the ticket's tokens; sim/workers.py): the
    # next D's answer goes on from there.
    sent: tuple[int, ...] = ()
    # Whether a D ever handed its stream off (``sent`` empties again if it migrates after).
    handed_off: bool = False
    # A handed-off client's answer other than a 200: why (``Proxy.answer``), e.g. every D down.
    lost: str = ""

    def prompt_pages(self) -> int:
        """The pages of its prompt's KV (what P holds)."""
        return max(1, math.ceil(self.tokens / PAGE_TOKENS))

    def pages(self) -> int:
        """The pages of its prompt and its whole answer (what D holds)."""
        return max(1, math.ceil((self.tokens + self.out) / PAGE_TOKENS))

    def first_token(self) -> int:
        return (self.id * 7919 + len(self.text)) % VOCAB

    def expected(self, first: int | None = None) -> tuple[int, ...]:
        """The answer: P's first token, then what D decodes from it (with real schedulers: the
        colocated model's greedy answer)."""
        if self.reference is not None:
            return self.reference
        f = self.first_token() if first is None else first
        return (f, *((f * 31 + k * (self.id + 1)) % VOCAB for k in range(1, self.out)))


class Clock(Protocol):
    """What every part of the simulated cluster runs on (``world.World`` is the one there is):
    the virtual clock and its queue, the seeded random generator, the config, the trace."""

    config: SimConfig
    rng: random.Random
    now: float
    skew: dict[str, float]  # host -> its clock's offset
    handoffs: Counter[str]  # hand-offs by what became of them (the summary line's figures)

    def at(self, delay: float, what: str, fn: Callable[..., None], *args: Any) -> None: ...

    def at_time(self, t: float, what: str, fn: Callable[..., None], *args: Any) -> None: ...

    def trace_line(self, line: str) -> None: ...

    def plant(self, name: str) -> bool: ...


class ProxyView(Protocol):
    """The proxy as a worker (legs) and a role switch (discovery, a client of it going away)
    reach it (``proxy.Proxy``)."""

    def leg_answer(self, gen: int, room: int, leg: str, ok: bool, reason: str,
                   refused: bool = False, lost: bool = False) -> None: ...

    def relayed(self, gen: int, room: int, client: Client, tokens: tuple[int, ...]) -> None: ...

    def handed_off(self, gen: int, room: int, ticket: Ticket) -> None: ...

    def show_workers(self, rng: random.Random) -> None: ...

    def disconnect_a_client_of(self, name: str, rng: random.Random) -> bool: ...


class RegistryView(Protocol):
    """The bootstrap server as the workers (their records) and the role switches (whether it is
    up; a record withdrawn) reach it (``registry.Registry``)."""

    up: bool

    def register(self, p: PrefillWorker) -> None: ...

    def heartbeat(self, p: PrefillWorker) -> None: ...

    def deregister(self, node: Node) -> None: ...

    def resolve(self, d: DecodeWorker, bootstrap_addr: str) -> None: ...


class NetworkView(Protocol):
    """The network between the hosts (``network.Network``): the side channel the workers send on,
    and the partitions in force (a role switch notes that it raced one)."""

    cut: set[frozenset[str]]  # host pairs partitioned now

    def reachable(self, a: str, b: str) -> bool: ...

    def send(self, src: str, dst: str, message: Message) -> None: ...


class WorldView(Clock, Protocol):
    """The world as a worker sees it: the clock, the proxy, the registry, the network, its core's
    driver, the transfer servers (P's, and a draining D's hand-offs). Spelled out here, not
    imported, because the world imports the workers to build them: the workers naming ``World``
    would close an import circle."""

    @property
    def proxy(self) -> ProxyView: ...

    @property
    def registry(self) -> RegistryView: ...

    @property
    def network(self) -> NetworkView: ...

    def handle(self, node: Node, core: Endpoint[Ev, Fx], event: Ev, now: float) -> list[Fx]: ...

    def transfer_server(self, addr: str) -> PrefillWorker | None: ...

    def handoff_source(self, name: str, gen: int) -> DecodeWorker | None: ...


class Pool:
    """A worker's pages: every page freed exactly once."""

    def __init__(self, world: WorldView, name: str, size: int) -> None:
        self.world, self.name, self.size = world, name, size
        self.free = set(range(1, size + 1))

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        pages = sorted(self.free)[:n]
        self.free.difference_update(pages)
        return pages

    def give(self, pages: list[int], why: str) -> None:
        twice = [p for p in pages if p in self.free]
        if twice:
            raise Violation(f"{self.name}: pages {twice} freed twice ({why})")
        self.free.update(pages)


class Node(ABC):
    """A worker process serving one role: alive or not, its generation (a restart is a new one;
    a role switch a new node under the same name, ``switch.py``)."""

    role = ""  # "prefill" or "decode"

    def __init__(self, world: WorldView, name: str) -> None:
        self.world, self.name = world, name
        self.alive = False
        self.gen = 0
        self.wake = math.inf
        self.withdrawn = False  # its registry record withdrawn for a role switch: no heartbeats

    def stop(self) -> None:
        """A role switch stopped this role's backend (it held nothing: StopRole checked)."""
        self.alive = False

    def local(self) -> float:
        return self.world.now + self.world.skew[self.name]

    def schedule_wake(self, deadline: float | None) -> None:
        if deadline is None:
            return
        # A hair after: the node reads now + skew, which must not round to just before it.
        at = deadline - self.world.skew[self.name] + 1e-6
        if at < self.wake:
            self.wake = at
            gen = self.gen
            self.world.at_time(at, f"{self.name} timers", self._on_wake, gen, at)

    def _on_wake(self, gen: int, at: float) -> None:
        if gen == self.gen and self.alive and at == self.wake:
            self.wake = math.inf
            self.feed(ev.TimeAdvanced())

    @abstractmethod
    def feed(self, event: Any) -> None:  # Any: each role's own event union
        """Hand ``event`` to the worker's core and carry out what it returns."""

    @abstractmethod
    def start(self) -> None:
        """Start (or restart) the process: a new generation, a fresh core and pool."""

    @abstractmethod
    def receive(self, peer: str, message: Any) -> None:
        """A side-channel message arrived from ``peer``."""

    @abstractmethod
    def leg(self, gen: int, room: int, client: Client, bootstrap: str | None) -> None:
        """The proxy's leg of ``room`` arrives (HTTP POST), with its P's bootstrap address
        (D's leg; None: D prefills it itself; P's own leg carries its own, unused)."""

    @abstractmethod
    def abort(self, room: int) -> None:
        """The proxy's /abort_request for ``room``."""

    @abstractmethod
    def crash(self) -> None:
        """The process dies: its open legs' connections break."""

    @abstractmethod
    def leftovers(self, switching: bool = False) -> str:
        """What this worker still holds ("" when idle): rooms, pages, registrations.

        ``switching``: what a role switch waits for (drain) and must find released (StopRole).
        A P's room that only waits for our leg — D's early hello (EARLY_PEER) or D's early
        abort (REFUSED), for a leg a draining P refuses — is not counted: it holds no request,
        page or registration, and no local event can end it (kv_sender has no Aborted row
        there; only its lease does). The stopped role drops it; D's side of an EARLY_PEER room
        ends by D's peer timeout, its heartbeats unanswered (REFUSED: D knows already)."""

    @abstractmethod
    def fail_in_flight(self, reason: str) -> None:
        """A role switch's drain deadline passed: fail what is left, as the worker's own abort
        does (every room aborted, its leg answered with ``reason``, its pages and
        registrations freed)."""


class PrefillWorker(Node):
    role = "prefill"

    def __init__(self, world: WorldView, name: str) -> None:
        super().__init__(world, name)
        self.advertised = bootstrap_addr(name)
        self.side = f"{self.name}:side"
        self.core: PrefillEndpoint
        self.pool = Pool(world, self.name, world.config.pages)
        self.held: dict[int, list[int]] = {}  # room -> pages
        self.regs: dict[int, int] = {}  # uuid -> room: the transfer server
        self.legs: dict[int, tuple[int, Client]] = {}  # room -> (router gen, client): open legs
        self.transfer = ""
        self.busy_until = 0.0  # one prefill at a time
        self.cached_groups: set[int] = set()  # shared prefixes its prefix cache holds

    def start(self) -> None:
        w = self.world
        self.gen += 1
        self.alive, self.wake, self.withdrawn = True, math.inf, False
        self.transfer = f"{self.name}:{17000 + self.gen}"  # a new port per process
        cls = ShorteningPrefill if w.config.plant == "lease-shortens" else PrefillEndpoint
        self.core = cls(LAYOUT, random.Random(w.rng.getrandbits(64)), LEASE,
                        transfer_addr=self.transfer, kv_checksum=w.config.checksums)
        self.pool = Pool(w, self.name, w.config.pages)
        self.held, self.regs, self.legs = {}, {}, {}
        self.busy_until, self.cached_groups = 0.0, set()
        w.registry.register(self)
        w.at(REGISTRY_HEARTBEAT, f"{self.name} registry heartbeat", self._heartbeat, self.gen)

    def crash(self) -> None:
        self.alive = False
        for room, (gen, _) in sorted(self.legs.items()):
            self.world.proxy.leg_answer(gen, room, "prefill", False, "prefill connection reset",
                                        lost=True)
        self.legs = {}

    def _heartbeat(self, gen: int) -> None:
        if gen != self.gen or not self.alive or self.withdrawn:
            return
        self.world.registry.heartbeat(self)
        self.world.at(REGISTRY_HEARTBEAT, f"{self.name} registry heartbeat", self._heartbeat, gen)

    def leg(self, gen: int, room: int, client: Client, bootstrap: str | None = None) -> None:
        if not self.alive:
            self.world.proxy.leg_answer(gen, room, "prefill", False, "prefill connection refused",
                                        refused=True)
            return
        self.legs[room] = (gen, client)
        self.feed(ev.PrefillRequestAccepted(room))
        if self.core.state_of(room) is None or room in self.held:
            return  # refused (the leg was answered), or a duplicate of a live room
        pages = self.pool.take(client.prompt_pages())  # P holds the prompt's KV only
        if pages is None:
            self.feed(ev.PrefillFailed(room, "no free pages"))
            return
        self.held[room] = pages
        w = self.world
        if w.config.faults and w.rng.random() < 0.02:
            w.trace_line(f"{self.name}: the forward of room {room:x} hangs")
            return  # only the lease (or an abort) ends this room now
        uncached = client.tokens
        if client.group >= 0:
            if client.group in self.cached_groups:
                uncached -= client.prefix
            self.cached_groups.add(client.group)
        start = max(w.now, self.busy_until)
        self.busy_until = start + w.config.cost.prefill(uncached)
        w.at(self.busy_until - w.now, f"{self.name} prefill of room {room:x}", self._prefilled,
             self.gen, room)
        stream = w.config.stream
        for done in range(stream, client.tokens, stream) if stream else ():
            # Chunk by chunk: the KV is written through ``done`` tokens this far into the run.
            at = start + w.config.cost.prefill(done * uncached // client.tokens)
            w.at(at - w.now, f"{self.name} part of room {room:x}", self._part_prefilled,
                 self.gen, room, done // PAGE_TOKENS)

    def _part_prefilled(self, gen: int, room: int, pages: int) -> None:
        if gen == self.gen and self.alive and self.core.state_of(room) is not None:
            self.feed(ev.PartPrefilled(room, pages))

    def _prefilled(self, gen: int, room: int) -> None:
        if gen != self.gen or not self.alive or self.core.state_of(room) is None:
            return
        client = self.legs.get(room, (0, None))[1]
        first = client.first_token() if client is not None else 0
        self.feed(ev.PrefillFinished(room, first, len(self.held[room])))

    def abort(self, room: int) -> None:
        if self.alive and self.core.state_of(room) is not None:
            self.feed(ev.Aborted(room, "aborted by the proxy"))

    def receive(self, peer: str, message: Any) -> None:
        self.feed(ev.MessageReceived(peer, message))

    def fail_in_flight(self, reason: str) -> None:
        if self.world.plant("switch-leaks"):  # planted bug: the legs answered, nothing freed
            for room in sorted(self.legs):
                self._answer_leg(room, False, reason)
            return
        for room in sorted(self.core.rooms):
            if self.core.state_of(room) is not None:  # an abort may end another room's too
                self.feed(ev.Aborted(room, reason))

    def feed(self, event: ev.PrefillEvent) -> None:
        w = self.world
        drive(functools.partial(w.handle, self, self.core), event, self.local(),
              functools.partial(self._carry_out, event))
        self.schedule_wake(self.core.next_deadline())

    def _carry_out(self, event: ev.PrefillEvent, e: fx.PrefillEffect) -> tuple[Any, ...]:
        """One effect of ``event`` (the event fed: the planted missing release looks at it)."""
        w = self.world
        match e:
            case fx.SendMessage():
                w.network.send(self.side, e.peer, e.message)
            case fx.RegisterKV():
                return self._register(e.room, e.uuid, e.spare_uuid)
            case fx.RegisterPart():
                self.regs[e.uuid] = e.room
                return (ev.KVChecksummed(e.room, e.uuid, (e.room % (1 << 32),)),) if (
                    e.checksum) else ()
            case fx.NarrowKV():
                self.regs.pop(e.replaces, None)
                if e.replaces_spare is not None:
                    self.regs.pop(e.replaces_spare, None)
                return self._register(e.room, e.uuid, e.spare_uuid)
            case fx.ReleaseKV():
                parts = () if w.plant("part-leak") else e.parts  # planted: the parts stay
                for uuid in (e.uuid, e.spare_uuid, *parts):
                    if uuid is not None and self.regs.pop(uuid, None) is None:
                        raise Violation(f"{self.name}: registration {uuid} released twice")
                pages = self.held.pop(e.room, None)
                done = isinstance(event, ev.MessageReceived) and isinstance(event.message,
                                                                            Done)
                if pages is not None and not (done and w.plant("missing-release-on-done")):
                    self.pool.give(pages, f"ReleaseKV of room {e.room:x}")
            case fx.CompleteRequest():
                self._answer_leg(e.room, True, "")
            case fx.FailRequest():
                self._answer_leg(e.room, False, e.reason)
            case fx.RejectRequest():
                self._answer_leg(e.room, False, e.reason)
            case fx.AckWhileBusy():
                pass  # the simulated steps never keep the endpoint busy
            case _:
                assert_never(e)
        return ()

    def _register(self, room: int, uuid: int, spare: int | None) -> tuple[Any, ...]:
        """The transfer server takes the KV (twice with checksums on: the spare is D's re-pull)
        and, with checksums on, P's scheduler reports them (the room stands for its bytes)."""
        self.regs[uuid] = room
        if spare is None:
            return ()
        self.regs[spare] = room
        return (ev.KVChecksummed(room, uuid, (room % (1 << 32),)),)

    def leftovers(self, switching: bool = False) -> str:
        held = self.pool.size - len(self.pool.free)
        rooms = live_rooms(self.core, switching)
        parts = [f"rooms {rooms}"] if rooms else []
        parts += [f"{held} pages never freed"] if held else []
        parts += [f"{len(self.regs)} registrations"] if self.regs else []
        return ", ".join(parts)

    def _answer_leg(self, room: int, ok: bool, reason: str) -> None:
        gen_client = self.legs.pop(room, None)
        if gen_client is not None:
            self.world.proxy.leg_answer(gen_client[0], room, "prefill", ok, reason)


# P's rooms that only wait for P's own leg (Node.leftovers).
_BEFORE_OUR_LEG = frozenset({KV_SENDER.S.EARLY_PEER, KV_SENDER.S.REFUSED})


def live_rooms(core: PrefillEndpoint, switching: bool) -> list[int]:
    """P's rooms (``switching``: but those that only wait for P's leg; ``Node.leftovers``)."""
    return sorted(r for r in core.rooms
                  if not switching or core.state_of(r) not in _BEFORE_OUR_LEG)


class ShorteningLeases(Leases):
    """Planted bug: a heartbeat moves the lease to now + half the extension, shorter or not."""

    def _fx_ExtendExpiry(self, r: SenderRoom, now: float, out: list[fx.PrefillEffect],
                         cause: Cause) -> None:
        self.set_expiry(r, now + self.config.extension / 2)


class ShorteningPrefill(PrefillEndpoint):
    """The real endpoint, with the planted bug in its leases."""

    leases_type = ShorteningLeases


class DecodeWorker(Node):
    role = "decode"

    def __init__(self, world: WorldView, name: str) -> None:
        super().__init__(world, name)
        self.core: DecodeEndpoint
        self.pool = Pool(world, self.name, world.config.pages)
        self.held: dict[int, list[int]] = {}  # room -> pages
        self.legs: dict[int, tuple[int, Client]] = {}  # room -> (router gen, client)
        self.waiting: list[int] = []  # rooms waiting for pages, FIFO
        self.puller = PullRunner(self)  # its pull executor
        # Rooms whose pages wait for their pull's report (the planted bug held-until-pull-reports)
        self.release_on_report: set[int] = set()
        self.relaying: set[int] = set()  # rooms whose answer goes out (D's leg answered 200)
        self.pull_failed: set[int] = set()  # rooms whose pull failed (the double-free plant)
        self.bad_kv: set[int] = set()  # rooms decoding from corrupted KV (the unverified plant)
        self.desk = Desk(self)  # its streams and live hand-offs (handoff.py)

    def start(self) -> None:
        w = self.world
        self.gen += 1
        self.alive, self.wake, self.withdrawn = True, math.inf, False
        self.core = DecodeEndpoint(self.name, LAYOUT, DECODE, incarnation=w.rng.getrandbits(62) | 1,
                                   kv_checksum=w.config.checksums)
        if w.plant("no-ready-timeout"):
            self.core._state_timeout[KV_RECEIVER.S.WAITING_FOR_READY] = math.inf  # planted bug
        self.pool = Pool(w, self.name, w.config.pages)
        self.held, self.legs, self.waiting, self.relaying = {}, {}, [], set()
        self.puller, self.release_on_report = PullRunner(self), set()
        self.pull_failed, self.bad_kv = set(), set()
        self.desk = Desk(self)

    def crash(self) -> None:
        self.alive = False
        for room, (gen, _) in sorted(self.legs.items()):
            self.world.proxy.leg_answer(gen, room, "decode", False, "decode connection reset",
                                        lost=True)
        self.legs = {}

    def leg(self, gen: int, room: int, client: Client, bootstrap: str | None,
            accept_handoff: bool = False, ticket: Ticket | None = None) -> None:
        """``accept_handoff``: the stream may end with a hand-off ticket should this D drain;
        ``ticket``: a hand-off's, whose KV this D pulls instead of a prefill (handoff.py)."""
        if not self.alive:
            self.world.proxy.leg_answer(gen, room, "decode", False, "decode connection refused",
                                        refused=True)
            return
        if room in self.legs:
            self.world.proxy.leg_answer(gen, room, "decode", False, f"room {room:x} is live here")
            return
        if accept_handoff:
            self.desk.accepting.add(room)
        if ticket is not None:
            self.desk.take(gen, room, client, ticket)
            return
        self.legs[room] = (gen, client)
        if bootstrap is None:  # no bootstrap fields: D prefills it itself
            self._prefill_here(room, client)
            return
        n = client.prompt_pages()
        self.feed(ev.DecodeRequestAccepted(room, bootstrap, n))

    def _prefill_here(self, room: int, client: Client) -> None:
        pages = self.pool.take(client.pages())
        if pages is None:
            self.fail_leg(room, "no free pages for a local prefill")
            return
        self.held[room] = pages
        self.bad_kv.discard(room)  # a recompute: this KV is our own
        cost = self.world.config.cost.prefill(client.tokens)
        self.world.at(cost, f"{self.name} local prefill of room {room:x}", self._first_token,
                      self.gen, room, client.first_token())

    def _first_token(self, gen: int, room: int, first: int) -> None:
        if gen != self.gen or room not in self.legs:
            return
        router_gen, client = self.legs[room]
        client.first_at = self.world.now
        self.world.proxy.leg_answer(router_gen, room, "decode", True, "")
        # The batch it decodes in, as it joins: the simple model of a continuous batch. The body's
        # end never reaches the proxy before its headers (Desk.stream_out: 2 ms at least).
        step = self.world.config.cost.step(len(self.relaying) + 1)
        tokens = client.expected(first)
        if room in self.bad_kv:  # D continues from KV that is not P's: its tokens are not either
            tokens = (tokens[0], *((t + 1) % VOCAB for t in tokens[1:]))
        self.desk.stream_out(room, Stream(router_gen, client, (), tokens, self.world.now, step, 1))

    def leftovers(self, switching: bool = False) -> str:
        held = self.pool.size - len(self.pool.free)
        parts = [f"rooms {sorted(self.core.rooms)}"] if self.core.rooms else []
        parts += [f"{held} pages never freed"] if held else []
        parts += [f"legs {sorted(self.legs)}"] if self.legs else []
        parts += [f"waiting {self.waiting}"] if self.waiting else []
        return ", ".join(parts + self.desk.leftovers())

    def fail_leg(self, room: int, reason: str) -> None:
        gen_client = self.legs.pop(room, None)
        if gen_client is not None:
            self.world.proxy.leg_answer(gen_client[0], room, "decode", False, reason)

    def abort(self, room: int) -> None:
        if not self.alive or self.desk.abort(room):
            return
        if self.core.state_of(room) is not None:
            self.feed(ev.Aborted(room, "aborted by the proxy"))
        elif room in self.legs:  # decoding (or a local prefill): the scheduler's own abort
            self.legs.pop(room)
            self.relaying.discard(room)
            self.desk.streams.pop(room, None)
            pages = self.held.pop(room, None)
            if pages is not None:
                self.pool.give(pages, f"abort of room {room:x}")
            self.allocate_waiting()

    def receive(self, peer: str, message: Any) -> None:
        self.feed(ev.MessageReceived(peer, message))

    def fail_in_flight(self, reason: str) -> None:
        if self.world.plant("switch-leaks"):  # planted bug: the legs answered, nothing freed
            for room in sorted(self.legs):
                self.fail_leg(room, reason)
            return
        self.desk.close(reason)
        for room in sorted(self.core.rooms):
            if self.core.state_of(room) is not None:
                self.feed(ev.Aborted(room, reason))
        # The pull executor closes with the role: each pull still running reports failed now
        # (its room, aborted above, is CANCELLING: its pages went back with the abort).
        pulls, self.puller.in_flight = self.puller.in_flight, {}
        for room in sorted(pulls):
            if self.core.state_of(room) is not None:
                self.feed(ev.PullFailed(room, f"pull cancelled: {reason}"))
        # What the scheduler decodes (or prefills itself): its own abort. A stream mid-relay
        # breaks off with the reason (the proxy may migrate it), one not started fails.
        for room in sorted(self.legs):
            self.fail_leg(room, reason)
            self.relaying.discard(room)
            pages = self.held.pop(room, None)
            if pages is not None:
                self.pool.give(pages, f"room {room:x} failed by a role switch")

    def resolved(self, gen: int, answer: Any) -> None:
        if gen == self.gen and self.alive:
            self.feed(answer)

    def feed(self, event: ev.DecodeEvent) -> None:
        drive(functools.partial(self.world.handle, self, self.core), event, self.local(),
              self._carry_out)
        self.schedule_wake(self.core.next_deadline())
        if isinstance(event, ev.TimeAdvanced) and self.alive:
            self.desk.feed(event)  # its offers' leases (the wake is the node's one timer)

    def _carry_out(self, e: fx.DecodeEffect) -> list[ev.DecodeEvent]:
        w = self.world
        match e:
            case fx.SendMessage():
                w.network.send(self.name, e.peer, e.message)
            case fx.ResolvePeer():
                w.registry.resolve(self, e.bootstrap_addr)
            case fx.ForgetPeer() | fx.RepeatWhileBusy():
                pass
            case fx.ForgetTransfer():
                if not w.plant("held-until-pull-reports"):  # the old D dropped nothing
                    self.puller.drop(e.transfer_addr)
            case fx.AllocateBlocks():
                self.waiting.append(e.room)
                return self.allocate_waiting(feed=False)
            case fx.CancelAllocation():
                if e.room in self.waiting:
                    self.waiting.remove(e.room)
                else:
                    # Granted earlier in this same batch of effects (its BlocksAllocated is not
                    # fed yet, and will find the room over): the pages go back now.
                    self.pool.give(self.held.pop(e.room), f"cancelled allocation of {e.room:x}")
            case fx.StartPull():
                gen_client = self.legs.get(e.room)
                self.puller.start(e, gen_client[1].tokens if gen_client is not None else 0)
            case fx.CancelPull():
                if not (w.plant("release-without-cancel") or w.plant("held-until-pull-reports")):
                    self.puller.cancel(e.room)
            case fx.ReleaseBlocks():
                pull = self.puller.in_flight.get(e.room)
                if w.plant("held-until-pull-reports") and pull is not None:
                    self.release_on_report.add(e.room)  # the planted bug: the old CANCELLING
                    return []
                if pull is not None and not pull.cancelled:
                    raise Violation(f"{self.name}: room {e.room:x}'s pages freed while its "
                                    "pull, not cancelled, may still write them")
                pages = self.held.pop(e.room)
                self.pool.give(pages, f"ReleaseBlocks of room {e.room:x}")
                if w.plant("double-free") and e.room in self.pull_failed:
                    self.pool.give(pages, f"ReleaseBlocks of room {e.room:x} (planted)")
                return self.allocate_waiting(feed=False)
            case fx.CompleteTransfer():
                gen_client = self.legs.get(e.room)
                if gen_client is not None:
                    w.at(0.001, f"{self.name} room {e.room:x} joins the batch", self._first_token,
                         self.gen, e.room, e.first_token)
            case fx.FailRequest():
                self._failed(e)
            case fx.RejectRequest():
                self.fail_leg(e.room, e.reason)
            case _:
                assert_never(e)
        return []

    def _failed(self, e: fx.FailRequest) -> None:
        gen_client = self.legs.get(e.room)
        if gen_client is None:
            return
        if self.world.config.recompute and e.status in RECOMPUTABLE:
            self.world.trace_line(f"{self.name}: recomputes room {e.room:x} ({e.reason})")
            self.world.at(0.001, f"{self.name} recompute of room {e.room:x}",
                          self._recompute, self.gen, e.room)
            return
        self.fail_leg(e.room, e.reason)

    def _recompute(self, gen: int, room: int) -> None:
        if gen != self.gen or room not in self.legs or room in self.held:
            # Its old pages are still held until the core's ReleaseBlocks: wait for them.
            if gen == self.gen and room in self.legs:
                self.world.at(0.05, f"{self.name} recompute of room {room:x}", self._recompute,
                              gen, room)
            return
        self._prefill_here(room, self.legs[room][1])

    def allocate_waiting(self, feed: bool = True) -> list[Any]:
        out: list[Any] = []
        if not self.desk.place_waiting():
            return out  # a hand-off's stream is mid-answer: its pages come first
        while self.waiting:
            room = self.waiting[0]
            gen_client = self.legs.get(room)
            n = gen_client[1].pages() if gen_client else 1
            pages = self.pool.take(n)
            if pages is None:
                break
            self.waiting.pop(0)
            self.held[room] = pages
            out.append(ev.BlocksAllocated(room))
        if feed:
            for event in out:
                self.feed(event)
            return []
        return out

    def pulling_from(self, transfer_addr: str) -> list[int]:
        """The rooms whose pull from ``transfer_addr`` is in flight (scenarios.py)."""
        return self.puller.pulling_from(transfer_addr)

    def holds_pages(self, room: int) -> bool:
        return room in self.held

    def pull_ended(self, room: int, outcome: str, reason: str = "") -> None:
        """The pull executor's report of ``room``'s pull (``PullRunner``): ``landed``,
        ``landed corrupted`` (the unverified-kv plant), ``corrupted``, ``failed`` or
        ``cancelled`` (its KV, if any, dropped)."""
        self.puller.reports.append((self.world.now, room, outcome))
        if room in self.release_on_report:  # the planted bug: the pages go back only now
            self.release_on_report.discard(room)
            self.pool.give(self.held.pop(room), f"room {room:x}'s pull reported")
            self.feed(ev.PullFailed(room, "the room failed while its pull ran"))
            self.allocate_waiting()
        elif outcome == "cancelled":
            self.feed(ev.PullFailed(room, reason))
        elif outcome == "corrupted":
            self.feed(ev.ChecksumMismatched(room, "array 0 differs from P's checksum"))
        elif outcome.startswith("landed"):
            if outcome == "landed corrupted":
                self.bad_kv.add(room)  # the planted bug: the check that would catch it skipped
            if room not in self.held:
                raise Violation(f"{self.name}: room {room:x}'s pull wrote its KV into pages "
                                "the room had freed (another room's, or free)")
            self.feed(ev.PullSucceeded(room))
        else:
            self.pull_failed.add(room)
            self.feed(ev.PullFailed(room, reason))


@attrs.define(eq=False)
class _Pull:
    id: int
    uuid: int
    addr: str  # P's transfer address
    deadline: float  # on the world's clock
    cancelled: bool = False


class PullRunner:
    """A modelled D's pull executor: each pull takes its cost on the model, or is slow, fails or
    arrives corrupted as the seed draws. A pull from a P that died hangs until its deadline, as
    from a dead host (``SimConfig.hung_pulls``), unless D drops the connection first (``drop``:
    the core's ForgetTransfer). A cancelled pull (CancelPull) drops what it brings and reports
    failed. Each pull reports once, to its worker's ``pull_ended``."""

    def __init__(self, node: DecodeWorker) -> None:
        self.node = node
        self.in_flight: dict[int, _Pull] = {}  # room -> its pull
        self._ids = itertools.count(1)
        config = node.world.config
        self._stuck_left, self._failing_left = config.stuck_pulls, config.failed_pulls
        self.stuck: list[tuple[float, int]] = []  # (when, room) of each pull that never reports
        self.failing: list[int] = []  # the rooms whose pulls were made to fail
        self.reports: list[tuple[float, int, str]] = []  # (when, room, outcome) of each report

    def start(self, e: fx.StartPull, tokens: int) -> None:
        node, w = self.node, self.node.world
        pull = _Pull(next(self._ids), e.uuid, e.transfer_addr, w.now + PULL_DEADLINE)
        self.in_flight[e.room] = pull
        if self._stuck_left > 0:  # staged (scenarios.py): it never reports
            self._stuck_left -= 1
            self.stuck.append((w.now, e.room))
            return
        tokens = min(tokens, e.n_pages * PAGE_TOKENS)  # a part, or what no part carried
        took = w.config.cost.pull(tokens) + w.rng.uniform(0.001, 0.005)
        fault = ""
        if w.config.faults:
            r = w.rng.random()
            if r < 0.04:
                took = w.rng.uniform(1.0, 2 * PULL_DEADLINE)  # slow: maybe past its deadline
            elif r < 0.07:
                fault = "failed"
            elif r < 0.13 and w.config.checksums:
                fault = "corrupted"  # the bytes arrive, damaged: only the checksums can tell
        if self._failing_left > 0:  # staged (scenarios.py): a transfer error from a live P
            self._failing_left -= 1
            self.failing.append(e.room)
            fault = "failed"
        if took >= PULL_DEADLINE:
            took, fault = PULL_DEADLINE, "late"
        w.at(took, f"{node.name} pull of room {e.room:x}", self._ended, node.gen, e.room,
             pull.id, fault)

    def cancel(self, room: int) -> None:
        # No pull: it reported just now, and the room failed on a deadline due before its
        # report was handled (its KV, if any, was in the room's pages first).
        pull = self.in_flight.get(room)
        if pull is not None:
            pull.cancelled = True

    def drop(self, addr: str) -> None:
        """D drops its connections to ``addr``: every pull on them ends now."""
        node = self.node
        for room, pull in sorted(self.in_flight.items()):
            if pull.addr == addr:
                node.world.at(0.0, f"{node.name} pull of room {room:x} dropped", self._ended,
                              node.gen, room, pull.id, "dropped")

    def pulling_from(self, addr: str) -> list[int]:
        return sorted(room for room, pull in self.in_flight.items() if pull.addr == addr)

    def _ended(self, gen: int, room: int, pull_id: int, fault: str) -> None:
        """``fault``: "" (none drawn), late, failed, corrupted, dropped."""
        node, w = self.node, self.node.world
        pull = self.in_flight.get(room)
        if gen != node.gen or not node.alive or pull is None or pull.id != pull_id:
            return
        source = w.transfer_server(pull.addr)
        if source is None and w.config.hung_pulls and fault in ("", "corrupted"):
            # P died: from a dead host, nothing resets the connection; the pull hangs until
            # its deadline (or until D drops the connection: drop).
            w.at_time(pull.deadline, f"{node.name} pull of room {room:x} hung", self._ended,
                      gen, room, pull_id, "late")
            return
        del self.in_flight[room]
        if pull.cancelled:  # the executor drops what it brought, scatters nothing
            node.pull_ended(room, "cancelled", "cancelled: the room failed while it ran")
        elif fault == "dropped":
            node.pull_ended(room, "failed",
                            f"the connection to {pull.addr} was dropped (P lost)")
        elif fault == "late":
            node.pull_ended(room, "failed",
                            f"pull not finished within its {PULL_DEADLINE:g} s deadline")
        elif fault == "failed":
            node.pull_ended(room, "failed", "injected transfer failure")
        elif (source is None or pull.uuid not in source.regs
              or not w.network.reachable(node.name, source.name)):
            node.pull_ended(room, "failed", f"nothing registered as {pull.uuid} at {pull.addr}")
        elif fault == "corrupted":
            node.pull_ended(room, "landed corrupted" if w.plant("unverified-kv")
                            else "corrupted")
        else:
            node.pull_ended(room, "landed")

# -- live KV hand-off between the decode workers -------------------------------------------------
# (Here, beside the workers, not in a module of its own: the desk drives its worker and the
# worker builds its desk, so two modules would import each other.)
#
# Live KV hand-off between the simulated decode workers (``pd_fsm.sim``).
#
# A modelled D's streams and its hand-offs, both sides, as the real worker runs them
# (``io_trio/worker/decode_adapter.py``, ``schedulers/disaggregation/decode_handoff.py``): each D
# has a :class:`Desk` whose lifecycle of every hand-off is the core's ``HandoffLedger`` (table
# kv_handoff), fed through the core's one driver.
#
# Giving (a draining D, ``Desk.hand_off``, started by a role switch leaving decode or a SIGTERM
# when another D is listed and answers its /health, ``gate.py``): each stream it relays whose leg
# allowed it (``accept_handoff``: the proxy routed another D when it posted the leg) and that has
# a token left to decode is registered on the D's transfer server (``offers``: the tokens whose KV
# it holds, the last one the next input), offered for the lease (``HandoffOffered``), its pages go
# back at once (the gathered KV is a buffer of its own) and its leg ends with a hand-off ticket
# (``ProxyView.handed_off``), not an answer.
# Streams that join the batch while the window is open are handed off after their first step. The
# registration is released exactly once: when the proxy says the taking D answered
# (``HandoffPulled``), when its lease ends (``LeaseExpired``), or with the process (a crash, or the
# role stopped past the drain deadline: the transfer server closes).
#
# Taking (``Desk.take``, a leg that carries a ticket): the pages of the whole sequence are reserved,
# the pull starts (``HandoffClaimed`` -> ``StartHandoffPull``, keyed by the negative pull number
# ``pull_key``). The pull succeeds only if the draining D's process of that generation is up, still
# registers the ticket's uuid (its lease not over) and is reachable; it can fail by injection, as
# PD pulls do. Then the stream goes on from the pulled KV (``EnterDecode``: the continuation is a
# function of the pulled tokens, so KV from anything else gives a wrong answer), or the leg fails
# (``FailHandoff``: the proxy falls back to a migration, a re-prefill). An aborted request keeps its
# pages until its pull reports (``FinishAborted``, ``FreeHeldPages``).

_CLOSED = "the transfer server closed with the role"


def pull_key(room: int) -> int:
    """The ledger's key of the pull into ``room``: negative, never an offer's uuid."""
    return -(room + 1)


def room_of(key: int) -> int:
    return -key - 1


@attrs.frozen
class Ticket:
    """What a draining D's stream ends with, and the proxy posts to the taking D."""

    uuid: int
    source: str  # the draining D's name
    gen: int  # its process's generation: a restart, or a new role, registers none of its offers
    tokens: tuple[int, ...]  # what the client has: the KV covers all but the last (the next input)
    lease_s: float = 0.0  # the offer's lease when made: a full taker waits half of it for pages


@attrs.define(eq=False)
class Stream:
    """A stream a D relays: ``tokens`` after ``base`` (what the client had from an earlier D),
    ``lead`` of them out at ``started`` (P's first token; none after a hand-off), one more every
    ``step`` seconds."""

    router_gen: int
    client: Client
    base: tuple[int, ...]
    tokens: tuple[int, ...]
    started: float
    step: float
    lead: int
    accept: bool = False  # the proxy allowed a hand-off (another D routed when it posted the leg)

    def sent(self, now: float) -> int:
        """How many of ``tokens`` the client has at ``now``."""
        steps = math.floor((now - self.started) / self.step) if self.step > 0 else len(self.tokens)
        return min(len(self.tokens), self.lead + steps)


class Desk:
    def __init__(self, node: DecodeWorker) -> None:
        self.node = node
        self.ledger = HandoffLedger()
        self.offers: dict[int, tuple[int, ...]] = {}  # uuid -> tokens: the transfer server's
        self.streams: dict[int, Stream] = {}  # room -> the stream it relays
        self.accepting: set[int] = set()  # rooms whose leg allowed a hand-off
        self.taking: dict[int, Ticket] = {}  # room -> the ticket its pull reads
        self.page_wait: list[int] = []  # rooms whose claim waits for pages, first come first
        self.until: float | None = None  # local time the hand-off window closes (draining)
        self._uuids = itertools.count(1)
        self._pulls: dict[int, int] = {}  # room -> pull id in flight
        self._pull_ids = itertools.count(1)

    # -- streams ----------------------------------------------------------------------------------

    def stream_out(self, room: int, stream: Stream) -> None:
        """``room``'s stream goes out (its leg answered 200): its last token after its steps."""
        node, w = self.node, self.node.world
        stream.accept = room in self.accepting
        self.accepting.discard(room)
        self.streams[room] = stream
        node.relaying.add(room)
        rest = (len(stream.tokens) - stream.lead) * stream.step
        w.at(max(rest, 0.002), f"{node.name} decode of room {room:x}", self._decoded, node.gen,
             room, stream)
        if self.until is not None and node.local() < self.until:
            # Joined the batch while draining: handed off after its first step, as the worker's
            # next tick would.
            w.at(stream.step, f"{node.name} hands room {room:x} off", self._give_late, node.gen,
                 room, stream)

    def _decoded(self, gen: int, room: int, stream: Stream) -> None:
        node = self.node
        if gen != node.gen or self.streams.get(room) is not stream or room not in node.legs:
            return
        del self.streams[room]
        router_gen, client = node.legs.pop(room)
        node.relaying.discard(room)
        node.pool.give(node.held.pop(room), f"room {room:x} finished decoding")
        node.world.proxy.relayed(router_gen, room, client, stream.tokens)
        node.allocate_waiting()

    # -- giving -----------------------------------------------------------------------------------

    def hand_off(self, lease_s: float) -> int:
        """Draining: hand off every stream that may go, and those that join for ``lease_s``;
        how many went now."""
        self.until = self.node.local() + lease_s
        return sum(self._give(room) for room in sorted(self.streams))

    def _give_late(self, gen: int, room: int, stream: Stream) -> None:
        if gen == self.node.gen and self.streams.get(room) is stream:
            self._give(room)

    def _give(self, room: int) -> bool:
        """Register ``room``'s KV and end its stream with a ticket, if it may go."""
        node, w = self.node, self.node.world
        stream = self.streams[room]
        now, until = node.local(), self.until
        n = stream.sent(w.now)
        has = stream.base + stream.tokens[:n]  # what the client has: at least one token
        if (until is None or until - now <= 0 or not stream.accept or room not in node.legs
                or not node.alive or n >= len(stream.tokens) or not has):
            return False
        uuid = next(self._uuids)
        self.offers[uuid] = has
        self.feed(ev.HandoffOffered(uuid, until - now))
        del self.streams[room]
        router_gen, _ = node.legs.pop(room)
        node.relaying.discard(room)
        node.pool.give(node.held.pop(room), f"room {room:x} handed off")
        w.proxy.handed_off(router_gen, room, Ticket(uuid, node.name, node.gen, self.offers[uuid],
                                                    until - now))
        node.allocate_waiting()
        return True

    def release(self, uuid: int) -> None:
        """The proxy's /handoff_release: the taking D answered its leg (or never will)."""
        self.feed(ev.HandoffPulled(uuid))

    def release_offer(self, uuid: int, reason: str) -> None:
        """ReleaseOffer: the registration leaves the transfer server, exactly once."""
        if uuid not in self.offers:
            raise Violation(f"{self.node.name}: hand-off registration {uuid} released twice "
                            f"({reason})")
        del self.offers[uuid]
        # By the ledger's reason (core/handoff.py): its lease's end, or the proxy's word; or
        # the transfer server closing with the role (``close``).
        key = "expired" if "lease" in reason else "closed" if reason == _CLOSED else "released"
        self.node.world.handoffs[key] += 1

    # -- taking -----------------------------------------------------------------------------------

    def take(self, gen: int, room: int, client: Client, ticket: Ticket) -> None:
        """A leg with ``ticket``: reserve the whole sequence's pages and pull the KV; with none
        free (or claims already waiting), wait for them, ahead of the rooms' page queue."""
        node = self.node
        node.legs[room] = (gen, client)
        self.taking[room] = ticket
        pages = None if self.page_wait else node.pool.take(client.pages())
        if pages is None:
            self.page_wait.append(room)
            node.world.handoffs["waited_for_pages"] += 1
            self.feed(ev.HandoffQueued(pull_key(room), ticket.lease_s / 2))
            return
        node.held[room] = pages
        self.feed(ev.HandoffClaimed(pull_key(room)))

    def place_waiting(self) -> bool:
        """Pages for the claims waiting for them, first come first; True when none waits."""
        node = self.node
        while self.page_wait:
            room = self.page_wait[0]
            if self.ledger.state_of(pull_key(room)) != KV_HANDOFF.S.WAITING_FOR_PAGES:
                self.page_wait.pop(0)  # its wait ended, or it was aborted
                continue
            pages = node.pool.take(node.legs[room][1].pages())
            if pages is None:
                return False
            self.page_wait.pop(0)
            node.held[room] = pages
            self.feed(ev.HandoffPagesReserved(pull_key(room)))
        return True

    def _pull(self, key: int) -> None:
        node, w = self.node, self.node.world
        room = room_of(key)
        ticket, client = self.taking[room], node.legs[room][1]
        pull = self._pulls[room] = next(self._pull_ids)
        took = w.config.cost.pull(client.tokens + len(ticket.tokens)) + w.rng.uniform(0.001, 0.005)
        r = w.rng.random() if w.config.faults else 1.0
        if r < HANDOFF_PULL_SLOW:
            took = w.rng.uniform(1.0, 2 * PULL_DEADLINE)  # slow: past most leases, or its deadline
        fails = HANDOFF_PULL_SLOW <= r < HANDOFF_PULL_SLOW + HANDOFF_PULL_FAILS
        w.at(min(took, PULL_DEADLINE), f"{node.name} hand-off pull of room {room:x}",
             self._pulled, node.gen, room, pull, fails or took >= PULL_DEADLINE)

    def _pulled(self, gen: int, room: int, pull: int, fails: bool) -> None:
        node = self.node
        if gen != node.gen or not node.alive or self._pulls.get(room) != pull:
            return
        del self._pulls[room]
        ticket = self.taking[room]
        source = node.world.handoff_source(ticket.source, ticket.gen)
        if fails:
            why = "injected, or past the pull deadline"
        elif source is None:
            # The draining D crashed or restarted, or its role stopped: once its leases ended
            # (or its drain deadline passed), nothing held it.
            why = "source gone"
        elif source.desk.offers.get(ticket.uuid) != ticket.tokens:
            why = "lease over"
        elif not node.world.network.reachable(node.name, ticket.source):
            why = "partitioned"
        else:
            self.feed(ev.PullSucceeded(pull_key(room)))
            return
        node.world.handoffs[f"pull {why}"] += 1
        self.feed(ev.PullFailed(pull_key(room), f"hand-off pull of {ticket.uuid} from "
                                                f"{ticket.source}: {why}"))

    def _enter_decode(self, room: int) -> None:
        """The pulled KV is in the pages: the stream goes on from its next token."""
        node, w = self.node, self.node.world
        ticket = self.taking.pop(room)
        source = w.handoff_source(ticket.source, ticket.gen)
        assert source is not None  # PullSucceeded only from a source that held it this step
        pulled = source.desk.offers[ticket.uuid]
        router_gen, client = node.legs[room]
        w.proxy.leg_answer(router_gen, room, "decode", True, "")
        # The continuation is the model's function of the pulled KV (its first token), from the
        # position after the last token the client has.
        rest = client.expected(pulled[0])[len(pulled):]
        step = w.config.cost.step(len(node.relaying) + 1)
        self.stream_out(room, Stream(router_gen, client, pulled, rest, w.now, step, 0))

    def abort(self, room: int) -> bool:
        """The proxy's abort of a room whose claim waits for pages (finished: it holds none) or
        whose pull runs (finished, its pages kept for the pull)."""
        if self.ledger.state_of(pull_key(room)) not in (KV_HANDOFF.S.WAITING_FOR_PAGES,
                                                        KV_HANDOFF.S.PULLING):
            return False
        self.feed(ev.Aborted(pull_key(room), "aborted by the proxy"))
        return True

    # -- the ledger -------------------------------------------------------------------------------

    def feed(self, event: ev.HandoffEvent) -> None:
        node = self.node
        drive(functools.partial(node.world.handle, node, self.ledger), event, node.local(),
              self._carry_out)
        node.schedule_wake(self.ledger.next_deadline())

    def _carry_out(self, e: fx.HandoffEffect) -> tuple[Any, ...]:
        node = self.node
        match e:
            case fx.ReleaseOffer():
                self.release_offer(e.uuid, e.reason)
            case fx.StartHandoffPull():
                self._pull(e.room)
            case fx.EnterDecode():
                self._enter_decode(room_of(e.room))
            case fx.FailHandoff():
                room = room_of(e.room)
                del self.taking[room]
                held = node.held.pop(room, None)  # none: it waited for pages past its time
                if held is not None:
                    node.pool.give(held, f"hand-off pull of room {room:x} failed")
                node.fail_leg(room, f"hand-off failed: {e.reason}")
                node.allocate_waiting()
            case fx.FinishAborted():
                node.legs.pop(room_of(e.room), None)  # nobody waits; the pages stay held
            case fx.FreeHeldPages():
                room = room_of(e.room)
                del self.taking[room]
                node.pool.give(node.held.pop(room), f"aborted hand-off pull of room {room:x}")
                node.allocate_waiting()
            case fx.FinishUnplaced():
                del self.taking[room_of(e.room)]
                node.legs.pop(room_of(e.room), None)  # nobody waits; it held no pages
            case _:
                assert_never(e)
        return ()

    def close(self, reason: str) -> None:
        """The role stops past its drain deadline: pulls cancelled (each reports failed), the
        transfer server closed (its registrations go with it), no stream left to hand off."""
        for room in sorted(self._pulls):
            del self._pulls[room]
            self.feed(ev.PullFailed(pull_key(room), f"pull cancelled: {reason}"))
        for room in list(self.page_wait):  # their legs fail with the rest (fail_in_flight)
            if self.ledger.state_of(pull_key(room)) == KV_HANDOFF.S.WAITING_FOR_PAGES:
                leg = self.node.legs.get(room)
                self.feed(ev.Aborted(pull_key(room), f"closed: {reason}"))
                if leg is not None:
                    self.node.legs[room] = leg
        self.page_wait.clear()
        for uuid in sorted(self.offers):
            self.release_offer(uuid, _CLOSED)
        self.streams.clear()
        self.until = None

    def leftovers(self) -> list[str]:
        return [f"{len(self.offers)} hand-off registrations"] if self.offers else []

    def check(self, now: float, tolerance: float) -> None:
        """The books agree: the transfer server registers exactly the ledger's offers; every
        pull the ledger runs holds its pages; no offer lives past its lease."""
        ledger = self.ledger
        offered = {k for k in ledger.handoffs if ledger.state_of(k) == KV_HANDOFF.S.OFFERED}
        if offered != set(self.offers):
            raise Violation(f"{self.node.name}: hand-off registrations {sorted(self.offers)}, "
                            f"but the ledger offers {sorted(offered)}")
        pulling = {room_of(k) for k in ledger.handoffs
                   if k < 0 and ledger.state_of(k) != KV_HANDOFF.S.WAITING_FOR_PAGES}
        if not pulling <= set(self.node.held):
            raise Violation(f"{self.node.name}: hand-off pulls {sorted(pulling)} hold no pages")
        deadline = ledger.next_deadline()
        if deadline is not None and now > deadline + tolerance:
            raise Violation(f"{self.node.name}: a hand-off offer lives {now - deadline:.1f} s "
                            "past its lease")
