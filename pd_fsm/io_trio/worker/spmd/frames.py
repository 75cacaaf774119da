"""The frames of a multi-process instance's command stream: rank 0 to every other rank.

A tensor-parallel instance may span several processes (one per host), each driving its own
devices of one global mesh (``jax.distributed``). JAX runs a sharded computation only when every
process calls it, in the same order, with the same arguments; the scheduler is deterministic
given its inputs (its seed generator included), so every rank runs a replica of it and rank 0,
the one that serves HTTP, sends the others exactly those inputs: requests added, requests
aborted, and "step now". The replicas then make the same decisions and launch the same sharded
computations; their outputs are identical and thrown away.

A prefill or decode instance sends :class:`TickStarted` instead of :class:`StepOrdered`: the
whole tick's inputs (rank 0's clock, side-channel and registry arrivals, legs, aborts) and, on
D, the pulls every rank has finished, which the ranks report back (:class:`PullReported`).

Frame layout::

    b"PS" | version (1 B) | kind (1 B) | seq (8 B, big-endian) | msgpack payload
          | [HMAC-SHA256 of everything before it, 32 B: with a cluster secret]

``seq`` numbers rank 0's frames 1, 2, ... (a ``Hello`` is 0): a rank applies frame ``n`` only
right after frame ``n - 1``, so nothing is replayed, reordered or skipped unnoticed. :func:`decode`
turns any bytes into a frame or raises :class:`SpmdProtocolError`; nothing else escapes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Any

import attrs
import cattrs
import msgpack

from pd_fsm.core import codec
from pd_fsm.core import events as ev
from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.request import LogprobSpec

MAGIC = b"PS"
VERSION = 1
MAC_SIZE = 32
_HEADER = struct.Struct(">2sBBQ")
# A batch carries whole prompts: a few hundred thousand token ids at most.
MAX_FRAME = 16 * 1024 * 1024
MAX_COMMANDS = 65_536
MAX_RANKS = 1024


class SpmdProtocolError(RemoteProtocolError):
    """A frame of the command stream that cannot be applied (malformed, unsigned, forged, or
    out of sequence)."""


@attrs.frozen
class Hello:
    """A rank > 0, connected and ready: sent once, the first thing on its connection."""

    rank: int


@attrs.frozen
class RequestAdded:
    """Rank 0's scheduler took this request (``Scheduler.make_request`` + ``add_request``)."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    logprobs: LogprobSpec


@attrs.frozen
class RequestAborted:
    """Rank 0's scheduler aborted this request (``Scheduler.abort``)."""

    rid: str
    message: str


Command = RequestAdded | RequestAborted


@attrs.frozen
class StepOrdered:
    """Apply ``commands`` in order, then run one scheduler step: rank 0 is running it."""

    commands: tuple[Command, ...]


@attrs.frozen
class Pinged:
    """Rank 0 is alive and idle (a rank that hears nothing for long gives up on it)."""


@attrs.frozen
class Stopped:
    """Rank 0 is shutting down: the other ranks exit too."""


# -- a prefill or decode instance (RFC-2 §6.2's N:N pairing): rank 0 runs the PD protocol, every
# rank runs the same tick (``schedulers/disaggregation/tick.py``) on the same inputs.

InboxEvent = ev.MessageReceived | ev.PeerResolved | ev.PeerResolutionFailed | ev.LegRefused


@attrs.frozen
class Arrival:
    """One entry of rank 0's inbox: what came from the side channel or the registry, and when
    (rank 0's ``time.monotonic()``)."""

    arrived: float
    event: InboxEvent


@attrs.frozen
class LegAdded:
    """A PD leg (or a plain request, ``room`` None) rank 0 hands to its tick."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    logprobs: LogprobSpec
    accepted: float
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    room: int | None = None


@attrs.frozen
class PullAgreed:
    """D: collect this room's pull in this tick; ``failure`` "" when it arrived on every rank,
    else why some rank's failed (then every rank fails it)."""

    room: int
    failure: str = ""


@attrs.frozen
class TickStarted:
    """Run one PD tick with rank 0's inputs: its clock, inbox, legs, aborts and (D) the pulls
    every rank has. ``fingerprint``: rank 0's state after the previous tick, to compare."""

    tick: int
    now: float
    fingerprint: str
    arrivals: tuple[Arrival, ...] = ()
    legs: tuple[LegAdded, ...] = ()
    aborts: tuple[str, ...] = ()
    pulls: tuple[PullAgreed, ...] = ()


@attrs.frozen
class PullReported:
    """A rank > 0 to rank 0: its share of ``room``'s KV arrived (``ok``) or failed (``reason``)."""

    rank: int
    room: int
    ok: bool
    reason: str = ""


@attrs.frozen
class Announced:
    """Rank 0's registry record (JSON), once, before any tick: a P rank registers its own
    transfer server under the same instance and entry address, with its own ``tp_rank``."""

    record: str


Frame = Hello | StepOrdered | Pinged | Stopped | TickStarted | PullReported | Announced
_KINDS: dict[int, type[Frame]] = {1: Hello, 2: StepOrdered, 3: Pinged, 4: Stopped,
                                  5: TickStarted, 6: PullReported, 7: Announced}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}

_converter = cattrs.Converter(forbid_extra_keys=True)


def _strict(kind: type) -> None:
    # cattrs would turn "5" into 5; a frame says what it means or is refused.
    def check(value: Any, _: type) -> Any:
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not ok:
            raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
        return value

    _converter.register_structure_hook(kind, check)


for _kind in (int, float, str, bool):
    _strict(_kind)
_converter.register_unstructure_hook(
    StepOrdered,
    lambda s: [[type(c).__name__, _converter.unstructure(c)] for c in s.commands],
)


_COMMANDS: dict[str, type[Command]] = {c.__name__: c for c in (RequestAdded, RequestAborted)}


def _structure_step(raw: Any, _: type) -> StepOrdered:
    if not isinstance(raw, list) or len(raw) > MAX_COMMANDS:
        raise ValueError(f"commands must be a list of at most {MAX_COMMANDS}")
    commands: list[Command] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2 and item[0] in _COMMANDS):
            raise ValueError(f"not a command: {item!r:.80}")
        commands.append(_converter.structure(item[1], _COMMANDS[item[0]]))
    return StepOrdered(tuple(commands))


_converter.register_structure_hook(StepOrdered, _structure_step)

_EVENTS: dict[str, type[InboxEvent]] = {
    c.__name__: c for c in (ev.MessageReceived, ev.PeerResolved, ev.PeerResolutionFailed,
                            ev.LegRefused)
}


def _unstructure_arrival(a: Arrival) -> list[Any]:
    e = a.event
    if isinstance(e, ev.MessageReceived):  # the side channel's own codec, unsigned here
        body: Any = [e.peer, codec.encode(e.message)]
    else:
        body = _converter.unstructure(e)
    return [a.arrived, type(e).__name__, body]


def _structure_arrival(raw: Any, _: type) -> Arrival:
    if not (isinstance(raw, list) and len(raw) == 3 and raw[1] in _EVENTS):
        raise ValueError(f"not an arrival: {raw!r:.80}")
    arrived = _converter.structure(raw[0], float)
    kind, body = _EVENTS[raw[1]], raw[2]
    if kind is ev.MessageReceived:
        if not (isinstance(body, list) and len(body) == 2 and isinstance(body[1], bytes)):
            raise ValueError("a message arrival is [peer, bytes]")
        event: InboxEvent = ev.MessageReceived(_converter.structure(body[0], str),
                                               codec.decode(body[1]))
    else:
        event = _converter.structure(body, kind)
    return Arrival(arrived, event)


_converter.register_unstructure_hook(Arrival, _unstructure_arrival)
_converter.register_structure_hook(Arrival, _structure_arrival)


def encode(frame: Frame, seq: int, key: bytes | None) -> bytes:
    """``frame`` as bytes, numbered ``seq``, signed with ``key`` (the instance's
    :func:`pd_fsm.core.keys.spmd_key`) when there is one."""
    payload: bytes = msgpack.packb(_converter.unstructure(frame), use_bin_type=True)
    body = _HEADER.pack(MAGIC, VERSION, _KIND_OF[type(frame)], seq) + payload
    if key is not None:
        body += hmac.new(key, body, hashlib.sha256).digest()
    if len(body) > MAX_FRAME:
        raise ValueError(f"a frame of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return body


def decode(data: bytes, key: bytes | None) -> tuple[int, Frame]:
    """``(seq, frame)`` from bytes a peer sent; :class:`SpmdProtocolError` for anything else."""
    if len(data) > MAX_FRAME:
        raise SpmdProtocolError(f"frame of {len(data)} bytes is over {MAX_FRAME}")
    if key is not None:
        if len(data) < _HEADER.size + MAC_SIZE:
            raise SpmdProtocolError("frame too short to be signed")
        data, mac = data[:-MAC_SIZE], data[-MAC_SIZE:]
        if not hmac.compare_digest(mac, hmac.new(key, data, hashlib.sha256).digest()):
            raise SpmdProtocolError("bad MAC (unsigned, forged, or another cluster's key)")
    if len(data) < _HEADER.size:
        raise SpmdProtocolError("frame shorter than its header")
    magic, version, kind, seq = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SpmdProtocolError(f"not a command frame (magic {magic!r})")
    if version != VERSION:
        raise SpmdProtocolError(f"command frame version {version}, this rank speaks {VERSION}")
    cls = _KINDS.get(kind)
    if cls is None:
        raise SpmdProtocolError(f"unknown frame kind {kind}")
    try:
        raw = msgpack.unpackb(data[_HEADER.size:], raw=False, strict_map_key=True)
        frame = _converter.structure(raw, cls)
    except cattrs.BaseValidationError as exc:
        why = "; ".join(cattrs.transform_error(exc, path=cls.__name__))
        raise SpmdProtocolError(f"malformed {cls.__name__}: {why}") from None
    except Exception as exc:  # msgpack, and the value types' own validators
        raise SpmdProtocolError(f"malformed {cls.__name__}: {exc}") from None
    if isinstance(frame, Hello | PullReported) and not 0 < frame.rank < MAX_RANKS:
        raise SpmdProtocolError(f"{cls.__name__} from rank {frame.rank}: only ranks > 0 send it")
    return seq, frame
