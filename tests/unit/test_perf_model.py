"""The performance model (pd_fsm/sim/perf.py) on a made-up profile whose answers can be worked
out by hand: the model must reproduce them, and order placements the way the costs say."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest

from pd_fsm.sim.perf import Placement, Request, nice_weight, outcome, poisson, simulate
from pd_fsm.sim.perf_profile import CoreProfile, Profile, interpolate

# One core: prefill 1 ms a token, a decode step 20 ms (+5 ms a row); two cores: twice as fast.
ONE = CoreProfile(cores=1, prefill=((16, 0.016), (1024, 1.024)),
                  decode=((1, 64, 0.020), (8, 64, 0.055), (1, 512, 0.020), (8, 512, 0.055)),
                  copy=((0, 0.0), (1 << 30, 1.0)), pull=((0, 0.0), (1 << 30, 1.0)))
TWO = CoreProfile(cores=2, prefill=((16, 0.008), (1024, 0.512)),
                  decode=((1, 64, 0.010), (8, 64, 0.0275), (1, 512, 0.010), (8, 512, 0.0275)),
                  copy=ONE.copy, pull=ONE.pull)
PROFILE = Profile(model="made-up", kv_bytes_per_token=1024, page_size=16,
                  max_batched_tokens=1024, max_running=8, by_cores=(ONE, TWO))
COLOCATED = Placement("colocated", colocated=True)
PINNED = Placement("pinned")
SHARED = Placement("shared", shared=True)
PRIORITY = Placement("shared, D above P", shared=True, nice_p=10, nice_d=-5)


def test_interpolation_is_linear_and_continues_past_the_ends() -> None:
    pts = [(0.0, 0.0), (10.0, 1.0), (20.0, 3.0)]
    assert interpolate(pts, 5) == pytest.approx(0.5)
    assert interpolate(pts, 15) == pytest.approx(2.0)
    assert interpolate(pts, 30) == pytest.approx(5.0)  # the last segment's slope
    assert interpolate([(1.0, 2.0)], 9) == 2.0


def test_one_request_alone_takes_what_the_profile_says() -> None:
    # 64-token prompt, 4 tokens out, colocated on two cores: the first step prefills (64 tokens
    # at 0.5 ms) and decodes the new row (10 ms): two tokens at ~74 ms; two more steps of 10 ms.
    (r,) = simulate(PROFILE, COLOCATED, [Request(0.0, 64, 4)])
    assert r.ttft == pytest.approx(0.032 + 0.010, abs=0.003)
    assert r.token_times[-1] == pytest.approx(0.042 + 0.020, abs=0.004)
    assert len(r.token_times) == 4


def test_a_prompt_longer_than_the_budget_is_prefilled_in_budget_sized_chunks() -> None:
    # As plan_prefill: the first row is cut to --max-batched-tokens. A 512-token prompt joins
    # a colocated worker that decodes another request: at a budget of 256 it takes two
    # forwards of 256 (128 ms each on two cores), each with a decode step, so the running
    # request's gaps stay near 140 ms; at 1,024 one forward of 512 holds a gap of 266 ms.
    def gaps(budget: int) -> list[float]:
        profile = attrs.evolve(PROFILE, max_batched_tokens=budget)
        running, prompt = simulate(profile, COLOCATED, [Request(0.0, 64, 40),
                                                        Request(0.1, 512, 2)])
        # The prompt's own TTFT barely changes: 256 ms of prefill either way, its first decode,
        # the running step it waits for (and, chunked, one more decode step).
        assert prompt.ttft == pytest.approx(0.28, abs=0.015)
        return _gaps(running)

    assert max(gaps(256)) == pytest.approx(0.128 + 0.011, abs=0.006)
    assert max(gaps(1024)) == pytest.approx(0.256 + 0.011, abs=0.006)


def test_pd_adds_the_pull_and_runs_each_side_on_its_own_core() -> None:
    (r,) = simulate(PROFILE, attrs.evolve(PINNED, stream_tokens=0), [Request(0.0, 512, 3)])
    kv = 512 * 1024 / (1 << 30)  # gather, pull, scatter of 512 tokens' KV: 1 s a GiB each
    assert r.ttft == pytest.approx(0.512 + 3 * kv + 0.020, abs=0.004)  # one core's prefill
    assert r.tpot == pytest.approx(0.020 / 2, abs=0.002)  # P's token + D's first leave together


def test_a_streaming_p_prefills_in_chunks_and_d_pulls_only_the_last() -> None:
    # 1 MiB of KV a token: a gather, pull or scatter of 512 tokens' KV takes 0.5 s (1 s a GiB).
    heavy = attrs.evolve(PROFILE, kv_bytes_per_token=1 << 20)
    (whole,) = simulate(heavy, attrs.evolve(PINNED, stream_tokens=0), [Request(0.0, 512, 3)])
    # prefill 512 tokens (1 ms each), gather, pull and scatter them, then D's first step.
    assert whole.ttft == pytest.approx(0.512 + 3 * 0.5 + 0.020, abs=0.005)
    (streamed,) = simulate(heavy, attrs.evolve(PINNED, stream_tokens=256),
                           [Request(0.0, 512, 3)])
    # Two chunks, each prefilled and gathered; the first part's pull overlapped the second
    # chunk: only the last 256 tokens are pulled after the prefill.
    assert streamed.ttft == pytest.approx(0.512 + 0.5 + 0.25 + 0.5 + 0.020, abs=0.005)


def test_a_step_keeps_busy_only_the_cores_it_can_use() -> None:
    # D's decode step runs no faster on two cores than on one: it keeps one busy, and P, far
    # below it in priority, still has the other for its prefill (one core's speed, 2 x 256 ms).
    flat = attrs.evolve(TWO, decode=ONE.decode)
    profile = attrs.evolve(PROFILE, by_cores=(ONE, flat))
    decoding, prompt = simulate(profile, PRIORITY, [Request(0.0, 64, 200),
                                                    Request(0.3, 512, 2)])
    gathers = 3 * 512 * 1024 / (1 << 30) / 2  # on one core; the pull is of the last chunk
    assert prompt.ttft == pytest.approx(0.512 + gathers, abs=0.06)  # + D's next step
    assert max(_gaps(decoding)) < 0.030  # D keeps its core: steps of 20-25 ms


def test_a_step_keeps_busy_the_cores_the_profile_measured() -> None:
    # The same flat decode step, but profiled keeping 1.5 cores busy (XLA's threads spin): D,
    # far above P, takes 1.5 of the two cores while it steps, and P's prefill gets the half
    # core left instead of a whole one, so its first token comes later. A profile that says
    # the step keeps one core busy gives the speed-up's answer again.
    def with_busy(decode_busy: float, threads: int = 0) -> Request:
        flat = attrs.evolve(TWO, decode=ONE.decode, prefill_busy=((16, 2.0), (1024, 2.0)),
                            decode_busy=((1, 64, decode_busy), (8, 64, decode_busy)))
        profile = attrs.evolve(PROFILE, by_cores=(ONE, flat))
        placement = attrs.evolve(PRIORITY, decode_threads=threads)
        return simulate(profile, placement, [Request(0.0, 64, 200), Request(0.3, 512, 2)])[1]

    gathers = 3 * 512 * 1024 / (1 << 30) / 2
    assert with_busy(1.0).ttft == pytest.approx(0.512 + gathers, abs=0.06)  # as without
    assert with_busy(1.5).ttft > 1.5 * with_busy(1.0).ttft
    assert with_busy(2.0).ttft > with_busy(1.5).ttft
    # D on pools of one thread (`serve --cpu-pools 1`) steps on one core and keeps one busy.
    assert with_busy(1.5, threads=1).ttft == pytest.approx(with_busy(1.0).ttft, abs=0.01)


def test_priorities_let_d_take_the_cores_from_p() -> None:
    # A long prompt arrives while another request decodes: with equal priority D's steps slow
    # to P's share; with D far above P they keep (almost) their speed.
    load = [Request(0.0, 64, 40), Request(0.3, 1024, 2)]
    equal = simulate(PROFILE, SHARED, [Request(r.arrival, r.prompt, r.out) for r in load])
    ahead = simulate(PROFILE, PRIORITY, [Request(r.arrival, r.prompt, r.out) for r in load])
    assert max(_gaps(ahead[0])) < max(_gaps(equal[0]))
    assert nice_weight(-5) / nice_weight(10) == pytest.approx(1.25 ** 15)  # CFS: x1.25 a step


def test_local_prefill_sends_a_prompt_to_d_while_p_is_busy() -> None:
    # Conditional disaggregation by P's queue: the second prompt arrives while P (one core)
    # prefills the first, so D prefills it on its own core (512 ms) and decodes its first row
    # in the same step (20 ms), as a colocated worker would; without it, it waits behind P.
    def run(queue: int) -> list[Request]:
        placement = attrs.evolve(PINNED, stream_tokens=0, local_prefill_queue=queue)
        return simulate(PROFILE, placement, [Request(0.0, 512, 3), Request(0.1, 512, 3)])

    first, local = run(1)
    assert (first.prefill_by, first.decode_by) == ("prefill", "decode")
    assert (local.prefill_by, local.decode_by) == ("decode", "decode")
    assert local.ttft == pytest.approx(0.512 + 0.020, abs=0.004)
    assert len(local.token_times) == 3
    _, queued = run(0)
    assert queued.prefill_by == "prefill" and queued.ttft > 0.9  # 2 x 512 ms on P, less 0.1


def _gaps(r: Request) -> list[float]:
    return [b - a for a, b in zip(r.token_times, r.token_times[1:], strict=False)]


def test_goodput_counts_requests_meeting_both_targets() -> None:
    done = simulate(PROFILE, COLOCATED, poisson(1.0, [64, 256] * 6, 16, seed=3))
    got = outcome(done, ttft_s=2.0, tpot_s=0.1)
    assert got.finished == 12 and got.met == 12
    strict = outcome(done, ttft_s=0.001, tpot_s=0.1)
    assert strict.met == 0 and strict.goodput == 0.0
    assert math.isfinite(got.ttft_p50) and got.goodput > 0


def test_more_load_than_capacity_loses_goodput() -> None:
    light = outcome(simulate(PROFILE, PINNED, poisson(0.5, [900] * 16, 32)), 2.0, 0.1)
    heavy = outcome(simulate(PROFILE, PINNED, poisson(8.0, [900] * 16, 32)), 2.0, 0.1)
    assert heavy.met < light.met


def test_profile_round_trips_and_merges(tmp_path: Path) -> None:
    one = Profile(model="m", kv_bytes_per_token=8, page_size=16, max_batched_tokens=1024,
                  max_running=8, by_cores=(ONE,))
    busy = attrs.evolve(TWO, prefill_busy=((16, 1.7),), decode_busy=((1, 64, 1.4),))
    two = Profile(model="m", kv_bytes_per_token=8, page_size=16, max_batched_tokens=1024,
                  max_running=8, by_cores=(busy,))
    both = one.merged(two)
    both.dump(tmp_path / "p.json")
    back = Profile.load(tmp_path / "p.json")
    assert back == both and back.on(1) == ONE and back.on(2) == busy and back.on(16) == busy
    assert back.on(2).measured_busy and not back.on(1).measured_busy
    # A profile written before busy cores were recorded reads as one without them.
    raw = json.loads((tmp_path / "p.json").read_text())
    for c in raw["by_cores"]:
        c.pop("prefill_busy"), c.pop("decode_busy")
    (tmp_path / "old.json").write_text(json.dumps(raw))
    assert Profile.load(tmp_path / "old.json").on(2) == TWO
    other = Profile(model="n", kv_bytes_per_token=8, page_size=16, max_batched_tokens=1024,
                    max_running=8, by_cores=(TWO,))
    with pytest.raises(ValueError, match="different models"):
        one.merged(other)


def test_profile_measures_the_real_engine(tmp_path: Path) -> None:
    # `pd-fsm profile` on the tiny model, a few shapes: every cost it writes is a real,
    # positive time, and the model reads it back.
    import subprocess
    import sys

    out = tmp_path / "tiny.json"
    run = subprocess.run(
        [sys.executable, "-m", "pd_fsm.cli", "profile", "--model", "tiny", "--num-pages", "64",
         "--prefill-tokens", "16", "64", "--decode-rows", "1", "2", "--decode-contexts", "32",
         "--copy-mib", "1", "--repeats", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    profile = Profile.load(out)
    (core,) = profile.by_cores
    assert [t for t, _ in core.prefill] == [16, 64] and all(s > 0 for _, s in core.prefill)
    assert [(b, c) for b, c, _ in core.decode] == [(1, 32), (2, 32)]
    assert all(s > 0 for *_, s in core.decode) and core.pull[0][1] > 0
    # Cores kept busy: CPU over wall seconds, for every prefill and decode shape.
    assert [t for t, _ in core.prefill_busy] == [16, 64]
    assert [(b, c) for b, c, _ in core.decode_busy] == [(1, 32), (2, 32)]
    assert all(n > 0.1 for _, n in core.prefill_busy)
    assert all(n > 0.1 for *_, n in core.decode_busy)
    assert profile.kv_bytes_per_token > 0
    (r,) = simulate(profile, COLOCATED, [Request(0.0, 40, 3)])
    assert len(r.token_times) == 3 and r.ttft > 0


def test_cluster_model_static_splits_and_the_planner() -> None:
    from pd_fsm.core.planner import PlannerConfig, SwitchRole
    from pd_fsm.sim.perf_cluster import ClusterConfig, Phase, goodput, run_cluster, shifting

    # Long prompts with one-token answers: prefill is all the work, so 3P:1D beats 1P:3D, and a
    # planner started at 1P:3D moves decode workers over to prefill.
    reqs = shifting([Phase(60.0, 3.0, (900, 1000), (2, 2))], seed=2)
    few_p = run_cluster(PROFILE, ClusterConfig(prefill=1, decode=3), reqs)
    many_p = run_cluster(PROFILE, ClusterConfig(prefill=3, decode=1), reqs)
    assert goodput(many_p.requests, 0, 60, 2.0, 0.1) > goodput(few_p.requests, 0, 60, 2.0, 0.1)
    planned = run_cluster(PROFILE, ClusterConfig(
        prefill=1, decode=3, interval=2.0, switch_s=1.0,
        planner=PlannerConfig(patience=2, cooldown=5.0)), reqs)
    assert planned.decisions and all(isinstance(d, SwitchRole) and d.to == "prefill"
                                     for _, d in planned.decisions)
    assert planned.roles[-1][1:] == (3, 1, 0)  # it stops at min_decode 1
    assert goodput(planned.requests, 0, 60, 2.0, 0.1) > goodput(few_p.requests, 0, 60, 2.0, 0.1)
    # Every request is served to its last token, in every cluster.
    for run in (few_p, many_p, planned):
        assert all(len(r.token_times) == r.out for r in run.requests)


def test_sim_cli_prints_every_placement_and_cluster(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    from pd_fsm.cli import build_parser

    PROFILE.dump(tmp_path / "p.json")
    argv = ["sim", "--profile", str(tmp_path / "p.json"), "--rates", "1", "--prompts", "6",
            "--local-queues", "1"]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # Equal priority, the two default nice pairs, each with D on one thread, and local prefill.
    assert out.count("| PD shared") == 6 and "| colocated" in out and "| PD pinned" in out
    assert "| PD shared, nice P +10 / D -5, local prefill at P queue >= 1 |" in out
    assert "| PD shared, nice P +10 / D -5, D pools of 1 thread |" in out
    argv = ["sim", "--profile", str(tmp_path / "p.json"), "--workers", "4",
            "--phases", "long:10,short:10"]
    args = build_parser(argv).parse_args(argv)
    assert args.func(args) == 0
    out = capsys.readouterr().out
    for name in ("static 1P:3D", "static 2P:2D", "static 3P:1D", "colocated x4", "adaptive"):
        assert f"| {name}" in out


def test_cluster_model_the_planner_makes_workers_colocated_and_back() -> None:
    from pd_fsm.core.planner import PlannerConfig, SwitchRole
    from pd_fsm.sim.perf_cluster import ClusterConfig, Phase, goodput, run_cluster, shifting

    # Short prompts, long answers at a rate the 2:2 split's one-core D cannot decode in time:
    # the planner with colocate merges the P/D part into colocated workers (pairs, then the
    # orphans), and gets more goodput than the static split it started from.
    reqs = shifting([Phase(60.0, 8.0, (16, 48), (48, 96))], seed=3)
    static = run_cluster(PROFILE, ClusterConfig(prefill=2, decode=2), reqs)
    planned = run_cluster(PROFILE, ClusterConfig(
        prefill=2, decode=2, interval=2.0, switch_s=1.0,
        planner=PlannerConfig(ttft_slo=2.0, itl_slo=0.05, patience=2, cooldown=5.0,
                              colocate=True)), reqs)
    assert planned.decisions and all(isinstance(d, SwitchRole) for _, d in planned.decisions)
    assert any(d.to == "null" for _, d in planned.decisions)  # type: ignore[union-attr]
    assert planned.roles[-1][3] > 0  # colocated workers at the end
    assert goodput(planned.requests, 0, 60, 2.0, 0.05) > goodput(static.requests, 0, 60, 2.0,
                                                                  0.05)
    for run in (static, planned):
        assert all(len(r.token_times) == r.out for r in run.requests)


@pytest.mark.parametrize("seed", range(12))
def test_cluster_model_a_narrow_decode_makes_the_wide_prefill_colocated(seed: int) -> None:
    """``pd-fsm cluster``'s shape: P on XLA pools of two threads, D of one (``decode_cores``).
    Short prompts with long answers, then long prompts, then short again, at rates the
    one-core D cannot decode in time: the planner with colocate makes the wide P colocated and
    keeps the D as a standby (never switched), takes P back beside it when colocated falls
    behind, and the proxy's D serves alone while no entry is (``alone``: nothing waits for
    one). Over every seed the short-prompt phases get several times the static split's
    goodput, and every request is served to its last token."""
    from pd_fsm.core.planner import PlannerConfig, SwitchRole
    from pd_fsm.sim.perf_cluster import ClusterConfig, Phase, goodput, run_cluster, shifting

    short, long = ((16, 48), (48, 96)), ((900, 1000), (2, 4))
    reqs = shifting([Phase(40.0, 3.0, *short), Phase(40.0, 1.5, *long),
                     Phase(40.0, 3.0, *short)], seed=seed)
    shape = {"prefill": 1, "decode": 1, "cores": 2, "decode_cores": 1}
    static = run_cluster(PROFILE, ClusterConfig(**shape), reqs)  # type: ignore[arg-type]
    planned = run_cluster(PROFILE, ClusterConfig(
        **shape, alone=True, interval=2.0, switch_s=1.0,  # type: ignore[arg-type]
        planner=PlannerConfig(ttft_slo=2.0, itl_slo=0.05, patience=2, cooldown=5.0,
                              colocate=True, recall=10.0)), reqs)
    switches = [d for _, d in planned.decisions if isinstance(d, SwitchRole)]
    assert switches and switches[0].worker == "w0" and switches[0].to == "null"
    assert "standby" in switches[0].reason
    assert all(d.worker == "w0" for d in switches)  # the D (w1) never switched
    assert all(d == 1 for _, _, d, _ in planned.roles)
    assert planned.deferred == 0  # while P drained to colocated or back, D served alone
    for a, b in ((0.0, 40.0), (80.0, 120.0)):
        assert goodput(planned.requests, a, b, 2.0, 0.05) > \
            3 * goodput(static.requests, a, b, 2.0, 0.05)
    for run in (static, planned):
        assert all(len(r.token_times) == r.out for r in run.requests)
