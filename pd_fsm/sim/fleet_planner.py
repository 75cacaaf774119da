"""The SLA planner (``pd_fsm/core/planner.py``, the code the real cluster runs) acting in the
fleet model (``fleet.py``), as it acts in the CPU cluster's model (``perf_cluster.py``).

Every ``interval`` seconds (until the last arrival) the planner observes one
``WorkerSnapshot`` an instance, built from the model's own state:

- ``waiting``: P and colocated, the prompts queued on it; D, the rooms routed to it and not
  yet admitted (on the way or ready). ``running``: the rows it decodes.
- ``ttft_p90``: of the prompts whose prefill it ended in the last ``window`` (a P's TTFT ends
  at its prefill, as the worker's own histogram; a colocated one's at its first token, the
  same step). ``itl_p90``: the gaps between its steps in the window while it had rows (every
  row's inter-token gap on it). ``oldest_wait``: its oldest queued prompt's wait so far.
- ``kv_usage``: KV tokens reserved over its capacity. ``busy``: the share of the last
  interval its steps took. ``prompt_tokens``: the mean prompt routed to it in the window.
- Not modelled (no meaning on a chip): ``nice``, ``cpus``, ``pool_threads`` (None), so the
  planner's priority, cores and narrow-D levers stay off; a ``SetNice``, ``SetCpus`` or
  ``MoveStreams`` decided anyway is counted in ``ignored`` and not carried out.

Carrying out: a ``SwitchRole`` drains the instance (it takes no new work: its prompts not
begun go back to the other entries; it finishes its chunks begun, its rows, its rooms in
flight), then it serves in the new role ``switch_s`` later (the weights stay loaded; every
role's shapes compiled). With a launcher, ``ScaleUp`` adds an instance of the role's TP after
``start_s`` where the host's chips allow (else counted in ``refused``), and ``ScaleDown`` drains
one and gives its chips back. The last D drains only once no P can still send it a room.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import deque
from collections.abc import Sequence

import attrs

from pd_fsm.core.planner import (
    Decision,
    Planner,
    PlannerConfig,
    Role,
    ScaleDown,
    ScaleUp,
    SwitchRole,
    WorkerSnapshot,
)
from pd_fsm.sim.chip import ChipCosts
from pd_fsm.sim.fleet import Fleet, FleetConfig, FleetReq, Instance, Step
from pd_fsm.sim.perf_cluster import drained, p90

ROLE: dict[Role, str] = {"null": "colocated", "prefill": "prefill", "decode": "decode"}
SEEN: dict[str, Role] = {v: k for k, v in ROLE.items()}


@attrs.frozen
class FleetPlanning:
    planner: PlannerConfig
    interval: float = 2.0  # seconds between the planner's observations
    window: float = 10.0  # the latencies it sees: those of the last this many seconds
    switch_s: float = 2.0  # a drained instance serves in its new role this much later
    launcher: bool = False  # ScaleUp / ScaleDown carried out (else refused)
    start_s: float = 30.0  # a launched instance serves this long after its ScaleUp
    chips: int = 0  # the chips a launcher may fill (0: the starting configuration's)


@attrs.define
class PlannedRun:
    requests: list[FleetReq]
    decisions: list[tuple[float, Decision]]
    roles: list[tuple[float, int, int, int]]  # (time, P, D, colocated) serving, at each change
    ignored: int  # decisions with no meaning on a chip (SetNice, SetCpus, MoveStreams)
    refused: int  # ScaleUp with no launcher or no chip free
    deferred: int  # arrivals that found no entry serving and waited 0.1 s for one


def _recent(kept: deque[tuple[float, float]], since: float) -> list[float]:
    while kept and kept[0][0] < since:
        kept.popleft()
    return [v for _, v in kept]


class PlannedFleet(Fleet):
    def __init__(self, costs: ChipCosts, config: FleetConfig, max_batched_tokens: int,
                 max_running: int, planning: FleetPlanning, last_arrival: float) -> None:
        super().__init__(costs, config, max_batched_tokens, max_running)
        self.planning, self.last_arrival = planning, last_arrival
        self.limits = (max_batched_tokens, max_running)
        self.planner = Planner(planning.planner)
        self.switching: dict[str, str] = {}  # instance -> its next role ("gone") while it drains
        self.armed: set[str] = set()  # drained: serving in the new role after switch_s
        self.stepping: dict[str, Step] = {}
        self.routed: dict[str, set[FleetReq]] = {}  # D -> rooms routed, not yet admitted
        self.ttfts: dict[str, deque[tuple[float, float]]] = {}
        self.gaps_seen: dict[str, deque[tuple[float, float]]] = {}
        self.taken: dict[str, deque[tuple[float, float]]] = {}
        self.busy_at: dict[str, float] = {}
        self.ignored = self.refused = self.deferred = 0
        self.pending_chips = 0
        self.names = itertools.count()
        self.roles: list[tuple[float, int, int, int]] = []
        self._note_roles()
        self.at(planning.interval, self.plan)

    # -- the model's hooks --------------------------------------------------------------------

    def live(self, role: str) -> list[Instance]:
        return [i for i in self.instances if i.role == role and i.name not in self.switching]

    def entry_for(self, r: FleetReq) -> Instance | None:
        entries = self.live("colocated") + (self.live("prefill") if self.live("decode") else [])
        if not entries:  # every entry mid-switch: the request waits for one
            self.deferred += 1
            self.at(self.now + 0.1, functools.partial(self.arrive, r))
            return None
        w = min(entries, key=lambda i: (i.entry_load(), i.name))
        self.taken.setdefault(w.name, deque()).append((self.now, float(r.prompt)))
        return w

    def pick_decode(self, r: FleetReq) -> Instance:
        ds = self.live("decode") or [i for i in self.instances if i.role == "decode"]
        d = min(ds, key=lambda i: (i.decode_load(), i.name))
        self.routed.setdefault(d.name, set()).add(r)
        return d

    def plan_step(self, w: Instance) -> Step | None:
        step = super().plan_step(w)
        if step is not None:
            self.stepping[w.name] = step
        return step

    def finish(self, w: Instance, step: Step) -> None:
        now = self.now
        if w.rows:  # every running row's token gap is this step's
            self.gaps_seen.setdefault(w.name, deque()).append((now, now - w.last_end))
        ended = [r for r, n in step.chunks if r.prefilled + n == r.prompt]
        for r in step.admitted:
            self.routed.get(w.name, set()).discard(r)
        super().finish(w, step)
        kept = self.ttfts.setdefault(w.name, deque())
        kept.extend((now, now - r.arrival) for r in ended)

    def kick(self, w: Instance) -> None:
        super().kick(w)
        if not w.busy:
            for name in list(self.switching):
                self._maybe_switch(self._named(name))

    # -- roles --------------------------------------------------------------------------------

    def _named(self, name: str) -> Instance:
        return next(i for i in self.instances if i.name == name)

    def _note_roles(self) -> None:
        self.roles.append((self.now, len(self.live("prefill")), len(self.live("decode")),
                           len(self.live("colocated"))))

    def _empty(self, w: Instance) -> bool:
        return drained(
            not (w.busy or w.waiting or w.rows or w.ready or w.held or self.routed.get(w.name)),
            last_decode=w.role == "decode" and not self.live("decode"),
            prefills_holding=(bool(p.waiting or p.busy or p.held) for p in self.instances
                              if p.role == "prefill"))

    def _maybe_switch(self, w: Instance) -> None:
        to = self.switching.get(w.name)
        if to is None or w.name in self.armed or not self._empty(w):
            return
        self.armed.add(w.name)
        self.at(self.now + (0.0 if to == "gone" else self.planning.switch_s),
                lambda: self._switched(w, to))

    def _switched(self, w: Instance, to: str) -> None:
        del self.switching[w.name]
        self.armed.discard(w.name)
        if to == "gone":
            self.instances.remove(w)
        else:
            w.role = to
            w.stream_tokens = (self.config.stream_tokens
                               if to == "prefill" and self.config.streamed else 0)
        self._note_roles()
        if to != "gone":
            self.kick(w)

    def _drain(self, w: Instance, to: str) -> None:
        self.switching[w.name] = to
        self._note_roles()
        if w.role != "decode":  # its prompts not begun go to the other entries
            step = self.stepping.get(w.name) if w.busy else None
            begun = {id(r) for r, _ in step.chunks} if step else set()
            moved = [r for r in w.waiting if r.prefilled == r.cached and id(r) not in begun]
            w.waiting = deque(r for r in w.waiting if r not in moved)
            w.waiting_tokens -= sum(r.prompt - r.prefilled for r in moved)
            for r in moved:
                self.arrive(r)
        self._maybe_switch(w)

    def _launch(self, role: str) -> None:
        c = self.config
        tp = {"colocated": c.tp_colocated, "prefill": c.tp_prefill, "decode": c.tp_decode}[role]
        used = sum(i.tp for i in self.instances) + self.pending_chips
        if not self.planning.launcher or used + tp > (self.planning.chips or c.chips):
            self.refused += 1
            return
        self.pending_chips += tp

        def started() -> None:
            self.pending_chips -= tp
            w = Instance(role, tp, f"n{next(self.names)}", self.costs, *self.limits,
                         c.stream_tokens if role == "prefill" and c.streamed else 0)
            self.instances.append(w)
            self._note_roles()
            self.kick(w)

        self.at(self.now + self.planning.start_s, started)

    # -- the planner --------------------------------------------------------------------------

    def plan(self) -> None:
        for d in self.planner.observe(self.snapshots(), self.now):
            self.carry_out(d)
        if self.now < self.last_arrival:
            self.at(self.now + self.planning.interval, self.plan)

    def carry_out(self, d: Decision) -> None:
        if isinstance(d, SwitchRole | ScaleDown):
            named = [i for i in self.instances if i.name == d.worker]
            if named and d.worker not in self.switching:
                self._drain(named[0], ROLE[d.to] if isinstance(d, SwitchRole) else "gone")
        elif isinstance(d, ScaleUp):
            self._launch(ROLE[d.role])
        else:
            self.ignored += 1

    def snapshots(self) -> list[WorkerSnapshot]:
        since = self.now - self.planning.window
        out = []
        for w in self.instances:
            queued = [r.arrival for r in w.waiting]
            busy = (w.busy_s - self.busy_at.get(w.name, 0.0)) / self.planning.interval
            self.busy_at[w.name] = w.busy_s
            taken = _recent(self.taken.setdefault(w.name, deque()), since)
            routed = self.routed.get(w.name, set())
            out.append(WorkerSnapshot(
                w.name, SEEN[w.role],
                waiting=len(routed) if w.role == "decode" else len(queued),
                running=len(w.rows),
                ttft_p90=p90(_recent(self.ttfts.setdefault(w.name, deque()), since)),
                itl_p90=p90(_recent(self.gaps_seen.setdefault(w.name, deque()), since)),
                kv_usage=w.held / max(w.capacity, 1), switching=w.name in self.switching,
                oldest_wait=self.now - min(queued) if queued else 0.0, busy=min(busy, 1.0),
                prompt_tokens=sum(taken) / len(taken) if taken else math.nan))
        return out


def simulate_planned(costs: ChipCosts, config: FleetConfig, requests: Sequence[FleetReq],
                     horizon: float, max_batched_tokens: int, max_running: int,
                     planning: FleetPlanning) -> PlannedRun:
    """Fresh copies of ``requests`` through ``config`` with the planner acting on it, until
    every one is answered or ``horizon``."""
    reqs = [FleetReq(r.arrival, r.prompt, r.out, prefilled=r.cached, cached=r.cached)
            for r in requests]
    last = max((r.arrival for r in reqs), default=0.0)
    fleet = PlannedFleet(costs, config, max_batched_tokens, max_running, planning, last)
    fleet.run(reqs, horizon)
    return PlannedRun(reqs, list(fleet.planner.decisions), fleet.roles, fleet.ignored,
                      fleet.refused, fleet.deferred)
