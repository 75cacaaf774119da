"""Side-channel messages between P and D (DESIGN §5). Plain data; encoding lives in codec.py."""

from __future__ import annotations

import attrs

MAX_ROOM = 1 << 63  # rooms are uniform in [0, 2^63), as sglang's routers draw them
MAX_UUID = 1 << 64  # jax.experimental.transfer uuids must fit in uint64
MAX_PAGES = 1 << 20
MAX_TOKEN = 1 << 31
MAX_REASON = 1024
MAX_ROOMS_PER_HEARTBEAT = 4096
MAX_TOP_LOGPROBS = 20  # alternatives per position: OpenAI's top_logprobs maximum
MAX_KV_SHARDS = 1024  # arrays per pool in one registration (P's tensor-parallel size)
MAX_KV_CHECKSUMS = 4096  # arrays in one registration (pools x shards), each with its checksum
KV_CHECKSUM_LIMIT = 1 << 32  # a checksum is a 32-bit word (pd_fsm.jax_engine.kv.checksum)


@attrs.frozen(slots=True)
class TokenLogprob:
    """One alternative of a position's top log-probabilities: a token and its log-prob."""

    token: int
    logprob: float


@attrs.frozen(slots=True)
class RecvInit:
    """D → P: pages reserved for ``room``; send READY to ``reply_to`` (D's identity)."""

    room: int
    reply_to: str
    n_pages: int
    layout_hash: str
    # D's incarnation (0: not said). P reads a new one from the same D as "D restarted: the rooms
    # its previous process claimed are gone" and frees their KV at once, not at lease expiry.
    incarnation: int = 0
    # Leading pages of the prompt (of ``n_pages``) D already holds from its prefix cache: P
    # registers only the rest (delta-only transfer).
    skip_pages: int = 0


@attrs.frozen(slots=True)
class Ready:
    """P → D: the room's KV is registered under ``uuid``; pull it."""

    room: int
    uuid: int
    first_token: int
    n_pages: int  # pages registered: the prompt's after RECV_INIT's skip_pages
    layout_hash: str
    first_logprob: float = 0.0  # of first_token under P's distribution (for return_logprob)
    # P's incarnation (0: not said) and where to pull from. A restarted P comes back on the same
    # side-channel port with a new transfer port: D pulls from the address the READY names, and
    # a new incarnation tells D that rooms READY'd by the previous process are gone.
    incarnation: int = 0
    transfer_addr: str = ""
    # The first position's most likely tokens, when the request asked for top logprobs: D
    # reports them as P computed them (the sampled token's own is first_logprob).
    first_top: tuple[TokenLogprob, ...] = ()
    # How P registered each pool: one array per kv-head shard (P's tensor-parallel size). D pulls
    # that many and regroups them onto its own devices, or refuses a count it cannot regroup.
    kv_shards: int = 1
    # With KV checksums on (both sides' --disaggregation-kv-checksum): one per registered array,
    # in registration order, of the bytes P registered, so D can tell KV corrupted in flight
    # from good KV before scattering it; and a second registration of the same arrays, for D's
    # one re-pull after a mismatch (a registration is pulled once). (): checksums not in use.
    kv_checksums: tuple[int, ...] = ()
    repull_uuid: int = 0


@attrs.frozen(slots=True)
class KVPart:
    """P → D, while P still prefills the rest of the prompt (streamed KV): the
    prompt's pages ``first_page`` .. ``first_page + n_pages`` are registered under ``uuid``;
    pull them. Parts come in page order, each starting where the last ended; READY follows
    with the pages no part carried (its ``n_pages`` counts only those) and the first token."""

    room: int
    uuid: int
    first_page: int
    n_pages: int
    layout_hash: str
    incarnation: int = 0  # P's, and where to pull from, as in READY
    transfer_addr: str = ""
    kv_shards: int = 1
    kv_checksums: tuple[int, ...] = ()  # as READY's, of this part's arrays (checksums on)


@attrs.frozen(slots=True)
class Done:
    """D → P: the pull ended (``ok``) or failed (``reason``)."""

    room: int
    ok: bool
    reason: str = ""


@attrs.frozen(slots=True)
class Heartbeat:
    """D → P, batched per P: D still wants these rooms (extends their KV hold leases)."""

    seq: int  # echoed in the ack, so D knows which of its messages P had seen when answering
    rooms: tuple[int, ...]
    incarnation: int = 0  # D's, as in RecvInit


@attrs.frozen(slots=True)
class HeartbeatAck:
    """P → D: P is alive (``incarnation`` changes when P restarts).

    ``failed_rooms``: rooms of the heartbeat that P failed. ``unknown_rooms``: rooms P has never
    seen (or forgot in a restart); for a room whose RECV_INIT went out before heartbeat ``seq``,
    that means P lost it, and D fails the room instead of waiting out its READY timeout.
    """

    incarnation: int
    seq: int
    failed_rooms: tuple[int, ...] = ()
    unknown_rooms: tuple[int, ...] = ()


@attrs.frozen(slots=True)
class Abort:
    """Either way: the sender gave up on ``room``."""

    room: int
    reason: str


Message = RecvInit | KVPart | Ready | Done | Heartbeat | HeartbeatAck | Abort

# Wire names (also what statistics and logs call them).
WIRE_NAMES: dict[type, str] = {
    RecvInit: "RECV_INIT",
    KVPart: "KV_PART",
    Ready: "READY",
    Done: "DONE",
    Heartbeat: "HB",
    HeartbeatAck: "HB_ACK",
    Abort: "ABORT",
}
BY_WIRE_NAME: dict[str, type] = {v: k for k, v in WIRE_NAMES.items()}
