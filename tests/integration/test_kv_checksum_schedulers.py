"""KV checked on arrival (issue 31 §3) with the real prefill and decode schedulers, the tiny
model and two real transfer servers: P checksums what it registers, D verifies every pull before
scattering it. A fault corrupts bytes in flight (``tests/support/corrupting_engine.py``: D's
engine hands over a damaged copy of what it pulled):

* a clean pull verifies and the answer is the colocated one;
* one corrupted pull is pulled again, from P's spare registration, and the answer is the
  uncorrupted one; the mismatch and the re-pull are counted;
* every pull corrupted: the room fails with a 502 naming the mismatch, and every page, room and
  registration is released on both sides; under the recompute policy D prefills the prompt
  itself and the answer is the colocated one;
* the control: without verification the same fault reaches the answer, so the checks above are
  what keeps it out.
"""

from __future__ import annotations

from typing import Any

import pytest

from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import DisaggregationArgs
from tests.support.corrupting_engine import CorruptingDecode, CorruptingEngine
from tests.support.pd_pair import BOOT, PDPair, collect

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
IDS = [17, 3, 250, 41, 9, 77, 120, 5, 64, 33, 2]  # three pages of 4 tokens
ROOM = 7100


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


@pytest.fixture(scope="module")
def colocated(tiny: LoadedModel) -> list[int]:
    colo = Scheduler(SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=8,
                                   max_batched_tokens=256), model=tiny)
    colo.add_request(Req("r", IDS, GREEDY))
    return list(collect(colo.run_until_idle())["r"]["ids"])


def _args(mode: str, **kw: Any) -> DisaggregationArgs:
    return DisaggregationArgs(model="tiny", num_pages=64, page_size=4, max_running=8,
                              max_batched_tokens=256, disaggregation_mode=mode,
                              instance_id=f"{mode}-0", **kw)


def _pair(tiny: LoadedModel, corrupt: int, *, verify: bool = True, garbage: bool = False,
          **d_kw: Any) -> PDPair:
    pair = PDPair(tiny, _args("prefill", kv_checksum=True),
                  _args("decode", kv_checksum=verify, **d_kw), decode_cls=CorruptingDecode)
    engine = pair.d.role.engine
    assert isinstance(engine, CorruptingEngine)
    engine.corrupt, engine.garbage = corrupt, garbage
    return pair


def _serve(pair: PDPair, room: int) -> dict[str, Any]:
    """One request through both legs, run until D answered and both sides hold nothing."""
    pair.d.role.add_pd_request(Req("r", IDS, GREEDY), BOOT, room)
    pair.p.role.add_pd_request(Req("r", IDS, GREEDY), room)
    pair.run(lambda: "r" in collect(pair.d_outputs)
             and collect(pair.d_outputs)["r"]["reason"] is not None and pair.books_balanced())
    got: dict[str, Any] = collect(pair.d_outputs)["r"]
    return got


def _counts(pair: PDPair) -> tuple[int, int, int, int]:
    """(mismatches, re-pulls) as the core counts them, (corrupted, good) pulls as D saw them."""
    stats, pulls = pair.d.role.link.core.stats, pair.d.role.transfer_stats
    return (stats.kv_checksum_mismatches, stats.kv_checksum_repulls, pulls["pulls_corrupted"],
            pulls["pulls_ok"])


def test_a_clean_pull_verifies_and_the_answer_is_unchanged(tiny: LoadedModel,
                                                           colocated: list[int]) -> None:
    pair = _pair(tiny, corrupt=0)
    try:
        got = _serve(pair, ROOM)
        assert got["ids"] == colocated and got["reason"].kind == "length"
        assert _counts(pair) == (0, 0, 0, 1) and pair.d.role.engine.pulls == 1
        # P registered the room twice (the spare for a re-pull) and released both.
        stats = pair.p.role.transfer_stats
        assert stats["registered"] == stats["released"] == 2
    finally:
        pair.close()


def test_one_corrupted_pull_is_pulled_again_and_the_answer_is_unchanged(
    tiny: LoadedModel, colocated: list[int]
) -> None:
    pair = _pair(tiny, corrupt=1)
    try:
        got = _serve(pair, ROOM + 1)
        assert got["ids"] == colocated and got["reason"].kind == "length"
        assert _counts(pair) == (1, 1, 1, 1) and pair.d.role.engine.pulls == 2
        assert pair.d.role.link.failures.pop("r", None) is None and pair.d.role.recomputed == 0
    finally:
        pair.close()


def test_every_pull_corrupted_fails_the_room_naming_the_mismatch(tiny: LoadedModel) -> None:
    pair = _pair(tiny, corrupt=-1)
    try:
        got = _serve(pair, ROOM + 2)  # returns once every page and registration is back
        assert got["reason"].kind == "abort"
        status, reason = pair.d.role.link.failures.pop("r", None)
        assert status == 502, reason
        assert "KV corrupted in flight (and on the re-pull): KV checksum mismatch: array 0 " \
               "(main_kv, shard 0) sums to" in reason, reason
        assert _counts(pair) == (2, 1, 2, 0) and pair.d.role.engine.pulls == 2
        d_pages = pair.d.page_budget.allocator
        assert d_pages.num_free == d_pages.total and not pair.d.role.held_pages
        assert not pair.p.role.engine.registrations() and not pair.p.role.held_pages
    finally:
        pair.close()


def test_every_pull_corrupted_under_recompute_is_prefilled_on_d(
    tiny: LoadedModel, colocated: list[int]
) -> None:
    pair = _pair(tiny, corrupt=-1, failure_policy="recompute")
    try:
        got = _serve(pair, ROOM + 3)
        assert got["ids"] == colocated and got["reason"].kind == "length"
        assert pair.d.role.recomputed == 1 and pair.d.role.link.failures.pop("r", None) is None
        assert _counts(pair) == (2, 1, 2, 0)
    finally:
        pair.close()


def test_without_verification_the_corruption_reaches_the_answer(
    tiny: LoadedModel, colocated: list[int]
) -> None:
    """The control: D does not verify (READY's checksums are ignored), a page of the pull is
    overwritten, and the request "succeeds" with other tokens than the colocated model's."""
    pair = _pair(tiny, corrupt=1, verify=False, garbage=True)
    try:
        got = _serve(pair, ROOM + 4)
        assert got["reason"].kind == "length" and got["ids"] != colocated
        assert _counts(pair) == (0, 0, 0, 1)
    finally:
        pair.close()
