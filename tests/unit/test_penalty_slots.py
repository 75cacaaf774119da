"""The penalties' counts on the device (``schedulers/penalty_slots.py``): a slot a penalized
request, seeded from what it generated, freed once it finished or once the chain chose for it,
and no slot where none is free (that step goes to the chain)."""

from __future__ import annotations

import numpy as np

from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.penalty_slots import PenaltySlots
from pd_fsm.schedulers.request import Req, ReqState

VOCAB = 40


def _req(rid: str, output: list[int], penalty: float = 0.5) -> Req:
    req = Req(rid, [1, 2, 3], SamplingParams(frequency_penalty=penalty))
    req.output_ids.extend(output)
    return req


def test_a_slot_a_penalized_request_seeded_with_its_history() -> None:
    slots = PenaltySlots(2, VOCAB)
    a, b, plain = _req("a", [5, 5, 9]), _req("b", []), _req("c", [4], penalty=0.0)
    assert slots.fit([a, None, plain, b])
    got = slots.slots_for([a, None, plain, b])
    assert got[1] == got[2] == -1 and sorted([got[0], got[3]]) == [0, 1]
    counts = np.asarray(slots.counts)
    assert counts[got[0], 5] == 2 and counts[got[0], 9] == 1 and counts[got[0]].sum() == 3
    assert counts[got[3]].sum() == 0
    # The same requests keep their slots (nothing seeded again).
    assert slots.slots_for([b, a]) == [got[3], got[0]]


def test_no_free_slot_until_a_request_finishes_or_the_chain_chose_for_it() -> None:
    slots = PenaltySlots(2, VOCAB)
    a, b, c = _req("a", [1]), _req("b", [2]), _req("c", [3, 3])
    slots.slots_for([a, b])
    assert not slots.fit([c]) and slots.fit([a, b])
    a.state = ReqState.FINISHED
    assert slots.fit([c])
    (slot_c,) = slots.slots_for([c])
    assert np.asarray(slots.counts)[slot_c, 3] == 2  # a's counts gone with its slot
    slots.forget([b, None])
    assert slots.held() == 1 and slots.fit([_req("d", [])])
