"""A worker as the planner sees it: its role from ``/server_info``, its queues, KV use and
latency histograms from ``/metrics`` (the names ``worker/metrics.py`` exports).

Latencies are p90s over the window between two scrapes: the difference of the cumulative
histograms, so a worker's history before the last decision does not weigh on the next one. A P's
(or colocated worker's) oldest request still waiting for its first answer
(``oldest_unanswered_seconds``) is read as it is now: a backlog shows there before any TTFT does.

A colocated worker (role ``null``) serves whole requests: its TTFT and ITL both come
from its own histograms, its waiting requests are those not prefilled yet, as P's. (A planner
without ``--colocate`` leaves such workers out of its pressures: ``core/planner.py``.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypeGuard, cast, get_args

import attrs
from prometheus_client.parser import text_string_to_metric_families

from pd_fsm.core.planner import Role, WorkerSnapshot
from pd_fsm.io_trio.worker.metrics import PREFIX

TTFT = f"{PREFIX}_time_to_first_token_seconds"
ITL = f"{PREFIX}_inter_token_latency_seconds"
BACKEND = f"{PREFIX}_backend_"
# Requests not prefilled yet (P), or whose KV has not arrived yet (D): pd_queues' keys.
D_WAITING_QUEUES = ("recv_queue", "alloc_queue", "pulls_inflight")
# The roles the core planner takes snapshots of (``Role``'s values).
PLANNED_ROLES: tuple[str, ...] = get_args(Role)


@attrs.frozen
class Histogram:
    """Cumulative bucket counts by upper bound (the last bound is +inf)."""

    bounds: tuple[float, ...] = ()
    counts: tuple[float, ...] = ()

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, earlier: Histogram | None) -> Histogram:
        """What was observed after ``earlier`` (a worker restarted meanwhile: all of it)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.total > self.total:
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in
                                            zip(self.counts, earlier.counts, strict=True)))

    def quantile(self, q: float) -> float:
        """The q-quantile, linear within its bucket; NaN with nothing observed. One past the
        last finite bound reads as that bound (a lower bound of the truth)."""
        if self.total <= 0:
            return math.nan
        rank = q * self.total
        low, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return low
                inside = count - below
                return low + (bound - low) * ((rank - below) / inside if inside else 1.0)
            low, below = bound, count
        return low


@attrs.frozen
class Scrape:
    """One scrape of one worker."""

    role: str  # "prefill" | "decode" | "null"
    serving: bool  # False while it drains for a role switch, or switches
    ttft: Histogram
    itl: Histogram
    gauges: Mapping[str, float]  # pd_fsm_worker_backend_* by name (labelled: "name{key}")
    nice: int | None = None  # its compute threads' CPU priority (/server_info's "nice")
    cpus: frozenset[int] | None = None  # the cores its threads run on (/server_info's "cpus")
    pool_threads: int | None = None  # its XLA pools' threads (/server_info's "cpu_pool_threads")
    at: float = 0.0  # when it was scraped (the planner's clock): busy shares need the window

    def busy(self, earlier: Scrape | None) -> float:
        """The share of the window since ``earlier`` its scheduler's steps ran (0 with no
        earlier scrape, or a worker that restarted meanwhile)."""
        key = "step_seconds_total"
        if (earlier is None or self.at <= earlier.at or key not in self.gauges
                or key not in earlier.gauges):
            return 0.0
        ran = self.gauges[key] - earlier.gauges[key]  # negative after a restart: 0 below
        return max(0.0, min(1.0, ran / (self.at - earlier.at)))

    def prompt_mean(self, earlier: Scrape | None) -> float:
        """The mean prompt (tokens) of the requests its scheduler admitted in the window since
        ``earlier``; NaN with none admitted, no earlier scrape, or a restart meanwhile."""
        keys = ("prompt_tokens_total", "prompts_total")
        if earlier is None or not all(k in self.gauges and k in earlier.gauges for k in keys):
            return math.nan
        tokens, prompts = (self.gauges[k] - earlier.gauges[k] for k in keys)
        return tokens / prompts if prompts > 0 and tokens >= 0 else math.nan

    def snapshot(self, worker: str, earlier: Scrape | None) -> WorkerSnapshot | None:
        """The planner's view over the window since ``earlier``; None for a role the core
        planner does not know (``Role``'s values)."""
        if self.role not in PLANNED_ROLES:
            return None
        g = self.gauges
        if self.role == "decode":
            waiting = sum(g.get(f"pd_queues{{{k}}}", 0.0) for k in D_WAITING_QUEUES)
        else:  # P, or a colocated worker: requests queued or not prefilled yet
            waiting = g.get("queued", 0.0) + g.get("waiting", 0.0)
        total = g.get("total_pages", 0.0)
        used = (total - g.get("free_pages", total)) / total if total > 0 else 0.0
        # D's requests wait for P's prefill and the transfer: not D's own backlog.
        oldest = 0.0 if self.role == "decode" else g.get("oldest_unanswered_seconds", 0.0)
        return WorkerSnapshot(
            worker=worker,
            role=cast(Role, self.role),  # checked above against Role's values
            waiting=int(waiting),
            running=int(g.get("running", 0.0)),
            ttft_p90=self.ttft.since(None if earlier is None else earlier.ttft).quantile(0.9),
            itl_p90=self.itl.since(None if earlier is None else earlier.itl).quantile(0.9),
            kv_usage=max(0.0, min(1.0, used)),
            switching=not self.serving,
            nice=self.nice,
            oldest_wait=oldest,
            cpus=self.cpus,
            busy=self.busy(earlier),
            pool_threads=self.pool_threads,
            prompt_tokens=self.prompt_mean(earlier),
        )


def parse(info: Mapping[str, object], metrics: str, at: float = 0.0) -> Scrape:
    """A scrape from a worker's ``/server_info`` (parsed) and ``/metrics`` (text), taken
    ``at``. Raises ValueError for text that is not Prometheus' exposition format."""
    buckets: dict[str, list[tuple[float, float]]] = {TTFT: [], ITL: []}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.name[: -len("_bucket")] in buckets:
                le = float(sample.labels["le"])
                buckets[sample.name[: -len("_bucket")]].append((le, float(sample.value)))
            elif sample.name.startswith(BACKEND):
                key = sample.name[len(BACKEND):]
                if "key" in sample.labels:
                    key = f"{key}{{{sample.labels['key']}}}"
                gauges[key] = float(sample.value)
    role, nice, threads = (info.get("disaggregation_mode"), info.get("nice"),
                           info.get("cpu_pool_threads"))
    return Scrape(
        role=role if isinstance(role, str) else "null",
        serving=info.get("role_state", "SERVING") == "SERVING",
        ttft=_histogram(buckets[TTFT]),
        itl=_histogram(buckets[ITL]),
        gauges=gauges,
        nice=nice if _whole(nice) else None,
        cpus=_cpus(info.get("cpus")),
        pool_threads=threads if _whole(threads) and threads >= 1 else None,
        at=at,
    )


def _whole(value: object) -> TypeGuard[int]:
    """An int from JSON (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _cpus(listed: object) -> frozenset[int] | None:
    """/server_info's ``cpus`` (a list of core ids); None for anything else."""
    if not isinstance(listed, list) or not listed:
        return None
    if not all(_whole(c) and c >= 0 for c in listed):
        return None
    return frozenset(listed)


def _histogram(pairs: list[tuple[float, float]]) -> Histogram:
    pairs.sort()
    return Histogram(tuple(b for b, _ in pairs), tuple(c for _, c in pairs))
