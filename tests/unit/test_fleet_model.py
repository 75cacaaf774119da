"""The fleet model on an accelerator's profile (pd_fsm/sim/chip.py, fleet.py, plan.py): each cost
term checked against a figure computed here by hand from the profile's numbers, so that a
planted error in a term (the all-reduce scaled, the link's bandwidth, a leg left out, the
pipeline's order) moves a checked figure; and the fleet deterministic per seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from pd_fsm.sim.chip import HOSTS, ChipCosts, ChipModel, Links
from pd_fsm.sim.fleet import FleetConfig, FleetReq, Slo, goodput, simulate_fleet, workload
from pd_fsm.sim.perf_profile import CoreProfile, Profile
from pd_fsm.sim.plan import Settings, configurations, evaluate, streamed_hidden

KV = 100_000  # bytes a token
B = (1_000_000, 1_000_000_000)  # the legs' two points: linear, so exact between them


def _profile() -> Profile:
    """Linear costs, so a figure by hand is exact: prefill 0.1 ms a token; a decode step
    2 ms + rows x context x 1e-8 s (bilinear: the interpolation is exact); the legs linear."""
    chip = CoreProfile(
        cores=1,
        prefill=((100, 0.01), (1000, 0.1), (10000, 1.0)),
        decode=tuple((r, c, 0.002 + r * c * 1e-8) for c in (1000, 10000) for r in (1, 100)),
        copy=tuple((b, b / 1e11) for b in B), pull=(),
        gather=tuple((b, b / 1e11) for b in B), d2h=tuple((b, b / 4e9) for b in B),
        d2h_pinned=tuple((b, b / 1e9) for b in B), h2d=tuple((b, b / 5e9) for b in B),
        scatter=tuple((b, 0.004 + b / 5e10) for b in B))
    return Profile(model="linear", kv_bytes_per_token=KV, page_size=16,
                   max_batched_tokens=4096, max_running=256, by_cores=(chip,), platform="tpu")


def _costs(**links: object) -> ChipCosts:
    return ChipCosts(_profile(), HOSTS["v5e-8"], ChipModel(), Links(**links))  # type: ignore[arg-type]


def _one(config: FleetConfig, prompt: int, out: int, costs: ChipCosts | None = None) -> FleetReq:
    c = costs or _costs()
    run = simulate_fleet(c, config, [FleetReq(0.0, prompt, out)], 100.0, 4096, 256)
    return run.requests[0]


def test_tensor_parallelism_divides_the_step_and_adds_two_all_reduces_a_layer() -> None:
    c = _costs()
    one = 0.002 + 64 * 2000 * 1e-8
    fixed = 0.17e-3
    ring = 28 * 2 * (10e-6 + 64 * 1024 * 2 * 2 * (3 / 4) / 100e9)
    assert c.decode_s(64, 2000, 4) == pytest.approx(fixed + (one - fixed) / 4 + ring, rel=1e-9)
    assert c.decode_s(64, 2000, 1) == pytest.approx(one, rel=1e-9)
    prefill_ring = 28 * 2 * (10e-6 + 512 * 1024 * 2 * 2 * (1 / 2) / 100e9)
    assert c.prefill_s(0, 512, 2) == pytest.approx(fixed + (0.0512 - fixed) / 2 + prefill_ring)


def test_a_chunk_costs_the_prompt_to_its_end_less_to_its_start() -> None:
    c = ChipCosts(attrs.evolve(_profile(), by_cores=(attrs.evolve(
        _profile().on(1), prefill=((1000, 0.1), (2000, 0.3), (4000, 1.0))),)), HOSTS["v5e-8"])
    assert c.prefill_s(1000, 1000, 1) == pytest.approx(0.2)  # 0.3 - 0.1: its attention
    assert c.prefill_s(0, 1000, 1) == pytest.approx(0.1)


def test_kv_capacity_is_the_chips_hbm_less_one_copy_of_the_weights() -> None:
    c = _costs()
    assert c.kv_capacity_tokens(2) == int((2 * 16e9 * 0.9 - 1.19e9) // KV)


def test_a_room_moves_through_its_three_legs_and_the_link() -> None:
    n = 8192 * KV
    assert _costs().stages_s(8192, 1, 2) == pytest.approx(
        (n / 4e9, 200e-6 + n / 5e9, n / 2 / 5e9))
    assert _costs(net_gbps=2.5).stages_s(8192, 1, 1)[1] == pytest.approx(200e-6 + n / 2.5e9)
    assert _costs(d2h_leg="d2h_pinned").stages_s(8192, 2, 1)[0] == pytest.approx(n / 2 / 1e9)
    assert _costs(d2h_gbps=2.0).stages_s(8192, 2, 1)[0] == pytest.approx(n / 2 / 2e9)
    ici = _costs(path="ici").stages_s(8192, 2, 4)
    assert ici == pytest.approx((0.0, 10e-6 + n / 2 / 100e9, 0.0))


def test_pd_ttft_is_prefill_gather_legs_scatter_and_ds_first_step() -> None:
    r = _one(FleetConfig("pd", prefill=1, decode=1), 1000, 3)
    room = 1000 * KV
    prefill_end = 0.1 + room / 1e11
    ready = prefill_end + room / 4e9 + (200e-6 + room / 5e9) + room / 5e9
    first = ready + 0.004 + room / 5e10 + (0.002 + 1000 * 1e-8)
    assert (r.prefill_end, r.ready, r.first) == pytest.approx((prefill_end, ready, first))
    assert r.ttft == pytest.approx(first)
    # tokens 1 and 2 leave with D's first step; token 3 a step later, its context one longer
    assert r.itl == pytest.approx((0.002 + 1001 * 1e-8) / 2)


def test_colocated_first_token_is_its_prefill_and_each_next_a_decode_step() -> None:
    r = _one(FleetConfig("colo", colocated=1), 1000, 3)
    assert r.ttft == pytest.approx(0.1)
    assert r.last - r.first == pytest.approx((0.002 + 1000e-8) + (0.002 + 1001e-8))


def test_a_mixed_step_costs_its_parts_and_the_extra_share() -> None:
    c = ChipCosts(_profile(), HOSTS["v5e-8"], mixed_extra=0.5)
    reqs = [FleetReq(0.0, 1000, 50), FleetReq(0.05, 1000, 2)]
    run = simulate_fleet(c, FleetConfig("colo", colocated=1), reqs, 100.0, 4096, 256)
    first, second = run.requests
    # the second arrives mid-decode: its prefill joins the step after the one running at 0.05
    steps = [0.1]
    while steps[-1] < 0.05:
        steps.append(steps[-1] + 0.002 + (1000 + len(steps) - 1) * 1e-8)
    mixed = 1.5 * (0.1 + 0.002 + (1000 + len(steps) - 1) * 1e-8)
    assert second.first == pytest.approx(steps[-1] + mixed)
    assert first.first == pytest.approx(0.1)


def test_streaming_pipelines_each_chunks_legs_behind_the_next_chunk() -> None:
    r = _one(FleetConfig("s", prefill=1, decode=1, streamed=True, stream_tokens=1000), 2000, 2)
    part = 1000 * KV
    d2h, net, h2d = part / 4e9, 200e-6 + part / 5e9, part / 5e9
    t1 = 0.1 + part / 1e11
    s1 = t1 + d2h
    n1 = s1 + net
    h1 = n1 + h2d
    t2 = t1 + 0.1 + part / 1e11
    s2 = max(t2, s1) + d2h
    n2 = max(s2, n1) + net
    h2 = max(n2, h1) + h2d
    assert (r.prefill_end, r.ready) == pytest.approx((t2, h2))
    whole, left, hidden = streamed_hidden(_costs(), 2000, stream_tokens=1000)
    room = 2000 * KV
    assert whole == pytest.approx(room / 4e9 + 200e-6 + room / 5e9 + room / 5e9)
    assert left == pytest.approx(h2 - t2)
    assert hidden == pytest.approx(1 - (h2 - t2) / whole)


def test_a_slow_link_moves_the_pd_ttft_by_the_bytes_over_its_bandwidth() -> None:
    fast = _one(FleetConfig("pd", prefill=1, decode=1), 1000, 2)
    slow = _one(FleetConfig("pd", prefill=1, decode=1), 1000, 2, _costs(net_gbps=1.0))
    assert slow.ttft - fast.ttft == pytest.approx(1000 * KV / 1e9 - 1000 * KV / 5e9)


def test_the_v6e_host_scales_prefill_by_flops_and_decode_by_hbm() -> None:
    v6 = ChipCosts(_profile(), HOSTS["v6e-8"])
    assert v6.prefill_s(0, 1000, 1) == pytest.approx(0.1 / (918 / 197))
    assert v6.decode_s(1, 1000, 1) == pytest.approx(0.00201 / (1640 / 819))
    assert v6.kv_capacity_tokens(1) == int((32e9 * 0.9 - 1.19e9) // KV)


def _fingerprint(seed: int) -> list[tuple[float, float]]:
    reqs = workload("chat", seconds=10.0).requests(20.0, seed)
    run = simulate_fleet(_costs(), FleetConfig("pd", prefill=1, decode=3, streamed=True),
                         reqs, 200.0, 4096, 256)
    return [(r.first, r.last) for r in run.requests]


def test_the_fleet_is_deterministic_per_seed() -> None:
    assert _fingerprint(3) == _fingerprint(3)
    assert _fingerprint(3) != _fingerprint(4)


def test_goodput_counts_the_requests_within_both_slos_and_the_long_prompt_ttft() -> None:
    slo = Slo(ttft_s=1.0, ttft_long_s=2.0, long_prompt=8192, itl_s=0.05)
    ok = FleetReq(0.0, 1024, 3, first=0.9, last=0.9 + 0.08)
    slow_itl = FleetReq(1.0, 1024, 3, first=1.5, last=1.5 + 0.2)
    long_ok = FleetReq(2.0, 8192, 3, first=3.8, last=3.88)
    long_late = FleetReq(3.0, 8192, 3, first=5.1, last=5.2)
    assert goodput([ok, slow_itl, long_ok, long_late], slo, 0.0, 4.0) == pytest.approx(0.5)


def test_every_split_of_a_host_is_enumerated() -> None:
    configs = configurations(8)
    splits = {(c.prefill, c.tp_prefill, c.decode, c.tp_decode) for c in configs if c.prefill}
    want = {(p, tp, d, td) for tp in (1, 2, 4, 8) for td in (1, 2, 4, 8)
            for p in range(1, 9) for d in range(1, 9) if p * tp + d * td == 8}
    assert splits == want
    assert len(configs) == 4 + 2 * len(want)
    assert all(c.chips == 8 for c in configs)


def test_evaluate_reads_goodput_over_the_arrival_window() -> None:
    s = Settings(_costs(), workload("chat", seconds=5.0), Slo(), seed=1)
    point = evaluate(s, FleetConfig("colo", colocated=2), 2.0)
    reqs = workload("chat", seconds=5.0).requests(2.0, 1)
    assert point.goodput == pytest.approx(sum(1 for _ in reqs) / 5.0)  # light: all met
    assert point.met == 1.0


def test_pd_fsm_plan_prints_the_best_configuration(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _profile().dump(path)
    out = subprocess.run(
        [sys.executable, "-m", "pd_fsm.cli", "plan", "--profile", str(path), "--chips", "16",
         "--cell", "4", "--workload", "chat", "--seconds", "3", "--rates", "8", "--top", "1"],
        capture_output=True, text=True, check=True).stdout
    assert "16 chips of v5e-8 as 4 cell(s) of 4" in out
    assert "best: " in out and "binds: " in out and "hidden" in out


def test_plan_refuses_a_cpu_profile(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _profile().dump(path)
    raw = json.loads(path.read_text())
    raw["platform"] = "cpu"
    path.write_text(json.dumps(raw))
    run = subprocess.run([sys.executable, "-m", "pd_fsm.cli", "plan", "--profile", str(path)],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "CPU profile" in run.stderr


def test_the_worst_gap_is_the_longest_step_a_request_waited_for_its_next_token() -> None:
    """A request decoding on a colocated instance when another's prefill joins a step: its
    mean gap hides that step, its worst gap is it."""
    reqs = [FleetReq(0.0, 1000, 40), FleetReq(0.05, 3000, 2)]
    run = simulate_fleet(_costs(), FleetConfig("colo", colocated=1), reqs, 100.0, 4096, 256)
    first = run.requests[0]
    step = (0.002 + 1000e-8, 0.3)  # a decode step alone; the mixed one is mostly the prefill
    assert first.worst_gap > step[1]
    assert first.worst_gap == pytest.approx(max(run.requests[0].gaps or [0.0]))
    assert first.itl < first.worst_gap / 5
    worst = Slo(itl_s=0.05, itl_measure="worst")
    assert Slo(itl_s=0.05).met(first) and not worst.met(first)


def _derive_module() -> object:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "bench" / "derive_tpu_profile.py"
    spec = importlib.util.spec_from_file_location("derive_tpu_profile", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_derived_profile_is_the_scripts_and_meets_the_figures_it_was_derived_from() -> None:
    """bench/tpu_v5e_profile_derived.json is what bench/derive_tpu_profile.py writes (no hand
    edit), and it gives back the chip's measured figures it was derived from
    (bench/RESULTS_tpu.md): a 1,024-token prefill 14.75 ms, decode steps overlapped 2.11 ms
    (1 x 2,048) and 4.35 ms (8 x 2,048), 41.98 ms (64 x 2,048); h2d of 117 MB 22.7 ms."""
    module = _derive_module()
    path = Path(__file__).resolve().parents[2] / "bench" / "tpu_v5e_profile_derived.json"
    on_disk = Profile.load(path)
    assert on_disk == module.profile()  # type: ignore[attr-defined]
    chip = on_disk.on(1)
    assert chip.prefill_s(1024) == pytest.approx(14.75e-3, rel=0.01)
    for rows, measured in ((1, 2.11e-3), (8, 4.35e-3), (64, 41.98e-3)):
        assert chip.decode_s(rows, 2048) == pytest.approx(measured, rel=0.02)
    assert chip.leg_s("h2d", 117_440_512) == pytest.approx(22.7e-3)
    assert "DERIVED" in json.loads(path.read_text())["_derivation"]["what"]
