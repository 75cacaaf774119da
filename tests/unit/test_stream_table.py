"""``StreamTable.oldest_unanswered`` (worker/streams.py): the planner's leading sign of a
prefill backlog is the age of the oldest live request that has had no first item yet."""

from __future__ import annotations

import time

import trio

from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob
from pd_fsm.io_trio.worker.streams import Item, Stream, StreamTable
from pd_fsm.jax_engine.sampling.params import SamplingParams


def _stream(rid: str, age: float) -> Stream:
    send, _ = trio.open_memory_channel[Item](4)
    job = GenerateJob(rid=rid, input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=1))
    return Stream(job, send, accepted=time.monotonic() - age)


def test_the_oldest_request_without_a_first_item_is_the_one_counted() -> None:
    table = StreamTable(max_queued=4)
    assert table.oldest_unanswered() == 0.0  # nothing live
    old, young = _stream("old", 9.0), _stream("young", 2.0)
    table.live.update(old=old, young=young)
    assert 9.0 <= table.oldest_unanswered() < 10.0
    old.put(BackendError(503, "any first item answers it"))
    assert 2.0 <= table.oldest_unanswered() < 3.0
    young.put(BackendError(503, "and this one"))
    assert table.oldest_unanswered() == 0.0
