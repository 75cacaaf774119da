"""The worker's per-request latency metrics: each inter-token interval, and goodput's count of
requests within the SLO (TTFT and mean inter-token latency), on trio's clock."""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing

from pd_fsm.io_trio.worker.generation import Timing as _Timing
from pd_fsm.io_trio.worker.metrics import WorkerMetrics
from pd_fsm.schedulers.request import FinishReason, RequestOutput


def _out(tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(rid="r", new_token_ids=(7,) * tokens, new_logprobs=(0.0,) * tokens,
                         text_delta="", prompt_tokens=3, completion_tokens=tokens,
                         finish_reason=FinishReason("length") if finished else None)


def _value(metrics: WorkerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def _run(metrics: WorkerMetrics, clock: trio.testing.MockClock,
               steps: list[tuple[float, int, bool]]) -> None:
    timing = _Timing(metrics, trio.current_time())
    for wait, tokens, finished in steps:
        clock.jump(wait)
        timing.output(_out(tokens, finished))


async def test_intervals_and_slo(mock_clock: trio.testing.MockClock) -> None:
    m = WorkerMetrics(lambda: {}, "decode", slo=(2.0, 0.1))
    # TTFT 1.5 s (P's token and the next come together), then 0.05 s per token: within.
    await _run(m, mock_clock, [(1.5, 2, False), (0.05, 1, False), (0.1, 2, True)])
    assert _value(m, "pd_fsm_worker_inter_token_latency_seconds_count") == 4
    assert _value(m, "pd_fsm_worker_inter_token_latency_seconds_sum") == pytest.approx(0.15)
    assert _value(m, "pd_fsm_worker_requests_slo_total", met="true") == 1
    # TTFT over 2 s: not goodput, however fast the rest.
    await _run(m, mock_clock, [(2.5, 1, False), (0.01, 1, True)])
    # Mean inter-token latency 0.2 s: not goodput either.
    await _run(m, mock_clock, [(0.1, 1, False), (0.2, 1, False), (0.2, 1, True)])
    # Nothing generated: not goodput.
    await _run(m, mock_clock, [(0.1, 0, True)])
    assert _value(m, "pd_fsm_worker_requests_slo_total", met="false") == 3
    assert _value(m, "pd_fsm_worker_requests_slo_total", met="true") == 1
    assert _value(m, "pd_fsm_worker_time_to_first_token_seconds_count") == 3


async def test_a_ttft_splits_where_this_worker_prefilled() -> None:
    """Queue (arrival to the first forward), prefill (to the token on the host) and delivery
    (to the handler), on the scheduler's clock; an output with no times (a first token from P)
    adds none."""
    m = WorkerMetrics(lambda: {}, "decode")
    timing = _Timing(m, trio.current_time())
    began, first = timing.arrived + 0.002, timing.arrived + 0.005
    await trio.sleep(0.01)
    timing.output(attrs.evolve(_out(1), first_token_times=(began, first)))
    name = "pd_fsm_worker_time_to_first_token_part_seconds_sum"
    assert _value(m, name, part="queue") == pytest.approx(0.002)
    assert _value(m, name, part="prefill") == pytest.approx(0.003)
    assert 0.005 <= _value(m, name, part="delivery") < 1.0
    _Timing(m, trio.current_time()).output(_out(1))
    for part in ("queue", "prefill", "delivery"):
        assert _value(m, "pd_fsm_worker_time_to_first_token_part_seconds_count", part=part) == 1
