"""Signed registry requests: what a write to the bootstrap registry carries instead of a secret.

With a cluster secret, every write (``PUT``/``DELETE /route``, ``POST /heartbeat``) carries three
headers::

    x-pd-fsm-time:  the sender's wall-clock time, integer milliseconds since the epoch
    x-pd-fsm-nonce: 16 random bytes, 32 lowercase hex digits
    x-pd-fsm-mac:   HMAC-SHA256(registry key, canonical request), 64 lowercase hex digits

where the registry key is :func:`pd_fsm.core.keys.registry_key` of the cluster secret and the
canonical request is these six lines joined by ``\\n`` (no trailing newline)::

    pd-fsm-request-v1
    METHOD                 (upper case, e.g. PUT)
    /path                  (the URL path, no query)
    time                   (the x-pd-fsm-time value)
    nonce                  (the x-pd-fsm-nonce value)
    sha256(body), hex      (of the exact body bytes sent)

No field can contain a newline (the path is refused if it does), so the string is unambiguous.
A captured request is of no use for another method, path, body or time, and the receiver's
:class:`~pd_fsm.core.replay.ReplayGuard` refuses it when sent again (its MAC already accepted) or
late (outside the window, or sent before the receiver started). An ``Authorization`` header is
refused outright: that is where the old scheme sent the secret itself, and a client that still
does so must fail loudly rather than leak it on every heartbeat.

Pure functions: the caller passes the time and the nonce, as everywhere in the core.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.replay import ReplayGuard

HEADER_TIME = "x-pd-fsm-time"
HEADER_NONCE = "x-pd-fsm-nonce"
HEADER_MAC = "x-pd-fsm-mac"
SCHEME = "pd-fsm-request-v1"
NONCE_BYTES = 16
_MAX_MS_DIGITS = 16  # ms since the epoch has 13 digits until the year 2286
_HEX = frozenset("0123456789abcdef")


class RequestAuthError(RemoteProtocolError):
    """A registry write that is not signed, or not signed right."""


def canonical_request(method: str, path: str, sent_ms: int, nonce: str, body: bytes) -> bytes:
    """The byte string a request's MAC covers (see the module docstring)."""
    if "\n" in path:
        raise ValueError("a path with a newline cannot be signed unambiguously")
    digest = hashlib.sha256(body).hexdigest()
    fields = (SCHEME, method.upper(), path, str(sent_ms), nonce, digest)
    return "\n".join(fields).encode("utf-8", "surrogateescape")


def _mac(key: bytes, method: str, path: str, sent_ms: int, nonce: str, body: bytes) -> bytes:
    return hmac.new(key, canonical_request(method, path, sent_ms, nonce, body), "sha256").digest()


def sign_request(
    key: bytes, method: str, path: str, body: bytes, *, sent_at: float, nonce: bytes
) -> dict[str, str]:
    """The three headers that authenticate this request; ``sent_at`` is the sender's wall clock
    in seconds and ``nonce`` 16 random bytes (adapters pass ``time.time()`` and
    ``secrets.token_bytes(16)``, afresh for every attempt)."""
    if not key:
        raise ValueError("signing needs a key")
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    if not 0 <= sent_at < 10**_MAX_MS_DIGITS / 1000:
        raise ValueError(f"sent_at {sent_at!r} is not a plausible wall-clock time")
    sent_ms, nonce_hex = round(sent_at * 1000), nonce.hex()
    mac = _mac(key, method, path, sent_ms, nonce_hex, body)
    return {HEADER_TIME: str(sent_ms), HEADER_NONCE: nonce_hex, HEADER_MAC: mac.hex()}


def _is_hex(value: str, length: int) -> bool:
    return len(value) == length and set(value) <= _HEX


def verify_request(
    key: bytes,
    method: str,
    path: str,
    body: bytes,
    headers: Mapping[str, str],
    *,
    guard: ReplayGuard | None,
    now: float,
) -> None:
    """Return if the request is signed with ``key`` and (with a ``guard``) fresh and new at the
    receiver's wall-clock time ``now``; raise :class:`RequestAuthError`,
    :class:`~pd_fsm.core.replay.StaleFrame` or :class:`~pd_fsm.core.replay.ReplayedFrame`
    saying why otherwise. ``headers``: lower-case names, or a case-insensitive mapping."""
    authorization = headers.get("authorization")
    if authorization is not None:
        scheme = authorization.partition(" ")[0] or "(empty)"
        raise RequestAuthError(
            f"Authorization header ({scheme}) refused: the cluster secret is never sent; sign "
            f"the request ({HEADER_TIME}, {HEADER_NONCE}, {HEADER_MAC}) with the registry key "
            "derived from it"
        )
    sent, nonce, mac = (headers.get(h) for h in (HEADER_TIME, HEADER_NONCE, HEADER_MAC))
    if sent is None or nonce is None or mac is None:
        present = {HEADER_TIME: sent, HEADER_NONCE: nonce, HEADER_MAC: mac}
        missing = ", ".join(h for h, v in present.items() if v is None)
        raise RequestAuthError(
            f"unsigned request: missing {missing} (writes must be signed with the registry key "
            "derived from the cluster secret)"
        )
    # isascii: str.isdigit also accepts digits such as "²", which int() refuses.
    if not (sent.isascii() and sent.isdigit() and len(sent) <= _MAX_MS_DIGITS):
        raise RequestAuthError(f"{HEADER_TIME} must be integer milliseconds, got {sent!r:.40}")
    if not _is_hex(nonce, 2 * NONCE_BYTES):
        raise RequestAuthError(f"{HEADER_NONCE} must be {2 * NONCE_BYTES} lowercase hex digits")
    if not _is_hex(mac, 64):
        raise RequestAuthError(f"{HEADER_MAC} must be 64 lowercase hex digits")
    if "\n" in path:
        raise RequestAuthError("path contains a newline")
    expected = _mac(key, method, path, int(sent), nonce, body)
    # Constant time: how much of a guessed MAC matched must not show in the answer's timing.
    if not hmac.compare_digest(bytes.fromhex(mac), expected):
        raise RequestAuthError(
            "bad signature: not made with this cluster's registry key, or the method, path, "
            "time, nonce or body changed after signing"
        )
    if guard is not None:
        guard.admit(int(sent) / 1000, expected, now)
