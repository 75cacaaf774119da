"""The SLA planner's policy: from snapshots of every worker, decide which worker
changes role, and when to ask for one more worker or give one back — each decision with its
reason. Sans-IO like the rest of the core: ``Planner.observe(snapshots, now)`` returns
decisions; an adapter gathers the snapshots (the workers' /metrics, or the performance model's
workers, ``pd_fsm/sim/perf_cluster.py``) and acts on them.

The rule, after Dynamo's SLA planner and DistServe: TTFT is P's to keep, ITL is D's.

- Each observation classifies the cluster: ``prefill_bound`` when the prefill side's pressure
  (the worst P's TTFT p90 or oldest wait so far over the target, or its queue over
  ``queue_per_prefill``) is above
  ``headroom`` while the decode side's (the worst D's ITL p90 over the target, or its KV use over
  ``kv_high``) is not; ``decode_bound`` the other way; ``both`` and ``idle`` (every pressure
  under ``idle_below``); else ``balanced``.
- Hysteresis: a class must hold for ``patience`` observations in a row before it is acted on.
- Acting: ``prefill_bound`` or ``decode_bound`` asks for a worker of the starved role when the
  cluster may grow (``max_workers``), else moves the least loaded worker of the other role over
  (never below ``min_prefill`` / ``min_decode``, never one already switching); ``both`` grows
  when it may, else moves a worker toward the side whose pressure is at least ``imbalance``
  times the other's (both over target, the worse side gains most); ``idle`` gives back the
  least loaded worker of the side with the lower pressure (never below the minimums or
  ``min_workers``).
- Cooldown: after a decision nothing is decided for ``cooldown`` seconds (a switched worker's
  queues and histograms need that long to show its effect), and the run of observations starts
  again.

Priorities before roles (``prefill_nices``): where P and D share cores with D above
P, a P's CPU priority is a lever that needs no drain and acts at once. ``prefill_bound`` (or
``both`` with the prefill side ``imbalance`` times worse) moves every P up the steps of
``prefill_nices`` (to a lower nice), ``decode_bound`` down them: one step, and one more for each
doubling of the starved side's pressure past ``headroom`` unless the other side is over its
target too (one step per cooldown is too slow for a P starved many times its target in a phase
of a minute). Only a P already at the end of the steps leaves the decision to the role
moves below. A priority change quiets the planner for ``nice_cooldown`` seconds, not
``cooldown``: nothing drains, only the window's histograms need to show the effect (so the wide
merge on light prompts below, which reads the prompts P takes, is not held by it:
``merge_in_nice_cooldown``). A lever, not a fixed priority, because no one priority suits
every phase: a P fixed at nice +10 beside D at -5 starves in a long-prompt phase (TTFT p50
4.2 s on a 2-core machine) and leaves D over its ITL target in a short-prompt one
(bench/RESULTS_adaptive.md).

Cores before priorities (``cores``): on one host P and D either split the
cores (P on the first half of ``cores``, D on the rest: neither waits for the other) or share
them all (D above P by priority: a prefill takes every core D leaves idle). Neither placement
wins everywhere (bench/RESULTS_placement.md, RESULTS_adaptive.md): split wins on mixed prompts
under steady load (D busy most of the time, so a P sharing with it gets almost nothing), shared
on long prompts at a low rate (one core prefills such a prompt in about the TTFT target; D,
idle most of the time, leaves P both). So the planner moves P and D
between the two (``SetCpus``: ``POST /set_cpus``, no drain) by the prefill side's pressure and
how busy D is (``WorkerSnapshot.busy``: the share of the window its steps ran):

- split, ``prefill_bound`` (or ``both`` with P ``imbalance`` times worse), the busiest D busy
  under ``share_below``: share every core — P gains what D leaves idle;
- shared, the prefill side over ``headroom`` while the busiest D is busy over ``split_above``
  (P gets little of what D holds) and some D's XLA pools have more than one thread, or
  ``decode_bound`` with every P at the lowest of ``prefill_nices`` (D's steps wait for P's
  threads in spite of its priority): split. A P the priority lever had raised is first moved
  back down its steps: that gives D back its cores' time at once and leaves P what D leaves
  idle, where a split takes a core from P until D reads idle enough to share again.

The rule for a P behind a busy D holds where D's pools have two threads, whose idle threads
spin: a batch-1 step keeps 1.4 of two cores busy, and a P sharing them meets a fraction of the
SLOs it meets split (bench/RESULTS_placement.md). A D of one thread keeps at most about one
core busy, so P shared with it already has the other; split, P has one core and D's idle share
of its own is lost: so that split is not taken for a D of one thread (pd-fsm cluster's D beside
P).

The band between the two busy shares is the hysteresis a placement's own effect needs (D on one
core runs each step slower, so it reads busier split than shared). The placement in force is read
from the workers' cores at every observation (shared when every P and D has every core), and a
worker whose cores do not match its role under it (it switched role, or joined) is moved at once,
with no patience. A colocated worker (``"null"``) takes every core. While P and D are split, their
priorities weigh on nothing: the priority lever below waits for a shared placement.

With ``colocate`` the planner may also make a worker colocated (role ``"null"``: it serves
whole requests, prefill and decode in one loop) and split colocated workers back into P and D,
because disaggregation is a bet that only pays when prefills delaying decode steps cost more
than the capacity a fixed split leaves idle (DistServe). A colocated worker's TTFT counts on the
prefill side and its inter-token gap on the decode side.

- Orphans: P with no D to pair with (or D with no P) serve nothing; when no worker is switching,
  every one of them becomes colocated at once (no patience: there is nothing to wait for).
- Merge: the P/D part under pressure (its own class ``prefill_bound``, ``decode_bound`` or
  ``both``) gives pairs, its least loaded P and D, to the colocated side — as many as bring its
  pressure back to ``headroom``; the P/D part keeps its ratio, and what is left of a side once
  the other's last worker went becomes colocated next (an orphan). Also where its less pressed
  side is idle: a move would fix that phase, but it bets that the phase lasts, one switch per
  cooldown, and leaves the cluster short of the donor's role when the workload turns back (the
  modelled 16-worker cluster moved Ps to D through a short-prompt phase and met 0.92x
  colocated's goodput over six seeds; merging instead, 0.94x: bench/RESULTS_planner_sim.md).
- Split: the colocated workers missing their inter-token target while their TTFT is within its
  own (``decode_bound`` among them: decode steps wait behind prefills) give one worker to the
  P/D side under more pressure, or, with no P/D part yet, two workers (one P, one D) when a
  third stays colocated to serve while they drain.
- Never every serving worker at once: a decision that would drain them all keeps its first
  ones (a merge lists the donor side first; the other side then follows as orphans). So two
  workers merge one at a time and never split back: a split would leave nobody serving whole
  requests while they drain.
- A narrow D (its XLA pools of fewer threads than a P's: ``WorkerSnapshot.pool_threads``) over
  its ITL target is slow on its own: neither a priority nor a core gives it a thread (lowering
  P's priority to its floor gains it nothing), and a move has no worker to give. So, before
  those levers, the widest P becomes colocated alone
  (its P side need not be busy: a move cannot fix this; it may be over its target too where
  that is only the TTFTs of the window, with nothing waiting on P now — the first seconds of a
  short-prompt phase after long prompts) — or before D misses at all, where
  P takes light prompts (under ``heavy_prompt`` on average in the last window it took any,
  within ``recall``) while D decodes
  (its pressure over ``idle_below``): a short-prompt phase has begun, and waiting for the miss
  costs seconds of each such phase; it does not wait for what P still holds of the last phase's
  long prompts (that drains on it meanwhile, the new short prompts going to D alone), nor for
  the quiet of a priority or cores change (it counts its ``patience`` through that quiet: a
  merge held by it comes late into the phase and meets fewer SLOs, bench/RESULTS_adaptive.md);
  never while P takes heavy prompts (a
  long-prompt phase goes on, where P/D is the mode the way back below chooses: a D over its
  target there is slowed by P's prefills on the cores they share, which the priority lever
  answers) — and the D stays in its
  role as a standby beside it (not an orphan to merge: colocated on its one thread it would
  take half the requests at half the speed). A P/D part with a narrow D merges no other way
  (the merge below would make the narrow D colocated first, then its P as an orphan: two
  colocated workers that never split back). The cluster then decodes on the wide
  worker's threads, as colocated does; the cores lever has no P to place meanwhile. With
  ``move_standby`` (off by default), once that worker serves, the standby gives it its running
  streams of at most ``heavy_prompt`` tokens so far (``MoveStreams``, once per merge, not held
  by the cooldown): the proxy prefills each again there. Left on the standby, they cost the
  colocated worker 15-40 % a token for 10-20 s (no priority answers it) — but moved, their
  prefills cost it more on a 2-core CPU, which is why it is off by default
  (bench/RESULTS_adaptive.md). A move that needs no prefill (the colocated worker pulling the
  standby's KV, as a D takes a hand-off) is not built. Back: the
  colocated worker over both its targets, its decode side the worse, with prompts of
  ``heavy_prompt`` tokens on average taken in the window (decode steps behind heavy prefills;
  over its ITL target alone its own steps are slow, and the narrow D would be slower; over both
  with short prompts, its own full batch at a peak), with the recall rule below, becomes P
  again beside the standby, which is still warm: one drain, where a split of
  two colocated workers needs a third to serve meanwhile.
- Colocated is the safe side (it leaves no capacity idle), P/D the bet: each mode's pressure
  (its worse side's, 1.0 at the target) is remembered when the planner leaves it, for
  ``recall`` seconds; a merge needs P/D to do worse than colocated did, a split needs colocated
  to do ``imbalance`` times worse than P/D did and no split in the last ``recall`` seconds — so
  two overloaded modes do not trade places every cooldown, and a split that did not pay is
  undone at once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Literal

import attrs

Role = Literal["prefill", "decode", "null"]  # "null": colocated (RFC-2's disaggregation mode)
Pressure = Literal["prefill_bound", "decode_bound", "both", "idle", "balanced"]


@attrs.frozen
class WorkerSnapshot:
    """One worker as the planner sees it. Latencies are p90 over the adapter's last window
    (NaN: nothing finished there); ``kv_usage`` is the share of KV pages in use."""

    worker: str
    role: Role
    waiting: int = 0  # requests queued: not prefilled yet (P, null), KV not arrived yet (D)
    running: int = 0  # rows decoding (D, null)
    ttft_p90: float = math.nan
    itl_p90: float = math.nan
    kv_usage: float = 0.0
    switching: bool = False  # draining for a role switch: neither side's any more
    nice: int | None = None  # its compute threads' CPU priority now (None: not known)
    # P, colocated: how long its oldest request has waited for a first answer, so far: a
    # backlog shows here before any TTFT does (a TTFT is observed only once the wait ended).
    oldest_wait: float = 0.0
    cpus: frozenset[int] | None = None  # the cores its threads may run on now (None: not known)
    busy: float = 0.0  # the share of the window its scheduler's steps ran (0..1)
    # The threads of its XLA pools (sized when it started; None: not known). One thread keeps
    # at most about one core busy, however many it may run on: no spinning peers.
    pool_threads: int | None = None
    # P, colocated: the mean prompt (tokens) of the requests it took in the window (NaN: none).
    # Its prefill work, which latencies alone cannot tell from a full batch's.
    prompt_tokens: float = math.nan


def _nice_steps(_config: object, _field: object, nices: tuple[int, ...]) -> None:
    if any(not -20 <= n <= 19 for n in nices):
        raise ValueError(f"prefill_nices {nices}: each must be in -20..19")
    if any(a <= b for a, b in itertools.pairwise(nices)):
        raise ValueError(f"prefill_nices {nices}: least priority first (strictly decreasing)")


@attrs.frozen
class PlannerConfig:
    ttft_slo: float = 2.0
    itl_slo: float = 0.1
    headroom: float = 0.8  # a side is under pressure past this share of its target
    idle_below: float = 0.3  # every side under this share: a worker may be given back
    queue_per_prefill: int = 4  # P's queue this long is pressure 1.0 whatever its TTFT
    kv_high: float = 0.9  # D's KV this full is pressure 1.0
    imbalance: float = 1.5  # both sides over: move a worker when one is this much worse
    patience: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    cooldown: float = attrs.field(default=30.0, validator=attrs.validators.ge(0.0))
    min_prefill: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    min_decode: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    min_workers: int = 2
    max_workers: int = 0  # 0: the cluster does not grow or shrink, only switches roles
    # Switches decided at once, at most (0: as many as the pressures ask). 1 by default: in the
    # modelled 64-worker run (bench/RESULTS_planner_sim.md) the proportional step overshot.
    max_step: int = 1
    # May make workers colocated ("null") and split them back (see the module's docstring).
    colocate: bool = False
    recall: float = attrs.field(default=120.0, validator=attrs.validators.ge(0.0))
    # The CPU priorities (nice values) the planner may give prefill workers sharing cores with
    # decode workers, least priority first, e.g. (19, 10, 5, 0, -5); empty: it leaves them.
    prefill_nices: tuple[int, ...] = attrs.field(default=(), validator=_nice_steps)
    nice_cooldown: float = attrs.field(default=10.0, validator=attrs.validators.ge(0.0))
    # The cores P and D may split or share on this host (see the module's docstring); fewer
    # than two: the planner leaves every worker's cores alone.
    cores: frozenset[int] = frozenset()
    share_below: float = attrs.field(default=0.4, validator=attrs.validators.ge(0.0))
    split_above: float = attrs.field(default=0.6, validator=attrs.validators.ge(0.0))
    # A colocated worker's prompts this long on average stall its decode steps (one prefill
    # chunk at the CPU default, --max-batched-tokens 256): the split back beside a standby D.
    heavy_prompt: float = attrs.field(default=256.0, validator=attrs.validators.ge(0.0))
    # Where the standby D shares its cores with the colocated worker it merged into: once the
    # merge is done, the standby gives its running streams of at most ``heavy_prompt`` tokens
    # so far to the colocated worker (``MoveStreams``; see the module's docstring).
    move_standby: bool = False
    # The wide merge on light prompts is not held by a priority or cores change's quiet
    # (``nice_cooldown``): its evidence is the prompts P takes, not the window's latencies
    # that quiet waits on (see the module's docstring).
    merge_in_nice_cooldown: bool = True

    @split_above.validator
    def _band(self, _field: object, value: float) -> None:
        if value < self.share_below:
            raise ValueError(f"split_above {value} is below share_below {self.share_below}: "
                             "the band between them is the placement's hysteresis")


@attrs.frozen
class SwitchRole:
    worker: str
    to: Role
    reason: str


@attrs.frozen
class ScaleUp:
    role: Role
    reason: str


@attrs.frozen
class ScaleDown:
    worker: str
    reason: str


@attrs.frozen
class SetNice:
    """Give a worker's compute threads the CPU priority ``nice`` (``POST /set_nice``)."""

    worker: str
    nice: int
    reason: str


@attrs.frozen
class SetCpus:
    """Move a worker's threads to the cores ``cpus`` (``POST /set_cpus``)."""

    worker: str
    cpus: frozenset[int]
    reason: str


@attrs.frozen
class MoveStreams:
    """Give a worker's running streams of at most ``max_context`` tokens so far (prompt and
    output) to other workers (``POST /move_streams``): each is prefilled again where the proxy
    routes it, and goes on there."""

    worker: str
    max_context: int
    reason: str


Decision = SwitchRole | ScaleUp | ScaleDown | SetNice | SetCpus | MoveStreams
Placement = Literal["split", "shared"]


def split_halves(cores: frozenset[int]) -> dict[Role, frozenset[int]]:
    """Each role's cores when P and D split ``cores``: P the first half (the larger for an odd
    count: prefill is the compute-bound side), D the rest; a colocated worker every core."""
    ordered = sorted(cores)
    half = (len(ordered) + 1) // 2
    return {"prefill": frozenset(ordered[:half]), "decode": frozenset(ordered[half:]),
            "null": cores}


def _worst(values: Sequence[float]) -> float:
    known = [v for v in values if not math.isnan(v)]
    return max(known, default=0.0)


Mode = Literal["pd", "colocated"]
_BOUND: tuple[Pressure, ...] = ("prefill_bound", "decode_bound", "both")


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._run: tuple[Pressure, int] = ("balanced", 0)
        self._quiet_until = -math.inf
        self._quiet_calm = False  # the quiet is a priority or cores change's (nice_cooldown)
        # Observations in a row, within such a quiet, that the light-prompt merge held.
        self._light_run = 0
        # A mode's pressure when the planner last left it, and when (colocate only).
        self._left: dict[Mode | Placement, tuple[float, float]] = {}
        self._split_at = -math.inf
        # The mean prompt of the last window in which each worker took any, and when: at 0.5
        # req/s a window of 2 s often takes none, and the wide merge on light prompts would
        # wait for the next one, seconds later into a short-prompt phase.
        self._prompts: dict[str, tuple[float, float]] = {}
        # A wide merge under way with ``move_standby``: the worker made colocated, and the
        # standby Ds beside it whose streams move to it once it serves (``_standby_moves``).
        self._merging: tuple[str, tuple[str, ...]] | None = None
        # Where P and D run (``cores``), as the last observation showed them (and as a move
        # decided in it will make them); None without the lever or with no P or D seen.
        self.placement: Placement | None = None
        self.decisions: list[tuple[float, Decision]] = []  # every decision, for /metrics and logs

    def pressures(self, snapshots: Sequence[WorkerSnapshot]) -> tuple[float, float]:
        """(prefill side, decode side): 1.0 is at the target. A colocated worker is on both."""
        c = self.config
        # Without colocate, colocated workers are not the planner's: they weigh on nothing.
        live = [s for s in snapshots if not s.switching and (c.colocate or s.role != "null")]
        p = [s for s in live if s.role in ("prefill", "null")]
        d = [s for s in live if s.role in ("decode", "null")]
        p_load = max(_worst([s.ttft_p90 / c.ttft_slo for s in p]), self._backlog(p))
        d_load = max(_worst([s.itl_p90 / c.itl_slo for s in d]),
                     _worst([s.kv_usage / c.kv_high for s in d]))
        return p_load, d_load

    def _backlog(self, prefill: Sequence[WorkerSnapshot]) -> float:
        """The prefill side's pressure now: its oldest wait so far and its queue, not the TTFTs
        of requests already answered (those a window of the past holds)."""
        c = self.config
        return max(_worst([s.oldest_wait / c.ttft_slo for s in prefill]),
                   _worst([s.waiting / c.queue_per_prefill for s in prefill]))

    def classify(self, snapshots: Sequence[WorkerSnapshot]) -> Pressure:
        c = self.config
        p_load, d_load = self.pressures(snapshots)
        if p_load > c.headroom and d_load > c.headroom:
            return "both"
        if p_load > c.headroom:
            return "prefill_bound"
        if d_load > c.headroom:
            return "decode_bound"
        if p_load < c.idle_below and d_load < c.idle_below:
            return "idle"
        return "balanced"

    def observe(self, snapshots: Sequence[WorkerSnapshot], now: float) -> list[Decision]:
        """One observation of every worker; the decisions to act on now (several switches at
        once when the pressure asks for them, else at most one)."""
        self._prompts.update((s.worker, (s.prompt_tokens, now)) for s in snapshots
                             if not math.isnan(s.prompt_tokens))
        # Not held by the merge's cooldown: the switch it waits for is that decision's effect.
        moves, self._merging = _standby_moves(self._merging, snapshots, self.config)
        self.decisions.extend((now, d) for d in moves)
        c = self.config
        if not c.colocate:  # colocated workers are not the planner's to move
            snapshots = [s for s in snapshots if s.role != "null"]
        decisions: list[Decision] = []
        if now < self._quiet_until:  # the last decision's effect is not in the figures yet
            if not (self._quiet_calm and c.colocate and c.merge_in_nice_cooldown):
                return moves
            light = self._wide_merge(self.classify(snapshots), snapshots, now, light_only=True)
            self._light_run = self._light_run + 1 if light else 0
            if self._light_run < c.patience:
                return moves
            decisions = light
        if not decisions and len(c.cores) >= 2:
            decisions = self._misplaced(snapshots)
        if not decisions and c.colocate:
            decisions = self._orphans(snapshots)
        if not decisions:
            pressure = self.classify(snapshots)
            kind, count = self._run
            self._run = (pressure, count + 1 if kind == pressure else 1)
            if self._run[1] < c.patience:
                return moves
            decisions = self._decide(pressure, snapshots, now)
        # Never every serving worker draining at once: the cluster would serve nothing for a
        # drain's length (measured: a 1P1D merge and split failed requests at the drain deadline).
        # (A priority or a cores change drains nothing.)
        serving = sum(not s.switching for s in snapshots)
        calm = all(isinstance(d, SetNice | SetCpus) for d in decisions)
        if serving and len(decisions) >= serving and not calm:
            decisions = decisions[:serving - 1]
        if not decisions:
            return moves
        self.decisions.extend((now, d) for d in decisions)
        self._quiet_until = now + (c.nice_cooldown if calm else c.cooldown)
        self._quiet_calm = calm
        self._run, self._light_run = ("balanced", 0), 0
        return moves + decisions

    # -- colocate -----------------------------------------------------------------------------

    def _orphans(self, snapshots: Sequence[WorkerSnapshot]) -> list[Decision]:
        """P with no D (or D with no P), when nothing is mid-switch: all colocated, but a D
        narrower than a colocated worker, which stays a standby (module docstring)."""
        if any(s.switching for s in snapshots):
            return []
        count = {r: sum(s.role == r for s in snapshots) for r in ("prefill", "decode")}
        if bool(count["prefill"]) == bool(count["decode"]):
            return []
        lone = "prefill" if count["prefill"] else "decode"
        other = "decode" if lone == "prefill" else "prefill"
        wide = _widest([s for s in snapshots if s.role == "null"])
        return [SwitchRole(s.worker, "null", f"no {other} worker to pair with: colocated")
                for s in snapshots if s.role == lone
                and not (lone == "decode" and _narrower(s, wide))]

    def _last_prompts(self, s: WorkerSnapshot, now: float) -> float:
        """The mean prompt (tokens) of the last window in which ``s`` took any, within
        ``recall`` seconds; NaN: none."""
        last = _kept(self._prompts.get(s.worker), now, self.config.recall)
        return math.nan if last is None else last

    def _recalled(self, mode: Mode | Placement, now: float) -> float | None:
        return _kept(self._left.get(mode), now, self.config.recall)

    def _colocate(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot], now: float
                  ) -> list[Decision] | None:
        """A merge or a split (see the module's docstring); None: neither applies, and the
        P/D part is balanced by moves as without ``colocate``."""
        if pressure not in _BOUND:
            return None
        live = [s for s in snapshots if not s.switching]
        pd = [s for s in live if s.role != "null"]
        colo = [s for s in live if s.role == "null"]
        merged = self._merge(pd, now) if pd else None
        if merged is None and colo:
            merged = self._split(pd, colo, now)
        return merged

    def _merge(self, pd: Sequence[WorkerSnapshot], now: float) -> list[Decision] | None:
        """The P/D part (``pd``, none switching) gives workers to the colocated side."""
        c = self.config
        p_load, d_load = self.pressures(pd)
        pd_class = self.classify(pd)
        held = self._recalled("colocated", now)
        was = "" if held is None else f", colocated did {held:.2f}"
        pairs = min(sum(s.role == "prefill" for s in pd), sum(s.role == "decode" for s in pd))
        # Only _wide_merge's way with a narrow D; none with a side missing (a standby D beside
        # colocated workers, or orphans: _orphans' to decide).
        if _narrow_decode(pd) or not pairs:
            return None
        donor: Role = "decode" if p_load >= d_load else "prefill"
        # An idle donor side merges too: a move would fix this phase, but it is a bet that the
        # phase lasts, made one switch per cooldown (bench/RESULTS_planner_sim.md).
        if not (pd_class in _BOUND and (held is None or max(p_load, d_load) > held)):
            return None
        self._left["pd"] = (max(p_load, d_load), now)
        why = (f"P/D prefill pressure {p_load:.2f}, decode pressure {d_load:.2f}: "
               f"{pd_class}{was}: colocated")
        # Pairs, the least loaded of each side: the P/D part keeps its ratio, and the
        # colocated workers take their share of both sides' work. As many as bring the
        # P/D part's pressure back to headroom, not capped by max_step: overshooting
        # toward colocated leaves no capacity idle.
        k = max(1, math.ceil(pairs * (1.0 - c.headroom / max(p_load, d_load))))
        # The donor side first: where every worker would switch at once, observe()
        # keeps the first ones, and the other side follows as orphans.
        return [SwitchRole(s.worker, "null", why)
                for r in (donor, "prefill" if donor == "decode" else "decode")
                for s in sorted((s for s in pd if s.role == r), key=_load)[:k]]

    def _wide_merge(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot], now: float,
                    *, light_only: bool = False) -> list[Decision]:
        """A narrow D over its target: the widest P colocated, D a standby (the module's
        docstring); [] when that does not apply (``light_only``: unless on light prompts)."""
        c = self.config
        pd = [s for s in snapshots if not s.switching and s.role != "null"]
        prefills = [s for s in pd if s.role == "prefill"]
        own = self.classify(pd)
        backlog = self._backlog(prefills)
        p_load, d_load = self.pressures(pd)
        # Light prompts taken by P while D decodes: a short-prompt phase has begun, and the
        # narrow D's batch will grow past its target; merged now, the colocated worker takes
        # the phase from its start. Waiting for D's inter-token p90 to pass the target costs
        # seconds of each such phase (bench/RESULTS_adaptive.md), and the batch built
        # meanwhile does not drain at a load near colocated's capacity.
        # A backlog of the last phase's long prompts on P does not hold it back: they drain on
        # P as they would have anyway, while the short prompts arriving meanwhile go to the
        # standby D alone instead of queueing behind them. Waiting for that backlog to clear
        # would let D's batch build first.
        taken = [t for s in prefills if not math.isnan(t := self._last_prompts(s, now))]
        light = bool(taken) and max(taken) < c.heavy_prompt and d_load > c.idle_below
        # Heavy prompts taken by P: a long-prompt phase goes on, where P/D is the mode the
        # split back chooses, and a D over its target beside them is slowed by P's prefills
        # on the cores they share, which the priority lever answers (merged there, the
        # cluster splits back again within the phase).
        heavy = any(t >= c.heavy_prompt for t in taken)
        if light_only and not light:
            return []
        # Both sides over, with P holding no backlog now: P's side is the TTFTs of a phase
        # gone by, while the narrow D serves the new phase's short prompts.
        if pressure != own or heavy or not (own == "decode_bound" or light or (
                own == "both" and backlog <= c.headroom)):
            return []
        # Colocated's remembered pressure was under the heavy prompts it split back on: it
        # says nothing of light ones.
        held = None if light else self._recalled("colocated", now)
        wide = _widest(prefills)
        narrow = _narrow_decode(pd)
        if not narrow or wide is None or (held is not None and d_load <= held):
            return []
        self._left["pd"] = (max(p_load, d_load), now)
        if c.move_standby:
            self._merging = (wide.worker, tuple(s.worker for s in pd if s.role == "decode"))
        was = "" if held is None else f", colocated did {held:.2f}"
        queued = sum(s.waiting for s in prefills)
        why = (f"{own} on D's XLA pools of {narrow} thread(s)" if not light else
               f"P took prompts of {max(taken):.0f} tokens at most, D's of {narrow} thread(s) "
               f"decoding" + (f", P's {queued} queued drain on it" if queued else ""))
        return [SwitchRole(wide.worker, "null", (
            f"P/D decode pressure {d_load:.2f}: {why}, P's of {wide.pool_threads}{was}: the "
            f"widest P colocated, D a standby"))]

    def _split(self, pd: Sequence[WorkerSnapshot], colo: Sequence[WorkerSnapshot], now: float
               ) -> list[Decision] | None:
        """The colocated workers (``colo``, none switching) give workers to the P/D part."""
        c = self.config
        p_load, d_load = self.pressures(colo)
        held = self._recalled("pd", now)
        wide = _widest(colo)
        # A standby D beside them, no P: P/D again (one switch) only where colocated's
        # prefills are heavy too, so its decode steps wait behind them. Its decode pressure
        # alone is its own steps' speed, which the narrow D would not better.
        standby = wide is not None and not any(s.role == "prefill" for s in pd) and any(
            s.role == "decode" and _narrower(s, wide) for s in pd)
        # Beside a standby, over both targets with the decode side the worse and heavy prompts
        # taken in the window: prefills stall every decode step by a chunk, so the
        # inter-token p90 grows more than the TTFT. Over both at a short-prompt phase's peak
        # is the colocated worker's own full batch, which P beside the narrow D makes worse,
        # whichever side is the worse: the latencies cannot tell the two apart, the prompts
        # can (bench/RESULTS_adaptive.md).
        heavy = [s.prompt_tokens for s in colo if s.prompt_tokens >= c.heavy_prompt]
        behind = (self.classify(colo) == "both" and d_load > p_load and bool(heavy)
                  if standby else self.classify(colo) == "decode_bound")
        if not (behind and now - self._split_at >= c.recall
                and (held is None or max(p_load, d_load) > c.imbalance * held)):
            return None
        why = (f"colocated prefill pressure {p_load:.2f}, decode pressure {d_load:.2f}: "
               f"decode steps wait behind prefills"
               + (f" of {max(heavy):.0f}-token prompts" if standby else "")
               + ("" if held is None else f", P/D did {held:.2f}"))
        order = sorted(colo, key=_load)
        split: list[Decision]
        if standby:
            assert wide is not None
            split = [SwitchRole(wide.worker, "prefill", f"{why}: P beside the standby D")]
        elif any(s.role == "prefill" for s in pd) and any(s.role == "decode" for s in pd):
            pd_p, pd_d = self.pressures(pd)
            to: Role = "prefill" if pd_p > pd_d else "decode"
            split = [SwitchRole(order[0].worker, to, f"{why}: to {to}")]
        elif len(order) >= 3:  # one stays colocated: someone serves while the pair drains
            split = [SwitchRole(order[0].worker, "decode", f"{why}: split into P/D"),
                     SwitchRole(order[1].worker, "prefill", f"{why}: split into P/D")]
        else:
            return None
        self._left["colocated"] = (max(p_load, d_load), now)
        self._split_at = now
        return split

    # -- cores --------------------------------------------------------------------------------

    def _cores_of(self, role: Role, placement: Placement) -> frozenset[int]:
        cores = self.config.cores
        return split_halves(cores)[role] if placement == "split" else cores

    def _misplaced(self, snapshots: Sequence[WorkerSnapshot]) -> list[Decision]:
        """The placement in force, read from the P and D workers' cores (shared when every
        one has every core, else split: a move the workers did not all take counts as not
        made), and every worker whose cores are not its role's under it, moved. Read, not
        remembered: a move that failed, or was only logged (``--dry-run``), is decided again
        as any decision is, not repeated at every observation."""
        pd = [s for s in snapshots if s.role != "null" and s.cpus is not None]
        self.placement = (None if not pd else "shared"
                          if all(s.cpus == self.config.cores for s in pd) else "split")
        placement = self.placement
        if placement is None:
            return []
        return [SetCpus(s.worker, want, f"{s.role} worker on cores {_listed(s.cpus)}: "
                                        f"{placement}, its cores are {_listed(want)}")
                for s in snapshots
                if not s.switching and s.cpus is not None
                and s.cpus != (want := self._cores_of(s.role, placement))]

    def _place(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot], now: float
               ) -> list[Decision]:
        """P and D from split to shared cores or back (see the module's docstring); [] when
        the placement in force stays."""
        c = self.config
        live = [s for s in snapshots if not s.switching]
        # The placement is P's beside D: with either missing (a standby D beside a colocated
        # worker, say) there is nothing to place.
        if self.placement is None or not all(any(s.role == r for s in live)
                                             for r in ("prefill", "decode")):
            return []
        p_load, d_load = self.pressures(snapshots)
        busy = max(s.busy for s in live if s.role == "decode")
        why = (f"prefill pressure {p_load:.2f}, decode pressure {d_load:.2f}, "
               f"busiest D {busy:.0%} busy")
        to: Placement
        if self.placement == "split":
            starved = pressure == "prefill_bound" or (
                pressure == "both" and p_load >= c.imbalance * d_load)
            if not (starved and busy < c.share_below):
                return []
            to, why = "shared", f"{why}: P over its target, D mostly idle: P and D share cores"
        else:
            if (pressure == "decode_bound" and not self._p_above_floor(live)
                    and not (c.colocate and _narrow_decode(live))):
                # (A narrow D gains no thread from a split: colocate merges it instead.)
                why = f"{why}: D over its target beside P: P and D split the cores"
            elif p_load > c.headroom and busy > c.split_above and any(
                    s.pool_threads != 1 for s in live if s.role == "decode"):
                why = f"{why}: P over its target behind a busy D: P and D split the cores"
            else:
                return []
            to = "split"
        # Back to a placement left lately only when this one does worse than it did.
        worse = max(p_load, d_load)
        held = self._recalled(to, now)
        if held is not None and worse <= held:
            return []
        self._left[self.placement] = (worse, now)
        self.placement = to
        return [SetCpus(s.worker, want, why) for s in live
                if s.cpus != (want := self._cores_of(s.role, to))]

    def _p_above_floor(self, live: Sequence[WorkerSnapshot]) -> bool:
        """Some P above the lowest of ``prefill_nices``: a D over its target beside it is
        given its priority back before the cores are split (the priority lever below)."""
        if not self.config.prefill_nices:
            return False
        lowest = self.config.prefill_nices[0]
        return any(s.role == "prefill" and s.nice is not None and s.nice < lowest for s in live)

    # -- P and D ------------------------------------------------------------------------------

    def _decide(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot], now: float
                ) -> list[Decision]:
        c = self.config
        # Before the levers: a narrow D's own steps are slow, whatever P's priority or cores.
        wide = self._wide_merge(pressure, snapshots, now) if c.colocate else []
        if wide:
            return wide
        levers = self._levers(pressure, snapshots, now)
        if levers:
            return levers
        if c.colocate:
            merged_or_split = self._colocate(pressure, snapshots, now)
            if merged_or_split is not None:
                return merged_or_split
            # What is left to balance is the P/D part: its own pressures decide the moves.
            snapshots = [s for s in snapshots if s.role != "null"]
            if not snapshots:
                return []
            pressure = self.classify(snapshots)
        live = [s for s in snapshots if not s.switching]
        count = {r: sum(s.role == r for s in live) for r in ("prefill", "decode")}
        grow = c.max_workers > 0 and len(snapshots) < c.max_workers
        p_load, d_load = self.pressures(snapshots)
        why = f"prefill pressure {p_load:.2f}, decode pressure {d_load:.2f}"
        worse: Role = "prefill" if p_load >= d_load else "decode"
        if pressure == "both":
            if grow:
                return [ScaleUp(worse, f"{why}: both over {c.headroom:g}")]
            if max(p_load, d_load) < c.imbalance * min(p_load, d_load):
                return []
            pressure = "prefill_bound" if worse == "prefill" else "decode_bound"
            why = f"{why}: both over {c.headroom:g}, {worse} {c.imbalance:g}x worse"
        if pressure in ("prefill_bound", "decode_bound"):
            starved: Role = "prefill" if pressure == "prefill_bound" else "decode"
            donor: Role = "decode" if starved == "prefill" else "prefill"
            if grow:
                return [ScaleUp(starved, f"{why}: {starved} over {c.headroom:g}")]
            floor = c.min_decode if donor == "decode" else c.min_prefill
            if count[donor] <= floor:
                return []
            loads = {"prefill": p_load, "decode": d_load}
            # As many as bring the starved side back to headroom, as many as the donor can
            # give while staying under it (one when both are over), within its floor.
            need = math.ceil(count[starved] * (loads[starved] / c.headroom - 1.0))
            spare = (math.floor(count[donor] * (1.0 - loads[donor] / c.headroom))
                     if loads[donor] < c.headroom else 1)
            k = max(1, min(need, spare, count[donor] - floor))
            if c.max_step:
                k = min(k, c.max_step)
            donors = sorted((s for s in live if s.role == donor), key=_load)[:k]
            return [SwitchRole(d.worker, starved, f"{why}: {starved} over {c.headroom:g}, "
                               f"{donor} under it ({k} of {count[donor]})") for d in donors]
        if pressure == "idle" and c.max_workers > 0 and len(live) > c.min_workers:
            side: Role = "prefill" if p_load <= d_load else "decode"
            floor = c.min_prefill if side == "prefill" else c.min_decode
            if count[side] <= floor:
                return []
            idlest = min((s for s in live if s.role == side), key=_load)
            return [ScaleDown(idlest.worker, f"{why}: every side under {c.idle_below:g}")]
        return []


    def _levers(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot], now: float
                ) -> list[Decision]:
        """Cores, then priorities: what moves without a drain ([]: the role moves decide)."""
        c = self.config
        placed = self._place(pressure, snapshots, now) if len(c.cores) >= 2 else []
        if placed:
            return placed
        # Split, P's priority weighs on nothing (it has cores of its own).
        if c.prefill_nices and self.placement != "split":
            return self._renice(pressure, snapshots)
        return []

    def _renice(self, pressure: Pressure, snapshots: Sequence[WorkerSnapshot]
                ) -> list[Decision]:
        """Every P one step of ``prefill_nices`` toward the starved side (see the module's
        docstring); [] when no P can move, and the role moves decide."""
        c = self.config
        p_load, d_load = self.pressures(snapshots)
        both = pressure == "both"
        if both and max(p_load, d_load) >= c.imbalance * min(p_load, d_load):
            pressure = "prefill_bound" if p_load >= d_load else "decode_bound"
        if pressure not in ("prefill_bound", "decode_bound"):
            return []
        up = pressure == "prefill_bound"
        starved = p_load if up else d_load
        # One step when the other side is over its target too: it pays for every step.
        k = 1 if both else max(1, math.ceil(math.log2(starved / c.headroom)))
        why = (f"prefill pressure {p_load:.2f}, decode pressure {d_load:.2f}: {pressure}: "
               f"P's priority {'up' if up else 'down'}")
        out: list[Decision] = []
        for s in snapshots:
            if s.role != "prefill" or s.switching or s.nice is None:
                continue
            # Nearest first: up the steps toward the last, down them toward the first.
            steps = ([n for n in c.prefill_nices if n < s.nice] if up
                     else [n for n in reversed(c.prefill_nices) if n > s.nice])
            if steps:
                to = steps[min(k, len(steps)) - 1]
                out.append(SetNice(s.worker, to, f"{why}: nice {s.nice} -> {to}"))
        return out


def _kept(kept: tuple[float, float] | None, now: float, within: float) -> float | None:
    """A (value, when) kept no more than ``within`` seconds before ``now``: its value."""
    return None if kept is None or now - kept[1] > within else kept[0]


def _standby_moves(merging: tuple[str, tuple[str, ...]] | None,
                   snapshots: Sequence[WorkerSnapshot], c: PlannerConfig
                   ) -> tuple[list[Decision], tuple[str, tuple[str, ...]] | None]:
    """A wide merge's standby Ds give their streams to the colocated worker once it serves
    (the module's docstring): the moves to make now, and the merge still to wait for (None:
    done, or the switch ended otherwise)."""
    if merging is None:
        return [], None
    wide, standbys = merging
    by_name = {s.worker: s for s in snapshots}
    merged = by_name.get(wide)
    if merged is None or merged.switching:  # not scraped this time, or still draining
        return [], merging
    if merged.role != "null":  # the switch failed or was undone: nothing to move to
        return [], None
    moves: list[Decision] = [
        MoveStreams(s.worker, int(c.heavy_prompt), (
            f"standby D decoding {s.running} stream(s) on the cores of the colocated worker "
            f"it merged into: those of at most {c.heavy_prompt:.0f} tokens so far move to it"))
        for name in standbys if (s := by_name.get(name)) is not None
        and s.role == "decode" and not s.switching and s.running > 0]
    return moves, None


def _narrow_decode(live: Sequence[WorkerSnapshot]) -> int:
    """The threads of every D's XLA pools where all of them are narrower than some P's (the
    narrow D of the module's docstring); 0 otherwise, or where any is not known."""
    wide = _widest([s for s in live if s.role == "prefill"])
    ds = [s for s in live if s.role == "decode"]
    if not ds or not all(_narrower(s, wide) for s in ds):
        return 0
    return max(s.pool_threads or 0 for s in ds)


def _listed(cpus: frozenset[int] | None) -> str:
    return "?" if cpus is None else ",".join(map(str, sorted(cpus)))


def _widest(workers: Sequence[WorkerSnapshot]) -> WorkerSnapshot | None:
    """The worker with the most XLA pool threads (known), the least loaded of those tied."""
    known = [s for s in workers if s.pool_threads is not None]
    return min(known, key=lambda s: (-(s.pool_threads or 0), _load(s)), default=None)


def _narrower(s: WorkerSnapshot, than: WorkerSnapshot | None) -> bool:
    return (than is not None and s.pool_threads is not None and than.pool_threads is not None
            and s.pool_threads < than.pool_threads)


def _load(s: WorkerSnapshot) -> tuple[int, str]:
    return s.waiting + s.running, s.worker
