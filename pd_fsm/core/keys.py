"""Keys derived from the cluster secret (DESIGN §10 "Keys"): HKDF-SHA256, one key per purpose.

Every process of a cluster reads the same cluster secret from a file. Nothing uses it directly as
a key, and nothing sends it anywhere: HKDF-SHA256 (RFC 5869, extract then expand) derives from it
one 32-byte key per purpose, told apart by a label (HKDF's ``info``):

* :func:`side_channel_key` — the HMAC key of P↔D side-channel frames (:mod:`pd_fsm.core.codec`);
* :func:`registry_key` — the HMAC key of writes to the bootstrap registry
  (:mod:`pd_fsm.core.request_auth`);
* :func:`spmd_key` — the HMAC key of the command stream from rank 0 of a multi-process instance
  to its other ranks (:mod:`pd_fsm.io_trio.worker.spmd`).

The keys are independent outputs of a pseudo-random function: knowing one (or any number of
MACs made with it) tells nothing about the secret or another key, and a MAC made with one key
never verifies under the other. HKDF is not a password hash: the secret must be random (for
instance ``openssl rand -hex 32``), not a word someone chose.

Pure functions, stdlib ``hmac``/``hashlib`` only.
"""

from __future__ import annotations

import hashlib
import hmac

HASH_LEN = 32  # SHA-256 output, in bytes
KEY_LEN = 32
# A fixed salt names the application (RFC 5869 §3.1: a salt need not be secret); the version lets a
# later scheme derive different keys from the same secret file.
SALT = b"pd-fsm cluster keys v1"
SIDE_CHANNEL_LABEL = b"pd-fsm/v1 side-channel frame MAC"
REGISTRY_LABEL = b"pd-fsm/v1 registry request MAC"
SPMD_LABEL = b"pd-fsm/v1 spmd command MAC"


def hkdf_extract(salt: bytes, ikm: bytes) -> bytes:
    """RFC 5869 §2.2: PRK = HMAC-Hash(salt, IKM); an empty salt stands for HashLen zero bytes."""
    return hmac.new(salt or bytes(HASH_LEN), ikm, hashlib.sha256).digest()


def hkdf_expand(prk: bytes, info: bytes, length: int) -> bytes:
    """RFC 5869 §2.3: the first ``length`` bytes of T(1) | T(2) | ..., where
    T(i) = HMAC-Hash(PRK, T(i-1) | info | i) and T(0) is empty."""
    if not 0 < length <= 255 * HASH_LEN:
        raise ValueError(f"HKDF-SHA256 output length must be in 1..{255 * HASH_LEN}, got {length}")
    okm, block = b"", b""
    for counter in range(1, -(-length // HASH_LEN) + 1):
        block = hmac.new(prk, block + info + bytes((counter,)), hashlib.sha256).digest()
        okm += block
    return okm[:length]


def hkdf_sha256(ikm: bytes, *, salt: bytes, info: bytes, length: int = KEY_LEN) -> bytes:
    """RFC 5869 HKDF with SHA-256: extract, then expand."""
    return hkdf_expand(hkdf_extract(salt, ikm), info, length)


def _derive(secret: bytes, label: bytes) -> bytes:
    if not secret:
        raise ValueError("the cluster secret is empty")
    return hkdf_sha256(secret, salt=SALT, info=label)


def side_channel_key(secret: bytes) -> bytes:
    """The key that signs and verifies side-channel frames (never the registry's)."""
    return _derive(secret, SIDE_CHANNEL_LABEL)


def registry_key(secret: bytes) -> bytes:
    """The key that signs and verifies registry writes (never the side channel's)."""
    return _derive(secret, REGISTRY_LABEL)


def spmd_key(secret: bytes) -> bytes:
    """The key that signs and verifies a multi-process instance's command frames."""
    return _derive(secret, SPMD_LABEL)
