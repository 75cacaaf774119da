"""Protocol errors, split by whose fault they are (as in h11).

A :class:`LocalProtocolError` means our own code fed a machine something its table forbids: a bug
here, raised to the caller. A :class:`RemoteProtocolError` means a peer sent something invalid or
impossible: the endpoint fails the affected room with the error's message as reason, counts it,
and keeps serving. Adapters only ever see the remote kind from :func:`pd_fsm.core.codec.decode`.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class: a transition the tables do not allow, or bytes that are not a message."""


class LocalProtocolError(ProtocolError):
    """Our side broke the protocol (a bug in the caller of the core)."""


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the endpoint recovers by failing the room."""
