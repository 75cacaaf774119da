"""``StreamTable`` (worker/streams.py): ``oldest_unanswered``, the planner's leading sign of a
prefill backlog, is the age of the oldest live request that has had no first item yet; ``move``
gives up the running streams that allow it and are short enough."""

from __future__ import annotations

import time

import trio

from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob, Moved
from pd_fsm.io_trio.worker.streams import Item, JobStream, StreamTable
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.request import FinishReason, RequestOutput


def _stream(rid: str, age: float) -> JobStream:
    send, _ = trio.open_memory_channel[Item](4)
    job = GenerateJob(rid=rid, input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=1))
    return JobStream(job, send, accepted=time.monotonic() - age)


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


def _output(rid: str, tokens: int, finish: FinishReason | None = None) -> RequestOutput:
    return RequestOutput(rid=rid, new_token_ids=(9,) * tokens, new_logprobs=(),
                         text_delta="", finish_reason=finish, prompt_tokens=2,
                         completion_tokens=tokens)


def test_move_gives_up_the_running_streams_that_allow_it_and_are_short_enough() -> None:
    """Each chosen stream is aborted here; its scheduler's final (abort) output reaches its
    client as ``Moved``, counted as "moved", not as an error. Streams without the proxy's
    leave (``accept_move``), not yet in the scheduler or answered, or longer than
    ``max_context`` (prompt and output so far) stay."""
    table = StreamTable(max_queued=4)
    receivers = {}
    for rid, accept, started in (("a", True, True), ("long", True, True),
                                 ("plain", False, True), ("queued", True, False),
                                 ("unanswered", True, True)):
        send, receivers[rid] = trio.open_memory_channel[Item](8)
        job = GenerateJob(rid=rid, input_ids=(1, 2), sampling=SamplingParams(max_new_tokens=9),
                          accept_move=accept)
        table.live[rid] = JobStream(job, send, in_scheduler=started)
    # "unanswered": in the scheduler, no output yet (its HTTP answer has not begun).
    table.fan_out([_output("a", 3), _output("long", 6), _output("plain", 1),
                   _output("queued", 1)])
    assert table.move(5, "moved by the test") == 1  # a: 2 + 3 tokens; long: 2 + 6
    assert table.take_aborts() == ["a"]
    assert table.move(5, "again") == 0  # already being moved
    table.fan_out([_output("a", 1, FinishReason("abort", message="aborted"))])
    items = [receivers["a"].receive_nowait() for _ in range(2)]
    assert isinstance(items[1], Moved) and items[1].reason == "moved by the test"
    assert table.outcomes["moved"] == 1 and table.outcomes["error"] == 0
    assert "a" not in table.live and not table.live["long"].done  # finished: gone
