"""What P keeps of one room: table kv_sender's state, its kv_hold_lease's, and what their rows
need. ``PrefillEndpoint`` steps it; its parts (``prefill_lease``, ``prefill_kv``,
``prefill_outbox``) read and write it.
"""

from __future__ import annotations

from pd_fsm.core.messages import KVPart, TokenLogprob
from pd_fsm.core.tables import KV_HOLD_LEASE, KV_SENDER


class SenderRoom:
    __slots__ = (
        "d_incarnation",
        "d_pages",
        "d_skip",
        "expires_at",
        "first_logprob",
        "first_token",
        "first_top",
        "has_request",
        "kv_checksums",
        "lease",
        "n_pages",
        "part_end",
        "part_held",
        "parts",
        "peer",
        "ready_held",
        "refusal",
        "room",
        "sent",
        "spare_uuid",
        "state",
        "uuid",
        "written",
    )

    def __init__(self, room: int) -> None:
        self.room = room
        self.state = KV_SENDER.initial
        self.lease = KV_HOLD_LEASE.initial
        self.expires_at = 0.0
        self.peer: str | None = None
        self.uuid: int | None = None
        self.first_token = -1
        self.first_logprob = 0.0
        self.first_top: tuple[TokenLogprob, ...] = ()
        self.n_pages = -1  # ours, known at PrefillFinished
        self.d_pages = -1  # D's claim, from RECV_INIT
        self.d_skip = 0  # leading pages D holds already (RECV_INIT): not registered
        # Streamed KV: the pages D has or is pulling (D's own, then the parts sent), the end of
        # the part being registered, and every part's registration (released with the room).
        self.sent = 0
        self.part_end = 0
        self.parts: list[int] = []
        self.written = 0  # whole prompt pages our chunks wrote so far (PartPrefilled)
        self.part_held: KVPart | None = None  # KV checksums on: the part waits for its sums
        self.d_incarnation = 0  # of the D process whose RECV_INIT bound the room (0: not said)
        self.has_request = False
        self.refusal = ""  # D's reason, for a room D aborted before our leg arrived (REFUSED)
        # KV checksums on: the spare registration (D's re-pull), the checksums of the current
        # registration (None until KVChecksummed), and whether a row's READY waits for them.
        self.spare_uuid: int | None = None
        self.kv_checksums: tuple[int, ...] | None = None
        self.ready_held = False
