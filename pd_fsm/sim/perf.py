"""The performance model: replay a workload over a placement of workers whose
prefills, decode steps and KV moves take the times a profile measured (``perf_profile.py``),
and predict each request's TTFT and inter-token gaps, hence goodput.

What is modelled, after the real scheduler (``schedulers/scheduler.py``) and PD path:

- A worker steps in a loop: admit waiting requests while ``max_running`` and its pages allow
  (pages for prompt + output reserved at admission), prefill the admitted ones in one padded
  batch of at most ``max_batched_tokens`` (costed as a prefill of rows x longest tokens), then
  decode every running row once (costed by rows and mean context). A step's tokens leave when
  it ends; a request prefilled in a step is also decoded in it (its first two tokens leave
  together), as the real loop does.
- PD: P's step prefills, then gathers each room's KV (a device copy of its bytes); D pulls it
  (a loopback pull of those bytes, on its pull threads: no compute) and scatters it in its own
  loop (a copy), then decodes it; P's token and D's first leave at the end of that step.
- Cores: a pinned worker runs at its core count's profile. Workers sharing cores share them as
  Linux's CFS does: each busy worker gets cores in proportion to its nice weight (at most the
  cores it can use), and a step on ``c`` cores runs at the speed the one- and all-core profiles
  give, linearly between them.

- Streamed KV: P prefills a room's prompt in chunks of ``stream_tokens`` (256 by default, as
  ``pd-fsm serve``), several rooms' chunks in one padded batch, and D pulls only the last
  chunk's KV after the prefill. A colocated worker prefills each prompt whole. (Before this was
  modelled, a 788-token prompt was costed as one 1,024-token forward — 5.3 s on two cores
  against two chunks' 1.1 s and the 2.0 s measured — and PD shared was predicted at -65 % of
  its measured goodput; see bench/RESULTS_adaptive.md.)
- A step keeps busy the cores the profile measured it keeping busy (CPU over wall seconds;
  a two-core decode step at batch 1 keeps 1.4 cores busy while running no faster than on one:
  XLA's pool threads spin); what it leaves goes to the other workers on those cores by nice
  weight. With a profile measured before those figures were recorded, a step keeps busy only
  its speed-up from one core to all of the worker's (~1.1 cores for that step).

Not modelled: the proxy and HTTP (a few ms), a chunk's attention over the chunks before it
(the profile's prefill has no context), the radix cache, XLA's serial fractions beyond what
the two profiles capture.
Time advances in fixed ticks (``TICK``): a request's timings are exact to a tick.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable, Sequence

import attrs

from pd_fsm.sim.perf_profile import CoreProfile, Profile

TICK = 0.001  # seconds of simulated time per tick


def nice_weight(nice: int) -> float:
    """CFS's weight for a nice value (kernel/sched: 1024 at 0, x1.25 per step)."""
    return 1024.0 / (1.25 ** nice)


def bucket(n: int, least: int = 1) -> int:
    """The next power of two (the real scheduler pads batch rows and tokens so)."""
    b = least
    while b < n:
        b *= 2
    return b


@attrs.frozen
class Placement:
    """One static split: a colocated worker, or one P and one D, pinned to their own cores or
    sharing ``cores`` at the given nice values."""

    name: str
    colocated: bool = False
    cores: int = 2  # the machine's (a colocated worker's, or the shared ones)
    shared: bool = False  # PD: P and D both on every core (else P and D on cores/2 each)
    nice_p: int = 0
    nice_d: int = 0
    # P prefills a room's prompt in chunks of this many tokens and streams each chunk's KV to D
    # while it computes the next (`pd-fsm serve --disaggregation-stream-tokens`, default 256);
    # 0: the whole prompt in one forward, its KV pulled after it.
    stream_tokens: int = 256
    # Conditional disaggregation by P's queue (`pd-fsm proxy --local-prefill-queue N`): a
    # request arriving while P holds N or more goes to D, which prefills it itself, as a
    # colocated worker would; 0: off.
    local_prefill_queue: int = 0
    # D's XLA pool threads (`pd-fsm serve --cpu-pools N`; 0: its cores): with one on shared
    # cores, D steps at one core's speed and keeps one busy, leaving P the rest.
    decode_threads: int = 0


@attrs.define(eq=False)
class Request:
    arrival: float
    prompt: int
    out: int
    token_times: list[float] = attrs.field(factory=list)
    kv_ready: float = math.inf  # PD: when its KV is on D (pulled), scatter still to do
    prefilled: int = 0  # prompt tokens prefilled so far (P streams in chunks)
    prefill_by: str = ""  # the workers that served it (the planner's per-worker latencies)
    # When the worker that prefilled it gave its first token: a P at its prefill's end (the
    # real P's TTFT histogram observes that, not D's relay), else with the first decode.
    answered: float = math.nan
    decode_by: str = ""

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else math.inf

    @property
    def tpot(self) -> float:
        """Mean gap between output tokens (DistServe's TPOT)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else 0.0


@attrs.define(eq=False)
class _Job:
    """A step in progress: ``left`` of it to do (1.0 = all), and what it yields when done."""

    alone_s: float  # its time with the worker's whole share of cores
    slow_s: float  # its time on one core
    busy_s: float | None = None  # core-seconds it keeps busy alone (None: not profiled)
    left: float = 1.0
    chunks: list[tuple[Request, int]] = attrs.field(factory=list)  # prompt tokens per row
    prefilled: list[Request] = attrs.field(factory=list)  # rows whose prompt this step ends
    decoded: list[Request] = attrs.field(factory=list)
    scattered: list[Request] = attrs.field(factory=list)


_BUSY = {"prefill_s": "prefill_busy_cores", "decode_s": "decode_busy_cores"}


class Worker:
    """One modelled worker: its queues and the step it runs (``next_job`` builds a step as the
    real loop would, ``finish`` applies it). ``role`` may change between steps (a role switch,
    ``perf_cluster.py``)."""

    def __init__(self, role: str, profile: Profile, cores: int, nice: int = 0,
                 name: str = "", stream_tokens: int = 0) -> None:
        self.role, self.profile, self.cores, self.nice = role, profile, cores, nice
        self.stream_tokens = stream_tokens  # as a P (chunks); other roles prefill whole prompts
        self.name = name or role
        self.fast: CoreProfile = profile.on(cores)
        self.slow: CoreProfile = profile.on(1)
        self.waiting: deque[Request] = deque()
        self.arriving: list[Request] = []  # D: KV being pulled
        self.running: list[Request] = []
        self.pages_free = PAGES
        self.job: _Job | None = None

    def tail_tokens(self, r: Request) -> int:
        """The prompt tokens whose KV is still to pull when P's prefill of ``r`` ends: the last
        chunk's when P streams (the earlier parts were pulled while it computed the next one,
        which the profile's rates allow: a 256-token part's pull is a few ms against a chunk's
        hundreds), else the whole prompt's."""
        cap = self.stream_tokens
        return r.prompt - (r.prompt - 1) // cap * cap if cap else r.prompt

    def pages_for(self, r: Request) -> int:
        return -(-(r.prompt + r.out) // self.profile.page_size)

    def _cost(self, job: _Job, of: str, *a: float) -> None:
        """Add to ``job`` the cost of ``of`` (a CoreProfile method): seconds on this worker's
        cores alone, on one core, and the core-seconds it keeps busy (a copy: one core)."""
        fast = getattr(self.fast, of)(*a)
        job.alone_s += fast
        job.slow_s += getattr(self.slow, of)(*a)
        if job.busy_s is not None:
            busy = getattr(self.fast, _BUSY[of])(*a) if of in _BUSY else 1.0
            job.busy_s += fast * min(busy, self.cores)

    def _prefill_rows(self, job: _Job) -> int:
        """Fill ``job.chunks`` as the real plan_prefill (schedulers/plan.py) does: rows FIFO,
        each taking what is left of its prompt (a P that streams: at most one chunk); the first
        row alone is cut to the budget, later ones join while the padded batch stays within it.
        Returns the longest chunk."""
        cap = self.stream_tokens if self.role == "prefill" else 0
        budget = self.profile.max_batched_tokens
        longest = 0
        for r in self.waiting:
            if len(self.running) + len(job.scattered) + len(job.chunks) >= \
                    self.profile.max_running:
                break
            left = r.prompt - r.prefilled if not cap else min(r.prompt - r.prefilled, cap)
            if not job.chunks:
                n = min(left, budget)
            elif bucket(len(job.chunks) + 1) * bucket(max(longest, left), 16) <= budget:
                n = left
            elif bucket(len(job.chunks) + 1) * bucket(longest, 16) <= budget:
                n = min(left, bucket(longest, 16))
            else:
                break
            if r.prefilled == 0:  # pages for prompt + output, reserved at admission
                if self.pages_for(r) > self.pages_free:
                    break
                self.pages_free -= self.pages_for(r)
            job.chunks.append((r, n))
            longest = max(longest, n)
        return longest

    def next_job(self, now: float) -> _Job | None:
        """The next step's work, as the real loop would build it now (None: nothing to do)."""
        job = _Job(0.0, 0.0, 0.0 if self.fast.measured_busy else None)
        kv = self.profile.kv_bytes_per_token
        if self.role == "decode":
            for r in [r for r in self.arriving if r.kv_ready <= now]:
                if len(self.running) + len(job.scattered) >= self.profile.max_running:
                    break
                self.arriving.remove(r)
                self.pages_free -= self.pages_for(r)
                self._cost(job, "copy_s", r.prompt * kv)  # scatter
                job.scattered.append(r)
        if self.waiting:  # prompts to prefill: P's, colocated's, a D's under local prefill
            longest = self._prefill_rows(job)
            if job.chunks:
                padded = bucket(len(job.chunks)) * bucket(longest, 16)
                self._cost(job, "prefill_s", padded)
                job.prefilled = [r for r, n in job.chunks if r.prefilled + n == r.prompt]
                for r in job.prefilled:  # out of the queue (one with chunks to go stays first)
                    self.waiting.remove(r)
            if self.role == "prefill":  # P gathers each chunk's KV for its pull
                for _, n in job.chunks:
                    self._cost(job, "copy_s", n * kv)
        decoding = list(self.running) + (job.prefilled if self.role != "prefill" else [])
        decoding += job.scattered
        if decoding:
            context = sum(r.prompt + len(r.token_times) for r in decoding) / len(decoding)
            self._cost(job, "decode_s", len(decoding), context)
            job.decoded = decoding
        return job if job.chunks or job.decoded else None

    def finish(self, job: _Job, now: float, pick_decode: Callable[[Request], Worker] | None
               ) -> list[Request]:
        """Apply a finished step at ``now``; returns the requests it sent to a D (P) or
        finished (colocated, D)."""
        for r, n in job.chunks:
            r.prefilled += n
        if self.role == "prefill":
            kv = self.profile.kv_bytes_per_token
            for r in job.prefilled:
                r.token_times.append(math.nan)  # the first token rides with the KV to D
                r.prefill_by, r.answered = self.name, now
                self.pages_free += self.pages_for(r)  # released when D has pulled: close enough
                assert pick_decode is not None
                d = pick_decode(r)  # it may set kv_ready itself, to wake D then
                if not math.isfinite(r.kv_ready):
                    # Streamed: the earlier chunks' parts were pulled while P computed the
                    # next; the last chunk's pages are what READY leaves to pull.
                    r.kv_ready = now + d.fast.pull_s(self.tail_tokens(r) * kv)
                r.decode_by = d.name
                d.arriving.append(r)
            return list(job.prefilled)
        self.running.extend(job.prefilled + job.scattered)
        for r in job.decoded:
            if r.token_times and math.isnan(r.token_times[0]):
                r.token_times[0] = now  # P's token, relayed with the step's first on D
                r.token_times.append(now)
            else:
                r.token_times.append(now)
            if r in job.prefilled:
                r.token_times.insert(0, now)  # the prefill's token and the step's together
        for r in job.prefilled:
            r.prefill_by = r.decode_by = self.name
            r.answered = now
        done = [r for r in self.running if len(r.token_times) >= r.out]
        for r in done:
            del r.token_times[r.out:]
            self.running.remove(r)
            self.pages_free += self.pages_for(r)
        return done


PAGES = 255  # usable pages per worker (the benches' --num-pages 256, less the null page)


def _demand(w: Worker) -> float:
    """The cores ``w``'s step keeps busy: as profiled, else its speed-up from one core to all
    of its cores (a step that runs 1.2x faster on two cores than on one leaves most of the
    second idle)."""
    job = w.job
    assert job is not None
    if job.alone_s <= 0:
        return float(w.cores)
    if job.busy_s is not None:
        return min(float(w.cores), max(1.0, job.busy_s / job.alone_s))
    if job.slow_s <= 0:
        return float(w.cores)
    return min(float(w.cores), max(1.0, job.slow_s / job.alone_s))


def _shares(busy: Sequence[Worker], cores: int) -> dict[Worker, float]:
    """CFS over shared cores: cores in proportion to nice weight, none beyond what a step keeps
    busy; what one leaves goes to the others by weight (water-filling)."""
    out: dict[Worker, float] = {}
    left, free = list(busy), float(cores)
    while left:
        total = sum(nice_weight(w.nice) for w in left)
        capped = [w for w in left if _demand(w) <= free * nice_weight(w.nice) / total]
        if not capped:
            for w in left:
                out[w] = free * nice_weight(w.nice) / total
            break
        for w in capped:
            out[w] = _demand(w)
            free -= out[w]
            left.remove(w)
    return out


def _speeds(busy: Sequence[Worker], shared: bool, cores: int) -> dict[Worker, float]:
    """Each busy worker's progress per second on its current step."""
    out: dict[Worker, float] = {}
    shares = _shares(busy, cores) if shared else {}
    for w in busy:
        job = w.job
        assert job is not None
        c = shares.get(w, float(w.cores))
        need = _demand(w)
        if c >= need or job.slow_s <= 0:
            out[w] = 1.0 / max(job.alone_s, 1e-9)
            continue
        # Between one core's speed and the step's full speed, linearly in cores.
        one, full = 1.0 / max(job.slow_s, 1e-9), 1.0 / max(job.alone_s, 1e-9)
        out[w] = c * one if c <= 1 else one + (full - one) * (c - 1) / max(need - 1, 1e-9)
    return out


def simulate(profile: Profile, placement: Placement, requests: Sequence[Request],
             horizon: float = 3600.0) -> list[Request]:
    """Run ``requests`` (their ``arrival``, ``prompt``, ``out``) through ``placement``; returns
    them with their token times filled in (a request still unfinished at ``horizon`` keeps
    what it got)."""
    if placement.colocated:
        workers = [Worker("colocated", profile, placement.cores, 0)]
        p = d = None
    else:
        half = placement.cores if placement.shared else max(placement.cores // 2, 1)
        p = Worker("prefill", profile, half, placement.nice_p,
                   stream_tokens=placement.stream_tokens)
        d = Worker("decode", profile, min(half, placement.decode_threads or half),
                   placement.nice_d)
        workers = [p, d]
    entry = workers[0]

    def pick(_: Request) -> Worker:
        assert d is not None
        return d

    def p_load() -> int:  # P's requests as the proxy counts them: until P's answer
        assert p is not None
        return len(p.waiting) + (len(p.job.prefilled) if p.job else 0)

    pending = deque(sorted(requests, key=lambda r: r.arrival))
    now = 0.0
    while now < horizon:
        while pending and pending[0].arrival <= now:
            local = placement.local_prefill_queue and p_load() >= placement.local_prefill_queue
            (d if local and d else entry).waiting.append(pending.popleft())
        for w in workers:
            if w.job is None:
                w.job = w.next_job(now)
        busy = [w for w in workers if w.job is not None]
        if not busy and not pending and not (d and d.arriving):
            break
        for w, speed in _speeds(busy, placement.shared, placement.cores).items():
            assert w.job is not None
            w.job.left -= speed * TICK
            if w.job.left <= 0:
                job, w.job = w.job, None
                w.finish(job, now + TICK, pick)
        now += TICK
    return list(requests)


@attrs.frozen
class Outcome:
    ttft_p50: float
    tpot_p50: float
    goodput: float  # requests per second that met both targets
    met: int
    finished: int


def _pct(values: Sequence[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else math.nan


def outcome(done: Sequence[Request], ttft_s: float, tpot_s: float) -> Outcome:
    """Goodput as the benches measure it: met requests over the span from the first arrival to
    the last token."""
    ok = [r for r in done if len(r.token_times) >= r.out and not math.isnan(r.token_times[0])]
    met = [r for r in ok if r.ttft <= ttft_s and r.tpot <= tpot_s]
    start = min((r.arrival for r in done), default=0.0)
    end = max((r.token_times[-1] for r in ok), default=start)
    span = end - start
    return Outcome(_pct([r.ttft for r in ok], 50), _pct([r.tpot for r in ok], 50),
                   len(met) / span if span > 0 else 0.0, len(met), len(ok))


def poisson(rate: float, prompts: Sequence[int], out: int, seed: int = 1) -> list[Request]:
    """Arrivals at ``rate`` per second, one per prompt length (the benches' schedule: the same
    exponential gaps from ``random.Random(seed)``)."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for n in prompts:
        reqs.append(Request(t, n, out))
        t += rng.expovariate(rate)
    return reqs
