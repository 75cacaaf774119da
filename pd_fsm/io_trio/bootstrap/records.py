"""What an instance tells the bootstrap server about itself, validated strictly.

The registry in the core keeps records opaque; this module is where the adapter decides what a
well-formed registration is. Bodies come from the network, so structuring is strict: no int from
a string, no bool as an int, no unknown keys (a typo such as ``tp_rnak`` is an error, not a field
silently defaulted to 0), and every rank inside its size.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import cattrs

from pd_fsm.core.codec import strict_int
from pd_fsm.io_trio import strict_json
from pd_fsm.io_trio.bootstrap.addresses import is_loopback, unreachable_from
from pd_fsm.io_trio.side_channel.curve import is_z85_key
from pd_fsm.io_trio.unix_sockets import IPC_PREFIX, is_unix_url

ROLES = ("prefill", "decode")
MAX_STR = 256
MAX_META_KEYS = 64

InstanceKey = tuple[str, str, int, int, int, int]
RANK_AXES = ("tp", "cp", "dp", "pp")


def rank_query(tp_rank: int = 0) -> dict[str, int]:
    """The full rank tuple a lookup names (``GET /route``): ``tp_rank``, the other axes 0."""
    return {f"{a}_rank": tp_rank if a == "tp" else 0 for a in RANK_AXES}


class RecordError(ValueError):
    """A body that is not a valid record; ``problems`` names each field at fault."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


@attrs.frozen(slots=True)
class InstanceRecord:
    """``PUT /route`` body (RFC-2 §5.3), plus the address routers know the instance by."""

    role: str
    instance_id: str
    tp_rank: int
    tp_size: int
    cp_rank: int
    cp_size: int
    dp_rank: int
    dp_size: int
    pp_rank: int
    pp_size: int
    transfer_addr: str  # jax.experimental.transfer server, "host:port" (TCP only)
    # side channel ROUTER, "host:port" or "tcp://host:port"; "ipc://PATH" for a worker on its
    # unix socket alone (docs/unix_sockets.md)
    zmq_addr: str
    page_size: int
    kv_dtype: str
    # Ours, not the RFC's: a record without it is accepted, and the layout is then only checked
    # at the handshake (D compares READY's layout hash with its own before any pull).
    layout_hash: str = ""
    scheduler_addr: str | None = None
    # DESIGN §5 "Who is P": the (host, port) routers inject as bootstrap_host/bootstrap_port.
    # Default: the host and port of zmq_addr.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    mesh_meta: dict[str, Any] = attrs.field(factory=dict)
    # Ours, not the RFC's: the TTL this instance heartbeats against (its
    # --disaggregation-bootstrap-heartbeat-ttl); the registry expires it after that long without
    # a heartbeat instead of after its own --ttl. Absent: the registry's.
    heartbeat_ttl: float | None = None
    # Ours: P's CURVE public key (z85) when its side channel runs CURVE
    # (pd_fsm.io_trio.side_channel.curve); D dials only a P whose key it trusts.
    curve_public_key: str | None = None
    # Ours: how many times this worker has switched its role at runtime; a router
    # that addresses a leg to a role of an older epoch gets a 409 naming the current one.
    role_epoch: int = 0

    @property
    def key(self) -> InstanceKey:
        return (
            self.role,
            self.instance_id,
            self.tp_rank,
            self.cp_rank,
            self.dp_rank,
            self.pp_rank,
        )

    @property
    def advertised(self) -> str:
        """ "host:port" as routers know this instance (the registry's lookup key); a side channel
        on a unix socket is known by its ``ipc://PATH`` endpoint itself."""
        if self.zmq_addr.startswith(IPC_PREFIX):
            if self.bootstrap_host and self.bootstrap_port:
                return f"{self.bootstrap_host}:{self.bootstrap_port}"
            return self.bootstrap_host or self.zmq_addr
        host, port = split_host_port(self.zmq_addr)
        return f"{self.bootstrap_host or host}:{self.bootstrap_port or port}"

    @property
    def known_as(self) -> tuple[str, int | None]:
        """``advertised`` as the (bootstrap_host, bootstrap_port) routers inject: (the
        ``ipc://`` endpoint, None) for a side channel on a unix socket."""
        advertised = self.advertised
        if advertised.startswith(IPC_PREFIX):
            return advertised, None
        return split_host_port(advertised)


@attrs.frozen(slots=True)
class KeyBody:
    """``POST /heartbeat`` and ``DELETE /route`` body: just the instance key."""

    role: str
    instance_id: str
    tp_rank: int
    cp_rank: int
    dp_rank: int
    pp_rank: int

    @property
    def key(self) -> InstanceKey:
        return (self.role, self.instance_id, self.tp_rank, self.cp_rank, self.dp_rank, self.pp_rank)

    @classmethod
    def of(cls, record: InstanceRecord) -> KeyBody:
        return cls(*record.key)


def _strict_str(value: Any, _: type) -> str:
    if type(value) is not str:
        raise TypeError(f"expected str, got {type(value).__name__}")
    if len(value) > MAX_STR:
        raise ValueError(f"longer than {MAX_STR} characters")
    return value


def _meta(value: Any, _: type) -> dict[str, Any]:
    if type(value) is not dict:
        raise TypeError(f"expected an object, got {type(value).__name__}")
    if len(value) > MAX_META_KEYS:
        raise ValueError(f"more than {MAX_META_KEYS} keys")
    return dict(value)  # JSON already guarantees str keys and plain values


MAX_HEARTBEAT_TTL = 3600.0


def _strict_number(value: Any, _: type) -> float:
    """A JSON number (int or float), never a bool or a string."""
    if type(value) not in (int, float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    return float(value)


converter = cattrs.Converter(forbid_extra_keys=True)
converter.register_structure_hook(int, strict_int)
converter.register_structure_hook(str, _strict_str)
converter.register_structure_hook(float, _strict_number)
converter.register_structure_hook_func(lambda t: t == dict[str, Any], _meta)


def split_host_port(addr: str) -> tuple[str, int]:
    """("host", port) from "host:port", "tcp://host:port" or "[v6]:port"; ValueError if not."""
    rest = addr.split("://", 1)[1] if "://" in addr else addr
    host, sep, port_text = rest.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{addr!r} is not host:port")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ValueError(f"{addr!r}: port outside 1..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def _on_this_host(name: str, value: str) -> bool:
    """An address on the filesystem: a side channel's ``ipc://``, a unix socket's URL."""
    return ((name == "zmq_addr" and value.startswith(IPC_PREFIX))
            or (name == "scheduler_addr" and is_unix_url(value))
            or (name == "bootstrap_host" and value.startswith(IPC_PREFIX)))


def unreachable_fields(r: InstanceRecord, client_host: str | None) -> list[tuple[str, str]]:
    """(field, why) for each address a peer could not dial (pd_fsm.io_trio.bootstrap.addresses): a
    malformed one, a wildcard, loopback or a unix socket sent from ``client_host`` on another
    host."""
    out: list[tuple[str, str]] = []
    hosts: list[tuple[str, str]] = []
    for name in ("transfer_addr", "zmq_addr", "scheduler_addr", "bootstrap_host"):
        value = getattr(r, name)
        if value is not None and _on_this_host(name, value):
            if client_host is not None and not is_loopback(client_host):
                out.append((name, f"names a unix socket ({value}), which only its own host "
                                  f"reaches, but registered from {client_host}"))
        elif name == "bootstrap_host":
            if value:
                hosts.append((name, value))
        elif value is not None:
            try:
                hosts.append((name, split_host_port(value)[0]))
            except ValueError as exc:
                out.append((name, str(exc)))
    for name, host in hosts:
        why = unreachable_from(host, client_host)
        if why is not None:
            out.append((name, why))
    return out


def _check_key(role: str, instance_id: str, ranks: dict[str, int]) -> list[str]:
    problems: list[str] = []
    if role not in ROLES:
        problems.append(f"unknown role {role!r} (expected one of {', '.join(ROLES)}) @ body.role")
    if not instance_id:
        problems.append("instance_id must not be empty @ body.instance_id")
    for name, value in ranks.items():
        if value < 0:
            problems.append(f"{name} must be >= 0, got {value} @ body.{name}")
    return problems


def _check_record(r: InstanceRecord) -> list[str]:
    ranks = {f"{a}_rank": getattr(r, f"{a}_rank") for a in RANK_AXES}
    problems = _check_key(r.role, r.instance_id, ranks)
    for axis in RANK_AXES:
        rank, size = getattr(r, f"{axis}_rank"), getattr(r, f"{axis}_size")
        if size < 1:
            problems.append(f"{axis}_size must be >= 1, got {size} @ body.{axis}_size")
        elif rank >= size:
            problems.append(f"{axis}_rank {rank} must be < {axis}_size {size} @ body.{axis}_rank")
    problems += [f"{why} @ body.{name}" for name, why in unreachable_fields(r, None)]
    if r.page_size < 1:
        problems.append(f"page_size must be >= 1, got {r.page_size} @ body.page_size")
    if not r.kv_dtype:
        problems.append("kv_dtype must not be empty @ body.kv_dtype")
    if r.bootstrap_port is not None and not 0 < r.bootstrap_port < 65536:
        problems.append(f"bootstrap_port {r.bootstrap_port} outside 1..65535 @ body.bootstrap_port")
    if r.heartbeat_ttl is not None and not 0 < r.heartbeat_ttl <= MAX_HEARTBEAT_TTL:
        problems.append(
            f"heartbeat_ttl must be in (0, {MAX_HEARTBEAT_TTL:g}] s, got {r.heartbeat_ttl} "
            "@ body.heartbeat_ttl"
        )
    if r.curve_public_key is not None and not is_z85_key(r.curve_public_key):
        problems.append("curve_public_key must be a 40-character Z85 CURVE key "
                        "@ body.curve_public_key")
    if r.role_epoch < 0:
        problems.append(f"role_epoch must be >= 0, got {r.role_epoch} @ body.role_epoch")
    if r.bootstrap_host is not None and not r.bootstrap_host:
        problems.append("bootstrap_host must not be empty @ body.bootstrap_host")
    return problems


def _structure(body: Any, cls: type[Any]) -> Any:
    if type(body) is not dict:
        raise RecordError([f"body must be a JSON object, got {type(body).__name__}"])
    try:
        return converter.structure(body, cls)
    except Exception as exc:  # cattrs groups one error per field
        raise RecordError(cattrs.transform_error(exc, path="body")) from None


def parse_record(body: Any) -> InstanceRecord:
    """A validated record from a decoded JSON body, or :class:`RecordError`."""
    record: InstanceRecord = _structure(body, InstanceRecord)
    problems = _check_record(record) + _unservable(record)
    if problems:
        raise RecordError(problems)
    return record


def _unservable(record: InstanceRecord | KeyBody) -> list[str]:
    """Why ``record`` could not be listed back as strict JSON (a NaN, a lone surrogate): a
    record is refused when written, so that ``GET /list`` can never fail for everyone."""
    try:
        strict_json.loads(json.dumps(to_json(record)), what="body")
    except strict_json.JsonError as exc:
        return [f"cannot be served back as JSON: {exc.message}"]
    return []


def parse_key(body: Any) -> KeyBody:
    key: KeyBody = _structure(body, KeyBody)
    ranks = {f"{a}_rank": getattr(key, f"{a}_rank") for a in RANK_AXES}
    problems = _check_key(key.role, key.instance_id, ranks) + _unservable(key)
    if problems:
        raise RecordError(problems)
    return key


def to_json(record: InstanceRecord | KeyBody) -> dict[str, Any]:
    out: dict[str, Any] = converter.unstructure(record)
    return out


def record_from_json(body: Any) -> InstanceRecord:
    """The client's side: a record as the server returned it (validated the same way)."""
    return parse_record(body)
