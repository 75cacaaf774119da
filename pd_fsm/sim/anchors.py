"""The anchors' own reported failures as named scenarios (``pd-fsm sim --scenario NAME``),
staged in the simulated cluster against pd_fsm's real cores, each with a check of its own on
top of every invariant:

``sglang-31800-transfer-never-done`` — sglang PR #31800: a Mooncake KV receiver whose transfer
had started but never got its done signal stayed in ``Transferring`` forever (its timeout was
only evaluated while ``WaitingForInput``), never failed, never freed its decode slot; under load
the slots leaked until D admitted nothing. Staged: the first two pulls D starts never report, not
even at the pull executor's own deadline. Checked: each such room is failed to its client and
its pages are back by D's ``transfer_timeout`` (a window of every transferring state in
spec/state_tables/kv_receiver.toml) plus a heartbeat and the tolerance; the later rooms are
admitted and answered.

``sglang-13054-failure-sticks`` — a failure marker that stays stuck (the project's summary of the
thread, shared/COMPAT.md; the thread itself was not found in the stored corpus): one failed
transfer from a P must not fail later requests to that P. Staged: the first two pulls D starts
fail at once, from a live P. Checked: every room D pulls from that P after the failures lands.

``tpu-inference-2311-pulls-under-load`` — tpu-inference PR #2311 ("the high request rate hang
in Disagg": the host pool was recycled only when a later request ran ``get_finished``, so at a
high rate D waited on P for ever once the pool ran out) and #2403 (every pull timing out at a
high rate on tpu7x). Staged: 40 requests within half a second at one P and one D, each with 48
pages, pulls at 20 MB/s. Checked: every client gets an answer (none hangs), and within two
heartbeats and the tolerance of the last answer — no request after it to recycle anything — P
and D hold no page, room or registration.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import attrs

from pd_fsm.sim.config import DECODE, TOLERANCE, CostModel, SimConfig, Violation

ANCHORS = {
    "sglang-31800-transfer-never-done":
        "two pulls start and never report, not even at their own deadline (sglang #31800): "
        "D must fail each room and free its pages within its transfer timeout, and go on "
        "admitting",
    "sglang-13054-failure-sticks":
        "two pulls from a live P fail (sglang #13054, a failure marker that sticks): every "
        "later pull from that P must land",
    "tpu-inference-2311-pulls-under-load":
        "40 requests in half a second through one P and one D with few pages and slow pulls "
        "(tpu-inference #2311, #2403): every client answered, and P and D hold nothing two "
        "heartbeats after the last answer, with no request after it",
}

STUCK = 2
FAILED = 2
BURST = 40
RELEASED_BY = DECODE.transfer_timeout + DECODE.heartbeat_interval + TOLERANCE
RECYCLED_BY = 2 * DECODE.heartbeat_interval + TOLERANCE


def anchor_config(name: str, base: SimConfig) -> SimConfig:
    one = attrs.evolve(base, prefill=1, decode=1, faults=False, scenario=name)
    if name == "sglang-31800-transfer-never-done":
        return attrs.evolve(one, requests=8, arrival_window=2.0, stuck_pulls=STUCK)
    if name == "sglang-13054-failure-sticks":
        return attrs.evolve(one, requests=8, arrival_window=4.0, failed_pulls=FAILED)
    return attrs.evolve(one, requests=BURST, arrival_window=0.5, pages=48,
                        cost=CostModel(pull_bytes_per_second=20e6))


class AnchorWorld(Protocol):
    prefills: list[Any]  # modelled nodes (the pull executor staged is the modelled one)
    decodes: list[Any]
    clients: list[Any]
    now: float

    def at(self, delay: float, what: str, fn: Any, *args: Any) -> None: ...

    def trace_line(self, line: str) -> None: ...


class Anchor:
    """One anchor's staging and check (module docstring); ``outcomes`` counts what it saw."""

    def __init__(self, name: str, world: AnchorWorld) -> None:
        self.name, self.world = name, world
        self.outcomes: Counter[str] = Counter()
        self._seen: set[tuple[str, int]] = set()
        self._all_answered = False

    def check(self) -> None:
        w = self.world
        for d in w.decodes:
            if self.name == "sglang-31800-transfer-never-done":
                self._stuck(d)
            elif self.name == "sglang-13054-failure-sticks":
                self._after_failure(d)
            if self.name == "tpu-inference-2311-pulls-under-load":
                self._no_pull_failed(d)
        if (self.name == "tpu-inference-2311-pulls-under-load" and not self._all_answered
                and len(w.clients) == BURST and all(c.answer is not None for c in w.clients)):
            self._all_answered = True
            self.outcomes["all_answered"] += 1
            w.at(RECYCLED_BY, "scenario: P and D recycled?", self._recycled)

    def _stuck(self, d: Any) -> None:
        for started, room in d.puller.stuck:
            if ("stuck", room) in self._seen:
                continue
            self._seen.add(("stuck", room))
            self.outcomes["staged"] += 1
            self.world.trace_line(f"  scenario: {d.name}'s pull of room {room:x} never reports")
            self.world.at(started + RELEASED_BY - self.world.now,
                          f"scenario: {d.name}'s room {room:x} released?", self._released, d,
                          d.gen, room)

    def _released(self, d: Any, gen: int, room: int) -> None:
        if d.gen != gen or not d.alive:
            return
        if d.holds_pages(room) or room in d.legs:
            raise Violation(f"{d.name}: room {room:x}, whose pull never reported, still holds "
                            f"{'its pages' if d.holds_pages(room) else 'its client'} "
                            f"{RELEASED_BY:g} s after the pull started")
        self.outcomes["released"] += 1

    def _after_failure(self, d: Any) -> None:
        staged = [t for t, room, _ in d.puller.reports if room in d.puller.failing]
        if not staged:
            return
        self.outcomes["staged"] = max(self.outcomes["staged"], len(staged))
        for t, room, outcome in d.puller.reports:
            if room in d.puller.failing or t <= min(staged) or ("after", room) in self._seen:
                continue
            self._seen.add(("after", room))
            if outcome != "landed":
                raise Violation(f"{d.name}: room {room:x}'s pull {outcome} after an earlier "
                                "pull from the same P failed: the failure stuck")
            self.outcomes["landed_after_failure"] += 1

    def _no_pull_failed(self, d: Any) -> None:
        for _, room, outcome in d.puller.reports:
            if outcome != "landed":
                raise Violation(f"{d.name}: room {room:x}'s pull {outcome} under load")

    def _recycled(self) -> None:
        for node in (*self.world.prefills, *self.world.decodes):
            left = node.leftovers()
            if left:
                raise Violation(f"{node.name} still holds {left} {RECYCLED_BY:g} s after the "
                                "last answer, with no request after it")
        self.outcomes["recycled"] += 1
