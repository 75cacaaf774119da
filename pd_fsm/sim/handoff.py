"""Live KV hand-off between the simulated decode workers (issue 32 §2, ``pd_fsm.sim``).

A modelled D's streams and its hand-offs, both sides, as the real worker runs them
(``io_trio/worker/decode_role.py``, ``schedulers/disaggregation/decode_handoff.py``): each D has a
:class:`Desk` whose lifecycle of every hand-off is the core's ``HandoffLedger`` (table
kv_handoff), fed through the core's one driver.

Giving (a draining D, ``Desk.hand_off``, started by a role switch leaving decode when another D is
listed, ``switch.py``): each stream it relays whose leg allowed it (``accept_handoff``: the proxy
routed another D when it posted the leg) and that has a token left to decode is registered on the
D's transfer server (``offers``: the tokens whose KV it holds, the last one the next input),
offered for the lease (``HandoffOffered``), its pages go back at once (the gathered KV is a buffer
of its own) and its leg ends with a hand-off ticket (``ProxyView.handed_off``), not an answer.
Streams that join the batch while the window is open are handed off after their first step. The
registration is released exactly once: when the proxy says the taking D answered
(``HandoffPulled``), when its lease ends (``LeaseExpired``), or with the process (a crash, or the
role stopped past the drain deadline: the transfer server closes).

Taking (``Desk.take``, a leg that carries a ticket): the pages of the whole sequence are reserved,
the pull starts (``HandoffClaimed`` -> ``StartHandoffPull``, keyed by the negative pull number
``pull_key``). The pull succeeds only if the draining D's process of that generation is up, still
registers the ticket's uuid (its lease not over) and is reachable; it can fail by injection, as
PD pulls do. Then the stream goes on from the pulled KV (``EnterDecode``: the continuation is a
function of the pulled tokens, so KV from anything else gives a wrong answer), or the leg fails
(``FailHandoff``: the proxy falls back to a migration, a re-prefill). An aborted request keeps its
pages until its pull reports (``FinishAborted``, ``FreeHeldPages``).
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import TYPE_CHECKING, Any, assert_never

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import drive
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.tables import KV_HANDOFF
from pd_fsm.sim.config import HANDOFF_PULL_FAILS, HANDOFF_PULL_SLOW, PULL_DEADLINE, Violation

if TYPE_CHECKING:  # the workers build their desk: importing them here would close a circle
    from pd_fsm.sim.workers import Client, DecodeWorker


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
        w.proxy.handed_off(router_gen, room, Ticket(uuid, node.name, node.gen, self.offers[uuid]))
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
        """A leg with ``ticket``: reserve the whole sequence's pages and pull the KV."""
        node = self.node
        node.legs[room] = (gen, client)
        pages = node.pool.take(client.pages())
        if pages is None:
            node.fail_leg(room, "no free pages for a hand-off")
            return
        node.held[room] = pages
        self.taking[room] = ticket
        self.feed(ev.HandoffClaimed(pull_key(room)))

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
        """The proxy's abort of a room whose pull runs: finished, its pages kept for the pull."""
        if self.ledger.state_of(pull_key(room)) != KV_HANDOFF.S.PULLING:
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
                node.pool.give(node.held.pop(room), f"hand-off pull of room {room:x} failed")
                node.fail_leg(room, f"hand-off failed: {e.reason}")
                node.allocate_waiting()
            case fx.FinishAborted():
                node.legs.pop(room_of(e.room), None)  # nobody waits; the pages stay held
            case fx.FreeHeldPages():
                room = room_of(e.room)
                del self.taking[room]
                node.pool.give(node.held.pop(room), f"aborted hand-off pull of room {room:x}")
                node.allocate_waiting()
            case _:
                assert_never(e)
        return ()

    def close(self, reason: str) -> None:
        """The role stops past its drain deadline: pulls cancelled (each reports failed), the
        transfer server closed (its registrations go with it), no stream left to hand off."""
        for room in sorted(self._pulls):
            del self._pulls[room]
            self.feed(ev.PullFailed(pull_key(room), f"pull cancelled: {reason}"))
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
        pulling = {room_of(k) for k in ledger.handoffs if k < 0}
        if not pulling <= set(self.node.held):
            raise Violation(f"{self.node.name}: hand-off pulls {sorted(pulling)} hold no pages")
        deadline = ledger.next_deadline()
        if deadline is not None and now > deadline + tolerance:
            raise Violation(f"{self.node.name}: a hand-off offer lives {now - deadline:.1f} s "
                            "past its lease")
