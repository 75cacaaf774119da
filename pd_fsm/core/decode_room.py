"""What D keeps of one room (table kv_receiver), and how the endpoint's parts step one.

``DecodeEndpoint`` steps its rooms; the parts it is split into (``decode_peers``,
``decode_pulls``, ``decode_outbox``) read and write these records and, where a part's concern
steps a room (P lost, P's acks), step it through a callable the endpoint hands them.
"""

from __future__ import annotations

from collections.abc import Callable

from pd_fsm.core import effects as fx
from pd_fsm.core.messages import KVPart, Ready, TokenLogprob
from pd_fsm.core.tables import KV_RECEIVER


class ReceiverRoom:
    __slots__ = (
        "bootstrap_addr",
        "deferred",
        "first_logprob",
        "first_token",
        "first_top",
        "hello_seq",
        "incarnation",
        "incoming",
        "kv_checksums",
        "kv_shards",
        "n_pages",
        "part",
        "peer",
        "repull_uuid",
        "room",
        "skip",
        "state",
        "transfer_addr",
        "uuid",
    )

    def __init__(self, room: int, bootstrap_addr: str, n_pages: int) -> None:
        self.room = room
        self.state = KV_RECEIVER.initial
        self.bootstrap_addr = bootstrap_addr
        self.n_pages = n_pages  # the prompt's
        self.skip = 0  # of those, held already (our prefix cache): not pulled
        self.peer: str | None = None
        self.uuid = -1
        self.first_token = -1
        self.first_logprob = 0.0
        self.first_top: tuple[TokenLogprob, ...] = ()
        self.hello_seq = -1  # last heartbeat seq sent before our RECV_INIT
        self.incarnation = 0  # of the P process that sent READY (0: none yet, or not said)
        self.transfer_addr = ""  # where READY said to pull from ("": the registry's address)
        self.kv_shards = 1  # arrays per pool P registered (READY's)
        # READY's, when we verify pulls (kv_checksum): what each pulled array must sum to, and
        # the spare registration a re-pull takes after a mismatch (0: none).
        self.kv_checksums: tuple[int, ...] = ()
        self.repull_uuid = 0
        # Streamed KV: the part being pulled (its pages follow ``skip``), P's message being
        # stepped, and those P sent while a part was in flight (handled when it reports).
        self.part: KVPart | None = None
        self.incoming: KVPart | Ready | None = None
        self.deferred: list[KVPart | Ready] = []


def offer_start(r: ReceiverRoom, m: KVPart | Ready) -> int:
    """The first prompt page P's offer carries (READY: the pages after its ``n_pages`` from the
    prompt's end)."""
    return m.first_page if isinstance(m, KVPart) else r.n_pages - m.n_pages


# The endpoint's stepping, as its parts are handed it: (room, trigger, now, out, reason). A
# trigger of ours (a missing row is our bug), or P's (a missing row fails the room: P's fault).
StepRoom = Callable[[ReceiverRoom, str, float, list[fx.DecodeEffect], str], None]
