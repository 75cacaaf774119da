"""The planner service's reading of a worker: real ``WorkerMetrics`` text in, the core
planner's ``WorkerSnapshot`` out (``pd_fsm/io_trio/planner/scrape.py``)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pd_fsm.io_trio.planner.scrape import Histogram, parse
from pd_fsm.io_trio.worker.metrics import WorkerMetrics


def _text(stats: dict[str, Any], ttft: list[float] = (), itl: list[float] = ()) -> tuple[
        WorkerMetrics, str]:
    m = WorkerMetrics(lambda: stats)
    for v in ttft:
        m.ttft.observe(v)
    for v in itl:
        m.itl.observe(v)
    return m, m.render().decode()


def test_quantile_interpolates_within_a_bucket_and_is_nan_when_empty() -> None:
    h = Histogram((0.1, 0.2, math.inf), (0.0, 10.0, 10.0))
    assert h.quantile(0.9) == pytest.approx(0.19)
    assert h.quantile(0.5) == pytest.approx(0.15)
    assert math.isnan(Histogram((1.0, math.inf), (0.0, 0.0)).quantile(0.9))
    # Past the last finite bound: that bound, a lower bound of the truth.
    assert Histogram((1.0, math.inf), (0.0, 4.0)).quantile(0.9) == 1.0


def test_since_is_the_window_and_a_restart_starts_it_again() -> None:
    early = Histogram((0.1, math.inf), (5.0, 5.0))
    late = Histogram((0.1, math.inf), (5.0, 9.0))
    assert late.since(early) == Histogram((0.1, math.inf), (0.0, 4.0))
    restarted = Histogram((0.1, math.inf), (1.0, 1.0))  # counts went down: a new process
    assert restarted.since(late) == restarted


def test_a_prefill_workers_snapshot_from_its_metrics() -> None:
    stats = {"queued": 3, "waiting": 2, "running": 0, "free_pages": 30, "total_pages": 40,
             "pd_queues": {"send_queue": 1, "held_rooms": 4}}
    _, text = _text(stats, ttft=[0.3] * 9 + [4.0])
    scrape = parse({"disaggregation_mode": "prefill", "role_state": "SERVING", "nice": 10}, text)
    snap = scrape.snapshot("http://p", None)
    assert snap is not None
    assert (snap.role, snap.waiting, snap.running, snap.switching) == ("prefill", 5, 0, False)
    assert snap.nice == 10  # the planner's priority lever starts from it
    assert snap.oldest_wait == 0.0  # nothing waits in these stats
    assert parse({"disaggregation_mode": "prefill", "nice": True}, text).nice is None
    assert snap.kv_usage == pytest.approx(0.25)
    assert 0.25 <= snap.ttft_p90 <= 0.5  # the 9th of 10 is in the (0.25, 0.5] bucket
    assert math.isnan(snap.itl_p90)


def test_a_decode_workers_window_and_its_switching_state() -> None:
    stats: dict[str, Any] = {"running": 3, "free_pages": 0, "total_pages": 10,
                             "pd_queues": {"recv_queue": 1, "alloc_queue": 2,
                                           "pulls_inflight": 1, "held_rooms": 7}}
    m, first = _text(stats, itl=[0.5] * 10)
    before = parse({"disaggregation_mode": "decode"}, first)
    for _ in range(10):
        m.itl.observe(0.02)  # the window after the first scrape is fast
    after = parse({"disaggregation_mode": "decode", "role_state": "DRAINING"},
                  m.render().decode())
    snap = after.snapshot("http://d", before)
    assert snap is not None
    assert (snap.waiting, snap.running, snap.kv_usage, snap.switching) == (4, 3, 1.0, True)
    assert snap.itl_p90 <= 0.02  # only the window's
    whole = after.snapshot("http://d", None)
    assert whole is not None and whole.itl_p90 > 0.3  # everything since start


def test_a_colocated_workers_snapshot_has_both_latencies_of_its_own() -> None:
    """A null worker serves whole requests: TTFT and ITL from its own histograms, waiting as
    P's (queued or not prefilled yet), its rows running, its KV use."""
    stats = {"queued": 1, "waiting": 2, "prefilling": 1, "running": 4, "free_pages": 10,
             "total_pages": 40}
    _, text = _text(stats, ttft=[0.3] * 10, itl=[0.02] * 10)
    scrape = parse({"disaggregation_mode": "null", "role_state": "SERVING"}, text)
    assert scrape.role == "null"
    snap = scrape.snapshot("http://c", None)
    assert snap is not None
    assert (snap.worker, snap.role, snap.waiting, snap.running, snap.switching) == (
        "http://c", "null", 3, 4, False)
    assert snap.kv_usage == pytest.approx(0.75)
    assert 0.25 <= snap.ttft_p90 <= 0.5 and 0.01 <= snap.itl_p90 <= 0.025
    # A role the core planner does not know is left out.
    other = parse({"disaggregation_mode": "encode", "role_state": "SERVING"}, text)
    assert other.snapshot("http://e", None) is None


def test_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(ValueError):
        parse({"disaggregation_mode": "decode"}, "this is { not metrics\n")


def test_a_prefill_backlog_is_read_from_the_oldest_unanswered_request_d_s_is_not() -> None:
    stats = {"queued": 0, "waiting": 1, "oldest_unanswered_seconds": 3.5}
    _, text = _text(stats)
    p = parse({"disaggregation_mode": "prefill"}, text).snapshot("http://p", None)
    colo = parse({"disaggregation_mode": "null"}, text).snapshot("http://c", None)
    d = parse({"disaggregation_mode": "decode"}, text).snapshot("http://d", None)
    assert p is not None and colo is not None and d is not None
    assert (p.oldest_wait, colo.oldest_wait) == (3.5, 3.5)
    assert d.oldest_wait == 0.0  # D's requests wait for P and the transfer, not for D


def test_a_workers_cores_and_the_share_of_the_window_its_steps_ran() -> None:
    _, first = _text({"step_seconds_total": 1.0})
    _, second = _text({"step_seconds_total": 2.5})
    info = {"disaggregation_mode": "decode", "cpus": [1], "cpu_pool_threads": 1}
    before, after = parse(info, first, 10.0), parse(info, second, 12.0)
    snap = after.snapshot("http://d", before)
    assert snap is not None and snap.cpus == frozenset({1}) and snap.pool_threads == 1
    assert snap.busy == pytest.approx(0.75)  # 1.5 s of steps in a 2 s window
    # No earlier scrape, a restart (the total went down) or no steps exported: 0.
    assert after.busy(None) == 0.0
    assert parse(info, first, 14.0).busy(after) == 0.0  # restarted: 1.0 s after 2.5 s
    assert before.busy(after) == 0.0  # out of order
    _, none = _text({})
    assert parse(info, none, 14.0).busy(after) == 0.0
    # A window longer than the steps' clock (a late scrape): at most 1.
    _, burst = _text({"step_seconds_total": 9.0})
    assert parse(info, burst, 13.0).busy(after) == 1.0
    # Cores that are not a list of core ids are not known.
    for listed in ([], "0-1", [0, True], [-1], None):
        assert parse({"cpus": listed}, first).cpus is None, listed
    for threads in (0, True, "2", 1.5, None):  # nor a pool size that is not a count
        assert parse({"cpu_pool_threads": threads}, first).pool_threads is None, threads


def test_the_mean_prompt_of_the_requests_a_worker_took_in_the_window() -> None:
    """What tells a colocated worker's heavy prefills from its own full batch (run 25 of
    bench/RESULTS_adaptive.md): prompt tokens over the prompts admitted since the last scrape."""
    info = {"disaggregation_mode": "null"}
    _, first = _text({"prompt_tokens_total": 1000, "prompts_total": 4})
    _, second = _text({"prompt_tokens_total": 2200, "prompts_total": 6})
    before, after = parse(info, first, 10.0), parse(info, second, 12.0)
    snap = after.snapshot("http://c", before)
    assert snap is not None and snap.prompt_tokens == pytest.approx(600.0)
    # None admitted in the window, no earlier scrape, a restart, or a worker without them: NaN.
    assert math.isnan(after.prompt_mean(after))
    assert math.isnan(after.prompt_mean(None))
    _, restarted = _text({"prompt_tokens_total": 10, "prompts_total": 1})
    assert math.isnan(parse(info, restarted, 14.0).prompt_mean(after))
    _, none = _text({})
    assert math.isnan(parse(info, none, 14.0).prompt_mean(after))
