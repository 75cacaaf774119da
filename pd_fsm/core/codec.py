"""Wire codec for side-channel messages: msgpack via cattrs, versioned, optionally HMAC-signed.

Frame layout::

    b"PF" | version (1 B) | flags (1 B; bit 0 = signed) | [sent_ms (8 B) | nonce (8 B)]
          | msgpack payload | [HMAC-SHA256, 32 B]

The bracketed parts are present in signed frames only: the sender's wall-clock time in ms and a
random nonce, both under the MAC, so that a receiver holding a
:class:`~pd_fsm.core.replay.ReplayGuard` refuses a frame captured and sent again
(:mod:`pd_fsm.core.replay`). The caller supplies both: the core reads no clock.

The payload is a msgpack map ``{"t": WIRE_NAME, "b": {field: value}}``. :func:`decode` turns any
byte string into a :class:`~pd_fsm.core.messages.Message` or raises
:class:`~pd_fsm.core.errors.RemoteProtocolError` — nothing else escapes. Fields are checked
strictly (no int from a string, no bool as an int, ranges enforced) because a peer's bytes are not
trusted; a receiver configured with a secret refuses unsigned frames.

The ``secret`` of :func:`encode` and :func:`decode` is the HMAC key itself. The adapters pass
:func:`pd_fsm.core.keys.side_channel_key` of the cluster secret, never the cluster secret: the
registry signs its requests with another key derived from it, and a MAC made with one key never
verifies under the other.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable
from typing import Any

import attrs
import cattrs
import msgpack
from cattrs.gen import make_dict_structure_fn, override

from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.messages import (
    BY_WIRE_NAME,
    KV_CHECKSUM_LIMIT,
    MAX_KV_CHECKSUMS,
    MAX_KV_SHARDS,
    MAX_PAGES,
    MAX_REASON,
    MAX_ROOM,
    MAX_ROOMS_PER_HEARTBEAT,
    MAX_TOKEN,
    MAX_TOP_LOGPROBS,
    MAX_UUID,
    WIRE_NAMES,
    KVPart,
    Message,
    Ready,
    TokenLogprob,
)
from pd_fsm.core.replay import ReplayGuard

MAGIC = b"PF"
# 2: signed frames carry sent_ms and a nonce; 3: incarnations, READY.transfer_addr;
# 4: READY.first_top (a peer of version 3 would refuse the field by name; the version says why);
# 5: READY.kv_shards (P's KV as one array per kv-head shard: tensor parallelism);
# 6: READY.kv_checksums and READY.repull_uuid (KV checked on arrival); 7: KV_PART
# (KV streamed in parts while P prefills: a peer of version 6 would take it for an
# unknown message type and fail the room; the version refuses the peer before any room). A peer
# of another version is refused by its version number before anything else is read.
VERSION = 7
FLAG_SIGNED = 0x01
MAC_SIZE = 32
HEADER_SIZE = 4
_FRESHNESS = struct.Struct("!QQ")  # sent_ms, nonce
MAX_FRAME = 64 * 1024

# Per-field ranges: [lo, hi) for ints. A field not listed here only needs the right type.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "room": (0, MAX_ROOM),
    "uuid": (0, MAX_UUID),
    "n_pages": (0, MAX_PAGES + 1),
    "skip_pages": (0, MAX_PAGES + 1),
    "first_page": (0, MAX_PAGES),
    "first_token": (0, MAX_TOKEN),
    "incarnation": (0, MAX_UUID),
    "seq": (0, MAX_UUID),
    "kv_shards": (1, MAX_KV_SHARDS + 1),
    "repull_uuid": (0, MAX_UUID),
}


def strict_int(value: Any, _: type) -> int:
    """cattrs hook: an int and nothing else (no bool, no str, no float); shared with io_trio."""
    if type(value) is not int:  # bool is an int subclass: refuse it too
        raise TypeError(f"expected int, got {type(value).__name__}")
    return value


def _strict_str(value: Any, _: type) -> str:
    if type(value) is not str:
        raise TypeError(f"expected str, got {type(value).__name__}")
    if len(value) > MAX_REASON:
        raise ValueError(f"string longer than {MAX_REASON}")
    return value


def _strict_bool(value: Any, _: type) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected bool, got {type(value).__name__}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if type(value) is not float or value != value or value in (float("inf"), float("-inf")):
        raise TypeError(f"expected a finite float, got {value!r:.20}")
    return value


def _int_list(
    items: str, item: str, most: int, limit: int
) -> Callable[[Any, type], tuple[int, ...]]:
    """A cattrs hook: a list of at most ``most`` ints in [0, ``limit``); errors name ``items``."""

    def structure(value: Any, _: type) -> tuple[int, ...]:
        if type(value) is not list:
            raise TypeError(f"expected a list of {items}, got {type(value).__name__}")
        if len(value) > most:
            raise ValueError(f"more than {most} {items}")
        for v in value:
            if type(v) is not int or not 0 <= v < limit:
                raise ValueError(f"bad {item} {v!r:.40}")
        return tuple(value)

    return structure


_room_list = _int_list("rooms", "room id", MAX_ROOMS_PER_HEARTBEAT, MAX_ROOM)
# READY's kv_checksums, 32-bit words: the hook of that field alone (every other int tuple is a
# list of rooms).
_checksum_list = _int_list("checksums", "checksum", MAX_KV_CHECKSUMS, KV_CHECKSUM_LIMIT)


def _top_list(value: Any, _: type) -> tuple[TokenLogprob, ...]:
    """A position's top logprobs: at most MAX_TOP_LOGPROBS ``[token, logprob]`` pairs."""
    if type(value) is not list:
        raise TypeError(f"expected a list of [token, logprob] pairs, got {type(value).__name__}")
    if len(value) > MAX_TOP_LOGPROBS:
        raise ValueError(f"more than {MAX_TOP_LOGPROBS} top logprobs")
    out = []
    for pair in value:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError(f"bad [token, logprob] pair {pair!r:.40}")
        token, logprob = strict_int(pair[0], int), _strict_float(pair[1], float)
        if not 0 <= token < MAX_TOKEN or logprob > 0.0:
            raise ValueError(f"bad [token, logprob] pair {pair!r:.40}")
        out.append(TokenLogprob(token, logprob))
    return tuple(out)


_converter = cattrs.Converter(forbid_extra_keys=True)
_converter.register_structure_hook(int, strict_int)
_converter.register_structure_hook(str, _strict_str)
_converter.register_structure_hook(bool, _strict_bool)
_converter.register_structure_hook(float, _strict_float)
_converter.register_structure_hook_func(lambda t: t == tuple[int, ...], _room_list)
_converter.register_structure_hook_func(lambda t: t == tuple[TokenLogprob, ...], _top_list)
_converter.register_unstructure_hook_func(
    lambda t: t == tuple[TokenLogprob, ...], lambda v: [[t.token, t.logprob] for t in v]
)
_converter.register_unstructure_hook(tuple, list)
for _with_checksums in (Ready, KVPart):
    _converter.register_structure_hook(
        _with_checksums,
        make_dict_structure_fn(
            _with_checksums, _converter, kv_checksums=override(struct_hook=_checksum_list)
        ),
    )


def _check_ranges(message: Message) -> None:
    for field in attrs.fields(type(message)):
        bounds = _INT_RANGES.get(field.name)
        if bounds is not None:
            value = getattr(message, field.name)
            if not bounds[0] <= value < bounds[1]:
                raise ValueError(f"{field.name}={value} outside [{bounds[0]}, {bounds[1]})")


def _mac(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


def encode(
    message: Message, secret: bytes | None = None, *, sent_at: float = 0.0, nonce: int = 0
) -> bytes:
    """Bytes for ``message``; signed when ``secret`` is given.

    A signed frame also carries ``sent_at`` (the sender's wall-clock seconds) and ``nonce`` (64
    random bits): receivers with a replay guard refuse frames whose time is off by more than their
    window, or whose MAC they have seen. Adapters pass ``time.time()`` and ``secrets.randbits(64)``.
    """
    body = _converter.unstructure(message)
    payload: bytes = msgpack.packb({"t": WIRE_NAMES[type(message)], "b": body}, use_bin_type=True)
    if not secret:
        return MAGIC + bytes((VERSION, 0)) + payload
    if not 0 <= sent_at < 2**63 / 1000 or not 0 <= nonce < 2**64:
        raise ValueError("sent_at must be >= 0 and nonce must fit 64 bits")
    data = MAGIC + bytes((VERSION, FLAG_SIGNED)) + _FRESHNESS.pack(round(sent_at * 1000), nonce)
    data += payload
    return data + _mac(secret, data)


def decode(
    frame: bytes,
    secret: bytes | None = None,
    *,
    guard: ReplayGuard | None = None,
    now: float = 0.0,
) -> Message:
    """The message in ``frame``, or :class:`RemoteProtocolError` saying what is wrong with it.

    With a ``guard`` (which needs a ``secret``), a signed frame is also checked against the
    receiver's wall clock ``now`` and the MACs already accepted: :class:`~pd_fsm.core.replay.
    StaleFrame` or :class:`~pd_fsm.core.replay.ReplayedFrame` (both remote protocol errors).
    """
    if guard is not None and not secret:
        raise ValueError("a replay guard needs a secret: unsigned frames carry no time")
    frame, signed = _checked_header(frame)
    if secret:
        payload = _verified_payload(frame, signed, secret, guard, now)
    else:
        if signed:
            raise RemoteProtocolError("signed frame but no cluster secret configured here")
        payload = frame[HEADER_SIZE:]
    return _message(_unpacked(payload))


def _checked_header(frame: object) -> tuple[bytes, bool]:
    """The frame as bytes, once its size, magic, version and flags are right; and whether it
    says it is signed."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise RemoteProtocolError(f"frame is {type(frame).__name__}, not bytes")
    frame = bytes(frame)
    if len(frame) > MAX_FRAME:
        raise RemoteProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    if len(frame) < HEADER_SIZE or frame[:2] != MAGIC:
        raise RemoteProtocolError("not a pd_fsm frame (bad magic)")
    if frame[2] != VERSION:
        raise RemoteProtocolError(f"unsupported version {frame[2]} (this side speaks {VERSION})")
    if frame[3] & ~FLAG_SIGNED:
        raise RemoteProtocolError(f"unknown flags 0x{frame[3]:02x}")
    return frame, bool(frame[3] & FLAG_SIGNED)


def _verified_payload(frame: bytes, signed: bool, secret: bytes, guard: ReplayGuard | None,
                      now: float) -> bytes:
    """A signed frame's payload, once its MAC is right (and, with a ``guard``, its time is
    within the window and its MAC not seen before)."""
    if not signed:
        raise RemoteProtocolError("unsigned frame; this side requires a signature")
    if len(frame) < HEADER_SIZE + _FRESHNESS.size + MAC_SIZE:
        raise RemoteProtocolError("signed frame too short for its time, nonce and MAC")
    data, mac = frame[:-MAC_SIZE], frame[-MAC_SIZE:]
    if not hmac.compare_digest(mac, _mac(secret, data)):
        raise RemoteProtocolError("bad signature")
    if guard is not None:
        sent_ms, _nonce = _FRESHNESS.unpack_from(data, HEADER_SIZE)
        guard.admit(sent_ms / 1000, mac, now)
    return data[HEADER_SIZE + _FRESHNESS.size :]


def _unpacked(payload: bytes) -> dict[str, object]:
    """The payload's ``{"t": wire name, "b": body}`` map, read with every msgpack limit."""
    try:
        obj = msgpack.unpackb(
            payload,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_REASON * 4,
            max_bin_len=0,
            max_array_len=MAX_ROOMS_PER_HEARTBEAT,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises many types (ValueError, ExtraData, FormatError, ...)
        raise RemoteProtocolError(f"payload is not msgpack: {exc.__class__.__name__}") from None
    if type(obj) is not dict or set(obj) != {"t", "b"}:
        raise RemoteProtocolError("payload must be a map with keys 't' and 'b'")
    return obj


def _message(obj: dict[str, object]) -> Message:
    """The message a payload map names, its fields structured and range-checked."""
    name, body = obj["t"], obj["b"]
    cls = BY_WIRE_NAME.get(name) if type(name) is str else None
    if cls is None:
        raise RemoteProtocolError(f"unknown message type {name!r:.40}")
    if type(body) is not dict:
        raise RemoteProtocolError("message body must be a map")
    try:
        message: Message = _converter.structure(body, cls)
        _check_ranges(message)
    except Exception as exc:  # cattrs wraps field errors in ClassValidationError groups
        raise RemoteProtocolError(f"bad {name} message: {_describe(exc)}") from None
    return message


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    note = getattr(exc, "__notes__", None)
    text = f"missing field {exc}" if isinstance(exc, KeyError) else f"{exc}"
    return text + (f" ({note[-1]})" if note else "")
