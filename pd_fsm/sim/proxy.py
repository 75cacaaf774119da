"""The simulated proxy (``pd_fsm.sim``): the core's ``RoomRouter`` on the proxy host's clock, and
what the proxy process does around it, modelled: its HTTP legs to the workers (a millisecond or
two each, refused at once by a dead process), the clients' connections and answers, discovery of
the workers by the role each advertises, and a crash that resets every client connection (a
fresh proxy, a new generation, takes the new ones)."""

from __future__ import annotations

import random
from collections.abc import Collection
from typing import assert_never

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import RouterConfig
from pd_fsm.core.errors import LocalProtocolError
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.routing import Prompt
from pd_fsm.core.tables import ROOM
from pd_fsm.sim.config import DISCOVERY, ROOM_TIMEOUT, TOLERANCE, Violation, bootstrap_addr
from pd_fsm.sim.process import Process
from pd_fsm.sim.workers import Client, Clock, DecodeWorker, Ticket


class Proxy:
    def __init__(self, world: Clock, procs: dict[str, Process]) -> None:
        """``procs``: the worker processes by name (``switch.Processes.procs``), which the legs
        reach and discovery lists."""
        self.world, self.procs = world, procs
        self.gen = 0  # the proxy process's generation: bumped at every crash
        self._shown = self._listed()  # the worker lists the router routes to now
        self.router = self._new_router()
        self.rooms: dict[tuple[int, int], tuple[Client, float]] = {}  # (gen, room) -> client
        self._errors: dict[int, str] = {}  # room -> the router's ReplyError reason
        # ReopenRoom effects by cause, and decode legs redirected within their room.
        self.reopened = {"retry": 0, "migration": 0, "redirect": 0, "handoff": 0}
        self.tickets = Tickets(world, procs)

    def crash(self) -> None:
        """Every client of the old proxy loses its connection; a fresh proxy takes new ones."""
        for (gen, _), (client, _) in sorted(self.rooms.items(), key=lambda kv: kv[0]):
            if gen == self.gen and client.answer is None:
                self.answer(client, 502, "proxy connection reset")
        self.rooms = {k: v for k, v in self.rooms.items() if k[0] != self.gen}
        self.tickets.forget(self.gen)  # their draining Ds' leases release them
        self.gen += 1
        self.router = self._new_router()

    def _new_router(self) -> RoomRouter:
        self._shown = self._listed()
        c = self.world.config
        return RoomRouter(*self._shown, random.Random(self.world.rng.getrandbits(64)),
                          RouterConfig(room_timeout=ROOM_TIMEOUT, decode_recomputes=c.recompute),
                          c.routing)

    # -- clients and rooms --------------------------------------------------------------------

    def request(self, client: Client) -> None:
        """``client``'s request arrives."""
        self._route(ev.RoomRequested(str(client.id), Prompt(client.text, client.tokens),
                                     migratable=True), client)

    def _route(self, event: ev.RouterEvent, client: Client | None = None) -> None:
        """``event`` to the router, its effects carried out, its next deadline scheduled."""
        w, gen = self.world, self.gen
        try:
            effects = self.router.handle(event, w.now + w.skew["proxy"])
        except LocalProtocolError as exc:
            raise Violation(f"router: {exc}") from None
        for e in effects:
            self._carry_out(gen, e, client)
        # A room that ended without relaying D's whole answer: its client gets the error (a
        # JSON error, or an error chunk in a stream whose headers were out).
        for key in [k for k in self.rooms if k[0] == gen]:
            if self.router.poll(key[1]) is None:
                got, _ = self.rooms.pop(key)
                if got.answer is None:
                    self.answer(got, 502, self._errors.pop(key[1], "relay broke off"))
        self.tickets.prune(gen, self.router.rooms)
        deadline = self.router.next_deadline()
        if deadline is not None:
            w.at_time(deadline - w.skew["proxy"] + 1e-6, "proxy timers", self._wake, self.gen)

    def _carry_out(self, gen: int, e: fx.RouterEffect, client: Client | None) -> None:
        w = self.world
        self.tickets.answered(gen, e)  # a hand-off room's leg answered: its registration may go
        match e:
            case fx.DispatchRoom() | fx.DispatchLocal():
                assert client is not None
                self.rooms[(gen, e.room)] = (client, w.now)
                p = e.prefill if isinstance(e, fx.DispatchRoom) else None
                if p is not None:
                    w.at(w.rng.uniform(0.001, 0.003), f"P leg of room {e.room:x}",
                         self._post_leg, "prefill", p, gen, e.room, client, bootstrap_addr(p))
                w.at(w.rng.uniform(0.001, 0.003), f"D leg of room {e.room:x}", self._post_leg,
                     "decode", e.decode, gen, e.room, client,
                     None if p is None else bootstrap_addr(p), self.tickets.dispatched(gen, e))
            case fx.RelayDecode() | fx.BreakerChanged():
                pass  # the relay ends with the decode worker's answer (relayed)
            case fx.AbortLeg():
                w.at(0.002, f"abort {e.leg} leg of room {e.room:x}", self._abort_leg, e.leg,
                     e.url, e.room)
            case fx.ShedRequest():
                assert client is not None
                self.answer(client, 429, f"every {e.role} worker is full")
            case fx.NoWorkers():
                assert client is not None
                self.answer(client, 503, e.reason)
            case fx.ReplyError():
                self._errors[e.room] = e.reason
            case fx.RedirectDecode():
                # A PD room's leg goes again to P's KV; a hand-off room's with its ticket.
                got, _ = self.rooms[(gen, e.room)]
                self.reopened["redirect"] += 1
                w.at(w.rng.uniform(0.001, 0.003), f"D leg of room {e.room:x} again",
                     self._post_leg, "decode", e.decode, gen, e.room, got,
                     bootstrap_addr(e.prefill) if e.prefill else None,
                     self.tickets.posted(gen, e.room))
            case fx.ReopenRoom():
                # The request goes on in a new room: its client is not answered now. A model
                # answer is whole, so a migrated room relays all of it again.
                got, _ = self.rooms.pop((gen, e.room))
                self.reopened[e.cause] += 1
                got.sent = self.tickets.reopened(gen, e)
                got.handed_off = got.handed_off or bool(got.sent)
                w.at(max(e.delay, 0.001), f"reopen {e.cause} of room {e.room:x}", self._reopen,
                     gen, e, got)
            case _:
                assert_never(e)

    def _reopen(self, gen: int, e: fx.ReopenRoom, client: Client) -> None:
        if gen != self.gen:
            # The proxy restarted during the backoff: this client's connection went with it.
            self.answer(client, 502, "proxy connection reset")
            return
        prompt = Prompt(client.text, client.tokens)
        self._route(ev.RoomRequested(e.request_id, prompt, e.attempts, migratable=True,
                                     handoff=e.cause == "handoff"), client)

    def _wake(self, gen: int) -> None:
        if gen == self.gen:
            self._route(ev.TimeAdvanced())

    def relayed(self, gen: int, room: int, client: Client, tokens: tuple[int, ...]) -> None:
        """D's whole answer reached the proxy, which relays it (after what the client has from
        the D that handed the stream off, if one did)."""
        self.tickets.check_answer(gen, room)
        if gen != self.gen or (gen, room) not in self.rooms:
            return
        if self.router.poll(room) not in (ROOM.S.RELAYING, ROOM.S.LOCAL_RELAYING):
            return  # the room already failed (its client got that error)
        del self.rooms[(gen, room)]
        client.done_at = self.world.now
        self.answer(client, 200, client.sent + tokens)
        self._route(ev.RelayFinished(room))

    def handed_off(self, gen: int, room: int, ticket: Ticket) -> None:
        """A draining D ended ``room``'s stream with ``ticket`` (not relayed): the proxy keeps
        it, and the router reopens the request on another D alone (ReopenRoom, cause handoff),
        or fails it."""
        def heard() -> None:
            # In the leg's order: a stream's start the D sent just before it handed the stream
            # off (both 1 ms away) is no answer after the hand-off.
            self.tickets.handed(gen, room, ticket)
            self._leg_answered(gen, room, "decode", False, "handed off", False, False, True)

        self.world.at(0.001, f"decode leg of room {room:x} hands off", heard)

    def answer(self, client: Client, status: int, body: tuple[int, ...] | str) -> None:
        """``client`` gets its answer: once, and a 200 with the right tokens."""
        if client.answer is not None:
            raise Violation(f"client {client.id} answered twice: {client.answer} then "
                            f"{(status, body)}")
        if status == 200 and body != client.expected():
            raise Violation(f"client {client.id} got {body}, expected {client.expected()}")
        client.answer = (status, body)
        if client.handed_off and status != 200:
            client.lost = why_lost(self.procs, self._shown, status, str(body))
        self.world.trace_line(f"client {client.id} answered {status}")

    def disconnect_a_client_of(self, name: str, rng: random.Random) -> bool:
        """A client whose room has a leg on ``name`` goes away (the switch's fault, switch.py):
        the proxy's ClientDisconnected aborts the room's legs; the client wants no answer
        (counted as 499). False if ``name`` has no such room now."""
        rooms = self.router.rooms
        mine = [(room, client) for (gen, room), (client, _) in sorted(self.rooms.items())
                if gen == self.gen and client.answer is None and room in rooms
                and name in (rooms[room].prefill, rooms[room].decode)]
        if not mine:
            return False
        room, client = rng.choice(mine)
        self.answer(client, 499, "client disconnected")
        del self.rooms[(self.gen, room)]
        self._route(ev.ClientDisconnected(room))
        return True

    # -- legs ---------------------------------------------------------------------------------

    def _post_leg(self, leg: str, name: str, gen: int, room: int, client: Client,
                  bootstrap: str | None, ticket: Ticket | None = None) -> None:
        """The proxy's ``leg`` reaches worker ``name`` (HTTP POST): a process that is down
        refuses the connection, one switching its role answers 503 (RefuseLegs), one that
        serves the other role now answers 409 (a stale role); else its node takes the leg. A
        modelled D's leg may end in a hand-off if another D is routed now (``accept_handoff``),
        and a hand-off room's carries the ticket."""
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
        elif isinstance(node, DecodeWorker):
            node.leg(gen, room, client, bootstrap, any(d != name for d in self._shown[1]),
                     ticket)
        else:
            assert ticket is None, "a hand-off leg reached a worker that pulls no hand-off"
            node.leg(gen, room, client, bootstrap)

    def leg_answer(self, gen: int, room: int, leg: str, ok: bool, reason: str,
                   refused: bool = False, lost: bool = False) -> None:
        """A worker answered a leg (or its connection broke, or it refused the connection: a
        dead worker's port): the proxy hears it next."""
        self.world.at(0.001, f"{leg} leg of room {room:x} answers {'ok' if ok else reason}",
                      self._leg_answered, gen, room, leg, ok, reason, refused, lost)

    def _leg_answered(self, gen: int, room: int, leg: str, ok: bool, reason: str,
                      refused: bool, lost: bool, handoff: bool = False) -> None:
        if leg == "decode" and not handoff:
            self.tickets.check_answer(gen, room)
        if gen == self.gen:
            self._route(ev.LegResponded(room, leg, ok, reason, refused, refused, lost, handoff))

    def _abort_leg(self, leg: str, name: str, room: int) -> None:
        """The proxy's /abort_request reaches ``name``: its node aborts the room if it has it."""
        proc = self.procs[name]
        if proc.node.role == leg:
            if proc.races is not None:
                proc.races.add("abort")
            proc.node.abort(room)

    # -- discovery ----------------------------------------------------------------------------

    def _listed(self) -> tuple[list[str], list[str]]:
        """The workers as a discovering proxy would list them: by the role each advertises."""
        procs = self.procs.values()
        return ([p.name for p in procs if p.listed == "prefill"],
                [p.name for p in procs if p.listed == "decode"])

    def show_workers(self, rng: random.Random) -> None:
        """A worker left or joined a role: the proxy sees it within one discovery interval
        (``rng``: the role switches' own stream, switch.py)."""
        self.world.at(rng.uniform(0.05, DISCOVERY), "proxy discovers its workers",
                      self._discover, self.gen)

    def _discover(self, gen: int) -> None:
        listed = self._listed()
        if gen == self.gen and listed != self._shown:
            self._shown = listed
            self.router.set_workers(*listed)

    # -- invariants ---------------------------------------------------------------------------

    def check(self, drained: bool = False) -> None:
        """No room of the proxy lives past the router's room timeout; once ``drained``, none
        lives at all."""
        if drained:
            if any(gen == self.gen for gen, _ in self.rooms) or self.router.rooms:
                raise Violation(f"proxy rooms live after the drain: {len(self.router.rooms)}")
            return
        now = self.world.now
        for (gen, room), (_, since) in self.rooms.items():
            if gen == self.gen and now - since > ROOM_TIMEOUT + TOLERANCE:
                raise Violation(f"proxy: room {room:x} live {now - since:.1f} s")


def why_lost(procs: dict[str, Process], shown: tuple[list[str], list[str]], status: int,
             body: str) -> str:
    """Why a handed-off client got ``status``, not a 200 (the hand-off allows one only when every
    worker of a role was down or draining at once): the client left, the proxy restarted, none
    of the Ds (or Ps, for a re-prefill) the proxy routes to now (``shown``: P's, D's) up and
    taking legs (one that joined the role within the discovery interval is not routed to yet),
    or each role had one and the request's last leg was refused (its retries and redirects
    spent) or its last room failed (a re-prefill's PD fault: a failed or partitioned transfer,
    as any PD request meets it)."""
    if status == 499 or body == "proxy connection reset":
        return "client left" if status == 499 else "proxy restart"
    for role, names in (("decode", shown[1]), ("prefill", shown[0])):
        if not any(p.switch is not None and p.node.alive and p.node.role == role
                   and not p.refusing for p in (procs[name] for name in names)):
            return f"no {role} up"
    refused = status == 503 or "refused" in body or body[:4] in ("503 ", "409 ")
    return "both up, refused" if refused else "both up, failed"


class Tickets:
    """The proxy's hand-off tickets (``io_trio/proxy``: ``Progress.ticket`` and
    ``Room.ticket``): a ticket a draining D ended a stream with is kept, never relayed, and
    goes with the request's next room (ReopenRoom, cause handoff) to the D that pulls it. When
    that room's leg answers (its 2xx comes after the pull), fails, or falls back to a
    migration, the draining D is told it may release the registration (/handoff_release); a
    room that ends otherwise (its client left, the proxy restarted) leaves it to the lease."""

    def __init__(self, world: Clock, procs: dict[str, Process]) -> None:
        self.world, self.procs = world, procs
        self._handed: dict[tuple[int, int], Ticket] = {}  # (gen, room) its D handed off
        self._pending: dict[str, Ticket] = {}  # request id -> ticket, until its next room
        self._posted: dict[tuple[int, int], Ticket] = {}  # (gen, hand-off room) -> its ticket
        self._ended: set[tuple[int, int]] = set()  # rooms whose D handed their stream off

    def handed(self, gen: int, room: int, ticket: Ticket) -> None:
        self.world.handoffs["handed_off"] += 1
        self._handed[(gen, room)] = ticket
        self._ended.add((gen, room))

    def reopened(self, gen: int, e: fx.ReopenRoom) -> tuple[int, ...]:
        """What the client has when its request goes on in a new room: a handed-off stream's
        tokens so far; otherwise none (a model answer is whole, so a migrated or retried room
        relays all of it again)."""
        ticket = self._handed.pop((gen, e.room), None)
        if e.cause != "handoff" or ticket is None:
            return ()
        self._pending[e.request_id] = ticket
        return ticket.tokens

    def dispatched(self, gen: int, e: fx.DispatchRoom | fx.DispatchLocal) -> Ticket | None:
        """The ticket a new room's D leg carries (a hand-off room's), if any."""
        if not isinstance(e, fx.DispatchLocal) or e.reason != "handoff":
            return None
        ticket = self._pending.pop(e.request_id)
        self._posted[(gen, e.room)] = ticket
        return ticket

    def posted(self, gen: int, room: int) -> Ticket | None:
        """The ticket a hand-off room's leg carries (None for another room): a redirected leg
        carries it again."""
        return self._posted.get((gen, room))

    def answered(self, gen: int, e: fx.RouterEffect) -> None:
        """A hand-off room's leg answered: the KV was pulled (RelayDecode), or will not be (its
        fallback to a re-prefill, or its error): the draining D may drop the registration."""
        outcomes = {fx.RelayDecode: "taken", fx.ReopenRoom: "fell_back", fx.ReplyError: "failed"}
        outcome = outcomes.get(type(e))
        ticket = self._posted.pop((gen, getattr(e, "room", -1)), None) if outcome else None
        if outcome is None or ticket is None:
            return
        self.world.handoffs[outcome] += 1
        self.world.at(0.002, f"hand-off release {ticket.uuid} to {ticket.source}", self._release,
                      ticket)

    def _release(self, ticket: Ticket) -> None:
        node = self.procs[ticket.source].node
        if isinstance(node, DecodeWorker) and node.alive and node.gen == ticket.gen:
            node.desk.release(ticket.uuid)

    def prune(self, gen: int, live: Collection[int]) -> None:
        """Rooms that ended without their leg answering (cancelled, timed out unanswered)."""
        for key in [k for k in self._posted if k[0] == gen and k[1] not in live]:
            del self._posted[key]
        for key in [k for k in self._handed if k[0] == gen and k[1] not in live]:
            del self._handed[key]

    def forget(self, gen: int) -> None:
        """The proxy restarted: its tickets went with it."""
        self._posted = {k: t for k, t in self._posted.items() if k[0] != gen}
        self._handed = {k: t for k, t in self._handed.items() if k[0] != gen}
        self._pending.clear()

    def check_answer(self, gen: int, room: int) -> None:
        """A stream its D handed off gets no answer from that D: neither tokens nor a failure."""
        if (gen, room) in self._ended:
            raise Violation(f"proxy: room {room:x} was handed off, then its D answered it")
