"""A fleet of accelerator instances serving a workload, on the chip's costs (``chip.py``):
colocated instances, or P and D instances of ``tp`` chips each, the KV moved P -> D whole after
the prefill or streamed chunk by chunk while P computes the next. Event-driven and seeded:
one run is a function of its config, its requests and nothing else.

The loop of each instance, after pd_fsm's scheduler on a TPU (one program a step):

- **Colocated**: a step decodes every running row once and prefills up to the step's token
  budget (``max_batched_tokens`` less the decode rows) of the waiting prompts, FIFO, chunked
  (a mixed step, costed as its decode plus its chunks, times ``1 + ChipCosts.mixed_extra``:
  0 by default, kind to colocated; the one mixed step measured on the chip, 64 rows x 2,048 +
  a 512-token chunk, took 75 ms against 49 ms so added, 0.52). A prompt's KV (prompt +
  answer) is reserved when its first chunk is admitted.
- **P**: a step prefills up to the budget (streamed: one chunk of ``stream_tokens``, so that its
  KV can leave while the next chunk computes) and gathers the KV its chunks made (when not
  streamed: the room's, with its last chunk). The KV then goes through three stages, each one
  transfer at a time, in order (``ChipCosts.stages_s``): off P's chips, over the link, onto
  D's chips; the room is ready on D when its last part is. P holds a room's KV until then.
- **D**: a step admits the rooms ready for it (while its KV holds their prompt + answer and
  ``max_running`` allows), scatters them into its pool, and decodes every running row once;
  the first token (P's, relayed) and D's first leave with that step.

A request's TTFT ends with its first token's step; its ITL is its mean inter-token gap (the
first two tokens leave together in PD). Routing: a new request goes to the entry (P or
colocated) with the fewest prompt tokens waiting; a room to the D with the fewest tokens held or
on the way, chosen when P admits it (a streamed room's parts go there as they are made).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from pd_fsm.sim.chip import ChipCosts


@attrs.frozen
class FleetConfig:
    """Instances of one kind each per role: ``colocated`` of ``tp_colocated`` chips, or
    ``prefill`` of ``tp_prefill`` and ``decode`` of ``tp_decode``."""

    name: str
    colocated: int = 0
    tp_colocated: int = 1
    prefill: int = 0
    tp_prefill: int = 1
    decode: int = 0
    tp_decode: int = 1
    streamed: bool = False
    stream_tokens: int = 1024

    @property
    def chips(self) -> int:
        return (self.colocated * self.tp_colocated + self.prefill * self.tp_prefill
                + self.decode * self.tp_decode)


@attrs.define(eq=False)
class FleetReq:
    arrival: float
    prompt: int
    out: int
    prefilled: int = 0
    # Prompt tokens a prefix cache already holds: its prefill starts after them (the fleet
    # model caches nothing itself; a replay of a measured run sets what the server reported).
    cached: int = 0
    first: float = math.nan  # when its first token left
    last: float = math.nan  # when its last did
    ready: float = math.inf  # PD: when its whole KV is on D
    prefill_end: float = math.nan  # PD: when P's step that ended its prefill did
    decode_to: Instance | None = None
    # Where its tokens left: the gaps between that instance's steps (``Instance.gaps``) from
    # the step after its first token's to its last token's.
    gaps: list[float] | None = None
    first_step: int = 0
    last_step: int = 0

    @property
    def ttft(self) -> float:
        return self.first - self.arrival if not math.isnan(self.last) else math.inf

    @property
    def itl(self) -> float:
        """Mean gap between its tokens (DistServe's TPOT)."""
        if math.isnan(self.last):
            return math.inf
        return (self.last - self.first) / (self.out - 1) if self.out > 1 else 0.0

    @property
    def worst_gap(self) -> float:
        """Its longest gap between two tokens (a mixed step's prefill shows here, where the
        mean hides it)."""
        if math.isnan(self.last):
            return math.inf
        if self.gaps is None or self.last_step <= self.first_step:
            return 0.0
        return max(self.gaps[self.first_step + 1:self.last_step + 1])


class Instance:
    """One instance's queues, running rows and stages (module docstring)."""

    def __init__(self, role: str, tp: int, name: str, costs: ChipCosts, budget: int,
                 max_running: int, stream_tokens: int = 0) -> None:
        self.role, self.tp, self.name, self.costs = role, tp, name, costs
        self.budget, self.max_running, self.stream_tokens = budget, max_running, stream_tokens
        self.capacity = costs.kv_capacity_tokens(tp)
        self.held = 0  # KV tokens reserved
        self.on_the_way = 0  # D: tokens of rooms routed here, not yet admitted
        self.waiting: deque[FleetReq] = deque()  # prompts to prefill
        self.waiting_tokens = 0  # their prompt tokens not yet prefilled
        self.ready: deque[FleetReq] = deque()  # D: rooms whose KV is here
        self.rows: list[tuple[int, int, int, FleetReq]] = []  # heap: (last step, seq, first, req)
        self.seq = itertools.count()
        self.steps = 0  # steps done
        self.gaps: list[float] = []  # gaps[i]: step i's end less step i-1's
        self.last_end = 0.0
        self.sum_prompt = 0
        self.sum_start = 0
        self.busy = False
        self.busy_s = 0.0
        self.stage_free = [0.0, 0.0, 0.0]  # P: when each KV stage is free
        self.peak_held = 0

    def entry_load(self) -> int:
        return self.waiting_tokens

    def decode_load(self) -> int:
        return self.held + self.on_the_way

    def reserve(self, tokens: int) -> bool:
        if self.held + tokens > self.capacity:
            return False
        self.held += tokens
        self.peak_held = max(self.peak_held, self.held)
        return True

    def join(self, r: FleetReq, start: int) -> None:
        """``r`` decodes from the step after ``start``; it is done ``out - 1`` steps on."""
        heapq.heappush(self.rows, (start + r.out - 1, next(self.seq), start, r))
        self.sum_prompt += r.prompt
        self.sum_start += start

    def context(self) -> float:
        n = len(self.rows)
        return (self.sum_prompt + n * self.steps - self.sum_start) / n if n else 0.0


@attrs.define
class Step:
    seconds: float
    chunks: list[tuple[FleetReq, int]] = attrs.field(factory=list)
    admitted: list[FleetReq] = attrs.field(factory=list)  # D: rooms joining this step


@attrs.define
class FleetRun:
    requests: list[FleetReq]
    busy: dict[str, float]  # role -> busy share of its instances over the run
    stage_busy: tuple[float, float, float]  # busy share of P's KV stages
    kv_peak: dict[str, float]  # role -> peak share of KV held, worst instance
    end: float


class Fleet:
    def __init__(self, costs: ChipCosts, config: FleetConfig, max_batched_tokens: int,
                 max_running: int) -> None:
        self.costs, self.config = costs, config
        c = config
        made: list[Instance] = []
        for role, n, tp in (("colocated", c.colocated, c.tp_colocated),
                            ("prefill", c.prefill, c.tp_prefill),
                            ("decode", c.decode, c.tp_decode)):
            made += [Instance(role, tp, f"{role[0]}{i}", costs, max_batched_tokens,
                              max_running, c.stream_tokens if c.streamed else 0)
                     for i in range(n)]
        self.instances = made
        self.entries = [i for i in made if i.role != "decode"]
        self.decodes = [i for i in made if i.role == "decode"]
        if not self.entries or (c.prefill and not self.decodes):
            raise ValueError(f"{c.name}: no instance to take requests, or P without D")
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count()
        self.now = 0.0
        self.stage_busy = [0.0, 0.0, 0.0]

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run(self, requests: Sequence[FleetReq], horizon: float) -> None:
        for r in requests:
            self.at(r.arrival, functools.partial(self.arrive, r))
        while self.events:
            t, _, fn = heapq.heappop(self.events)
            if t > horizon:
                break
            self.now = t
            fn()

    def arrive(self, r: FleetReq) -> None:
        w = self.entry_for(r)
        if w is None:
            return
        w.waiting.append(r)
        w.waiting_tokens += r.prompt - r.prefilled
        self.kick(w)

    def entry_for(self, r: FleetReq) -> Instance | None:
        """The entry (P or colocated) that takes ``r``: the fewest prompt tokens waiting."""
        return min(self.entries, key=lambda i: (i.entry_load(), i.name))

    def pick_decode(self, r: FleetReq) -> Instance:
        """The D ``r``'s room goes to: the fewest tokens held or on the way."""
        return min(self.decodes, key=lambda i: (i.decode_load(), i.name))

    def kick(self, w: Instance) -> None:
        if w.busy:
            return
        step = self.plan_step(w)
        if step is None:
            return
        w.busy = True
        w.busy_s += step.seconds
        self.at(self.now + step.seconds, lambda: self.finish(w, step))

    # -- a step -------------------------------------------------------------------------------

    def _chunks(self, w: Instance, step: Step, budget: int) -> None:
        """FIFO chunks of the waiting prompts within ``budget`` tokens (a P streaming: one
        chunk of ``stream_tokens``), each admitted (KV reserved, a D chosen) at its first."""
        for r in w.waiting:
            if budget <= 0:
                break
            if r.prefilled == r.cached:
                if len(w.rows) + len(step.chunks) >= w.max_running:
                    break
                if not w.reserve(r.prompt + (r.out if w.role == "colocated" else 0)):
                    break
                if w.role == "prefill":
                    d = self.pick_decode(r)
                    d.on_the_way += r.prompt + r.out
                    r.decode_to = d
            n = min(r.prompt - r.prefilled, budget)
            step.chunks.append((r, n))
            step.seconds += self.costs.prefill_s(r.prefilled, n, w.tp)
            budget -= n

    def plan_step(self, w: Instance) -> Step | None:
        step = Step(0.0)
        if w.role == "decode":
            while w.ready and len(w.rows) + len(step.admitted) < w.max_running:
                r = w.ready[0]
                if not w.reserve(r.prompt + r.out):
                    break
                w.ready.popleft()
                w.on_the_way -= r.prompt + r.out
                step.admitted.append(r)
                step.seconds += self.costs.scatter_s(r.prompt, w.tp)
        rows = len(w.rows) + len(step.admitted)
        if w.role != "decode":
            budget = w.stream_tokens or (w.budget - rows)
            self._chunks(w, step, budget)
        if w.role == "prefill":
            for r, n in step.chunks:  # the chunk's KV gathered, or the room's with its last
                if w.stream_tokens or r.prefilled + n == r.prompt:
                    step.seconds += self.costs.gather_s(n if w.stream_tokens else r.prompt, w.tp)
        if rows:
            ctx = (w.context() * len(w.rows) + sum(r.prompt for r in step.admitted)) / rows
            if step.chunks:
                step.seconds *= 1.0 + self.costs.mixed_extra
            step.seconds += self.costs.decode_s(rows, ctx, w.tp) * (
                1.0 + (self.costs.mixed_extra if step.chunks else 0.0))
        if not step.chunks and not rows:
            return None
        return step

    def finish(self, w: Instance, step: Step) -> None:
        w.busy = False
        now = self.now
        for r in step.admitted:
            w.join(r, w.steps)
        w.steps += 1
        w.gaps.append(now - w.last_end)
        w.last_end = now
        for r in step.admitted:
            r.first, r.gaps, r.first_step = now, w.gaps, w.steps - 1
        while w.rows and w.rows[0][0] <= w.steps:
            _, _, start, r = heapq.heappop(w.rows)
            r.last, r.last_step = now, w.steps - 1
            w.held -= r.prompt + r.out
            w.sum_prompt -= r.prompt
            w.sum_start -= start
        for r, n in step.chunks:
            r.prefilled += n
            w.waiting_tokens -= n
            if w.role == "prefill":
                if r.prefilled == r.prompt:
                    r.prefill_end = now
                if w.stream_tokens:
                    self.send(w, r, n)
                elif r.prefilled == r.prompt:
                    self.send(w, r, r.prompt)
            elif r.prefilled == r.prompt:  # colocated: its first token leaves with this step
                r.first, r.gaps, r.first_step = now, w.gaps, w.steps - 1
                if r.out <= 1:
                    r.last = now
                    w.held -= r.prompt + r.out
                else:
                    w.join(r, w.steps)
        for r, _ in step.chunks:
            if r.prefilled == r.prompt:
                w.waiting.remove(r)
        self.kick(w)

    def send(self, p: Instance, r: FleetReq, tokens: int) -> None:
        """``tokens`` of ``r``'s KV through P's three stages; the room is on D with its last."""
        d = r.decode_to
        assert d is not None
        t = self.now
        for i, s in enumerate(self.costs.stages_s(tokens, p.tp, d.tp)):
            start = max(t, p.stage_free[i])
            p.stage_free[i] = t = start + s
            self.stage_busy[i] += s
        if r.prefilled == r.prompt:
            r.ready = t

            def arrived() -> None:
                p.held -= r.prompt
                d.ready.append(r)
                self.kick(d)
                self.kick(p)  # its KV freed may admit a prompt

            self.at(t, arrived)


def simulate_fleet(costs: ChipCosts, config: FleetConfig, requests: Sequence[FleetReq],
                   horizon: float, max_batched_tokens: int, max_running: int) -> FleetRun:
    """Run fresh copies of ``requests`` through ``config`` until every one is answered or
    ``horizon``."""
    reqs = [FleetReq(r.arrival, r.prompt, r.out, prefilled=r.cached, cached=r.cached)
            for r in requests]
    fleet = Fleet(costs, config, max_batched_tokens, max_running)
    fleet.run(reqs, horizon)
    end = max(fleet.now, 1e-9)
    busy: dict[str, float] = {}
    peak: dict[str, float] = {}
    for role in ("colocated", "prefill", "decode"):
        mine = [i for i in fleet.instances if i.role == role]
        if mine:
            busy[role] = sum(i.busy_s for i in mine) / len(mine) / end
            peak[role] = max(i.peak_held / max(i.capacity, 1) for i in mine)
    n_p = max(config.prefill, 1)
    stages = tuple(s / n_p / end for s in fleet.stage_busy)
    return FleetRun(reqs, busy, (stages[0], stages[1], stages[2]), peak, end)


@attrs.frozen
class FleetWorkload:
    """Poisson arrivals of fixed prompt and answer lengths, in phases (one for a steady
    workload): (seconds, prompt tokens, output tokens) each."""

    name: str
    phases: tuple[tuple[float, int, int], ...]

    def requests(self, rate: float | Sequence[float], seed: int) -> list[FleetReq]:
        """At ``rate`` req/s, or a rate a phase (the list over again past its end)."""
        rng = random.Random(seed)
        out: list[FleetReq] = []
        start = 0.0
        rates = [rate] if isinstance(rate, int | float) else list(rate)
        for i, (seconds, prompt, answer) in enumerate(self.phases):
            rate = rates[i % len(rates)]
            t = start + rng.expovariate(rate)
            while t < start + seconds:
                out.append(FleetReq(t, prompt, answer))
                t += rng.expovariate(rate)
            start += seconds
        return out

    @property
    def seconds(self) -> float:
        return sum(p[0] for p in self.phases)


KINDS = {"chat": (1024, 256), "rag": (8192, 256), "reasoning": (256, 2048)}


def workload(name: str, seconds: float = 60.0, phase_s: float = 180.0) -> FleetWorkload:
    """``chat``, ``rag``, ``reasoning`` for ``seconds``, or ``shifting``: the three in turn,
    ``phase_s`` each, twice."""
    if name in KINDS:
        return FleetWorkload(name, ((seconds, *KINDS[name]),))
    if name == "shifting":
        cycle = tuple((phase_s, *KINDS[k]) for k in ("chat", "rag", "reasoning"))
        return FleetWorkload(name, cycle * 2)
    raise ValueError(f"unknown workload {name!r}: chat, rag, reasoning or shifting")


@attrs.frozen
class Slo:
    ttft_s: float = 1.0
    ttft_long_s: float = 2.0  # for prompts of ``long_prompt`` tokens or more
    long_prompt: int = 8192
    itl_s: float = 0.05
    # What ``itl_s`` bounds: a request's mean gap (``mean``, DistServe's TPOT) or its longest
    # (``worst``: every gap within it).
    itl_measure: str = "mean"

    def ttft_slo(self, r: FleetReq) -> float:
        return self.ttft_long_s if r.prompt >= self.long_prompt else self.ttft_s

    def itl(self, r: FleetReq) -> float:
        return r.worst_gap if self.itl_measure == "worst" else r.itl

    def met(self, r: FleetReq) -> bool:
        return r.ttft <= self.ttft_slo(r) and self.itl(r) <= self.itl_s


def goodput(reqs: Sequence[FleetReq], slo: Slo, start: float, end: float) -> float:
    """Requests that arrived in [start, end) and met both SLOs, per second of that span."""
    met = sum(1 for r in reqs if start <= r.arrival < end and slo.met(r))
    return met / (end - start) if end > start else 0.0
