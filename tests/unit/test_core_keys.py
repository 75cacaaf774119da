"""Derived keys (HKDF-SHA256, RFC 5869) and signed registry requests (pd_fsm.core.request_auth)."""

from __future__ import annotations

import hashlib
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_fsm.core import keys
from pd_fsm.core.replay import ReplayedFrame, ReplayGuard, StaleFrame
from pd_fsm.core.request_auth import (
    HEADER_MAC,
    HEADER_NONCE,
    HEADER_TIME,
    RequestAuthError,
    canonical_request,
    sign_request,
    verify_request,
)

SECRET = b"0123456789abcdef0123456789abcdef"
KEY = keys.registry_key(SECRET)
T0 = 1_800_000_000.0
NONCE = bytes(range(16))
BODY = b'{"role":"prefill","instance_id":"p0"}'

# RFC 5869 appendix A: test cases 1 (salt and info, two output blocks) and 3 (neither).
RFC5869 = [
    (
        "0b" * 22,
        "000102030405060708090a0b0c",
        "f0f1f2f3f4f5f6f7f8f9",
        42,
        "077709362c2e32df0ddc3f0dc47bba6390b6c73bb50f9c3122ec844ad7c2b3e5",
        "3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865",
    ),
    (
        "0b" * 22,
        "",
        "",
        42,
        "19ef24a32c717b167f33a91d6f648bdf96596776afdb6377ac434c1c293ccb04",
        "8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879ec3454e5f3c738d2d9d201395faa4b61a96c8",
    ),
]


@pytest.mark.parametrize(("ikm", "salt", "info", "length", "prk", "okm"), RFC5869)
def test_hkdf_matches_rfc5869(ikm: str, salt: str, info: str, length: int, prk: str, okm: str):
    ikm_b, salt_b, info_b = bytes.fromhex(ikm), bytes.fromhex(salt), bytes.fromhex(info)
    assert keys.hkdf_extract(salt_b, ikm_b).hex() == prk
    assert keys.hkdf_expand(bytes.fromhex(prk), info_b, length).hex() == okm
    assert keys.hkdf_sha256(ikm_b, salt=salt_b, info=info_b, length=length).hex() == okm


def test_hkdf_refuses_impossible_lengths() -> None:
    for length in (0, 255 * 32 + 1):
        with pytest.raises(ValueError, match="length"):
            keys.hkdf_expand(bytes(32), b"", length)


def test_derived_keys_are_distinct_and_never_the_secret() -> None:
    side, registry = keys.side_channel_key(SECRET), keys.registry_key(SECRET)
    spmd = keys.spmd_key(SECRET)
    assert len(side) == len(registry) == len(spmd) == 32
    assert len({side, registry, spmd, SECRET}) == 4
    assert SECRET not in side + registry + spmd
    assert keys.side_channel_key(SECRET) == side  # deterministic: every process agrees
    assert keys.side_channel_key(SECRET + b"x") != side
    with pytest.raises(ValueError, match="empty"):
        keys.registry_key(b"")


def _headers(method: str = "POST", path: str = "/heartbeat", body: bytes = BODY, **kw: object):
    kw.setdefault("sent_at", T0)
    kw.setdefault("nonce", NONCE)
    return sign_request(KEY, method, path, body, **kw)  # type: ignore[arg-type]


def _verify(headers: dict[str, str], *, method: str = "POST", path: str = "/heartbeat",
            body: bytes = BODY, key: bytes = KEY, guard: ReplayGuard | None = None,
            now: float = T0 + 1) -> None:
    verify_request(key, method, path, body, headers, guard=guard, now=now)


def test_canonical_request_is_fixed() -> None:
    """The byte string is part of the wire protocol: another implementation must build it the
    same way (docstring of pd_fsm.core.request_auth)."""
    text = canonical_request("put", "/route", 1234, "ab" * 16, b"{}")
    digest = hashlib.sha256(b"{}").hexdigest()
    assert text == f"pd-fsm-request-v1\nPUT\n/route\n1234\n{'ab' * 16}\n{digest}".encode()
    with pytest.raises(ValueError, match="newline"):
        canonical_request("PUT", "/route\nX", 1, "", b"")


def test_signed_request_verifies_once_then_is_a_replay() -> None:
    guard = ReplayGuard(60, what="request")
    headers = _headers()
    assert set(headers) == {HEADER_TIME, HEADER_NONCE, HEADER_MAC}
    assert headers[HEADER_TIME] == str(int(T0 * 1000)) and headers[HEADER_NONCE] == NONCE.hex()
    _verify(headers, guard=guard)
    with pytest.raises(ReplayedFrame, match="request replayed"):
        _verify(headers, guard=guard)
    # The same request signed again (new nonce) is a new request.
    _verify(_headers(nonce=bytes(16)), guard=guard)


@pytest.mark.parametrize(
    ("change", "value"),
    [
        ("method", "PUT"),
        ("path", "/route"),
        ("body", BODY + b" "),
        ("key", keys.side_channel_key(SECRET)),  # the side channel's key, same secret
    ],
)
def test_anything_changed_under_the_signature_is_refused(change: str, value: object) -> None:
    with pytest.raises(RequestAuthError, match="bad signature"):
        _verify(_headers(), **{change: value})  # type: ignore[arg-type]


def test_time_and_nonce_are_under_the_mac() -> None:
    for name, value in ((HEADER_TIME, str(int(T0 * 1000) + 1)), (HEADER_NONCE, "00" * 16)):
        with pytest.raises(RequestAuthError, match="bad signature"):
            _verify({**_headers(), name: value})


def test_stale_future_and_pre_start_requests_are_refused() -> None:
    with pytest.raises(StaleFrame, match=r"request sent 61\.0 s ago"):
        _verify(_headers(), guard=ReplayGuard(60, what="request"), now=T0 + 61)
    with pytest.raises(StaleFrame, match="in the future"):
        _verify(_headers(), guard=ReplayGuard(60, what="request"), now=T0 - 61)
    restarted = ReplayGuard(60, not_before=T0 + 0.5, what="request")
    with pytest.raises(StaleFrame, match=r"0\.500 s before this process started"):
        _verify(_headers(), guard=restarted)


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({}, f"missing {HEADER_TIME}, {HEADER_NONCE}, {HEADER_MAC}"),
        ({HEADER_TIME: "1", HEADER_NONCE: "00" * 16}, f"missing {HEADER_MAC}"),
        ({"authorization": "Bearer " + SECRET.decode()}, "Authorization header (Bearer) refused"),
        ({HEADER_TIME: "1²", HEADER_NONCE: "00" * 16, HEADER_MAC: "00" * 32}, "milliseconds"),
        ({HEADER_TIME: "-1", HEADER_NONCE: "00" * 16, HEADER_MAC: "00" * 32}, "milliseconds"),
        ({HEADER_TIME: "1", HEADER_NONCE: "AB" * 16, HEADER_MAC: "00" * 32}, "lowercase hex"),
        ({HEADER_TIME: "1", HEADER_NONCE: "00" * 16, HEADER_MAC: "0" * 63}, "64 lowercase hex"),
    ],
)
def test_malformed_or_bearer_requests_are_refused(headers: dict[str, str], needle: str) -> None:
    with pytest.raises(RequestAuthError, match=re.escape(needle)):
        _verify(headers)


def test_bearer_is_refused_even_next_to_a_valid_signature() -> None:
    """A client that still sends the secret must fail loudly, not leak it on every request."""
    with pytest.raises(RequestAuthError, match="never sent"):
        _verify({**_headers(), "authorization": f"Bearer {SECRET.decode()}"})


@given(st.binary(max_size=200), st.binary(min_size=16, max_size=16), st.floats(0, 4e9))
def test_any_signed_request_verifies(body: bytes, nonce: bytes, sent_at: float) -> None:
    headers = sign_request(KEY, "DELETE", "/route", body, sent_at=sent_at, nonce=nonce)
    verify_request(KEY, "DELETE", "/route", body, headers, guard=None, now=sent_at)
