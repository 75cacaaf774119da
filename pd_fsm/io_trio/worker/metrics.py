"""Prometheus metrics of one worker: a registry per app (tests run several in one process).

The HTTP layer counts requests by endpoint and outcome, tokens and latencies; whatever the
backend's ``stats()`` returns is exported generically at scrape time: a number becomes a gauge
(or a counter when its key ends in ``_total``), a dict of numbers a metric with a ``key`` label
(e.g. KVPoll state counts, requests by outcome). A PD worker also has one histogram per phase
of a PD request that its role carries out (``phases.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd_fsm.core.role_switch import OUTCOMES
from pd_fsm.io_trio.phases import PhaseHistograms
from pd_fsm.io_trio.stats_metrics import StatsCollector

PREFIX = "pd_fsm_worker"
TTFT_PARTS = ("queue", "prefill", "delivery")
# 2 s and 100 ms are bounds: the default SLO's (--slo-ttft, --slo-itl) quantiles are exact there.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 2.5, 5, 10, 30, 60, 120, 300)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1,
               2.5, 5, 10)
# A drain's decision (drain_gate.py), by outcome and reason: /metrics shows each from 0.
DRAIN_OUTCOMES: dict[str, tuple[str, ...]] = {
    "handed_off": ("other_decode_healthy",),
    "finished_in_place": ("disabled", "not_decode", "spans_processes", "no_other_decode",
                          "no_healthy_decode", "registry_unreadable"),
}


@attrs.frozen
class RoleSnapshot:
    """A worker's role as /metrics shows it (worker/roles.py makes it)."""

    role: str
    epoch: int
    roles: tuple[str, ...]
    switches: Mapping[tuple[str, str, str], int]  # (from, to, outcome) -> count


class RoleCollector(Collector):
    """``role_switches_total{from,to,outcome}``, ``role_epoch`` and the current role as
    ``role{key}`` (1 for the role served, 0 for the others it may take)."""

    def __init__(self, snapshot: Callable[[], RoleSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        switches = CounterMetricFamily(f"{PREFIX}_role_switches",
                                       "role switches by the roles left and taken and outcome",
                                       labels=["from", "to", "outcome"])
        # Every switch this worker may make, by every outcome, from 0: a rate over a series
        # that appears only at its first switch would miss that switch.
        counts = {(a, b, o): 0 for a in snap.roles for b in snap.roles if a != b
                  for o in OUTCOMES}
        counts.update(snap.switches)
        for (source, target, outcome), n in sorted(counts.items()):
            switches.add_metric([source, target, outcome], n)
        yield switches
        yield GaugeMetricFamily(f"{PREFIX}_role_epoch",
                                "completed role switches of this worker (0 at start)",
                                value=snap.epoch)
        role = GaugeMetricFamily(f"{PREFIX}_role", "1 for the role this worker serves now",
                                 labels=["key"])  # not "role": the scrape target has one
        for r in snap.roles:
            role.add_metric([r], float(r == snap.role))
        yield role


class WorkerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]],
                 roles: str | tuple[str, ...] = "null",
                 slo: tuple[float, float] = (2.0, 0.1)) -> None:
        """``roles``: the role served, or every role the worker may take (their phases)."""
        self.slo_ttft, self.slo_itl = slo
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            f"{PREFIX}_http_requests",
            "generation requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "prompt tokens of accepted requests", registry=self.registry
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens", "tokens generated", registry=self.registry
        )
        self._latencies()
        self.slo = Counter(
            f"{PREFIX}_requests_slo",
            "finished requests by whether they met --slo-ttft and --slo-itl (goodput: met=true)",
            ["met"],
            registry=self.registry,
        )
        for met in ("true", "false"):
            self.slo.labels(met)  # both series exist from the start: rates need no guesswork
        self.drains = Counter(
            f"{PREFIX}_drains",
            "drains (SIGTERM, role switches) by whether running streams were handed off to "
            "another decode worker, and why not",
            ["outcome", "reason"],
            registry=self.registry,
        )
        for outcome, reasons in DRAIN_OUTCOMES.items():
            for reason in reasons:
                self.drains.labels(outcome, reason)
        self.phases = PhaseHistograms(self.registry, *((roles,) if isinstance(roles, str)
                                                       else roles))
        self.registry.register(StatsCollector(stats, f"{PREFIX}_backend"))

    def _latencies(self) -> None:
        """A request's latency histograms: TTFT (and its parts), end to end, inter-token."""
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "request arrival to first output",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft_parts = Histogram(
            f"{PREFIX}_time_to_first_token_part_seconds",
            "the parts of a TTFT where this worker prefilled the request: queue (arrival to its "
            "first forward, the steps in flight waited for), prefill (its first forward to its "
            "first token on the host: every chunk, and the device's queue), delivery (the "
            "token on the host to its HTTP handler)",
            ["part"],
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )
        for part in TTFT_PARTS:
            self.ttft_parts.labels(part)
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "request arrival to last output",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "time between a request's consecutive output tokens (tokens sent together share "
            "the interval)",
            buckets=ITL_BUCKETS,
            registry=self.registry,
        )

    def add_roles(self, snapshot: Callable[[], RoleSnapshot]) -> None:
        self.registry.register(RoleCollector(snapshot))

    def render(self) -> bytes:
        return generate_latest(self.registry)
