"""CURVE for the ZMQ side channel (DESIGN "Keys": across hosts, CURVE for ZMQ).

Each worker has a CURVE key pair in a file (pyzmq's certificate format, made by
``zmq.auth.create_certificates(DIR, NAME)``: ``NAME.key`` holds the public key, ``NAME.key_secret``
both) and a directory of the public keys it trusts (``*.key``):

- P's ROUTER is a CURVE server. A ZAP handler on P's own ZMQ context admits a D only if D's
  public key is in P's directory; any other client is refused during the handshake, before it can
  send a single frame, and counted (``side_channel.curve_refused``).
- P publishes its public key in its registry record (``curve_public_key``). D connects to a P
  only if that key is in D's directory (else the lookup fails with the reason, counted as
  ``curve_untrusted_server``), and CURVE then proves that the P answering holds the secret key.

The traffic is encrypted and authenticated per connection; the frame signatures of the cluster
secret (``side_channel.py``) still apply on top.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import zmq
import zmq.auth
from zmq.utils import z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP protocol (RFC 27)
ZAP_DOMAIN = b"pd-fsm"
Z85_KEY_LEN = 40


class CurveError(ValueError):
    """Key files that cannot be used (names the flag)."""


@attrs.frozen
class CurveKeys:
    public: bytes  # z85, 40 bytes
    secret: bytes = attrs.field(repr=False)
    trusted: frozenset[bytes]  # z85 public keys of the peers this worker accepts

    @classmethod
    def load(cls, key_file: Path, peers_dir: Path) -> CurveKeys:
        try:
            public, secret = zmq.auth.load_certificate(key_file)
        except (OSError, ValueError) as exc:
            raise CurveError(f"--side-channel-curve-key {key_file}: {exc}") from None
        if secret is None:
            raise CurveError(f"--side-channel-curve-key {key_file}: no secret key in it (give "
                             "the NAME.key_secret file)")
        if not peers_dir.is_dir():
            raise CurveError(f"--side-channel-curve-peers {peers_dir}: not a directory")
        try:
            trusted = frozenset(zmq.auth.load_certificates(peers_dir))
        except (OSError, ValueError) as exc:
            raise CurveError(f"--side-channel-curve-peers {peers_dir}: {exc}") from None
        if not trusted:
            raise CurveError(f"--side-channel-curve-peers {peers_dir}: no *.key files in it")
        return cls(public, secret, trusted)

    def trusts(self, public_z85: str | bytes) -> bool:
        key = public_z85.encode() if isinstance(public_z85, str) else public_z85
        return key in self.trusted

    def make_server(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN

    def make_client(self, sock: zmq.Socket[bytes], server_public: bytes) -> None:
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = server_public


def is_z85_key(text: str) -> bool:
    if len(text) != Z85_KEY_LEN:
        return False
    try:
        return len(z85.decode(text.encode())) == 32
    except (ValueError, KeyError, IndexError):
        return False


def zap_reply(request: list[bytes], keys: CurveKeys) -> tuple[list[bytes], bool]:
    """The ZAP reply for one request (RFC 27), and whether the client was admitted. Every
    request gets a reply, even a malformed one: a REP socket that skips one is stuck."""
    if len(request) < 6:  # libzmq never sends these; refuse rather than wedge the handler
        version = request[0] if request else b"1.0"
        request_id = request[1] if len(request) > 1 else b""
        return [version, request_id, b"500", b"malformed ZAP request", b"", b""], False
    version, request_id, _domain, _address, _identity, mechanism = request[:6]
    credentials = request[6:]
    admitted = (
        mechanism == b"CURVE"
        and len(credentials) == 1
        and len(credentials[0]) == 32
        and keys.trusts(z85.encode(credentials[0]))
    )
    status = (b"200", b"OK") if admitted else (b"400", b"client key not trusted")
    return [version, request_id, *status, b"", b""], admitted
