"""The wire codec: any byte string is a message or a RemoteProtocolError, nothing else."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_fsm.core import codec, keys
from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.messages import (
    KV_CHECKSUM_LIMIT,
    MAX_KV_CHECKSUMS,
    MAX_KV_SHARDS,
    MAX_ROOM,
    MAX_TOP_LOGPROBS,
    MAX_UUID,
    Abort,
    Done,
    Heartbeat,
    HeartbeatAck,
    KVPart,
    Message,
    Ready,
    RecvInit,
    TokenLogprob,
)
from pd_fsm.core.replay import ReplayedFrame, ReplayGuard, StaleFrame

SECRET = b"s3cret"
rooms = st.integers(0, MAX_ROOM - 1)
text = st.text(max_size=60)
messages: st.SearchStrategy[Message] = st.one_of(
    st.builds(RecvInit, rooms, text, st.integers(0, 1 << 20), text),
    st.builds(
        Ready,
        rooms,
        st.integers(0, MAX_UUID - 1),
        st.integers(0, (1 << 31) - 1),
        st.integers(0, 1 << 20),
        text,
        st.floats(allow_nan=False, allow_infinity=False),
        st.integers(0, MAX_UUID - 1),
        text,
        st.lists(
            st.builds(TokenLogprob, st.integers(0, (1 << 31) - 1),
                      st.floats(max_value=0.0, allow_nan=False, allow_infinity=False)),
            max_size=MAX_TOP_LOGPROBS,
        ).map(tuple),
        st.integers(1, MAX_KV_SHARDS),
        st.lists(st.integers(0, KV_CHECKSUM_LIMIT - 1), max_size=64).map(tuple),
        st.integers(0, MAX_UUID - 1),
    ),
    st.builds(
        KVPart, rooms, st.integers(0, MAX_UUID - 1), st.integers(0, (1 << 20) - 1),
        st.integers(0, 1 << 20), text, st.integers(0, MAX_UUID - 1), text,
        st.integers(1, MAX_KV_SHARDS),
        st.lists(st.integers(0, KV_CHECKSUM_LIMIT - 1), max_size=64).map(tuple),
    ),
    st.builds(Done, rooms, st.booleans(), text),
    st.builds(Heartbeat, st.integers(0, MAX_UUID - 1), st.lists(rooms, max_size=50).map(tuple)),
    st.builds(
        HeartbeatAck,
        st.integers(0, MAX_UUID - 1),
        st.integers(0, MAX_UUID - 1),
        st.lists(rooms, max_size=5).map(tuple),
        st.lists(rooms, max_size=5).map(tuple),
    ),
    st.builds(Abort, rooms, text),
)


def _decode_or_remote_error(frame: bytes, secret: bytes | None) -> Message | None:
    try:
        return codec.decode(frame, secret)
    except RemoteProtocolError:
        return None  # anything else propagates and fails the test


@given(messages, st.sampled_from([None, SECRET]))
def test_round_trip(message: Message, secret: bytes | None) -> None:
    assert codec.decode(codec.encode(message, secret), secret) == message


@settings(max_examples=500)
@given(st.binary(max_size=300), st.sampled_from([None, SECRET]))
def test_arbitrary_bytes(frame: bytes, secret: bytes | None) -> None:
    _decode_or_remote_error(frame, secret)


@settings(max_examples=500)
@given(messages, st.sampled_from([None, SECRET]), st.data())
def test_truncated_and_bit_flipped(
    message: Message, secret: bytes | None, data: st.DataObject
) -> None:
    frame = codec.encode(message, secret)
    cut = data.draw(st.integers(0, len(frame) - 1))
    assert _decode_or_remote_error(frame[:cut], secret) is None or secret is None
    pos = data.draw(st.integers(0, len(frame) - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = bytearray(frame)
    flipped[pos] ^= 1 << bit
    result = _decode_or_remote_error(bytes(flipped), secret)
    if secret is not None:
        assert result is None, "a bit flip must break the signature"


@given(messages)
def test_wrong_or_missing_signature_refused(message: Message) -> None:
    with pytest.raises(RemoteProtocolError, match="bad signature"):
        codec.decode(codec.encode(message, b"other-secret"), SECRET)
    with pytest.raises(RemoteProtocolError, match="unsigned"):
        codec.decode(codec.encode(message, None), SECRET)
    with pytest.raises(RemoteProtocolError, match="no cluster secret"):
        codec.decode(codec.encode(message, SECRET), None)


_READY = {"room": 1, "uuid": 1, "first_token": 1, "n_pages": 1, "layout_hash": "h"}


_PART = {"room": 1, "uuid": 2, "first_page": 0, "n_pages": 2, "layout_hash": "h"}


def _raw(payload: object, version: int = codec.VERSION) -> bytes:
    return codec.MAGIC + bytes((version, 0)) + msgpack.packb(payload)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"", "bad magic"),
        (b"XX\x01\x00", "bad magic"),
        (_raw({"t": "DONE", "b": {"room": 1, "ok": True}}, version=9), "unsupported version 9"),
        (codec.MAGIC + bytes((codec.VERSION, 0x80)) + msgpack.packb({}), "unknown flags"),
        (_raw([1, 2]), "map with keys"),
        (_raw({"t": "NOPE", "b": {}}), "unknown message type"),
        (_raw({"t": "DONE", "b": {"room": 1, "ok": 1}}), "expected bool"),
        (_raw({"t": "DONE", "b": {"room": "1", "ok": True}}), "expected int"),
        (_raw({"t": "DONE", "b": {"room": True, "ok": True}}), "expected int"),
        (_raw({"t": "DONE", "b": {"room": -1, "ok": True}}), "outside"),
        (_raw({"t": "DONE", "b": {"room": 1, "ok": True, "x": 1}}), "Extra fields"),
        (_raw({"t": "ABORT", "b": {"room": 1}}), "missing field"),
        (_raw({"t": "READY", "b": _READY | {"first_logprob": float("nan")}}), "finite"),
        (_raw({"t": "READY", "b": _READY | {"first_logprob": 1}}), "finite float"),
        (_raw({"t": "READY", "b": _READY | {"kv_shards": 0}}), "outside"),
        (_raw({"t": "READY", "b": _READY | {"kv_shards": MAX_KV_SHARDS + 1}}), "outside"),
        (_raw({"t": "READY", "b": _READY | {"kv_shards": 2}}, version=4), "unsupported version 4"),
        (_raw({"t": "READY", "b": _READY | {"kv_checksums": [-1]}}), "bad checksum -1"),
        (_raw({"t": "READY", "b": _READY | {"kv_checksums": [KV_CHECKSUM_LIMIT]}}),
         "bad checksum"),
        (_raw({"t": "READY", "b": _READY | {"kv_checksums": [True]}}), "bad checksum"),
        (_raw({"t": "READY", "b": _READY | {"kv_checksums": 5}}), "list of checksums"),
        (_raw({"t": "READY", "b": _READY | {"kv_checksums": [0] * (MAX_KV_CHECKSUMS + 1)}}),
         "not msgpack"),  # longer than any list this side reads
        (_raw({"t": "READY", "b": _READY | {"repull_uuid": -1}}), "outside"),
        (_raw({"t": "KV_PART", "b": _PART | {"first_page": -1}}), "first_page=-1 outside"),
        (_raw({"t": "KV_PART", "b": _PART | {"first_page": 1 << 20}}), "outside"),
        (_raw({"t": "KV_PART", "b": _PART | {"n_pages": "2"}}), "expected int"),
        (_raw({"t": "KV_PART", "b": _PART | {"kv_checksums": [-1]}}), "bad checksum -1"),
        (_raw({"t": "KV_PART", "b": _PART | {"first_token": 1}}), "Extra fields"),
        (_raw({"t": "KV_PART", "b": _PART}, version=6), "unsupported version 6"),
        (_raw({"t": "HB", "b": {"seq": 1, "rooms": list(range(5000))}}), "not msgpack"),
        (codec.MAGIC + bytes((codec.VERSION, 0)) + b"\xc1", "not msgpack"),
        (codec.MAGIC + bytes((codec.VERSION, 0)) + b"x" * (codec.MAX_FRAME + 1), "exceeds"),
        (_raw({"t": "DONE", "b": {"room": 1, "ok": True}}, version=1), "unsupported version 1"),
    ],
)
def test_each_malformation_is_named(frame: bytes, problem: str) -> None:
    with pytest.raises(RemoteProtocolError, match=problem):
        codec.decode(frame)


@pytest.mark.parametrize(
    ("top", "problem"),
    [
        ([[1, -0.5]] * (MAX_TOP_LOGPROBS + 1), "more than"),
        ([[1, 0.5]], "bad \\[token, logprob\\] pair"),  # a log-prob above 0
        ([[-1, -0.5]], "bad \\[token, logprob\\] pair"),
        ([[1]], "bad \\[token, logprob\\] pair"),
        ([[1, "x"]], "finite float"),
        ([[True, -0.5]], "expected int"),
        ({"1": -0.5}, "list of \\[token, logprob\\] pairs"),
    ],
)
def test_ready_top_logprobs_checked(top: object, problem: str) -> None:
    frame = _raw({"t": "READY", "b": {**_READY, "first_top": top}})
    with pytest.raises(RemoteProtocolError, match=problem):
        codec.decode(frame)


def test_a_peer_of_the_previous_version_is_refused_by_version_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Version 7 added KV_PART (streamed KV, issue 31 §1). A version-6 peer's frame is refused
    here by its version number, before its fields are read, and ours by a version-6 peer: each
    side names both versions (a version-6 D never takes a KV_PART for an unknown message that
    fails the room; it refuses the P before any room)."""
    ready = Ready(1, 2, 3, 4, "h", kv_checksums=(5, 6), repull_uuid=7)
    old = _raw({"t": "READY", "b": _READY}, version=codec.VERSION - 1)
    with pytest.raises(RemoteProtocolError, match=f"unsupported version {codec.VERSION - 1} "
                       rf"\(this side speaks {codec.VERSION}\)"):
        codec.decode(old)
    ours = codec.encode(ready, SECRET)
    monkeypatch.setattr(codec, "VERSION", codec.VERSION - 1)  # this process now speaks 6
    with pytest.raises(RemoteProtocolError, match=f"unsupported version {codec.VERSION + 1} "
                       rf"\(this side speaks {codec.VERSION}\)"):
        codec.decode(ours, SECRET)


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(RemoteProtocolError):
        codec.decode("text")  # type: ignore[arg-type]


# -- replay protection (signed frames carry sent time and nonce under the MAC) -------------------

T0 = 1_800_000_000.0  # a wall-clock time


def _signed(message: Message, sent_at: float = T0, nonce: int = 7) -> bytes:
    return codec.encode(message, SECRET, sent_at=sent_at, nonce=nonce)


@given(messages, st.floats(0, 4e9), st.integers(0, 2**64 - 1))
def test_signed_round_trip_through_a_guard(message: Message, sent: float, nonce: int) -> None:
    guard = ReplayGuard(window_s=60)
    frame = codec.encode(message, SECRET, sent_at=sent, nonce=nonce)
    assert codec.decode(frame, SECRET, guard=guard, now=sent + 59) == message


def test_replayed_frame_refused_fresh_ones_accepted() -> None:
    guard = ReplayGuard(window_s=60)
    frame = _signed(Abort(5, "client gone"))
    assert codec.decode(frame, SECRET, guard=guard, now=T0 + 1) == Abort(5, "client gone")
    with pytest.raises(ReplayedFrame):
        codec.decode(frame, SECRET, guard=guard, now=T0 + 2)
    # The same message sent again by the peer is a new frame (new nonce): accepted.
    again = _signed(Abort(5, "client gone"), nonce=8)
    assert codec.decode(again, SECRET, guard=guard, now=T0 + 2) == Abort(5, "client gone")
    # After the window the replay is stale, and the guard has forgotten the MAC.
    with pytest.raises(StaleFrame, match="ago"):
        codec.decode(frame, SECRET, guard=guard, now=T0 + 60.5)
    assert len(guard) == 0


def test_frame_from_the_future_refused() -> None:
    with pytest.raises(StaleFrame, match="future"):
        codec.decode(_signed(Done(1, True)), SECRET, guard=ReplayGuard(60), now=T0 - 61)


def test_freshness_is_under_the_mac() -> None:
    frame = bytearray(_signed(Heartbeat(1, (2,))))
    frame[codec.HEADER_SIZE + 3] ^= 1  # move the sent time
    with pytest.raises(RemoteProtocolError, match="bad signature"):
        codec.decode(bytes(frame), SECRET, guard=ReplayGuard(60), now=T0)


def test_guard_bounded() -> None:
    guard = ReplayGuard(window_s=60, max_entries=2)
    for nonce in (1, 2):
        codec.decode(_signed(Done(1, True), nonce=nonce), SECRET, guard=guard, now=T0)
    with pytest.raises(RemoteProtocolError, match="replay guard full"):
        codec.decode(_signed(Done(1, True), nonce=3), SECRET, guard=guard, now=T0)
    # Once the window has passed, room again.
    later = _signed(Done(1, True), sent_at=T0 + 61, nonce=4)
    assert codec.decode(later, SECRET, guard=guard, now=T0 + 61) == Done(1, True)


def test_guard_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="needs a secret"):
        codec.decode(codec.encode(Done(1, True)), None, guard=ReplayGuard(), now=T0)


def test_guard_floor_refuses_frames_sent_before_the_receiver_started() -> None:
    """A restarted receiver has forgotten every MAC it accepted; its floor (its own start) keeps
    frames captured before the restart from being replayed to it, though they are in the window."""
    before = _signed(Heartbeat(1, (2,)), sent_at=T0 - 5)
    first = ReplayGuard(window_s=60)
    assert codec.decode(before, SECRET, guard=first, now=T0 - 4) == Heartbeat(1, (2,))
    restarted = ReplayGuard(window_s=60, not_before=T0)  # the receiver started again at T0
    with pytest.raises(StaleFrame, match=r"5\.000 s before this process started"):
        codec.decode(before, SECRET, guard=restarted, now=T0 + 1)
    # Frames sent from the start on are admitted, once.
    after = _signed(Heartbeat(1, (2,)), sent_at=T0, nonce=8)
    assert codec.decode(after, SECRET, guard=restarted, now=T0 + 1) == Heartbeat(1, (2,))
    with pytest.raises(ReplayedFrame):
        codec.decode(after, SECRET, guard=restarted, now=T0 + 1)


def test_frames_signed_with_another_derived_key_are_refused() -> None:
    """The side channel signs with the side-channel key: a frame made with the registry key (or
    with the cluster secret itself) of the same secret does not verify."""
    side, registry = keys.side_channel_key(SECRET), keys.registry_key(SECRET)
    frame = codec.encode(Done(1, True), side, sent_at=T0, nonce=1)
    assert codec.decode(frame, side) == Done(1, True)
    for wrong in (registry, SECRET):
        forged = codec.encode(Done(1, True), wrong, sent_at=T0, nonce=1)
        with pytest.raises(RemoteProtocolError, match="bad signature"):
            codec.decode(forged, side)


def test_guard_floor_admits_a_frame_sent_in_the_millisecond_the_receiver_started() -> None:
    """Frames carry their time in whole milliseconds (rounded): a frame sent 0.1 ms after the
    receiver started reads as 0.3 ms before it, and must still be admitted (a test of the side
    channel saw exactly that refusal once)."""
    started = T0 + 0.0003
    sent = _signed(Heartbeat(1, (2,)), sent_at=started + 0.0001, nonce=9)  # on the wire: T0
    guard = ReplayGuard(window_s=60, not_before=started)
    assert codec.decode(sent, SECRET, guard=guard, now=started + 0.01) == Heartbeat(1, (2,))
    early = _signed(Heartbeat(1, (2,)), sent_at=T0 - 0.002, nonce=10)
    with pytest.raises(StaleFrame):
        codec.decode(early, SECRET, guard=guard, now=started + 0.01)
