"""Live KV hand-off between decode workers: what one D gives another so that a
running stream moves without a prefill.

A draining D gathers a running sequence's pages — the KV of the prompt and of every output token
but the last, which no step has fed yet — into packed arrays with the same gather P uses, registers
them on its transfer server under a fresh uuid, and ends the request's stream with a
:class:`HandoffTicket`. The proxy posts the request to another D with the ticket and the tokens so
far (``resume``); that D reserves pages, pulls the arrays through its pull executor (the same
path, deadline and checksums as a READY), and the request joins its decode batch with the
ticket's ``next_token`` as the input of its next step, so the output goes on exactly.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class HandoffTicket:
    """Where a handed-off sequence's KV is and what it covers."""

    transfer_addr: str  # the draining D's transfer server
    uuid: int  # its registration (one pull)
    kv_tokens: int  # positions whose KV the arrays hold: prompt + outputs but the last
    next_token: int  # the last output token: the next decode step's input
    layout_hash: str  # the pool layout the arrays were packed with
    kv_shards: int = 1  # arrays per pool (the draining D's tp size)
    kv_checksums: tuple[int, ...] = ()  # with --disaggregation-kv-checksum, one per array
    # The offer's lease when it was made (0: not said, a ticket of an older worker): a taking
    # D with no free pages waits for some within half of it (the rest is the pull's).
    lease_s: float = 0.0

    def to_json(self) -> dict[str, object]:
        return {**attrs.asdict(self), "kv_checksums": list(self.kv_checksums)}
