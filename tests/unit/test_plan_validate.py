"""The fleet model against the one chip's colocated worker as measured (bench/plan_validate.py on
the checked-in profile and serving records): the figures bench/RESULTS_plan.md reports within
+-20 % of the measurement stay there (and the worker's capacity within 10 %), and a planted
error in a cost term (the decode step or the prefill x 1.5) takes the figure resting on it out
of that band. Small loads, the report's 11 seeds: seconds."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import attrs
import pytest

from pd_fsm.sim.perf_profile import Profile

ROOT = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    path = ROOT / "bench" / "plan_validate.py"
    spec = importlib.util.spec_from_file_location("plan_validate", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


V = _module()


def _load(workload: str, rate: float) -> object:
    return next(x for x in V.loads(V.RUNS) if x.workload == workload and x.rate == rate)


def test_the_measured_loads_and_their_cache_hits_are_read_from_the_records() -> None:
    got = [(x.workload, x.prompts, round(x.arrival_rate, 2), x.cached_tokens)
           for x in V.loads(V.RUNS)]
    assert got == [("chat", 20, 2.10, 1008), ("chat", 40, 5.13, 20160),
                   ("chat", 80, 8.27, 40320), ("chat", 120, 11.98, 1008),
                   ("chat", 160, 17.13, 1008), ("rag", 8, 0.52, 8176), ("rag", 10, 1.28, 65408)]
    chat8 = _load("chat", 8.0)
    reqs = V.requests(chat8, V.poisson(80, 8.27, 0))
    assert [r.cached for r in reqs].count(1008) == 40 and reqs[40].cached == 0


def _within(profile: Profile, workload: str, rate: float) -> dict[str, float]:
    load = _load(workload, rate)
    f = V.predict(V.costs_for(profile), load, 11)
    return {"TTFT": f.ttft_p50 / load.ttft_p50, "ITL": f.itl_p50 / load.itl_p50,
            "met": f.met / load.met}


@pytest.mark.parametrize(("workload", "rate", "figures"), [
    ("rag", 0.5, ("TTFT", "ITL", "met")), ("chat", 8.0, ("ITL", "met")),
    ("chat", 16.0, ("ITL", "met"))])
def test_the_prediction_is_within_20_percent_where_the_report_says_it_holds(
        workload: str, rate: float, figures: tuple[str, ...]) -> None:
    ratios = _within(Profile.load(V.PROFILE), workload, rate)
    assert all(abs(ratios[k] - 1) <= 0.2 for k in figures), ratios


def test_the_worker_s_capacity_all_at_once_is_within_10_percent() -> None:
    sat = V.all_at_once(V.RUNS)
    assert sat is not None
    load, measured = sat
    got = V.throughput(V.costs_for(Profile.load(V.PROFILE)), load)
    assert got / measured == pytest.approx(1.0, abs=0.1)
    slow = V.throughput(V.costs_for(V.scaled(Profile.load(V.PROFILE), "decode", 1.5)), load)
    assert slow / measured < 0.85


def test_a_planted_error_in_the_decode_step_moves_the_itl_out_of_the_band() -> None:
    profile = Profile.load(V.PROFILE)
    true = _within(profile, "chat", 16.0)["ITL"]
    planted = _within(V.scaled(profile, "decode", 1.5), "chat", 16.0)["ITL"]
    assert planted > 1.2 and planted / true > 1.3


def test_a_planted_error_in_the_prefill_moves_the_long_prompts_ttft_out_of_the_band() -> None:
    profile = Profile.load(V.PROFILE)
    planted = _within(V.scaled(profile, "prefill", 1.5), "rag", 0.5)["TTFT"]
    assert planted > 1.2


def test_one_request_alone_waits_its_prefill_and_then_one_row_decode_steps() -> None:
    """The figures' kinds on the simplest load: TTFT the 1,024-token prefill's step; ITL p50
    the median of its 255 gaps, each a one-row decode step at the context it had then."""
    load = _load("chat", 2.0)
    costs = V.costs_for(Profile.load(V.PROFILE))
    f = V.simulate(costs, load, [0.0], cache=False)
    chip = costs.profile.on(1)
    assert f.ttft_p50 == pytest.approx(chip.prefill_s(1024))
    gaps = sorted(chip.decode_s(1, 1024 + k) for k in range(255))
    assert f.itl_p50 == pytest.approx(gaps[127])
    assert f.met == 1.0


RUN7 = ROOT / "bench" / "tpu_runs" / "2026-12-07" / "serve3"
CAP8 = ROOT / "bench" / "tpu_runs" / "2026-12-07" / "profile2" / "profile_cap8.json"


def test_run_7_s_records_mixed_lengths_and_cache_count_are_read() -> None:
    """Run 7's records carry their cache hits (none) and, for mixed lengths, the range ratio
    and seed: the replayed lengths are the very ones the bench sent (the worker's log counted
    50,426 prompt tokens for the 4 req/s load; its 916.8 tokens/s over 11.61 s, 10,645 out)."""
    got = [(x.workload, x.prompts, x.ratio, x.seed, x.cached_tokens) for x in V.loads(RUN7)]
    assert got[4:7] == [("chat", 160, 1.0, 104, 0), ("mixed", 40, 0.1, 106, 0),
                        ("mixed", 80, 0.1, 107, 0)]
    assert len(got) == 10 and {x[4] for x in got} == {0}
    mixed = V.loads(RUN7)[5]
    sent = V.requests(mixed, [0.0] * mixed.prompts, draw=mixed.seed)
    assert sum(r.prompt for r in sent) == 50426 and sum(r.out for r in sent) == 10645
    assert min(r.prompt for r in sent) >= 204 and max(r.prompt for r in sent) <= 2048
    other = V.requests(mixed, [0.0] * mixed.prompts, draw=0)
    assert [r.prompt for r in other] != [r.prompt for r in sent]
    sat = V.all_at_once(RUN7)
    assert sat is not None and sat[0].prompts == 128 and round(sat[1]) == 2831


def test_the_prefill_from_another_runner_replaces_only_the_prefill() -> None:
    profile, cap8 = Profile.load(V.PROFILE), Profile.load(CAP8)
    mixed = V.prefill_from(profile, cap8).on(1)
    assert mixed.prefill == cap8.on(1).prefill and mixed.decode == profile.on(1).decode
    assert mixed.prefill_s(1024) == pytest.approx(0.0156, abs=1e-4)
    note = V.prefill_note(profile, CAP8, cap8)
    assert "NOT THE PROFILE'S" in note and "max_running 8" in note
    with pytest.raises(ValueError, match="model"):
        V.prefill_from(profile, attrs.evolve(cap8, model="qwen3-1.7b"))
