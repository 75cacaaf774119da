"""Planning a fleet on the chip's costs (``pd-fsm plan``): every configuration of a cell of
chips — colocated at each TP, every static P:D split with TP per role, the KV streamed or
not — its goodput against rate (``fleet.py``), the rate where colocated first misses half its
requests, the best configuration there and the term that binds it.

A fleet of ``chips`` is ``chips / cell`` replicas of one cell (a host of 8 chips by default),
each taking an equal share of the arrivals (a Poisson stream split evenly at random is Poisson
in each part): its goodput is the cell's times the replicas. What that leaves out: a router
over the whole fleet pools its queues (a little more goodput near saturation for every
configuration), and P:D splits that differ between hosts. ``cell`` may be the whole fleet
(slower: every instance is simulated).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

from pd_fsm.sim.chip import ChipCosts
from pd_fsm.sim.fleet import (
    FleetConfig,
    FleetReq,
    FleetRun,
    FleetWorkload,
    Slo,
    goodput,
    simulate_fleet,
)

TPS = (1, 2, 4, 8)


def configurations(cell: int, stream_tokens: int = 1024) -> list[FleetConfig]:
    """Colocated at every TP that divides the cell, then every split using all its chips."""
    out = [FleetConfig(f"colocated {cell // tp}x TP{tp}", colocated=cell // tp, tp_colocated=tp)
           for tp in TPS if tp <= cell and cell % tp == 0]
    for tp_p in TPS:
        for tp_d in TPS:
            for p in range(1, cell // tp_p + 1):
                left = cell - p * tp_p
                if left <= 0 or left % tp_d:
                    continue
                d = left // tp_d
                for streamed in (False, True):
                    name = (f"{p}P TP{tp_p} : {d}D TP{tp_d}"
                            + (f", streamed {stream_tokens}" if streamed else ""))
                    out.append(FleetConfig(name, prefill=p, tp_prefill=tp_p, decode=d,
                                           tp_decode=tp_d, streamed=streamed,
                                           stream_tokens=stream_tokens))
    return out


@attrs.frozen
class Settings:
    """What every run of a plan shares."""

    costs: ChipCosts
    workload: FleetWorkload
    slo: Slo
    seed: int = 0
    drain_s: float = 600.0  # after the last arrival, at most this long to finish
    max_batched_tokens: int = 0  # 0: the profile's
    max_running: int = 0  # 0: the profile's


@attrs.frozen
class Point:
    """One configuration at one rate (per cell)."""

    rate: float
    goodput: float
    met: float  # share of the arrivals that met both SLOs
    ttft_missed: int
    itl_missed: int
    run: FleetRun


def evaluate(s: Settings, config: FleetConfig, rate: float) -> Point:
    reqs = s.workload.requests(rate, s.seed)
    profile = s.costs.profile
    run = simulate_fleet(s.costs, config, reqs, s.workload.seconds + s.drain_s,
                         s.max_batched_tokens or profile.max_batched_tokens,
                         s.max_running or profile.max_running)
    good = goodput(run.requests, s.slo, 0.0, s.workload.seconds)
    met = sum(1 for r in run.requests if s.slo.met(r))
    ttft = sum(1 for r in run.requests if not s.slo.met(r) and r.ttft > s.slo.ttft_slo(r))
    itl = sum(1 for r in run.requests if not s.slo.met(r) and r.ttft <= s.slo.ttft_slo(r))
    return Point(rate, good, met / max(len(reqs), 1), ttft, itl, run)


def half_miss_rate(s: Settings, colocated: Sequence[FleetConfig], low: float = 0.25,
                   rounds: int = 8) -> float:
    """The lowest rate (per cell, to within 1/2^rounds of it) at which the best colocated
    configuration meets at most half of its requests: doubling from ``low``, then bisecting."""

    def half_missed(rate: float) -> bool:
        return max(evaluate(s, c, rate).met for c in colocated) <= 0.5

    hi = low
    while not half_missed(hi):
        hi *= 2
        if hi > 1e5:
            raise ValueError("colocated never misses half its requests below 1e5 req/s")
    lo = hi / 2 if hi > low else 0.0
    for _ in range(rounds):
        mid = (lo + hi) / 2
        if half_missed(mid):
            hi = mid
        else:
            lo = mid
    return hi


def binding(config: FleetConfig, point: Point) -> str:
    """Which term binds ``config`` at ``point``: the busiest of its instances' compute and P's
    KV stages (busy shares over the run), beside the peak share of KV each role held, and what
    its missed requests missed (a TTFT, or only the ITL)."""
    run = point.run
    terms = {f"{role} compute": share for role, share in run.busy.items()}
    if config.prefill:
        for name, share in zip(("KV off P's chips", "KV link", "KV onto D's chips"),
                               run.stage_busy, strict=True):
            terms[name] = share
    top = max(terms, key=lambda k: terms[k])
    listed = ", ".join(f"{k} {v:.0%}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1]))
    peaks = ", ".join(f"{role} {share:.0%}" for role, share in run.kv_peak.items())
    return (f"binds: {top} ({terms[top]:.0%} busy); {listed}; KV held at peak: {peaks}; "
            f"missed TTFT {point.ttft_missed}, ITL only {point.itl_missed}")


def streamed_hidden(costs: ChipCosts, prompt: int, tp_p: int = 1, tp_d: int = 1,
                    stream_tokens: int = 1024) -> tuple[float, float, float]:
    """One request of ``prompt`` tokens alone through one P and one D: the KV transfer's time
    not streamed, what streaming leaves exposed after the prefill's end, and the share it
    hides."""
    exposed: list[float] = []
    for streamed in (False, True):
        config = FleetConfig("one", prefill=1, tp_prefill=tp_p, decode=1, tp_decode=tp_d,
                             streamed=streamed, stream_tokens=stream_tokens)
        run = simulate_fleet(costs, config, [FleetReq(0.0, prompt, 2)], 600.0,
                             costs.profile.max_batched_tokens, costs.profile.max_running)
        r = run.requests[0]
        exposed.append(r.ready - r.prefill_end)
    whole, left = exposed
    return whole, left, 1.0 - left / whole if whole > 0 else 1.0


def rate_grid(anchor: float, factors: Sequence[float] = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0)
              ) -> Iterator[float]:
    for f in factors:
        yield round(anchor * f, 4)
