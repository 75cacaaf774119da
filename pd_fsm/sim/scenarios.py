"""Named scenarios (``pd-fsm sim --scenario NAME``): a fault that the seeded draws reach only by
luck, staged on purpose at the moment it matters, with a check of its own on top of every
invariant (``pd_fsm.sim``).

``p-dies-mid-pull``: one P, one D, eight clients within a second, pulls slow enough to overlap
(5 MB/s on the cost model). Once D pulls from P for at least two rooms at once, P is SIGKILLed
(down for 30 s), and every pull from it hangs until its deadline, as a pull from a dead host does
(``SimConfig.hung_pulls``: nothing resets the connection) unless D drops the connection first.
The check: each room that was pulling when P died has its pages back within the peer timeout plus
two heartbeats and the tolerance of the kill, not when its pull gives up (the pull deadline, 8 s
here). Then the run goes on and drains as every seed does (every client answered once, nothing
left held). With the planted bug ``held-until-pull-reports`` (the pages wait for the pull's
report) the check fails; without it, it holds.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol, runtime_checkable

import attrs

from pd_fsm.sim.anchors import ANCHORS, Anchor, anchor_config
from pd_fsm.sim.config import DECODE, TOLERANCE, CostModel, SimConfig, Violation
from pd_fsm.sim.switch import Processes
from pd_fsm.sim.workers import WorldView

SCENARIOS = {
    "p-dies-mid-pull": "P is SIGKILLed while D pulls two rooms or more from it, and those pulls "
                       "hang until their deadline unless D drops their connection: D's pages "
                       "must be back within the peer timeout, not the pull deadline",
    **ANCHORS,  # the anchors' reported failures (anchors.py)
}

PULLS_AT_THE_KILL = 2
P_DOWN = 30.0  # seconds P stays down: past the check, so its restart is no part of it
# The latest D may still hold a page of a room that was pulling when P died, after the kill:
# P is lost after the peer timeout, judged at a heartbeat (two: the one that finds it due, and
# one of slack); the rest is the invariants' tolerance.
PAGES_BACK_S = DECODE.peer_timeout + 2 * DECODE.heartbeat_interval + TOLERANCE


def scenario_config(name: str, base: SimConfig | None = None) -> SimConfig:
    """What ``name`` runs with, over ``base`` (its schedulers, plant and checksums kept)."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}: one of {', '.join(SCENARIOS)}")
    if name in ANCHORS:
        return anchor_config(name, base or SimConfig())
    return attrs.evolve(base or SimConfig(), prefill=1, decode=1, requests=8,
                        arrival_window=1.0, faults=False, hung_pulls=True, scenario=name,
                        cost=CostModel(pull_bytes_per_second=5e6))


@runtime_checkable
class PulledFrom(Protocol):
    """What the scenario reads of a D (modelled or real)."""

    def pulling_from(self, transfer_addr: str) -> list[int]:
        """The rooms whose pull from ``transfer_addr`` is in flight."""

    def holds_pages(self, room: int) -> bool:
        """Whether ``room`` still holds pages here."""


class ScenarioWorld(WorldView, Protocol):
    # The nodes serving each role now (``world.World``'s: modelled or real ones, hence Any).
    prefills: list[Any]
    decodes: list[Any]


class PDiesMidPull:
    """Stages the kill after the step that puts ``PULLS_AT_THE_KILL`` pulls in flight; checks
    the pages ``PAGES_BACK_S`` later. ``outcomes``: staged, pages_back."""

    def __init__(self, world: ScenarioWorld, processes: Processes) -> None:
        self.world, self.processes = world, processes
        self.outcomes: Counter[str] = Counter()
        self._staged = False

    def check(self) -> None:
        """After every step: stage the kill once D pulls enough rooms from P."""
        w = self.world
        if self._staged or not w.prefills or not w.decodes:
            return
        p, d = w.prefills[0], w.decodes[0]
        transfer = getattr(p, "transfer", "")
        if not p.alive or not d.alive or not transfer:
            return
        reader = d
        assert isinstance(reader, PulledFrom), d
        pulling = reader.pulling_from(transfer)
        if len(pulling) < PULLS_AT_THE_KILL:
            return
        self._staged = True
        self.outcomes["staged"] += 1
        w.trace_line(f"  scenario: {p.name} SIGKILLed while {d.name} pulls rooms "
                     f"{[f'{r:x}' for r in pulling]} from it")
        self.processes.crash(p.name, P_DOWN)
        w.at(PAGES_BACK_S, f"scenario: {d.name}'s pages back?", self._pages_back, d, d.gen,
             tuple(pulling))

    def _pages_back(self, d: Any, gen: int, rooms: tuple[int, ...]) -> None:
        if d.gen != gen or not d.alive:
            return
        kept = [f"{r:x}" for r in rooms if d.holds_pages(r)]
        if kept:
            raise Violation(f"{d.name}: rooms {kept} still hold their pages {PAGES_BACK_S:g} s "
                            "after their P died mid-pull")
        self.outcomes["pages_back"] += 1


def make(name: str, world: ScenarioWorld, processes: Processes) -> PDiesMidPull | Anchor:
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}: one of {', '.join(SCENARIOS)}")
    if name in ANCHORS:
        return Anchor(name, world)  # type: ignore[arg-type]
    return PDiesMidPull(world, processes)
