"""The sans-IO core of pd_fsm: table-driven state machines, no sockets, no clock, no threads.

Imports only the standard library, attrs, cattrs and msgpack (a test enforces it).
"""

from pd_fsm.core.codec import decode, encode
from pd_fsm.core.config import DecodeConfig, LeaseConfig, RegistryConfig, RouterConfig
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from pd_fsm.core.kvpoll import KVPoll
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.core.registry import BootstrapRegistry
from pd_fsm.core.router import RoomRouter
from pd_fsm.core.tables import ALL_TABLES

__all__ = [
    "ALL_TABLES",
    "BootstrapRegistry",
    "DecodeConfig",
    "DecodeEndpoint",
    "KVPoll",
    "LeaseConfig",
    "LocalProtocolError",
    "PrefillEndpoint",
    "ProtocolError",
    "RegistryConfig",
    "RemoteProtocolError",
    "RoomRouter",
    "RouterConfig",
    "decode",
    "encode",
]
