"""The `pd-fsm serve` flags that are not copied to ``ServeConfig`` as they are: checked against
each other, read from files at start, or turned around (``--disable-radix-cache``). One ``Hook``
each, in the order ``config_from_args`` runs them, naming the flags it reads and the field it
sets (``flag_spec.unaccounted`` checks the names).

The heavier readers (addresses, CURVE keys, Jinja) are imported when their flag is given:
``pd-fsm --help`` must stay light.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pd_fsm.io_trio.api_key import api_key_flags, api_key_from_args
from pd_fsm.io_trio.cli_common import refuse_tls_on_unix
from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.cluster.tpu_placement import NO_CHIP, TpuPlacement, find_host, placement
from pd_fsm.io_trio.flag_spec import Hook
from pd_fsm.io_trio.tls import TLS, tls_flags, tls_from_args
from pd_fsm.io_trio.unix_sockets import (
    SIDE_CHANNEL_SUFFIX,
    UNIX_PREFIX,
    UnixSocket,
    check_path,
    port_from_args,
)
from pd_fsm.io_trio.worker.flags import DEFAULT_PORT

if TYPE_CHECKING:
    from pd_fsm.io_trio.side_channel.curve import CurveKeys


def _check_heartbeat(args: argparse.Namespace) -> None:
    interval = args.disaggregation_bootstrap_heartbeat_interval
    ttl = args.disaggregation_bootstrap_heartbeat_ttl
    if 2 * interval > ttl:
        raise ValueError(
            f"--disaggregation-bootstrap-heartbeat-interval {interval:g} cannot keep a "
            f"registration alive under --disaggregation-bootstrap-heartbeat-ttl {ttl:g}: "
            "keep it at most half the TTL, so one lost heartbeat does not expire it"
        )


def _check_nodes(args: argparse.Namespace) -> None:
    # --nnodes >= 1 is the flag's own check, run before this.
    if args.nnodes == 1:
        if args.node_rank != 0 or args.dist_init_addr is not None:
            raise ValueError("--node-rank and --dist-init-addr are for --nnodes > 1")
        return
    if not 0 <= args.node_rank < args.nnodes:
        raise ValueError(f"--node-rank must be in 0..{args.nnodes - 1}, got {args.node_rank}")
    if args.tp_size % args.nnodes:
        raise ValueError(f"--tp {args.tp_size} does not split over --nnodes {args.nnodes}")
    addr = args.dist_init_addr
    host, _, port = (addr or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"--nnodes > 1 needs --dist-init-addr HOST:PORT (PORT < 65535: PORT+1 "
                         f"is used too), got {addr!r}")


def _check_kv_checksum(args: argparse.Namespace) -> None:
    if args.disaggregation_kv_checksum and args.nnodes > 1:
        # Each P rank registers its own shards, but READY comes from rank 0 alone: it could not
        # carry the other ranks' checksums.
        raise ValueError("--disaggregation-kv-checksum is not supported with --nnodes > 1 "
                         "(READY would carry only rank 0's checksums)")


def _check_roles(args: argparse.Namespace) -> None:
    roles = args.roles or ()
    if roles and args.disaggregation_mode not in roles:
        raise ValueError(f"--roles {','.join(roles)} must include --disaggregation-mode's role "
                         f"({args.disaggregation_mode})")
    if len(roles) > 1 and args.nnodes > 1:
        # Every rank would have to switch in step with rank 0 (its replica, its transfer
        # server, its registration): not built. sglang refuses its role switch with DP
        # attention and EP alike.
        raise ValueError("--roles with more than one role is not supported with --nnodes > 1 "
                         "(an instance spanning processes cannot switch its role)")


def _check_role_nice(args: argparse.Namespace) -> None:
    role_nice = dict(args.role_nice or ())
    roles = args.roles or (args.disaggregation_mode,)
    stray = sorted(set(role_nice) - set(roles))
    if stray:
        raise ValueError(f"--role-nice names {', '.join(stray)}, not among the worker's roles "
                         f"({','.join(roles)})")
    start = role_nice.get(args.disaggregation_mode)
    if start is not None and args.nice not in (0, start):
        raise ValueError(f"--nice {args.nice} contradicts --role-nice "
                         f"{args.disaggregation_mode}={start}")


def _check_cpu_pools(args: argparse.Namespace) -> None:
    if not args.cpu_pools.isdigit():
        return
    if args.cpus is None:
        raise ValueError(f"--cpu-pools {args.cpu_pools} needs --cpus: the cores the worker "
                         "runs on once its pools of that many threads exist")
    if int(args.cpu_pools) > len(parse_cpus(args.cpus)):
        raise ValueError(f"--cpu-pools {args.cpu_pools}: more threads than --cpus "
                         f"{args.cpus} has cores")


def _pd_roles(args: argparse.Namespace) -> bool:
    return any(role != "null" for role in (args.disaggregation_mode, *(args.roles or ())))


def _port(args: argparse.Namespace) -> int | None:
    return port_from_args(args.port_given, args.uds, DEFAULT_PORT)


def _uds(args: argparse.Namespace) -> Path | None:
    """``--uds``, checked: a path a socket can have (and its side channel's beside it, for a
    worker that may be P), and nothing a unix socket cannot carry."""
    if args.uds is None:
        return None
    if args.ssl_certfile is not None:
        refuse_tls_on_unix(TLS(args.ssl_certfile), UnixSocket(args.uds))
    if args.nnodes > 1:
        raise ValueError("--uds is not supported with --nnodes > 1 (the ranks meet over TCP: "
                         "jax.distributed's coordinator and rank 0's command stream)")
    path = check_path(args.uds)
    if _pd_roles(args) and args.port_given is None:
        check_path(f"{path}{SIDE_CHANNEL_SUFFIX}", "--uds (its side channel's socket)")
    return path


def _bootstrap_host(args: argparse.Namespace) -> str:
    host: str = args.disaggregation_bootstrap_host
    if host.startswith(UNIX_PREFIX):  # the registry on a unix socket
        path = check_path(host[len(UNIX_PREFIX):], "--disaggregation-bootstrap-host")
        return f"{UNIX_PREFIX}{path}"
    return host


def _compilation_cache(args: argparse.Namespace) -> bool:
    if args.no_compilation_cache and args.compilation_cache_dir is not None:
        raise ValueError("--compilation-cache-dir and --no-compilation-cache contradict")
    return not args.no_compilation_cache


def _advertise_host(args: argparse.Namespace) -> str | None:
    # A worker that may become P or D at runtime needs the address peers reach it at too.
    if all(role == "null" for role in (args.disaggregation_mode, *(args.roles or ()))):
        if args.advertise_interface is not None:
            raise ValueError(
                "--advertise-interface is for P and D workers (--disaggregation-mode)"
            )
        return args.advertise_host  # type: ignore[no-any-return]
    # Raises AddressError (a ValueError) naming the flag to set.
    from pd_fsm.io_trio.bootstrap.addresses import advertised_host

    return advertised_host(
        args.host, args.advertise_host, args.advertise_interface,
        registry_host=args.disaggregation_bootstrap_host,
    )


def _side_channel_curve(args: argparse.Namespace) -> CurveKeys | None:
    if (args.side_channel_curve_key is None) != (args.side_channel_curve_peers is None):
        raise ValueError("--side-channel-curve-key and --side-channel-curve-peers go together")
    if args.side_channel_curve_key is None:
        return None
    if all(role == "null" for role in (args.disaggregation_mode, *(args.roles or ()))):
        raise ValueError("--side-channel-curve-key is for P and D workers")
    from pd_fsm.io_trio.side_channel.curve import CurveKeys

    # Raises CurveError (a ValueError) naming the flag.
    return CurveKeys.load(args.side_channel_curve_key, args.side_channel_curve_peers)


def _tpu(args: argparse.Namespace) -> TpuPlacement | None:
    """``--tpu-chips`` on this host, checked against its layout, ``--tp`` and ``--nnodes``."""
    if args.tpu_chips is None:
        if args.tpu_host is not None or args.tpu_port is not None:
            raise ValueError("--tpu-host and --tpu-port go with --tpu-chips")
        return None
    none = args.tpu_chips.strip() == NO_CHIP
    tpu = placement(args.tpu_chips, None if none else find_host(args.tpu_host, os.environ),
                    args.tpu_port)
    if args.tpu_port is not None and tpu.port is None:
        raise ValueError(f"--tpu-port: --tpu-chips {args.tpu_chips} is "
                         f"{'no chip' if none else 'the whole host'}, which needs no port")
    if tpu.host is None:
        return tpu
    if args.nnodes > 1:
        # Each rank would need the others' chips and ports (one slice of several processes):
        # not built; a rank takes a whole host.
        raise ValueError("--tpu-chips is for a one-process worker (with --nnodes > 1 each rank "
                         "takes a whole host: leave --tpu-chips out)")
    # One JAX device per chip on every host tpu_placement knows.
    if args.tp_size != len(tpu.chips):
        raise ValueError(f"--tp {args.tp_size} does not match --tpu-chips {args.tpu_chips}: "
                         f"{len(tpu.chips)} chip(s) of a {tpu.host.name}, one device each: give "
                         f"--tp {len(tpu.chips)}")
    return tpu


def _chat_template(args: argparse.Namespace) -> str | None:
    """The file's text, compiled once here so that a broken template stops the worker at start."""
    if args.chat_template is None:
        return None
    # Imported here: jinja2 is not needed for `pd-fsm --help`.
    from pd_fsm.text.chat_template import read_chat_template

    return read_chat_template(args.chat_template)


SERVE_HOOKS: tuple[Hook, ...] = (
    Hook(None, ("disaggregation_bootstrap_heartbeat_interval",
                "disaggregation_bootstrap_heartbeat_ttl"), _check_heartbeat),
    Hook(None, ("nnodes", "node_rank", "tp_size", "dist_init_addr"), _check_nodes),
    Hook(None, ("disaggregation_kv_checksum", "nnodes"), _check_kv_checksum),
    Hook(None, ("roles", "disaggregation_mode", "nnodes"), _check_roles),
    Hook(None, ("role_nice", "roles", "disaggregation_mode", "nice"), _check_role_nice),
    Hook(None, ("cpu_pools", "cpus"), _check_cpu_pools),
    Hook("tpu", ("tpu_chips", "tpu_host", "tpu_port", "tp_size", "nnodes"), _tpu),
    # Read when the flags are, before `serve` pins the process (worker/cli.py).
    Hook("cores_at_start", (), lambda args: frozenset(os.sched_getaffinity(0))),
    Hook("radix_cache", ("disable_radix_cache",), lambda args: not args.disable_radix_cache),
    # --drain-handoff states the default (a switch cannot turn a field off: not the field's
    # dest); the two exclude each other (argparse).
    Hook("drain_handoff", ("drain_handoff_stated", "no_drain_handoff"),
         lambda args: not args.no_drain_handoff),
    # --port not given: the default, or no TCP listener beside --uds.
    Hook("port", ("port_given", "uds"), _port),
    Hook("uds", ("uds", "ssl_certfile", "nnodes", "disaggregation_mode", "roles", "port_given"),
         _uds),
    Hook("disaggregation_bootstrap_host", ("disaggregation_bootstrap_host",), _bootstrap_host),
    Hook("compilation_cache", ("no_compilation_cache", "compilation_cache_dir"),
         _compilation_cache),
    Hook("advertise_host", ("host", "advertise_host", "advertise_interface",
                            "disaggregation_mode", "roles", "disaggregation_bootstrap_host"),
         _advertise_host),
    Hook("side_channel_curve", ("side_channel_curve_key", "side_channel_curve_peers",
                                "disaggregation_mode", "roles"), _side_channel_curve),
    Hook("chat_template", ("chat_template",), _chat_template),
    Hook("tls", tuple(flag.dest for flag in tls_flags()), tls_from_args),
    Hook("api_key", tuple(flag.dest for flag in api_key_flags()), api_key_from_args),
)
