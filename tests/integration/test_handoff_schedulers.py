"""Live KV hand-off (issue 32 §2) between two real DecodeSchedulers, the tiny model and two real
transfer servers: D1 decodes a request part way, hands it off (gathers and registers its KV,
releases its pages), D2 pulls that KV and goes on. The tokens equal an uninterrupted run; no
prefill runs on D2; every page and registration is released on both sides, the registration
exactly once (on D2's report, or at its lease's expiry when nobody pulls it); a request aborted
while its pull runs keeps its pages until the pull reports; a D2 with no free pages waits for
them — and pulls once a sequence frees them, or fails the request once half the offer's lease
has passed, or finishes it on an abort — holding nothing afterwards (table kv_handoff)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from pd_fsm.core.tables import KV_HANDOFF
from pd_fsm.jax_engine.model import LoadedModel, load_model
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers import Req, Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import DecodeScheduler, DisaggregationArgs
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.request import RequestOutput, Resume
from tests.support.pd_pair import collect

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
IDS = [17, 3, 250, 41, 9, 77, 120, 5, 64, 33, 2]


@pytest.fixture(scope="module")
def tiny() -> LoadedModel:
    return load_model("tiny")


def _args(name: str, **kw: Any) -> DisaggregationArgs:
    base: dict[str, Any] = {"model": "tiny", "num_pages": 64, "page_size": 4, "max_running": 8,
                            "max_batched_tokens": 256, "disaggregation_mode": "decode",
                            "instance_id": name}
    return DisaggregationArgs(**{**base, **kw})


@pytest.fixture
def pair(tiny: LoadedModel) -> Iterator[tuple[DecodeScheduler, DecodeScheduler]]:
    # A short pull deadline: a pull of a ticket nobody offers any more fails within it.
    d1, d2 = (DecodeScheduler(_args(name, pull_deadline=3.0), model=tiny)
              for name in ("d1", "d2"))
    yield d1, d2
    for d in (d1, d2):
        d.role.close()
        d.role.engine.close()


def _uninterrupted(tiny: LoadedModel) -> list[int]:
    colo = Scheduler(SchedulerArgs(model="tiny", num_pages=64, page_size=4, max_running=8,
                                   max_batched_tokens=256), model=tiny)
    colo.add_request(Req("r", IDS, GREEDY))
    return list(collect(colo.run_until_idle())["r"]["ids"])


def _decode_then_hand_off(d1: DecodeScheduler, tokens: int, lease_s: float
                          ) -> tuple[list[int], HandoffTicket]:
    """D1 prefills and decodes the request (no P in these tests) until the client has at least
    ``tokens`` tokens, then hands it off: those tokens and the ticket."""
    d1.add_request(Req("r", IDS, GREEDY))
    seen: list[int] = []
    while len(seen) < tokens:
        seen += collect(d1.step()).get("r", {"ids": []})["ids"]
    [(rid, ticket)] = d1.role.handoffs.hand_off({"r"}, lease_s)
    assert rid == "r"
    return seen, ticket


def _until_finished(d: DecodeScheduler, timeout: float) -> list[RequestOutput]:
    out: list[RequestOutput] = []
    deadline = time.monotonic() + timeout
    while not any(o.finished for o in out):
        assert time.monotonic() < deadline
        out += d.step()
        time.sleep(0.002)  # let the pull threads run
    return out


def _idle(d: DecodeScheduler) -> bool:
    s = d.stats()
    return (s.free_pages + s.cached_pages == s.total_pages and not d.role.engine.registrations()
            and not d.reqs and d.role.pull_executor.inflight == 0)


def test_a_handed_off_sequence_continues_exactly_without_a_prefill(
        tiny: LoadedModel, pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    seen, ticket = _decode_then_hand_off(d1, 7, lease_s=30.0)
    assert ticket.kv_tokens == len(IDS) + len(seen) - 1
    assert ticket.next_token == seen[-1] and not d1.reqs and d1.role.handoffs.outstanding == 1
    assert d1.stats().free_pages == d1.stats().total_pages  # pages back at once
    assert d1.step() == []  # no final output: the stream ends with the ticket

    req = d2.make_request("r", IDS, GREEDY, resume=Resume(tuple(seen[:-1])))
    d2.role.handoffs.take(req, ticket, text_sent=0)
    got = collect(_until_finished(d2, 120))["r"]
    assert seen + got["ids"] == _uninterrupted(tiny)
    assert got["reason"].kind == "length"
    assert {s[0] for s in d2.forward_shapes} == {"decode"}  # no prefill ran on D2
    assert d2.role.handoffs.stats["taken"] == 1

    assert d1.role.handoffs.release(ticket.uuid) and not d1.role.handoffs.release(ticket.uuid)
    assert d1.role.handoffs.stats == {"given": 1, "released": 1, "expired": 0, "taken": 0,
                                "take_failed": 0, "waited_for_pages": 0, "withdrawn": 0}
    assert _idle(d1) and _idle(d2)


def test_an_unclaimed_hand_off_expires_once_and_a_failed_pull_fails_the_request(
        tiny: LoadedModel, pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    seen, ticket = _decode_then_hand_off(d1, 3, lease_s=0.2)
    assert d1.role.next_deadline() is not None
    time.sleep(0.3)
    d1.step()
    assert d1.role.handoffs.stats["expired"] == 1 and not d1.role.engine.registrations()
    assert not d1.role.handoffs.release(ticket.uuid)  # released exactly once
    # D2 pulls the expired ticket: the pull fails and so does the request (the proxy then
    # migrates it by re-prefill); its pages go back.
    req = d2.make_request("r", IDS, GREEDY, resume=Resume(tuple(seen[:-1])))
    d2.role.handoffs.take(req, ticket, text_sent=0)
    _until_finished(d2, 60)
    assert d2.role.link.failures.pop("r", None) is not None
    assert d2.role.handoffs.stats["take_failed"] == 1
    assert _idle(d1) and _idle(d2)


def test_a_ticket_that_does_not_fit_is_refused_before_any_page(
        pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    seen, ticket = _decode_then_hand_off(d1, 3, lease_s=30.0)
    wrong = d2.make_request("r", IDS, GREEDY, resume=Resume(tuple(seen)))  # one token too many
    with pytest.raises(ValueError, match="covers"):
        d2.role.handoffs.take(wrong, ticket, text_sent=0)
    assert not d2.reqs and _idle(d2)
    d1.role.handoffs.release(ticket.uuid)
    assert _idle(d1)


def test_an_abort_during_the_pull_frees_the_pages_only_once_the_pull_reports(
        pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    seen, ticket = _decode_then_hand_off(d1, 3, lease_s=30.0)
    d1.role.handoffs.release(ticket.uuid)  # gone before D2 pulls: the pull hangs to its deadline
    req = d2.make_request("r", IDS, GREEDY, resume=Resume(tuple(seen[:-1])))
    d2.role.handoffs.take(req, ticket, text_sent=0)
    assert d2.abort("r", "client left")
    (out,) = d2.step()
    assert out.finish_reason is not None and out.finish_reason.kind == "abort"
    s = d2.stats()
    assert s.free_pages < s.total_pages  # held: the pull may still write them
    deadline = time.monotonic() + 30
    while not _idle(d2):
        assert time.monotonic() < deadline
        d2.step()
        time.sleep(0.01)
    assert d2.role.handoffs.ledger.outcomes[KV_HANDOFF.S.DROPPED] == 1 and _idle(d1)


FILLER = SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True)


def _fill(d: DecodeScheduler) -> None:
    """A plain request on ``d`` whose pages (prompt + 200 tokens out, reserved at admission)
    leave fewer free than the hand-off needs."""
    d.add_request(Req("filler", [(7 * i) % 250 + 1 for i in range(40)], FILLER))
    d.step()
    assert d.stats().free_pages < 9  # the hand-off's 11 + 24 tokens take 9 pages of 4


def _waiting_claim(d1: DecodeScheduler, d2: DecodeScheduler, lease_s: float
                   ) -> tuple[list[int], HandoffTicket]:
    seen, ticket = _decode_then_hand_off(d1, 7, lease_s=lease_s)
    _fill(d2)
    req = d2.make_request("r", IDS, GREEDY, resume=Resume(tuple(seen[:-1])))
    d2.role.handoffs.take(req, ticket, text_sent=0)  # accepted: no refusal
    d2.step()
    assert d2.role.handoffs.stats["waited_for_pages"] == 1
    ledger = d2.role.handoffs.ledger
    assert [ledger.state_of(k) for k in ledger.handoffs] == ["WAITING_FOR_PAGES"]
    return seen, ticket


def test_a_hand_off_with_no_free_pages_waits_and_goes_on_when_they_free(
        tiny: LoadedModel, pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    seen, ticket = _waiting_claim(d1, d2, lease_s=60.0)
    assert d2.abort("filler", "make room")  # its pages free: the claim takes them and pulls
    out: list[RequestOutput] = []
    deadline = time.monotonic() + 120
    while not any(o.rid == "r" and o.finished for o in out):
        assert time.monotonic() < deadline
        out += d2.step()
        time.sleep(0.002)  # let the pull threads run
    got = collect(out)["r"]
    assert seen + got["ids"] == _uninterrupted(tiny) and got["reason"].kind == "length"
    assert d2.role.handoffs.stats["taken"] == 1 and d2.role.handoffs.stats["take_failed"] == 0
    d1.role.handoffs.release(ticket.uuid)
    assert _idle(d1) and _idle(d2)


def test_a_hand_off_that_waits_past_half_its_lease_fails_and_holds_nothing(
        pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    _, ticket = _waiting_claim(d1, d2, lease_s=0.6)  # waits 0.3 s
    assert d2.role.next_deadline() is not None
    deadline = time.monotonic() + 30
    while d2.role.link.failures.pop("r", None) is None:
        assert time.monotonic() < deadline
        d2.step()
        time.sleep(0.01)
    assert d2.role.handoffs.stats["take_failed"] == 1 and d2.role.handoffs.stats["taken"] == 0
    d2.abort("filler", "done")
    d2.step()
    assert _idle(d2)
    deadline = time.monotonic() + 30
    while not _idle(d1):  # its lease (0.6 s) releases the offer nobody pulled
        assert time.monotonic() < deadline
        d1.step()
        time.sleep(0.01)
    assert d1.role.handoffs.stats["expired"] == 1 and not d1.role.handoffs.release(ticket.uuid)


def test_an_abort_while_waiting_for_pages_finishes_the_request_at_once(
        pair: tuple[DecodeScheduler, DecodeScheduler]) -> None:
    d1, d2 = pair
    _, ticket = _waiting_claim(d1, d2, lease_s=60.0)
    assert d2.abort("r", "client left")
    out = collect(d2.step())["r"]
    assert out["reason"].kind == "abort"
    ledger = d2.role.handoffs.ledger
    assert ledger.outcomes[KV_HANDOFF.S.WITHDRAWN] == 1 and not ledger.handoffs
    d2.abort("filler", "done")
    d2.step()
    d1.role.handoffs.release(ticket.uuid)
    assert _idle(d1) and _idle(d2)


def test_a_hand_off_waits_for_a_batch_slot_as_a_room_does(tiny: LoadedModel) -> None:
    """A taking D at ``--max-running`` (1 here) with pages to spare: the claim waits for a slot,
    not past it, and takes the one a finished sequence frees; the batch never holds two."""
    d1 = DecodeScheduler(_args("d1", pull_deadline=3.0), model=tiny)
    d2 = DecodeScheduler(_args("d2", pull_deadline=3.0, max_running=1), model=tiny)
    try:
        seen, ticket = _decode_then_hand_off(d1, 7, lease_s=60.0)
        d2.add_request(Req("filler", [5, 6, 7], SamplingParams(
            temperature=0.0, max_new_tokens=6, ignore_eos=True)))
        d2.step()
        assert d2.stats().free_pages > 20  # pages are not what it waits for
        req = d2.make_request("r", IDS, GREEDY, resume=Resume(tuple(seen[:-1])))
        d2.role.handoffs.take(req, ticket, text_sent=0)
        assert d2.role.handoffs.stats["waited_for_pages"] == 1
        out: list[RequestOutput] = []
        deadline = time.monotonic() + 120
        while not any(o.rid == "r" and o.finished for o in out):
            assert time.monotonic() < deadline
            out += d2.step()
            assert len(d2.running) <= 1
            time.sleep(0.002)  # let the pull threads run
        got = collect(out)
        assert got["filler"]["reason"].kind == "length"
        first_r = next(i for i, o in enumerate(out) if o.rid == "r")
        assert out[first_r - 1].rid == "filler" and out[first_r - 1].finished  # then r's turn
        assert seen + got["r"]["ids"] == _uninterrupted(tiny)
        assert d2.role.handoffs.stats["taken"] == 1
        d1.role.handoffs.release(ticket.uuid)
        assert _idle(d1) and _idle(d2)
    finally:
        for d in (d1, d2):
            d.role.close()
            d.role.engine.close()
