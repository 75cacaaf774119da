"""One P and one or two D endpoints over a hostile simulated network (hypothesis stateful test).

The network drops, duplicates, delays and reorders messages (frames go through the real codec);
either side can crash and come back empty; the clock jumps. The simulated schedulers own the
pages and the transfer server's registrations, and check the core's effects against them:

- every room reaches a terminal state by its deadline (no live room is ever past it, and after
  quiescing every room on every side is terminal);
- every page reserved for a room is released exactly once (a second release fails at once; after
  quiescing, free == total everywhere and the transfer server holds nothing);
- KVPoll never moves backwards and never leaves a terminal state;
- a lease expiry is never earlier than the latest expiry a heartbeat granted;
- Success on D implies P released the room's KV (by the end), and D's first token is P's.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pd_fsm.core import codec
from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.messages import Heartbeat
from pd_fsm.core.prefill_endpoint import PrefillEndpoint

LAYOUT = "L1"
P_ADDR = "tcp://p0"
BOOT = "127.0.0.1:8998"
SECRET = b"cluster-secret"
LEASE = LeaseConfig(initial=30.0, extension=20.0)
DCFG = DecodeConfig(
    heartbeat_interval=5.0,
    peer_timeout=15.0,
    resolve_timeout=10.0,
    queue_timeout=60.0,
    ready_timeout=60.0,
    transfer_timeout=30.0,
)
_ORDER = {KVPoll.Bootstrapping: 1, KVPoll.WaitingForInput: 2, KVPoll.Transferring: 3}
# The pull executor's contract (pd_fsm.jax_engine.pull_executor): every pull reports by this long
# after its submit, strictly within the core's transfer_timeout (DisaggregationArgs checks it). The
# core's CANCELLING backstop relies on it; a simulated pull still pending at its deadline fails.
PULL_DEADLINE = 20.0
assert DCFG.transfer_timeout > PULL_DEADLINE


class PDNetwork(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.rng = random.Random(0)
        self.p = self._new_p()
        self.ds: list[DecodeEndpoint] = []
        self.net: list[tuple[str, str, bytes]] = []  # (src, dst, frame)
        self.next_room = 1
        self.rooms: list[int] = []  # every room ever requested
        self.first_token: dict[int, int] = {}
        # P's simulated scheduler and transfer server
        self.p_pages: dict[int, int] = {}  # room -> pages held
        self.p_registered: dict[int, int] = {}  # uuid -> room
        self.p_released: set[int] = set()  # rooms whose KV P released (ever, this incarnation)
        self.p_pending_prefill: set[int] = set()
        self.granted: dict[int, float] = {}  # room -> latest expiry a heartbeat granted
        self.lease_seen: dict[int, float] = {}  # room -> lease expiry at the last check
        # D's simulated schedulers
        self.d_pages: list[dict[int, int]] = []
        self.d_waiting_alloc: list[dict[int, int]] = []
        self.d_pulls: list[dict[int, int]] = []  # room -> uuid
        self.d_pull_deadline: list[dict[int, float]] = []  # room -> when the executor reports
        self.d_resolving: list[set[str]] = []
        self.d_success: list[set[int]] = []
        self.polls: dict[tuple[str, int], KVPoll] = {}

    # -- plumbing -----------------------------------------------------------------------------

    def _new_p(self) -> PrefillEndpoint:
        return PrefillEndpoint(LAYOUT, random.Random(self.rng.getrandbits(32)), LEASE)

    def _d_name(self, i: int) -> str:
        return f"d{i}"

    def _send(self, src: str, dst: str, message: Any) -> None:
        self.net.append((src, dst, codec.encode(message, SECRET)))

    def _p_handle(self, event: Any) -> None:
        if isinstance(event, ev.MessageReceived) and isinstance(event.message, Heartbeat):
            for room in event.message.rooms:
                if self.p.lease_expiry(room) is not None:
                    self.granted[room] = max(
                        self.granted.get(room, 0.0), self.now + LEASE.extension
                    )
        for e in self.p.handle(event, self.now):
            if isinstance(e, fx.SendMessage):
                self._send(P_ADDR, e.peer, e.message)
            elif isinstance(e, fx.RegisterKV):
                assert e.room in self.p_pages, "registered KV of a room without pages"
                self.p_registered[e.uuid] = e.room
            elif isinstance(e, fx.ReleaseKV):
                assert e.room not in self.p_released, f"room {e.room}: P released KV twice"
                assert e.room in self.p_pages, f"room {e.room}: release of pages never held"
                del self.p_pages[e.room]
                self.p_released.add(e.room)
                if e.uuid is not None:
                    self.p_registered.pop(e.uuid, None)
                self.p_pending_prefill.discard(e.room)
            elif isinstance(e, fx.FailRequest | fx.CompleteRequest):
                self.p_pending_prefill.discard(e.room)
            elif isinstance(e, fx.RejectRequest):
                pass
            else:
                raise AssertionError(f"unexpected P effect {e}")

    def _d_handle(self, i: int, event: Any) -> None:
        for e in self.ds[i].handle(event, self.now):
            if isinstance(e, fx.SendMessage):
                self._send(self._d_name(i), e.peer, e.message)
            elif isinstance(e, fx.ResolvePeer):
                self.d_resolving[i].add(e.bootstrap_addr)
            elif isinstance(e, fx.AllocateBlocks):
                self.d_waiting_alloc[i][e.room] = e.n_pages
            elif isinstance(e, fx.CancelAllocation):
                assert self.d_waiting_alloc[i].pop(e.room, None) is not None
            elif isinstance(e, fx.StartPull):
                assert e.room in self.d_pages[i]
                self.d_pulls[i][e.room] = e.uuid
                self.d_pull_deadline[i][e.room] = self.now + PULL_DEADLINE
            elif isinstance(e, fx.ReleaseBlocks):
                assert e.room in self.d_pages[i], f"room {e.room}: D released pages twice"
                assert e.room not in self.d_pulls[i], "pages freed while a pull may write them"
                del self.d_pages[i][e.room]
            elif isinstance(e, fx.CompleteTransfer):
                assert e.room not in self.d_pulls[i]
                assert e.first_token == self.first_token[e.room], "D decodes from the wrong KV"
                del self.d_pages[i][e.room]  # the request decodes and finishes
                self.d_success[i].add(e.room)
            elif isinstance(e, fx.FailRequest | fx.RejectRequest):
                pass
            elif isinstance(e, fx.ForgetPeer):
                # Only a P that no live room still talks to may be forgotten. A CANCELLING room
                # sends P nothing more; its in-flight pull holds its own transfer connection.
                d = self.ds[i]
                assert all(
                    d.rooms[r].peer != e.peer or d.state_of(r) == "CANCELLING" for r in d.rooms
                ), "forgot a needed P"
            else:
                raise AssertionError(f"unexpected D effect {e}")

    def _tick_all(self) -> None:
        self._p_handle(ev.TimeAdvanced())
        for i in range(len(self.ds)):
            self._d_handle(i, ev.TimeAdvanced())

    # -- rules --------------------------------------------------------------------------------

    @initialize(n=st.integers(1, 2))
    def start(self, n: int) -> None:
        for i in range(n):
            self.ds.append(DecodeEndpoint(self._d_name(i), LAYOUT, DCFG))
            self.d_pages.append({})
            self.d_waiting_alloc.append({})
            self.d_pulls.append({})
            self.d_pull_deadline.append({})
            self.d_resolving.append(set())
            self.d_success.append(set())

    @rule(d=st.integers(0, 1), pages=st.integers(1, 4), p_first=st.booleans())
    def new_request(self, d: int, pages: int, p_first: bool) -> None:
        """The router posts both legs; either may arrive first."""
        d %= len(self.ds)
        room = self.next_room
        self.next_room += 1
        self.rooms.append(room)
        self.first_token[room] = room % 1000
        legs = [
            self._p_leg(room, pages),
            lambda: self._d_handle(d, ev.DecodeRequestAccepted(room, BOOT, pages)),
        ]
        if not p_first:
            legs.reverse()
        for leg in legs:
            leg()

    def _p_leg(self, room: int, pages: int):
        def accept() -> None:
            self.p_pages[room] = pages
            self.p_pending_prefill.add(room)
            self._p_handle(ev.PrefillRequestAccepted(room))
            if self.p.state_of(room) is None and room not in self.p_released:
                del self.p_pages[room]  # rejected: the scheduler never kept it

        return accept

    @precondition(lambda self: bool(self.p_pending_prefill))
    @rule(data=st.data(), ok=st.booleans())
    def p_prefill(self, data: st.DataObject, ok: bool) -> None:
        room = data.draw(st.sampled_from(sorted(self.p_pending_prefill)))
        self.p_pending_prefill.discard(room)
        if self.p.state_of(room) is None:
            return
        if ok:
            self._p_handle(ev.PrefillFinished(room, self.first_token[room], self.p_pages[room]))
        else:
            self._p_handle(ev.PrefillFailed(room, "forward failed"))

    @precondition(lambda self: any(self.d_resolving))
    @rule(data=st.data(), ok=st.booleans())
    def d_resolve(self, data: st.DataObject, ok: bool) -> None:
        i = data.draw(st.sampled_from([i for i, r in enumerate(self.d_resolving) if r]))
        addr = self.d_resolving[i].pop()
        if ok:
            self._d_handle(i, ev.PeerResolved(addr, P_ADDR, "tcp://p0-transfer", LAYOUT))
        else:
            self._d_handle(i, ev.PeerResolutionFailed(addr, "not registered"))

    @precondition(lambda self: any(self.d_waiting_alloc))
    @rule(data=st.data())
    def d_allocate(self, data: st.DataObject) -> None:
        i = data.draw(st.sampled_from([i for i, w in enumerate(self.d_waiting_alloc) if w]))
        room = data.draw(st.sampled_from(sorted(self.d_waiting_alloc[i])))
        self.d_pages[i][room] = self.d_waiting_alloc[i].pop(room)
        self._d_handle(i, ev.BlocksAllocated(room))

    @precondition(lambda self: any(self.d_pulls))
    @rule(data=st.data(), network_ok=st.booleans())
    def d_pull_finishes(self, data: st.DataObject, network_ok: bool) -> None:
        i = data.draw(st.sampled_from([i for i, p in enumerate(self.d_pulls) if p]))
        room = data.draw(st.sampled_from(sorted(self.d_pulls[i])))
        uuid = self._pop_pull(i, room)
        # One-shot registration, as jax.experimental.transfer: a pull consumes it.
        if network_ok and self.p_registered.get(uuid) == room:
            del self.p_registered[uuid]
            self._d_handle(i, ev.PullSucceeded(room))
        else:
            self._d_handle(i, ev.PullFailed(room, "connection closed"))

    @precondition(lambda self: bool(self.net))
    @rule(data=st.data(), action=st.sampled_from(["deliver", "deliver", "deliver", "drop", "dup"]))
    def network(self, data: st.DataObject, action: str) -> None:
        idx = data.draw(st.integers(0, len(self.net) - 1))  # any message: reordering
        src, dst, frame = self.net[idx]
        if action == "dup":
            self.net.append((src, dst, frame))
            return
        del self.net[idx]
        if action == "deliver":
            self._deliver(src, dst, frame)

    @rule()
    def progress(self) -> None:
        """Everything pending goes well once: messages in order, lookups, pages, prefills, pulls."""
        net, self.net = self.net, []
        for src, dst, frame in net:
            self._deliver(src, dst, frame)
        for i in range(len(self.ds)):
            while self.d_resolving[i]:
                self._d_handle(i, ev.PeerResolved(self.d_resolving[i].pop(), P_ADDR, "t", LAYOUT))
            for room in sorted(self.d_waiting_alloc[i]):
                if room in self.d_waiting_alloc[i]:
                    self.d_pages[i][room] = self.d_waiting_alloc[i].pop(room)
                    self._d_handle(i, ev.BlocksAllocated(room))
        for room in sorted(self.p_pending_prefill):
            if room in self.p_pending_prefill and self.p.state_of(room) is not None:
                self.p_pending_prefill.discard(room)
                self._p_handle(ev.PrefillFinished(room, self.first_token[room], self.p_pages[room]))
        self._finish_pulls()

    def _finish_pulls(self) -> None:
        for i in range(len(self.ds)):
            for room in sorted(self.d_pulls[i]):
                uuid = self._pop_pull(i, room)
                ok = self.p_registered.get(uuid) == room
                if ok:  # one-shot registration, as jax.experimental.transfer: a pull consumes it
                    del self.p_registered[uuid]
                self._d_handle(i, ev.PullSucceeded(room) if ok else ev.PullFailed(room, "gone"))

    def _pop_pull(self, i: int, room: int) -> int:
        del self.d_pull_deadline[i][room]
        return self.d_pulls[i].pop(room)

    def _deliver(self, src: str, dst: str, frame: bytes) -> None:
        message = codec.decode(frame, SECRET)
        if dst == P_ADDR:
            self._p_handle(ev.MessageReceived(src, message))
        elif int(dst[1:]) < len(self.ds):
            self._d_handle(int(dst[1:]), ev.MessageReceived(src, message))

    @rule(dt=st.one_of(st.sampled_from([0.5, 2.5, 5.0, 6.0, 16.0]), st.floats(0.1, 40.0)))
    def clock(self, dt: float) -> None:
        target = self.now + dt
        while True:  # pulls the executor gives up on in the meantime report at their deadline
            due = [
                (t, i, room)
                for i, pulls in enumerate(self.d_pull_deadline)
                for room, t in pulls.items()
                if t <= target
            ]
            if not due:
                break
            t, i, room = min(due)
            self.now = max(self.now, t)
            self._pop_pull(i, room)
            self._d_handle(i, ev.PullFailed(room, "not ready by the pull deadline"))
        self.now = target
        self._tick_all()

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        if not self.rooms:
            return
        room = data.draw(st.sampled_from(self.rooms))
        if data.draw(st.booleans()):
            self._p_handle(ev.Aborted(room, "client gone"))
        else:
            for i in range(len(self.ds)):
                self._d_handle(i, ev.Aborted(room, "client gone"))

    @rule()
    def crash_p(self) -> None:
        """P dies and restarts empty: its pages and registrations vanish with the process."""
        self.p = self._new_p()
        self.p_pages.clear()
        self.p_registered.clear()
        self.p_released.clear()
        self.p_pending_prefill.clear()
        self.granted.clear()
        self.lease_seen.clear()
        self.net = [m for m in self.net if m[1] != P_ADDR]
        self.polls = {k: v for k, v in self.polls.items() if k[0] != "p"}

    @rule(i=st.integers(0, 1))
    def crash_d(self, i: int) -> None:
        i %= len(self.ds)
        self.ds[i] = DecodeEndpoint(self._d_name(i), LAYOUT, DCFG)
        self.d_pages[i].clear()
        self.d_waiting_alloc[i].clear()
        self.d_pulls[i].clear()
        self.d_pull_deadline[i].clear()
        self.d_resolving[i].clear()
        self.net = [m for m in self.net if m[1] != self._d_name(i)]
        self.polls = {k: v for k, v in self.polls.items() if k[0] != f"d{i}"}

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def no_room_past_its_deadline(self) -> None:
        for room in self.p.rooms:
            expiry = self.p.lease_expiry(room)
            assert expiry is not None and expiry > self.now
        for d in self.ds:
            for room in d.rooms:
                deadline = d.room_deadline(room)
                assert deadline is not None and deadline > self.now

    @invariant()
    def lease_never_shorter_than_granted(self) -> None:
        for room, granted in self.granted.items():
            expiry = self.p.lease_expiry(room)
            if expiry is not None:
                assert expiry >= granted
        # ... and never moves earlier at all (the initial window counts as granted too).
        for room in self.p.rooms:
            expiry = self.p.lease_expiry(room)
            assert expiry is not None
            assert expiry >= self.lease_seen.get(room, expiry), f"room {room}: lease shortened"
            self.lease_seen[room] = expiry

    @invariant()
    def kvpoll_monotonic(self) -> None:
        sides = [("p", self.p)] + [(f"d{i}", d) for i, d in enumerate(self.ds)]
        for name, ep in sides:
            for room in self.rooms:
                poll = ep.poll(room)
                key = (name, room)
                prev = self.polls.get(key)
                if poll is None:
                    continue
                if prev is not None:
                    if prev.is_terminal:
                        assert poll == prev, f"{key} left terminal {prev.name} for {poll.name}"
                    elif not poll.is_terminal:
                        assert _ORDER[poll] >= _ORDER[prev], f"{key} {prev.name} -> {poll.name}"
                self.polls[key] = poll

    @invariant()
    def accounting_consistent(self) -> None:
        assert set(self.p_registered.values()) <= set(self.p_pages)
        for i, d in enumerate(self.ds):
            assert set(self.d_pulls[i]) <= set(self.d_pages[i])
            live_with_pages = {
                r
                for r in d.rooms
                if d.state_of(r) in ("WAITING_FOR_READY", "TRANSFERRING", "CANCELLING")
            }
            assert set(self.d_pages[i]) == live_with_pages

    def teardown(self) -> None:
        """Quiesce: finish what is pending, let every deadline pass, then check the books."""
        for _ in range(60):
            while self.net:
                self._deliver(*self.net.pop(0))
            self._finish_pulls()
            for i in range(len(self.ds)):
                while self.d_resolving[i]:
                    self._d_handle(
                        i, ev.PeerResolved(self.d_resolving[i].pop(), P_ADDR, "t", LAYOUT)
                    )
            self.now += 7.0
            self._tick_all()
        assert not self.p.rooms, (
            f"P rooms never finished: {dict((r, self.p.state_of(r)) for r in self.p.rooms)}"
        )
        assert not self.p_pages, f"P pages leaked: {self.p_pages}"
        assert not self.p_registered, "transfer-server registrations leaked"
        for i, d in enumerate(self.ds):
            assert not d.rooms, f"D{i} rooms never finished"
            assert not self.d_pages[i], f"D{i} pages leaked: {self.d_pages[i]}"
            for room in self.d_success[i]:
                # P released (DONE or lease expiry), unless P crashed and took the KV with it.
                assert room in self.p_released or self.p.poll(room) is None


PDNetwork.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestPDNetwork = PDNetwork.TestCase
