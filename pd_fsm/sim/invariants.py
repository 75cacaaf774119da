"""The workers' invariants (``pd_fsm.sim``), checked after every step against books kept across
steps: KVPoll only moves forward; P's lease is never shortened and no room lives past it; no D
room stays in a waiting state past that state's deadline (kv_receiver's [timeouts]); a modelled
D's hand-off books agree (``handoff.Desk.check``: its transfer server registers exactly the
offers its ledger holds, each pull it runs holds pages, no offer outlives its lease)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.core.tables import KV_RECEIVER
from pd_fsm.sim.config import DECODE, TOLERANCE, Violation
from pd_fsm.sim.workers import DecodeWorker

Key = tuple[str, int, int]  # (worker, its generation, room)


class Invariants:
    def __init__(self) -> None:
        self._polls: dict[Key, KVPoll] = {}
        self._leases: dict[Key, float] = {}
        self._d_states: dict[Key, tuple[str, float, float | None]] = {}

    def check(self, nodes: Iterable[Any]) -> None:
        """``nodes``: the workers' nodes, modelled (workers.py) or real (real.py, which shares
        no base with the modelled ones' ``core`` attribute: hence Any)."""
        for node in nodes:
            if not node.alive:
                continue
            now = node.local()
            if isinstance(node, DecodeWorker):
                node.desk.check(now, TOLERANCE)
            for room in list(node.core.rooms):
                key = (node.name, node.gen, room)
                self._monotonic(key, node.core.poll(room))
                if node.role == "prefill":
                    self._check_lease(node.core, key, now)
                else:
                    self._check_state(node.core, key, now)

    def _check_lease(self, core: PrefillEndpoint, key: Key, now: float) -> None:
        """P's lease is never shortened, and no room lives past it."""
        name, _, room = key
        expiry = core.lease_expiry(room)
        if expiry is None:
            return
        if expiry < self._leases.get(key, -math.inf):
            raise Violation(f"{name}: lease of room {room:x} shortened from "
                            f"{self._leases[key]:.3f} to {expiry:.3f}")
        self._leases[key] = expiry
        if now > expiry + TOLERANCE:
            raise Violation(f"{name}: room {room:x} live {now - expiry:.1f} s past its lease")

    def _check_state(self, core: DecodeEndpoint, key: Key, now: float) -> None:
        """No D room stays in a waiting state past that state's deadline (kv_receiver's
        [timeouts], with the windows the simulated cluster was given)."""
        name, _, room = key
        state = core.state_of(room)
        assert state is not None
        seen = self._d_states.get(key)
        # A re-armed deadline is a state entered again within one event (STREAMING -> a part
        # lands -> WAITING_FOR_READY -> the next part -> STREAMING): measured from then.
        deadline = core.room_deadline(room)
        if seen is None or seen[0] != state or seen[2] != deadline:
            self._d_states[key] = (state, now, deadline)
            return
        timeout = KV_RECEIVER.timeouts.get(state)
        if timeout is None:
            return
        window = float(getattr(DECODE, timeout.window))
        if now - seen[1] > window + TOLERANCE:
            raise Violation(f"{name}: room {room:x} in {state} for {now - seen[1]:.1f} s, "
                            f"past its {window:g} s deadline")

    def _monotonic(self, key: Key, poll: KVPoll | None) -> None:
        if poll is None:
            return
        name, _, room = key
        prev = self._polls.get(key)
        if prev is not None and poll < prev and poll != KVPoll.Failed:
            raise Violation(f"{name}: KVPoll of room {room:x} went {prev.name} -> {poll.name}")
        self._polls[key] = poll
