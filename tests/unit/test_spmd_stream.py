"""The command stream of a multi-process instance (``io_trio/worker/spmd``): frames that decode
to exactly what was sent or are refused with a reason; a rank 0 that counts and drops what is not
a hello and names the ranks that never joined; a follower, replaying into a real (tiny, one
device) scheduler over real ZMQ, that drops forged and replayed frames, applies the rest in
order, and leaves with an error on a gap, a divergence or a silent rank 0."""

from __future__ import annotations

import contextlib
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from pd_fsm.core import events as ev
from pd_fsm.core.keys import side_channel_key, spmd_key
from pd_fsm.core.messages import Abort, Heartbeat
from pd_fsm.io_trio.worker.spmd import frames
from pd_fsm.io_trio.worker.spmd.follower import Divergence, apply_step, follow
from pd_fsm.io_trio.worker.spmd.frames import (
    Announced,
    Arrival,
    Hello,
    LegAdded,
    Pinged,
    PullAgreed,
    PullReported,
    RequestAborted,
    RequestAdded,
    SpmdProtocolError,
    StepOrdered,
    Stopped,
    TickStarted,
    decode,
    encode,
)
from pd_fsm.io_trio.worker.spmd.leader import SpmdError, SpmdLeader, SpmdStats
from pd_fsm.jax_engine.sampling.grammar import Constraint
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.args import SchedulerArgs
from pd_fsm.schedulers.request import LogprobSpec
from pd_fsm.schedulers.scheduler import Scheduler
from tests.integration.failure_support import HOST, free_port

KEY = spmd_key(b"a cluster secret of enough entropy")
ADD = RequestAdded("r1", (1, 2, 3), SamplingParams(max_new_tokens=3, temperature=0.0),
                   LogprobSpec())

_sampling = st.builds(
    SamplingParams,
    max_new_tokens=st.integers(0, 4096), temperature=st.floats(0, 2),
    seed=st.none() | st.integers(0, 2**31), stop=st.lists(st.text(max_size=8), max_size=3),
    top_k=st.integers(-1, 100),
    constraint=st.none() | st.builds(Constraint, kind=st.just("regex"),
                                     source=st.text(max_size=20)),
)
_command = st.one_of(
    st.builds(RequestAdded, rid=st.text(max_size=40),
              input_ids=st.lists(st.integers(0, 2**31), max_size=50).map(tuple),
              sampling=_sampling,
              logprobs=st.builds(LogprobSpec, top=st.integers(0, 20),
                                 prompt_from=st.integers(-1, 100))),
    st.builds(RequestAborted, rid=st.text(max_size=40), message=st.text(max_size=40)),
)
_text = st.text(max_size=30)
_event = st.one_of(
    st.builds(ev.MessageReceived, peer=_text, message=st.one_of(
        st.builds(Heartbeat, seq=st.integers(0, 2**31),
                  rooms=st.lists(st.integers(0, 2**62), max_size=4).map(tuple)),
        st.builds(Abort, room=st.integers(0, 2**62), reason=_text))),
    st.builds(ev.PeerResolved, bootstrap_addr=_text, peer=_text, transfer_addr=_text,
              layout_hash=_text),
    st.builds(ev.PeerResolutionFailed, bootstrap_addr=_text, reason=_text),
    st.builds(ev.LegRefused, room=st.integers(0, 2**62),
              prefills=st.lists(_text, max_size=3).map(tuple), reason=_text),
)
_leg = st.builds(
    LegAdded, rid=_text, input_ids=st.lists(st.integers(0, 2**31), max_size=20).map(tuple),
    sampling=_sampling, logprobs=st.just(LogprobSpec()), accepted=st.floats(0, 1e9),
    bootstrap_host=st.none() | _text, bootstrap_port=st.none() | st.integers(1, 65535),
    room=st.none() | st.integers(0, 2**62),
)
_tick = st.builds(
    TickStarted, tick=st.integers(1, 2**62), now=st.floats(0, 1e9), fingerprint=_text,
    arrivals=st.lists(st.builds(Arrival, arrived=st.floats(0, 1e9), event=_event),
                      max_size=4).map(tuple),
    legs=st.lists(_leg, max_size=3).map(tuple), aborts=st.lists(_text, max_size=3).map(tuple),
    pulls=st.lists(st.builds(PullAgreed, room=st.integers(0, 2**62), failure=_text),
                   max_size=3).map(tuple),
)
_frame = st.one_of(
    st.builds(Hello, rank=st.integers(1, frames.MAX_RANKS - 1)),
    st.builds(StepOrdered, commands=st.lists(_command, max_size=5).map(tuple)),
    st.just(Pinged()), st.just(Stopped()), _tick,
    st.builds(PullReported, rank=st.integers(1, frames.MAX_RANKS - 1),
              room=st.integers(0, 2**62), ok=st.booleans(), reason=_text),
    st.builds(Announced, record=_text),
)


@given(frame=_frame, seq=st.integers(0, 2**63), key=st.sampled_from([None, KEY]))
def test_every_frame_round_trips(frame: frames.Frame, seq: int, key: bytes | None) -> None:
    assert decode(encode(frame, seq, key), key) == (seq, frame)


@given(kind=st.integers(0, 255), payload=st.binary(max_size=200), raw=st.booleans())
def test_any_bytes_decode_or_are_refused(kind: int, payload: bytes, raw: bool) -> None:
    # With a valid header too, so msgpack and the structuring see the bytes.
    data = payload if raw else _header(kind) + payload
    with contextlib.suppress(SpmdProtocolError):
        decode(data, None)


def _header(kind: int, seq: int = 1) -> bytes:
    return frames.MAGIC + bytes((frames.VERSION, kind)) + seq.to_bytes(8, "big")


def _raw(kind: int, payload: object, seq: int = 1) -> bytes:
    return _header(kind, seq) + msgpack.packb(payload)


@pytest.mark.parametrize(("data", "key", "reason"), [
    (encode(StepOrdered((ADD,)), 1, None), KEY, "bad MAC"),  # unsigned, a key expected
    (encode(StepOrdered((ADD,)), 1, side_channel_key(b"a cluster secret of enough entropy")),
     KEY, "bad MAC"),  # the side channel's key never signs a command
    (_raw(1, {"rank": "1"}), None, "expected int @ Hello.rank"),
    (_raw(1, {"rank": True}), None, "expected int @ Hello.rank"),
    (_raw(1, {"rank": 1, "extra": 2}), None, "extra fields found (extra)"),
    (_raw(1, {"rank": 0}), None, "only ranks > 0 send it"),
    (_raw(9, {}), None, "unknown frame kind 9"),
    (_raw(2, [["RequestAdded", {"rid": "a", "input_ids": [1], "logprobs": {},
                                "sampling": {"temperature": -1.0}}]]), None, "sampling"),
    (_raw(2, [["Unplanned", {}]]), None, "not a command"),
    (_raw(5, {"tick": 1, "now": 0.0, "fingerprint": "", "arrivals": [[0.0, "MessageReceived",
                                                                       ["p", b"junk"]]]}),
     None, "not a pd_fsm frame"),  # the side channel's codec refuses the message inside
    (_raw(5, {"tick": 1, "now": 0.0, "fingerprint": "", "arrivals": [[0.0, "TimeAdvanced",
                                                                       {}]]}),
     None, "expected Arrival @ TickStarted.arrivals"),  # not an event a tick takes
    (_raw(6, {"rank": 0, "room": 1, "ok": True, "reason": ""}), None, "only ranks > 0"),
    (b"XX" + bytes(20), None, "not a command frame"),
    (b"PS\x07" + bytes(20), None, "version 7"),
    (b"P", None, "shorter than its header"),
    (bytes(frames.MAX_FRAME + 1), None, "over"),
])
def test_bad_frames_are_refused_by_name(data: bytes, key: bytes | None, reason: str) -> None:
    with pytest.raises(SpmdProtocolError, match=reason.replace("(", r"\(").replace(")", r"\)")):
        decode(data, key)


def test_rank0_names_the_ranks_that_never_joined_and_drops_junk() -> None:
    port = free_port()
    leader = SpmdLeader(f"{HOST}:{port}", 3, KEY)
    ctx = zmq.Context.instance()
    socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
    try:
        for s in socks:
            s.connect(f"tcp://{HOST}:{port}")
        socks[0].send(b"junk")
        socks[1].send(encode(Hello(1), 0, None))  # unsigned: this instance has a key
        socks[2].send(encode(Hello(2), 0, KEY))
        with pytest.raises(SpmdError, match=r"ranks \[1\] did not join within 0.5 s"):
            leader.wait_for_ranks(0.5)
        assert leader.stats == SpmdStats(ranks=3, joined=1, frames_sent=0, frames_dropped=2)
        socks[0].send(encode(Hello(2), 0, KEY))
        with pytest.raises(SpmdError, match="rank 2 said hello twice"):
            leader.wait_for_ranks(5)
    finally:
        for s in socks:
            s.close(linger=0)
        leader.close()


@pytest.fixture(scope="module")
def scheduler() -> Scheduler:
    return Scheduler(SchedulerArgs(model="tiny", num_pages=32, page_size=4,
                                   max_batched_tokens=64, context_length=64))


def test_a_step_with_nothing_to_do_is_a_divergence(scheduler: Scheduler) -> None:
    with pytest.raises(Divergence, match="nothing to do"):
        apply_step(scheduler, StepOrdered(()))


class _Rank0:
    """A real ROUTER socket standing in for rank 0's, sending frames as a test chooses."""

    def __init__(self) -> None:
        self.port = free_port()
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(f"tcp://{HOST}:{self.port}")
        self.peer = b""

    def accept(self) -> None:
        assert self.sock.poll(10_000), "the follower never said hello"
        self.peer, data = self.sock.recv_multipart()
        assert decode(data, KEY) == (0, Hello(1))

    def send(self, data: bytes) -> None:
        self.sock.send_multipart([self.peer, data])

    def close(self) -> None:
        self.sock.close(linger=0)


def _follow_in_thread(scheduler: Scheduler, port: int, silence: float = 30.0) -> tuple[
        threading.Thread, list[int]]:
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(
        follow(scheduler, f"{HOST}:{port}", 1, KEY, silence=silence)), daemon=True)
    thread.start()
    return thread, result


def test_follower_replays_in_order_and_drops_what_it_cannot_trust(
        scheduler: Scheduler, caplog: pytest.LogCaptureFixture) -> None:
    # The steps rank 0 would take: the same request run here first, directly.
    scheduler.add_request(scheduler.make_request("r0", list(ADD.input_ids), ADD.sampling))
    steps = 0
    while scheduler.has_work():
        scheduler.step()
        steps += 1
    rank0 = _Rank0()
    try:
        thread, result = _follow_in_thread(scheduler, rank0.port)
        rank0.accept()
        rank0.send(encode(StepOrdered((ADD,)), 1, KEY))
        rank0.send(b"garbage")  # dropped
        rank0.send(encode(StepOrdered((ADD,)), 1, KEY))  # a replay of frame 1: dropped
        rank0.send(encode(StepOrdered(()), 2, b"x" * 32))  # forged: dropped
        rank0.send(encode(Pinged(), 2, KEY))
        for seq in range(3, steps + 2):
            rank0.send(encode(StepOrdered(()), seq, KEY))
        rank0.send(encode(Stopped(), steps + 2, KEY))
        thread.join(60)
        assert result == [0]
        assert caplog.text.count("dropped") == 3
        assert not scheduler.has_work()  # r1 ran to its end, exactly as rank 0's would
        assert scheduler.stats().running == 0
    finally:
        rank0.close()


def test_follower_leaves_on_a_gap(scheduler: Scheduler) -> None:
    rank0 = _Rank0()
    try:
        thread, result = _follow_in_thread(scheduler, rank0.port)
        rank0.accept()
        rank0.send(encode(Pinged(), 2, KEY))  # frame 1 never came
        thread.join(30)
        assert result == [1]
    finally:
        rank0.close()


def test_follower_leaves_a_silent_rank0(scheduler: Scheduler) -> None:
    rank0 = _Rank0()
    try:
        thread, result = _follow_in_thread(scheduler, rank0.port, silence=0.5)
        rank0.accept()
        thread.join(30)
        assert result == [1]
    finally:
        rank0.close()


def test_rank0_takes_each_ranks_reports_once_and_only_from_that_rank() -> None:
    port = free_port()
    leader = SpmdLeader(f"{HOST}:{port}", 2, KEY)
    ctx = zmq.Context.instance()
    rank1, stranger = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    try:
        for s in (rank1, stranger):
            s.connect(f"tcp://{HOST}:{port}")
        rank1.send(encode(Hello(1), 0, KEY))
        leader.wait_for_ranks(5)
        ok, failed = PullReported(1, 7, True), PullReported(1, 8, False, "timeout")
        rank1.send(encode(ok, 1, KEY))
        rank1.send(encode(ok, 1, KEY))  # a replay
        stranger.send(encode(failed, 2, KEY))  # names rank 1, is not its connection
        rank1.send(encode(failed, 2, b"y" * 32))  # forged
        rank1.send(encode(failed, 2, KEY))
        got: list[PullReported] = []
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            got += leader.reports()
            time.sleep(0.01)
        time.sleep(0.1)  # nothing more comes: the rest was dropped
        got += leader.reports()
        assert got == [ok, failed]
        assert leader.stats.frames_dropped == 3
    finally:
        for s in (rank1, stranger):
            s.close(linger=0)
        leader.close()
