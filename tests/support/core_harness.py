"""Drive one room of a Prefill/Decode endpoint by table trigger name.

The exhaustive and reference tests speak the tables' language (trigger names); this module turns
each trigger into the concrete event(s) the endpoint takes, and finds a path of triggers from the
initial state to any state using the table itself.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.config import DecodeConfig, LeaseConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.messages import Abort, Done, Heartbeat, HeartbeatAck, KVPart, Ready, RecvInit
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.core.tables import StateTable

LAYOUT = "layout-A"
ROOM = 12345
D_ID = "decode-0"
P_ADDR = "tcp://p0"
BOOT = "127.0.0.1:8998"
PAGES = 3
# D's harness verifies pulls (kv_checksum): READY carries a checksum per array and a spare
# registration, so every row of kv_receiver (the re-pull's too) can be driven.
CHECKSUMS = (0x1234ABCD,)
SPARE = 98


def path_to(table: StateTable, target: str, start: str | None = None) -> list[str]:
    """Shortest trigger path from ``start`` (default: initial) to ``target``, BFS over the rows."""
    start = start or table.initial
    prev: dict[str, tuple[str, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state == target:
            break
        for row in table.rows:
            if row.source == state and row.target not in prev and row.trigger != "ProtocolViolated":
                prev[row.target] = (state, row.trigger)
                queue.append(row.target)
    steps: list[str] = []
    node = target
    while prev[node] is not None:
        state, trigger = prev[node]  # type: ignore[misc]
        steps.append(trigger)
        node = state
    return steps[::-1]


class PrefillHarness:
    """One room on a PrefillEndpoint, fed by trigger names."""

    def __init__(self, seed: int = 0) -> None:
        self.ep = PrefillEndpoint(
            LAYOUT, random.Random(seed), LeaseConfig(initial=30, extension=20)
        )
        self.now = 0.0
        self.last: list[Any] = []

    @property
    def state(self) -> str | None:
        return self.ep.state_of(ROOM)

    def events_for(self, trigger: str) -> list[Any]:
        msg = lambda m: ev.MessageReceived(D_ID, m)  # noqa: E731
        return {
            "RequestAccepted": [ev.PrefillRequestAccepted(ROOM)],
            "RecvInitReceived": [msg(RecvInit(ROOM, D_ID, PAGES, LAYOUT))],
            "PartialRecvInitReceived": [msg(RecvInit(ROOM, D_ID, PAGES, LAYOUT, skip_pages=1))],
            "PrefillFinished": [ev.PrefillFinished(ROOM, 7, PAGES)],
            # One more whole page written than was sent (the last page goes with READY).
            "PartPrefilled": [ev.PartPrefilled(ROOM, min(self._sent() + 1, PAGES - 1))],
            "PrefillFailed": [ev.PrefillFailed(ROOM, "forward failed")],
            "DoneReceived": [msg(Done(ROOM, True))],
            "DoneFailedReceived": [msg(Done(ROOM, False, "pull failed"))],
            "AbortReceived": [msg(Abort(ROOM, "d gave up"))],
            "Aborted": [ev.Aborted(ROOM, "client gone")],
            # A RECV_INIT with the wrong layout is impossible in every state.
            "ProtocolViolated": [msg(RecvInit(ROOM, D_ID, PAGES, "other-layout"))],
        }[trigger]

    def _sent(self) -> int:
        room = self.ep.rooms.get(ROOM)
        return 0 if room is None else room.sent

    def fire(self, trigger: str) -> list[Any]:
        if trigger == "LeaseExpired":
            expiry = self.ep.lease_expiry(ROOM)
            assert expiry is not None, f"no lease in {self.state}"
            self.now = expiry
            self.last = self.ep.handle(ev.TimeAdvanced(), self.now)
            return self.last
        out: list[Any] = []
        for e in self.events_for(trigger):
            out.extend(self.ep.handle(e, self.now))
        self.last = out
        return out


class DecodeHarness:
    """One room on a DecodeEndpoint, fed by trigger names."""

    def __init__(self) -> None:
        # A P silent for 40 s with 2 heartbeats unanswered is lost (PeerLost); every state's
        # own deadline is longer, and firing TimedOut keeps P talking until then.
        self.config = DecodeConfig(heartbeat_interval=5, peer_timeout=40)
        self.ep = DecodeEndpoint(D_ID, LAYOUT, self.config, kv_checksum=True)
        self.now = 0.0
        self.last: list[Any] = []

    @property
    def state(self) -> str | None:
        return self.ep.state_of(ROOM)

    def events_for(self, trigger: str) -> list[Any]:
        msg = lambda m: ev.MessageReceived(P_ADDR, m)  # noqa: E731
        return {
            "RequestAccepted": [ev.DecodeRequestAccepted(ROOM, BOOT, PAGES)],
            "PeerResolved": [ev.PeerResolved(BOOT, P_ADDR, "tcp://p0-transfer", LAYOUT)],
            "PeerUnresolved": [ev.PeerResolutionFailed(BOOT, "no such prefill")],
            "BlocksAllocated": [ev.BlocksAllocated(ROOM)],
            "ReadyReceived": [msg(Ready(ROOM, 99, 7, PAGES - self._held(), LAYOUT,
                                        kv_checksums=CHECKSUMS, repull_uuid=SPARE))],
            # The next page, as a part (P still prefilling): it starts where D's pages end.
            "PartReceived": [msg(KVPart(ROOM, 97, self._held(), 1, LAYOUT,
                                        kv_checksums=CHECKSUMS))],
            # A part that overtook the one before it (a page further on).
            "OfferAheadReceived": [msg(KVPart(ROOM, 96, self._held() + 1, 1, LAYOUT,
                                              kv_checksums=CHECKSUMS))],
            "AbortReceived": [msg(Abort(ROOM, "p gave up"))],
            "PullSucceeded": [ev.PullSucceeded(ROOM)],
            "PullFailed": [ev.PullFailed(ROOM, "connection closed")],
            "ChecksumMismatched": [ev.ChecksumMismatched(ROOM, "array 0 sums to 0x1 here")],
            "Aborted": [ev.Aborted(ROOM, "client gone")],
            "ProtocolViolated": [msg(Ready(ROOM, 99, 7, PAGES, "other-layout"))],
        }[trigger]

    def _held(self) -> int:
        """Where P's next offer must start: after the room's pages D holds (its prefix cache's,
        then the parts pulled) and the part it is pulling."""
        room = self.ep.rooms.get(ROOM)
        if room is None:
            return 0
        return room.skip if room.part is None else room.part.first_page + room.part.n_pages

    def fire(self, trigger: str) -> list[Any]:
        if trigger == "TimedOut":
            deadline = self.ep.room_deadline(ROOM)
            assert deadline is not None
            # P answered just before: the room's own deadline fires, not P's silence.
            self.ep.handle(ev.MessageReceived(P_ADDR, HeartbeatAck(1, 0)), deadline - 1e-3)
            self.now = deadline
            self.last = self.ep.handle(ev.TimeAdvanced(), self.now)
            return self.last
        if trigger == "PeerLost":
            # P falls silent: heartbeats go unanswered until the peer timeout has passed. Only
            # a room in P's heartbeat set can hear of it; others would just see time pass.
            room = self.ep.rooms.get(ROOM)
            peer = self.ep.peers.get(room.peer) if room is not None and room.peer else None
            if peer is None or ROOM not in peer.rooms:
                self.last = []
                return self.last
            out = []
            for _ in range(20):
                self.now += self.config.heartbeat_interval
                out.extend(self.ep.handle(ev.TimeAdvanced(), self.now))
                if any(isinstance(e, fx.FailRequest | fx.ReleaseBlocks) for e in out):
                    break
            self.last = [e for e in out if not _is_heartbeat(e)]
            return self.last
        out: list[Any] = []
        for e in self.events_for(trigger):
            out.extend(self.ep.handle(e, self.now))
        self.last = out
        return out


def external_kinds(effects: list[Any]) -> list[str]:
    """Effect objects as the table's effect names (SendMessage split by message type)."""
    names: list[str] = []
    for e in effects:
        if isinstance(e, fx.SendMessage):
            kind = type(e.message).__name__
            if kind == "Done":
                names.append("SendDone" if e.message.ok else "SendDoneFailed")
            elif kind == "HeartbeatAck" or kind == "Heartbeat":
                continue
            else:
                names.append({"Ready": "SendReady", "Abort": "SendAbort",
                              "RecvInit": "SendRecvInit", "KVPart": "SendPart"}[kind])
        elif isinstance(e, fx.StartPull) and e.repull:
            names.append("StartRepull")
        elif isinstance(e, fx.StartPull) and e.part:
            names.append("StartPartPull")
        elif not isinstance(e, fx.ForgetPeer | fx.ForgetTransfer):  # a peer's, not a row's
            names.append(type(e).__name__)
    return names


def _is_heartbeat(effect: Any) -> bool:
    return isinstance(effect, fx.SendMessage) and isinstance(effect.message, Heartbeat)
