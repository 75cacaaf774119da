"""Inputs to the endpoints. Frozen, slotted, past-tense (as h11's events).

Local events come from the embedding scheduler or adapter; :class:`MessageReceived` carries a
peer's message (remote). ``now`` is never part of an event: it is the second argument of
``handle``.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from pd_fsm.core.messages import Message, TokenLogprob
from pd_fsm.core.routing import Attempts, Prompt


@attrs.frozen(slots=True)
class TimeAdvanced:
    """Nothing happened but time: fire what is due (the adapter's wake-up at next_deadline())."""


@attrs.frozen(slots=True)
class StepStarted:
    """The embedder starts a step that keeps it from feeding the endpoint for a while (a forward
    pass: seconds when a shape compiles). The endpoint answers with what keeps peers from taking
    it for dead meanwhile (``fx.AckWhileBusy`` on P, ``fx.RepeatWhileBusy`` on D), which the I/O
    side carries out until ``StepEnded``; what arrives meanwhile is fed after the step, stamped
    with its arrival time."""


@attrs.frozen(slots=True)
class StepEnded:
    """The step is over: the while-busy effect of ``StepStarted`` no longer applies."""


@attrs.frozen(slots=True)
class MessageReceived:
    """A decoded side-channel message from ``peer`` (P: D's socket identity; D: P's address)."""

    peer: str
    message: Message


# --- P (PrefillEndpoint) ---------------------------------------------------------------------


@attrs.frozen(slots=True)
class PrefillRequestAccepted:
    room: int


@attrs.frozen(slots=True)
class PrefillFinished:
    room: int
    first_token: int
    n_pages: int
    first_logprob: float = 0.0
    first_top: tuple[TokenLogprob, ...] = ()  # the first position's top logprobs, when asked


@attrs.frozen(slots=True)
class PartPrefilled:
    """P, streaming KV: a chunk of the room's prefill ran (not the last), so the prompt's KV is
    written through its first ``pages`` whole pages. The endpoint registers and announces what
    D lacks of them (a part) when D is bound."""

    room: int
    pages: int


@attrs.frozen(slots=True)
class PrefillFailed:
    room: int
    reason: str


@attrs.frozen(slots=True)
class KVChecksummed:
    """P, with KV checksums on: the checksums of the arrays the room's ``RegisterKV`` (or
    ``NarrowKV``) registered under ``uuid``, one per array in registration order. They exist
    only once the gather has run, after the row that sends READY was decided, so that row's
    READY waits for this event (fed back in the same driver step: it is never late)."""

    room: int
    uuid: int
    checksums: tuple[int, ...]


# --- D (DecodeEndpoint) ----------------------------------------------------------------------


@attrs.frozen(slots=True)
class DecodeRequestAccepted:
    room: int
    bootstrap_addr: str  # "host:port" as the router injected it
    n_pages: int


@attrs.frozen(slots=True)
class PeerResolved:
    """The bootstrap server named the P behind ``bootstrap_addr``."""

    bootstrap_addr: str
    peer: str  # P's side-channel address: the key for SendMessage and heartbeats
    transfer_addr: str
    layout_hash: str = ""


@attrs.frozen(slots=True)
class PeerResolutionFailed:
    bootstrap_addr: str
    reason: str


@attrs.frozen(slots=True)
class BlocksAllocated:
    room: int
    skip_pages: int = 0  # leading prompt pages already held (D's prefix cache): not pulled


@attrs.frozen(slots=True)
class PullSucceeded:
    room: int


@attrs.frozen(slots=True)
class PullFailed:
    room: int
    reason: str


@attrs.frozen(slots=True)
class ChecksumMismatched:
    """The pulled KV's checksums differ from READY's: corrupted in flight. Nothing was
    scattered, so the room's pages hold nothing of it and no pull is in flight any more."""

    room: int
    reason: str


# --- both sides ------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class Aborted:
    """Local abort: the client went away or /abort_request named the room."""

    room: int
    reason: str = "aborted"


# What each endpoint's ``handle`` takes: a closed union, so an embedder's wrong event is a type
# error (at run time, still a LocalProtocolError).
PrefillEvent = (
    TimeAdvanced | MessageReceived | PrefillRequestAccepted | PrefillFinished | PartPrefilled
    | PrefillFailed | KVChecksummed | Aborted | StepStarted | StepEnded
)
@attrs.frozen(slots=True)
class LegRefused:
    """D refused a leg before any room opened here (no address for its P): tell the Ps it may
    have gone to (``prefills``, their side-channel addresses), so P's leg fails now rather than
    at its lease expiry. P remembers a room aborted before its leg arrives."""

    room: int
    prefills: tuple[str, ...]
    reason: str


DecodeEvent = (
    TimeAdvanced | MessageReceived | DecodeRequestAccepted | PeerResolved | PeerResolutionFailed
    | BlocksAllocated | PullSucceeded | PullFailed | ChecksumMismatched | Aborted | StepStarted
    | StepEnded | LegRefused
)


# --- bootstrap registry ----------------------------------------------------------------------

InstanceKey = tuple[str, str, int, int, int, int]  # (role, instance_id, tp, cp, dp, pp)
Rec = TypeVar("Rec")  # the adapter's record type: opaque to the core, kept as given


@attrs.frozen(slots=True)
class InstanceRegistered(Generic[Rec]):
    key: InstanceKey
    record: Rec  # the adapter's validated registration
    advertised: str | None = None  # "host:port" routers know it by (bootstrap_host/port)
    # The TTL the instance heartbeats against (RFC-2 §7 heartbeat_ttl); None: the registry's.
    ttl: float | None = None


@attrs.frozen(slots=True)
class InstanceHeartbeat:
    key: InstanceKey


@attrs.frozen(slots=True)
class InstanceDeregistered:
    key: InstanceKey


# --- proxy rooms -----------------------------------------------------------------------------


@attrs.frozen(slots=True)
class RoomRequested:
    """A client request arrived at the proxy: draw a room, pick P and D (or D alone)."""

    request_id: str
    # For cache_aware routing and conditional disaggregation.
    prompt: Prompt = attrs.field(factory=Prompt)
    # A later room of the same request (ReopenRoom's): what the earlier ones used up.
    attempts: Attempts = attrs.field(factory=Attempts)
    # The proxy can continue this request's stream exactly on another worker (the prompt plus
    # the tokens so far): a decode worker breaking off mid-relay migrates it, not fails it.
    migratable: bool = False
    # The room continues a stream a draining D handed off: D alone, no P leg (the new D pulls
    # the KV the draining D registered).
    handoff: bool = False


@attrs.frozen(slots=True)
class LegResponded:
    room: int
    leg: str  # "prefill" | "decode"
    ok: bool
    reason: str = ""
    # The worker did not take the leg (connect error, a 503 while draining): nothing of the
    # room is there, so D's leg may go to another D in the same room.
    refused: bool = False
    # The leg failed before any byte reached the client, and not by the request's fault (a
    # refusal, a lost connection, a 5xx): the request may go on in a new room.
    retryable: bool = False
    # The connection to the worker was lost before its answer ended: the worker's fault (with
    # a refusal, what its circuit breaker counts).
    lost: bool = False
    # D ended its stream mid-relay with a hand-off ticket (it is draining): not a
    # fault of D's; the request goes on on another D, which pulls the KV D registered.
    handoff: bool = False


@attrs.frozen(slots=True)
class ClientDisconnected:
    room: int


@attrs.frozen(slots=True)
class RelayFinished:
    """The last byte of D's answer went to the client: the room is over."""

    room: int


# --- the client's side of a proxy request (table proxy_session) --------------------------------


@attrs.frozen(slots=True)
class HeadersSent:
    """The status line of a streamed answer went to the client: errors go in-band from here."""


@attrs.frozen(slots=True)
class ChunkRelayed:
    """A chunk of D's stream went to the client, not ending with its ``[DONE]`` event."""


@attrs.frozen(slots=True)
class DoneRelayed:
    """A chunk of D's stream ending with its ``[DONE]`` event went to the client."""


@attrs.frozen(slots=True)
class AnswerRelayed:
    """D's answer is whole: its last bytes are in the send about to go."""


@attrs.frozen(slots=True)
class ErrorAnswered:
    """The proxy's error answer is in the send about to go."""


@attrs.frozen(slots=True)
class ClientLeft:
    """The server reported the client's connection ended (after a whole answer: its end)."""


@attrs.frozen(slots=True)
class AnswerSplit:
    """After a break, the answer went on as its unfinished sequences (their indices, one or
    more), each in a request of its own (table proxy_sequence)."""

    sequences: tuple[int, ...]


@attrs.frozen(slots=True)
class SequenceEnded:
    """Sequence ``index`` of a split answer ended: finished, or failed with its error event."""

    index: int


RegistryEvent = TimeAdvanced | InstanceRegistered[Rec] | InstanceHeartbeat | InstanceDeregistered
RouterEvent = TimeAdvanced | RoomRequested | LegResponded | ClientDisconnected | RelayFinished
SessionEvent = (
    HeadersSent | ChunkRelayed | DoneRelayed | AnswerRelayed | ErrorAnswered | ClientLeft
    | AnswerSplit | SequenceEnded
)


# -- live KV hand-off between decode workers (table kv_handoff) ---------------------


@attrs.frozen(slots=True)
class HandoffOffered:
    """A draining D registered a running sequence's KV under ``uuid`` for ``lease_s``."""

    uuid: int
    lease_s: float


@attrs.frozen(slots=True)
class HandoffPulled:
    """The proxy says the taking D answered (after its pull) or failed: ``uuid`` may go."""

    uuid: int


@attrs.frozen(slots=True)
class HandoffClaimed:
    """The taking D accepted a ticket and reserved its pages; ``room``: its pull's number."""

    room: int


@attrs.frozen(slots=True)
class HandoffQueued:
    """The taking D accepted a ticket while no pages were free; ``room``: its pull's number. It
    waits for pages for ``wait_s`` at most."""

    room: int
    wait_s: float


@attrs.frozen(slots=True)
class HandoffPagesReserved:
    """Pages came free for waiting hand-off ``room`` and were reserved."""

    room: int


# A hand-off's pull reports as any pull does (PullSucceeded / PullFailed, by its room); a local
# abort of its request is Aborted.
HandoffEvent = (
    TimeAdvanced | HandoffOffered | HandoffPulled | HandoffClaimed | HandoffQueued
    | HandoffPagesReserved | PullSucceeded | PullFailed | Aborted
)


# -- a worker's role at runtime (table role_switch) ----------------------------------


@attrs.frozen(slots=True)
class SwitchRequested:
    """Someone asked the worker to serve ``role`` instead ("prefill", "decode" or "null"); what
    is in flight has ``drain_s`` seconds to finish."""

    role: str
    drain_s: float


@attrs.frozen(slots=True)
class RoleDrained:
    """The role being left holds nothing for anyone (no request, room, queue, registration)."""


@attrs.frozen(slots=True)
class RoleStarted:
    """The role being started serves (built, warmed, registered under its epoch)."""


@attrs.frozen(slots=True)
class RoleStartFailed:
    """Building or starting the role raised; ``reason`` says what."""

    reason: str


RoleSwitchEvent = TimeAdvanced | SwitchRequested | RoleDrained | RoleStarted | RoleStartFailed
