"""The bench's phase table: quantiles from histogram bucket deltas (as Prometheus'
histogram_quantile interpolates them), the sides told apart by the histograms they expose."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pd_fsm.io_trio.bench_client import (
    diff_histograms,
    histogram_quantile,
    parse_histograms,
    phase_table,
    side_of,
)
from pd_fsm.io_trio.phases import PHASES, PhaseHistograms, role_phases
from pd_fsm.io_trio.worker.metrics import WorkerMetrics

INF = math.inf


def test_quantile_interpolates_inside_the_bucket() -> None:
    buckets = {0.1: 0.0, 1.0: 10.0, 2.0: 20.0, INF: 20.0}
    assert histogram_quantile(0.5, buckets) == pytest.approx(1.0)  # rank 10: top of (0.1, 1]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.55)  # rank 5: half of (0.1, 1]
    assert histogram_quantile(0.99, buckets) == pytest.approx(1.98)  # rank 19.8 in (1, 2]


def test_quantile_edges() -> None:
    # The first bucket starts at 0.
    assert histogram_quantile(0.5, {1.0: 4.0, INF: 4.0}) == pytest.approx(0.5)
    # A rank in the +Inf bucket answers the highest finite bound.
    assert histogram_quantile(0.5, {1.0: 0.0, 2.0: 0.0, INF: 5.0}) == 2.0
    # No observations, or no +Inf bucket: NaN.
    assert math.isnan(histogram_quantile(0.5, {1.0: 0.0, INF: 0.0}))
    assert math.isnan(histogram_quantile(0.5, {1.0: 3.0}))
    assert math.isnan(histogram_quantile(0.5, {}))


def test_deltas_of_a_run_and_a_restart() -> None:
    before = {"h": {1.0: 2.0, INF: 3.0}}
    assert diff_histograms(before, {"h": {1.0: 5.0, INF: 7.0}}) == {"h": {1.0: 3.0, INF: 4.0}}
    # A process that restarted in between counts from zero: its new counts are the run's.
    assert diff_histograms(before, {"h": {1.0: 1.0, INF: 1.0}}) == {"h": {1.0: 1.0, INF: 1.0}}
    # A histogram that appeared during the run.
    assert diff_histograms({}, {"g": {1.0: 1.0, INF: 2.0}}) == {"g": {1.0: 1.0, INF: 2.0}}


def _exposition(role: str, samples: dict[str, list[float]]) -> str:
    if role == "proxy":
        registry = CollectorRegistry()
        phases = PhaseHistograms(registry, "proxy")
        ttft = None
    else:
        metrics = WorkerMetrics(lambda: {}, role)
        registry, phases, ttft = metrics.registry, metrics.phases, metrics.ttft
    for key, values in samples.items():
        for v in values:
            if key == "ttft":
                assert ttft is not None
                ttft.observe(v)
            else:
                phases.observe(key, v)
    return generate_latest(registry).decode()


def test_each_role_exposes_only_its_phases() -> None:
    for role in ("prefill", "decode", "proxy"):
        names = set(parse_histograms(_exposition(role, {})))
        mine = {p.name for p in role_phases(role)}
        assert mine and mine <= names
        assert not ({p.name for p in PHASES} - mine) & names
    colocated = set(parse_histograms(_exposition("null", {})))
    assert not {p.name for p in PHASES} & colocated


def test_phase_table_from_scrapes_before_and_after() -> None:
    p_before = _exposition("prefill", {"prefill_queue": [0.003]})
    p_after = _exposition("prefill", {"prefill_queue": [0.003, 0.02, 0.02, 0.02],
                                      "kv_gather": [0.0002]})
    d_after = _exposition("decode", {"kv_pull": [0.04] * 3, "kv_transfer_bytes": [3e6],
                                     "kv_transfer_gbps": [1.5], "ttft": [0.3]})
    x_after = _exposition("proxy", {"proxy_decode_first_byte": [0.4]})
    before = {"p": parse_histograms(p_before)}
    after = {"p": parse_histograms(p_after), "d": parse_histograms(d_after),
             "x": parse_histograms(x_after)}
    assert [side_of(after[k]) for k in ("p", "d", "x")] == ["P", "D", "proxy"]
    table = phase_table(before, after)
    rows = {tuple(line.split()[:2]): line.split() for line in table.splitlines()[3:]}
    # 3 of the 4 queue samples are this run's: all in (0.01, 0.025].
    assert rows["P", "prefill_queue"][-1] == "3"
    assert 10.0 <= float(rows["P", "prefill_queue"][2]) <= 25.0  # p50, ms
    assert rows["P", "kv_gather"][-1] == "1"
    assert rows["D", "kv_pull"][-1] == "3"
    assert rows["D", "kv_transfer_bytes"][3] == "MB"
    assert rows["D", "kv_transfer_gbps"][3] == "GB/s"
    assert rows["D", "time_to_first_token"][-1] == "1"
    assert rows["proxy", "decode_first_byte"][-1] == "1"
    # A phase seen nowhere this run has its row with no quantile.
    assert rows["P", "kv_register"][2:] == ["-", "-", "0"]
    # Rows come in the order a request meets the phases.
    order = [key for key in rows]
    assert order.index(("D", "kv_pull")) > order.index(("P", "prefill_queue"))
    assert order.index(("proxy", "decode_first_byte")) > order.index(("D", "time_to_first_token"))


def test_phase_table_without_any_histogram_says_so() -> None:
    assert "no phase histograms" in phase_table({}, {"u": {}})
