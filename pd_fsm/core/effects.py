"""Outputs of the endpoints: commands for the embedding code to carry out.

Each names the room it is about. Effects that only change the endpoint's own bookkeeping (lease
arithmetic, heartbeat membership, counting duplicates) appear in the tables but never leave the
core.
"""

from __future__ import annotations

from typing import Generic, TypeVar

import attrs

from pd_fsm.core.messages import Heartbeat, HeartbeatAck, Message, TokenLogprob
from pd_fsm.core.routing import Attempts


@attrs.frozen(slots=True)
class SendMessage:
    peer: str
    message: Message


# --- while a step keeps the embedder busy (ev.StepStarted .. ev.StepEnded) -------------------


@attrs.frozen(slots=True)
class AckWhileBusy:
    """P, until ``StepEnded``: answer each HEARTBEAT at once with a bare "alive" HB_ACK (no
    failed or unknown rooms). D then does not take a busy P for a dead one; the heartbeat itself
    reaches the endpoint after the step (stamped with its arrival time), extends the leases, and
    the endpoint's own ack follows."""

    incarnation: int

    def answer(self, message: Message) -> Message | None:
        """The reply to ``message`` while busy, if it gets one now."""
        if isinstance(message, Heartbeat):
            return HeartbeatAck(self.incarnation, message.seq)
        return None


@attrs.frozen(slots=True)
class RepeatWhileBusy:
    """D, until ``StepEnded``: while the step has lasted longer than ``interval``, send these
    heartbeats again every ``interval``. Each carries the last seq sent to its P, so P's ack
    proves P alive without telling the endpoint about rooms it has not asked about yet."""

    heartbeats: tuple[SendMessage, ...]
    interval: float


BusyEffect = AckWhileBusy | RepeatWhileBusy  # what StepStarted asks of the I/O side


# --- P ---------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class RegisterKV:
    """Gather the room's pages and register them with the transfer server under ``uuid``
    (the prompt's pages after the first ``skip_pages``, which D holds already). With KV
    checksums on, also under ``spare_uuid`` (the same arrays: D's one re-pull after a checksum
    mismatch, since a registration is pulled once), and answer ``KVChecksummed``."""

    room: int
    uuid: int
    skip_pages: int = 0
    spare_uuid: int | None = None


@attrs.frozen(slots=True)
class NarrowKV:
    """D said late that it holds the prompt's first ``skip_pages``: release the room's
    registration ``replaces`` (and ``replaces_spare``) and register only the rest under
    ``uuid`` (and ``spare_uuid``, as ``RegisterKV`` does)."""

    room: int
    uuid: int
    skip_pages: int
    replaces: int
    spare_uuid: int | None = None
    replaces_spare: int | None = None


@attrs.frozen(slots=True)
class RegisterPart:
    """Streamed KV: gather the prompt's pages ``first_page`` .. ``first_page + n_pages`` (written
    by the chunks prefilled so far) and register them under ``uuid`` until ``ReleaseKV``. A
    part has no spare registration: a corrupted part is not pulled again (the room fails, or D
    recomputes it by its policy)."""

    room: int
    uuid: int
    first_page: int
    n_pages: int
    checksum: bool = False  # KV checksums on: answer KVChecksummed with the part's sums


@attrs.frozen(slots=True)
class ReleaseKV:
    """Unregister ``uuid`` (None: never registered), ``spare_uuid`` (KV checksums on) and every
    part's registration (``parts``: streamed KV) and free the room's pages. Once per room."""

    room: int
    uuid: int | None
    spare_uuid: int | None = None
    parts: tuple[int, ...] = ()


@attrs.frozen(slots=True)
class CompleteRequest:
    """P's HTTP leg can answer: the KV is handed off to D."""

    room: int


# --- D ---------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class ForgetPeer:
    """P is gone (lost, restarted or moved) and no room needs it: close its connection."""

    peer: str


@attrs.frozen(slots=True)
class ForgetTransfer:
    """P died (lost, or restarted): drop every transfer connection to where that process served,
    failing the pulls still waiting on them now (a pull on a fresh connection to a dead transfer
    server waits until its deadline otherwise), and connect afresh next time (a connection to a
    dead transfer server fails every later pull on it, even when a new process listens on the
    same address)."""

    transfer_addr: str


@attrs.frozen(slots=True)
class ResolvePeer:
    """Look up the P at ``bootstrap_addr``; answer PeerResolved / PeerResolutionFailed."""

    bootstrap_addr: str


@attrs.frozen(slots=True)
class AllocateBlocks:
    """Reserve ``n_pages`` for the room when possible; answer BlocksAllocated."""

    room: int
    n_pages: int


@attrs.frozen(slots=True)
class CancelAllocation:
    room: int


@attrs.frozen(slots=True)
class StartPull:
    """Pull ``n_pages`` into the room's pages after its first ``skip_pages`` (held already).
    ``kv_checksums``: READY's, to verify the pulled arrays against before any is scattered
    (empty: verify nothing); ``repull``: this is the room's second pull, of READY's spare
    registration, after the first one's checksums did not match; ``part``: a part P announced
    while it prefills the rest (KV_PART), not READY's pull: the room does not join the batch
    when it lands."""

    room: int
    peer: str
    transfer_addr: str
    uuid: int
    n_pages: int
    skip_pages: int = 0
    kv_shards: int = 1  # arrays per pool P registered (READY's kv_shards)
    kv_checksums: tuple[int, ...] = ()
    repull: bool = False
    part: bool = False


@attrs.frozen(slots=True)
class CancelPull:
    """The room failed while its pull is in flight: from now on the pull executor never
    scatters its KV into the room's pages (checked under the pool's lock), nor starts its pull
    if it has not started; the pull still reports (without KV: a late result is dropped and
    counted). The room's pages are released right after this."""

    room: int


@attrs.frozen(slots=True)
class ReleaseBlocks:
    """Free the room's reserved pages. Once per room, only when no pull can still write them."""

    room: int


@attrs.frozen(slots=True)
class CompleteTransfer:
    """The room's KV is in our pages: join the decode batch with ``first_token``."""

    room: int
    first_token: int
    first_logprob: float = 0.0
    first_top: tuple[TokenLogprob, ...] = ()


# --- both ------------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class FailRequest:
    """Answer the HTTP leg of ``room`` with an error. ``status`` is the HTTP status to use."""

    room: int
    reason: str
    status: int = 500


@attrs.frozen(slots=True)
class RejectRequest:
    """A request the endpoint refused outright (e.g. a live ``bootstrap_room`` reused)."""

    room: int
    reason: str
    status: int = 409


# What each endpoint's ``handle`` returns: closed unions (an embedder's dispatch can be checked
# for exhaustiveness with ``assert_never``).
PrefillEffect = (
    SendMessage | RegisterKV | RegisterPart | NarrowKV | ReleaseKV | CompleteRequest | FailRequest
    | RejectRequest | AckWhileBusy
)
DecodeEffect = (
    SendMessage | ForgetPeer | ForgetTransfer | ResolvePeer | AllocateBlocks | CancelAllocation
    | StartPull | CancelPull | ReleaseBlocks | CompleteTransfer | FailRequest | RejectRequest
    | RepeatWhileBusy
)
# The endpoints' effects only the I/O layer carries out (side channel, bootstrap lookup); the
# schedulers queue them in their outbox.
IOEffect = SendMessage | ForgetPeer | ResolvePeer


# --- bootstrap registry ----------------------------------------------------------------------


Rec = TypeVar("Rec")


@attrs.frozen(slots=True)
class InstanceExpired(Generic[Rec]):
    key: tuple[str, str, int, int, int, int]
    record: Rec


# --- proxy -----------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class DispatchRoom:
    room: int
    request_id: str
    prefill: str
    decode: str


@attrs.frozen(slots=True)
class RelayDecode:
    room: int


@attrs.frozen(slots=True)
class DispatchLocal:
    """Post the request to D alone, without bootstrap fields: D prefills it; or
    to a colocated worker, which serves it whole."""

    room: int
    request_id: str
    decode: str
    # "short_prompt" | "prefill_busy" | "handoff" (D pulls a handed-off stream); for a colocated
    # worker "fewer_in_flight" | "no_prefill" | "no_decode"
    reason: str
    role: str = "decode"  # the leg's X-PD-Role: "decode", or "null" for a colocated worker


@attrs.frozen(slots=True)
class AbortLeg:
    room: int
    leg: str  # "prefill" | "decode"
    url: str


@attrs.frozen(slots=True)
class ReplyError:
    room: int
    reason: str


@attrs.frozen(slots=True)
class RedirectDecode:
    """Post the room's decode leg again, same body (same bootstrap_room), to ``decode``: the
    first D refused it before taking the room, so P's KV waits for a D to claim it."""

    room: int
    prefill: str  # the room's P, which holds its KV
    decode: str


@attrs.frozen(slots=True)
class ReopenRoom:
    """The room ended RETRIED, MIGRATED or HANDED_OFF: feed ``RoomRequested`` again for its
    request, after ``delay`` (a retry's backoff; 0 for a migration or a hand-off), with
    ``attempts`` (and, for a hand-off, ``handoff=True``: D alone, no P leg)."""

    room: int
    request_id: str
    cause: str  # "retry" | "migration" | "handoff"
    delay: float
    attempts: Attempts


@attrs.frozen(slots=True)
class BreakerChanged:
    """A worker's circuit breaker changed state (table worker_breaker): log it, count it."""

    worker: str
    old: str
    new: str


@attrs.frozen(slots=True)
class ShedRequest:
    """Every worker of ``role`` is at its queue bound (RoutingConfig.max_queue): answer the
    request 429 with Retry-After now; no room is drawn."""

    request_id: str
    role: str  # "prefill" | "decode" | "colocated" (only colocated workers, every one full)
    retry_after: float


@attrs.frozen(slots=True)
class NoWorkers:
    """The proxy lists no worker of ``role``: answer the request 503 now; no room is drawn."""

    request_id: str
    role: str  # "prefill" | "decode"

    @property
    def reason(self) -> str:
        return f"no {self.role} workers available"


# -- live KV hand-off between decode workers (table kv_handoff) ---------------------


@attrs.frozen(slots=True)
class ReleaseOffer:
    """Drop hand-off ``uuid``'s registration from this D's transfer server."""

    uuid: int
    reason: str


@attrs.frozen(slots=True)
class StartHandoffPull:
    """Pull the ticket of hand-off ``room`` into the pages reserved for it."""

    room: int


@attrs.frozen(slots=True)
class EnterDecode:
    """Hand-off ``room``'s KV is in its pages: its request joins the decode batch."""

    room: int


@attrs.frozen(slots=True)
class FailHandoff:
    """Hand-off ``room``'s pull failed: free its pages, fail its request (502)."""

    room: int
    reason: str


@attrs.frozen(slots=True)
class FinishAborted:
    """Finish hand-off ``room``'s aborted request; its pages stay held until its pull reports."""

    room: int
    reason: str


@attrs.frozen(slots=True)
class FreeHeldPages:
    """Hand-off ``room``'s aborted pull reported: free the pages it held."""

    room: int


@attrs.frozen(slots=True)
class FinishUnplaced:
    """Finish waiting hand-off ``room``'s aborted request: it holds no pages."""

    room: int
    reason: str


HandoffEffect = (
    ReleaseOffer | StartHandoffPull | EnterDecode | FailHandoff | FinishAborted | FreeHeldPages
    | FinishUnplaced
)

RouterEffect = (
    DispatchRoom | DispatchLocal | RelayDecode | AbortLeg | ReplyError | ReopenRoom
    | RedirectDecode | BreakerChanged | ShedRequest | NoWorkers
)


# --- the client's side of a proxy request (table proxy_session) --------------------------------


@attrs.frozen(slots=True)
class ReportRelayFinished:
    """Feed ``RelayFinished`` to the router for the request's current room."""


@attrs.frozen(slots=True)
class ReportDisconnect:
    """Count the request as disconnected and feed ``ClientDisconnected`` to the router for the
    request's current room."""


@attrs.frozen(slots=True)
class AbortSequences:
    """A split answer's client left: count the request as disconnected, once, and tell each of
    its sequences' requests (each then aborts its own room's legs: ``ReportSequenceLeft``)."""


@attrs.frozen(slots=True)
class ReportSequenceLeft:
    """Feed ``ClientDisconnected`` to the router for a sequence's current room; not counted (the
    answer's ``AbortSequences`` counted the request's disconnect)."""


SessionEffect = ReportRelayFinished | ReportDisconnect | AbortSequences | ReportSequenceLeft


# -- a worker's role at runtime (table role_switch) ----------------------------------


@attrs.frozen(slots=True)
class WithdrawRecord:
    """Leave the registry (the role being left is listed there no more)."""


@attrs.frozen(slots=True)
class RefuseLegs:
    """Answer new legs 503 with Retry-After until ``AcceptLegs``."""

    reason: str


@attrs.frozen(slots=True)
class FailInFlight:
    """Fail every request the role being left still has, with ``reason``."""

    reason: str


@attrs.frozen(slots=True)
class StopRole:
    """Stop ``role``'s backend (its serve task) and check it released everything."""

    role: str


@attrs.frozen(slots=True)
class StartRole:
    """Build ``role``'s backend from the loaded weights and start it, registered under ``epoch``
    (``restoring``: the old role again, after the new one failed with ``reason``)."""

    role: str
    epoch: int
    restoring: bool = False
    reason: str = ""


@attrs.frozen(slots=True)
class AcceptLegs:
    """Take legs again: ``role`` under ``epoch`` is current."""

    role: str
    epoch: int


@attrs.frozen(slots=True)
class RefuseSwitch:
    """Answer a switch request 409 with ``reason``: another switch is under way."""

    reason: str


@attrs.frozen(slots=True)
class ExitProcess:
    """End the process with a non-zero status; ``reason`` names both failures."""

    reason: str


RoleSwitchEffect = (
    WithdrawRecord | RefuseLegs | FailInFlight | StopRole | StartRole | AcceptLegs | RefuseSwitch
    | ExitProcess
)
