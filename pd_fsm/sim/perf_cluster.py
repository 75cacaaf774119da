"""The performance model over a whole cluster: N workers, each on its own cores
(as each has its own device in a real cluster), static splits or the SLA planner
(``pd_fsm/core/planner.py``) switching roles as the workload shifts.

Event-driven (a worker's step ends ``alone_s`` after it starts: no worker shares cores here):
arrivals go to the P or colocated worker with the fewest requests queued (a P only while some D
takes rooms), a prefilled room to the accepting D with the fewest rows; every ``interval`` the
planner observes each worker (its queue, rows, KV use, and the p90 TTFT / inter-token gap of the
requests it served in the last ``window``) and its decisions are carried out: a switching worker
takes no new work, finishes what it has, and serves in the new role ``switch_s`` later (the
weights stay loaded and every role's shapes are compiled before ready — so a switch
costs a drain, not a start). A worker the planner makes colocated ("null") takes arrivals beside
the P; the last D of a drain waits until no P can still send it a room.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Callable, Iterable, Sequence

import attrs

from pd_fsm.core.planner import (
    Decision,
    MoveStreams,
    Planner,
    PlannerConfig,
    Role,
    ScaleDown,
    ScaleUp,
    SwitchRole,
    WorkerSnapshot,
)
from pd_fsm.sim.perf import PAGES, Request, Worker
from pd_fsm.sim.perf_profile import Profile


def drained(idle: bool, *, last_decode: bool, prefills_holding: Iterable[bool]) -> bool:
    """Whether a switching worker holds nothing now (a simulated fleet's role-switch drain):
    ``idle``, and, for the last D (a D switching with no other D serving), no P still holding
    a request, which could yet send it a room."""
    return idle and not (last_decode and any(prefills_holding))

@attrs.frozen
class Phase:
    """``seconds`` of Poisson arrivals at ``rate``, prompts and answers drawn in the ranges."""

    seconds: float
    rate: float
    prompt: tuple[int, int]
    out: tuple[int, int]


def shifting(phases: Sequence[Phase], seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    reqs: list[Request] = []
    start = 0.0
    for ph in phases:
        t = start + rng.expovariate(ph.rate)
        while t < start + ph.seconds:
            reqs.append(Request(t, rng.randint(*ph.prompt), rng.randint(*ph.out)))
            t += rng.expovariate(ph.rate)
        start += ph.seconds
    return reqs


@attrs.frozen
class ClusterConfig:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0  # colocated workers, besides the P and D ones
    cores: int = 1  # per worker
    # D's cores, where narrower than ``cores`` (0: ``cores``): the threads of its XLA pools,
    # sized when it starts and kept across a switch, as ``pd-fsm cluster`` gives its D one
    # thread beside a P of two. The planner reads them (``WorkerSnapshot.pool_threads``).
    decode_cores: int = 0
    # A request with no P (or none with a D to send to) and no colocated worker to take it goes
    # to a D, which prefills it alone (``pd-fsm proxy --local-prefill-without-prefill``, on
    # under ``pd-fsm cluster --planner``); off: it waits until an entry serves again.
    alone: bool = False
    planner: PlannerConfig | None = None
    interval: float = 5.0  # seconds between the planner's observations
    window: float = 20.0  # the latencies it sees: requests served in the last this many s
    # A drained worker serves in its new role this much later. Measured on real workers: 0.64-0.79
    # s for an idle SmolLM2 (README "Role switch"); 2.0 keeps bench/RESULTS_planner_sim.md
    # reproducible and allows for a loaded machine.
    switch_s: float = 2.0
    stream_tokens: int = 256  # a P prefills in chunks of this many, streaming each (perf.py)


@attrs.define
class ClusterRun:
    requests: list[Request]
    decisions: list[tuple[float, Decision]]
    roles: list[tuple[float, int, int, int]]  # (time, P, D, colocated) after every change
    alone: int = 0  # requests a D prefilled alone (``alone``): no entry was serving
    deferred: int = 0  # arrivals that found no entry and waited (every 0.1 s) for one


def p90(values: Sequence[float]) -> float:
    """The 90th percentile (nearest rank); NaN of none."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]


class _Cluster:
    def __init__(self, profile: Profile, config: ClusterConfig, requests: list[Request]) -> None:
        self.profile, self.config = profile, config
        roles = (["colocated"] * config.colocated + ["prefill"] * config.prefill
                 + ["decode"] * config.decode)
        narrow = config.decode_cores or config.cores
        self.workers = [Worker(role, profile, narrow if role == "decode" else config.cores,
                               name=f"w{i}", stream_tokens=config.stream_tokens)
                        for i, role in enumerate(roles)]
        self.alone = self.deferred = 0
        self.switching: dict[str, str] = {}  # worker -> its next role, while it drains
        self._armed: set[str] = set()  # drained: serving in the new role after switch_s
        self.busy: set[str] = set()
        self.events: list[tuple[float, int, str, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.requests = requests
        self.planner = Planner(config.planner) if config.planner else None
        self.roles: list[tuple[float, int, int, int]] = []
        self._note_roles()
        for r in requests:
            self.at(r.arrival, "arrive", functools.partial(self.arrive, r))
        if self.planner is not None:
            self.at(config.interval, "plan", self.plan)

    def at(self, t: float, what: str, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), what, fn))

    def _role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role and w.name not in self.switching]

    def _note_roles(self) -> None:
        self.roles.append((self.now, len(self._role("prefill")), len(self._role("decode")),
                           len(self._role("colocated"))))

    def run(self) -> None:
        last = max((r.arrival for r in self.requests), default=0.0) + 600.0
        while self.events:
            t, _, _, fn = heapq.heappop(self.events)
            if t > last:
                break
            self.now = t
            fn()

    # -- work ---------------------------------------------------------------------------------

    def arrive(self, r: Request) -> None:
        entry = self._role("colocated") + (self._role("prefill") if self._role("decode") else [])
        if not entry and self.config.alone and self._role("decode"):
            entry = self._role("decode")  # D prefills it alone
            self.alone += 1
        elif not entry:  # every entry mid-switch: the request waits for one
            self.deferred += 1
            self.at(self.now + 0.1, "arrive", lambda: self.arrive(r))
            return
        w = min(entry, key=lambda w: (len(w.waiting) + (w.name in self.busy), w.name))
        w.waiting.append(r)
        self.kick(w)

    def pick_decode(self, r: Request) -> Worker:
        ds = self._role("decode") or [w for w in self.workers if w.role == "decode"]
        d = min(ds, key=lambda w: (len(w.running) + len(w.arriving), w.name))
        p = self._named(r.prefill_by)
        r.kv_ready = self.now + d.fast.pull_s(p.tail_tokens(r) * self.profile.kv_bytes_per_token)
        self.at(r.kv_ready, "kv", lambda: self.kick(d))  # D scatters it at its next step
        return d

    def kick(self, w: Worker) -> None:
        if w.name in self.busy:
            return
        job = w.next_job(self.now)
        if job is None:
            # The last D of a drain may have waited for this worker's rooms: look at them all.
            for name in list(self.switching):
                self._maybe_switch(self._named(name))
            return
        self.busy.add(w.name)

        def done() -> None:
            self.busy.discard(w.name)
            w.finish(job, self.now, self.pick_decode)
            self.kick(w)

        self.at(self.now + job.alone_s, "step", done)

    # -- roles --------------------------------------------------------------------------------

    def _named(self, name: str) -> Worker:
        return next(w for w in self.workers if w.name == name)

    def _empty(self, w: Worker) -> bool:
        return drained(not (w.waiting or w.running or w.arriving or w.name in self.busy),
                       last_decode=w.role == "decode" and not self._role("decode"),
                       prefills_holding=(bool(p.waiting) or p.name in self.busy
                                         for p in self.workers if p.role == "prefill"))

    def _maybe_switch(self, w: Worker) -> None:
        to = self.switching.get(w.name)
        if to is None or w.name in self._armed or not self._empty(w):
            return

        def switched() -> None:
            w.role = to
            del self.switching[w.name]
            self._armed.discard(w.name)
            self._note_roles()
            self.kick(w)

        self._armed.add(w.name)
        self.at(self.now + self.config.switch_s, "switched", switched)

    def plan(self) -> None:
        assert self.planner is not None
        for decision in self.planner.observe(self.snapshots(), self.now):
            self.carry_out(decision)
        self.at(self.now + self.config.interval, "plan", self.plan)

    def carry_out(self, d: Decision) -> None:
        if isinstance(d, SwitchRole):
            w = self._named(d.worker)
            self.switching[w.name] = "colocated" if d.to == "null" else d.to
            self._note_roles()
            # Its queued requests go back to the other entries (it takes no more); one it has
            # begun to prefill (a chunk) it finishes, as the real drain does.
            if w.role in ("prefill", "colocated"):
                begun = [r for r in w.waiting if r.prefilled]
                queued = [r for r in w.waiting if not r.prefilled]
                w.waiting = type(w.waiting)(begun)
                for r in queued:
                    self.arrive(r)
            self._maybe_switch(w)
        elif isinstance(d, ScaleUp | ScaleDown):
            pass  # a fixed pool of workers here: the planner runs with max_workers 0
        elif isinstance(d, MoveStreams):
            # Never decided here (move_standby off): no worker shares cores in this model, so
            # a standby's streams slow nobody, and a move would only cost their prefills.
            pass

    def snapshots(self) -> list[WorkerSnapshot]:
        since = self.now - self.config.window
        out = []
        for w in self.workers:
            role: Role = ("null" if w.role == "colocated" else
                          "prefill" if w.role == "prefill" else "decode")
            # As the worker's own histogram: a P's TTFT ends at its prefill, not at D's relay
            # (a D backlogged behind its pulls read as P's pressure here before 2026-12-06).
            ttft = [r.answered - r.arrival for r in self.requests
                    if r.prefill_by == w.name and r.answered >= since]
            gaps = [b - a for r in self.requests if r.decode_by == w.name
                    for a, b in itertools.pairwise(r.token_times[1:]) if b >= since]
            used = sum(w.pages_for(r) for r in w.running)
            prompts = [r.prompt for r in self.requests  # (the model's: prefilled in it)
                       if r.prefill_by == w.name and r.answered >= since]
            out.append(WorkerSnapshot(
                w.name, role, waiting=len(w.waiting) + len(w.arriving), running=len(w.running),
                ttft_p90=p90(ttft), itl_p90=p90(gaps), kv_usage=used / PAGES,
                switching=w.name in self.switching, pool_threads=w.cores,
                prompt_tokens=sum(prompts) / len(prompts) if prompts else math.nan))
        return out


def run_cluster(profile: Profile, config: ClusterConfig, requests: Sequence[Request]
                ) -> ClusterRun:
    reqs = [Request(r.arrival, r.prompt, r.out) for r in requests]
    c = _Cluster(profile, config, reqs)
    c.run()
    return ClusterRun(reqs, [] if c.planner is None else list(c.planner.decisions), c.roles,
                      c.alone, c.deferred)


def goodput(reqs: Sequence[Request], start: float, end: float, ttft_s: float,
            tpot_s: float) -> float:
    """Requests that arrived in [start, end) and met both targets, per second of the span."""
    met = sum(1 for r in reqs if start <= r.arrival < end and len(r.token_times) >= r.out
              and not math.isnan(r.token_times[0]) and r.ttft <= ttft_s and r.tpot <= tpot_s)
    return met / (end - start) if end > start else 0.0
