"""bench/bench_adaptive.py's pure parts: the shifting schedule every placement gets, the
unmeasured prompts, and the tables' goodput per phase and ratios to the best static placement."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_adaptive as ba  # bench/, not a package: found by the path above

from pd_fsm.io_trio.bench_client import Result


def _args(**over: object) -> argparse.Namespace:
    base = {"phases": "ABA", "phase_seconds": 30.0, "rate": 1.0, "a_prompt": (400, 800),
            "a_out": (8, 8), "b_prompt": (16, 64), "b_out": (64, 128), "seed": 3,
            "slo_ttft": 2.0, "slo_tpot": 0.1, "tight_tpot": 0.05}
    return argparse.Namespace(**{**base, **over})


def test_schedule_shifts_between_the_kinds_by_arrival_time() -> None:
    s = ba.make_schedule(_args())
    assert s == ba.make_schedule(_args())  # every placement gets the same one
    assert s.arrivals == sorted(s.arrivals) and s.arrivals[-1] < 90.0
    for a, k, p in zip(s.arrivals, s.phase_of, s.prompts, strict=True):
        assert k == int(a // 30.0)
        lo, hi = (400, 800) if s.kinds[k] == "A" else (16, 64)
        assert lo <= p.words <= hi and len(p.text.split()) == p.words
        assert p.max_tokens == 8 if s.kinds[k] == "A" else 64 <= (p.max_tokens or 0) <= 128
    assert sorted(i for k in range(3) for i in s.in_phase(k)) == list(range(len(s.prompts)))


def test_warm_prompts_take_each_kind_of_the_same_lengths_and_other_words() -> None:
    s = ba.make_schedule(_args())
    warm = ba.warm_prompts(s, 2, seed=0)
    assert [p.max_tokens == 8 for p in warm] == [True, True, False, False]
    firsts = [next(p for p, k in zip(s.prompts, s.phase_of, strict=True) if s.kinds[k] == kind)
              for kind in "AB"]
    assert [warm[0].words, warm[2].words] == [p.words for p in firsts]
    assert all(len(w.text.split()) == w.words for w in warm)
    # Not the measured texts: a prefix cache warmed with them would serve the measured ones.
    assert not {w.text for w in warm} & {p.text for p in s.prompts}
    assert warm == ba.warm_prompts(s, 2, seed=0)  # the same for every placement


def test_a_later_repeat_sends_the_same_shapes_in_other_words() -> None:
    s = ba.make_schedule(_args())
    again = ba.reworded(s.prompts, random.Random("repeat-1-3"))
    assert [(p.words, p.max_tokens) for p in again] == [(p.words, p.max_tokens) for p in s.prompts]
    assert all(len(p.text.split()) == p.words for p in again)
    assert not {p.text for p in again} & {p.text for p in s.prompts}


def _met(n: int, of: int) -> list[Result]:
    """``of`` requests of which the first ``n`` met TTFT <= 2 s and TPOT <= 100 ms."""
    return [Result(ok=True, ttft=0.5 if i < n else 5.0, itl=[0.02, 0.04]) for i in range(of)]


def test_report_goodput_per_phase_and_ratios_to_the_best_static() -> None:
    sched = ba.Schedule("AB", 10.0, [1.0, 2.0, 11.0, 12.0], [0, 0, 1, 1],
                        ba.make_schedule(_args()).prompts[:4])
    runs = {"static X": [_met(2, 2)[:2] + _met(0, 2)],   # all of A, none of B
            "static Y": [_met(0, 2) + _met(1, 2)],       # none of A, one of B
            ba.ADAPTIVE: [_met(2, 2) + _met(2, 2)]}      # everything
    lines, out = ba.report("t", runs, sched, _args(phases="AB"))
    assert [f[ba.ADAPTIVE]["goodput"] for f in out["phases"]] == [0.2, 0.2]
    assert out["phases"][1]["static Y"]["goodput"] == 0.1
    assert out["overall"]["static X"]["goodput"] == pytest.approx(0.1)  # 2 met in 20 s
    text = "\n".join(lines)
    assert "per phase: 1.00, 2.00 (>= the best static in every phase)" in text
    # The control (the adaptive cluster, its planner in --dry-run) is not a static placement.
    runs[ba.CONTROL] = [_met(2, 2) + _met(2, 2)]
    lines, _ = ba.report("t", runs, sched, _args(phases="AB"))
    assert "per phase: 1.00, 2.00 (>= the best static in every phase)" in "\n".join(lines)
    assert "whole run: 2.00x the best static placement" in text
    # What bounds the goal: X's A and Y's B summed (3 met) over the best static run's 2 met,
    # and all 4 sent over those 2.
    assert ("TPOT <= 100 ms: the best static placement of each phase, summed, met 3 of 4 "
            "(1.50x the best static placement's 2); every request met would be 2.00x") in text
