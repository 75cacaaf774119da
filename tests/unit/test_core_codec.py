"""The wire codec: any byte string is a message or a RemoteProtocolError, nothing else."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_fsm.core import codec
from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.messages import (
    MAX_ROOM,
    MAX_UUID,
    Abort,
    Done,
    Heartbeat,
    HeartbeatAck,
    Message,
    Ready,
    RecvInit,
)

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


def _raw(payload: object, version: int = codec.VERSION) -> bytes:
    return codec.MAGIC + bytes((version, 0)) + msgpack.packb(payload)


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        (b"", "bad magic"),
        (b"XX\x01\x00", "bad magic"),
        (_raw({"t": "DONE", "b": {"room": 1, "ok": True}}, version=9), "unsupported version 9"),
        (codec.MAGIC + b"\x01\x80" + msgpack.packb({}), "unknown flags"),
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
        (_raw({"t": "HB", "b": {"seq": 1, "rooms": list(range(5000))}}), "not msgpack"),
        (codec.MAGIC + b"\x01\x00" + b"\xc1", "not msgpack"),
        (codec.MAGIC + b"\x01\x00" + b"x" * (codec.MAX_FRAME + 1), "exceeds"),
    ],
)
def test_each_malformation_is_named(frame: bytes, problem: str) -> None:
    with pytest.raises(RemoteProtocolError, match=problem):
        codec.decode(frame)


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(RemoteProtocolError):
        codec.decode("text")  # type: ignore[arg-type]
