"""`pd-fsm bootstrap`: the bootstrap server as a process (DESIGN §8)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from pathlib import Path

import trio

from pd_fsm.core.config import RegistryConfig
from pd_fsm.io_trio.bootstrap.server import DEFAULT_MAX_BODY, BootstrapServer, serve_bootstrap
from pd_fsm.io_trio.cli_common import (
    STOP_GRACE_S,
    listened,
    refuse_tls_on_unix,
    run_service,
    stop_on_signal,
)
from pd_fsm.io_trio.flag_spec import add_flags
from pd_fsm.io_trio.tls import TLS, add_tls_arguments, tls_from_args
from pd_fsm.io_trio.unix_sockets import UnixSocket, port_from_args, uds_flags, uds_from_args

log = logging.getLogger("pd_fsm.io_trio.bootstrap.cli")

DEFAULT_PORT = 8998


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bootstrap", help="run the bootstrap server (instance registry)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None,
                   help=f"port to bind (0: any free port; default {DEFAULT_PORT}, or none beside "
                        "--uds)")
    add_flags(p, uds_flags("the registry"))
    p.add_argument(
        "--ttl",
        "--disaggregation-bootstrap-heartbeat-ttl",  # RFC-2 §7's name
        dest="ttl",
        type=float,
        default=RegistryConfig().ttl,
        help="seconds an instance stays listed without a heartbeat (default 15)",
    )
    p.add_argument(
        "--secret-file",
        type=Path,
        help="file holding the cluster secret; writes must then be signed with the registry key "
        "derived from it (HMAC-SHA256; the secret itself is never sent)",
    )
    p.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, help="request body limit")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ...")
    add_tls_arguments(p, client=False)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="pd-fsm bootstrap: %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.ttl <= 0:
        log.error("--ttl must be positive")
        return 2
    secret: bytes | None = None
    if args.secret_file is not None:
        try:
            secret = args.secret_file.read_bytes().strip()
        except OSError as exc:
            log.error("cannot read --secret-file: %s", exc)
            return 2
        if not secret:
            log.error("--secret-file %s is empty", args.secret_file)
            return 2
    try:
        tls = tls_from_args(args)
        uds = uds_from_args(args)
        refuse_tls_on_unix(tls, uds)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    port = port_from_args(args.port, uds, DEFAULT_PORT)
    server = BootstrapServer(RegistryConfig(ttl=args.ttl), secret=secret, max_body=args.max_body)
    return run_service(_run, server, args.host, port, tls, uds, host=args.host, port=port,
                       log=log, uds=uds)


async def _run(server: BootstrapServer, host: str, port: int | None, tls: TLS,
               uds: UnixSocket | None) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal, stop, log)
        serve = functools.partial(serve_bootstrap, shutdown_trigger=stop.wait, tls=tls, uds=uds)
        url = await nursery.start(serve, server, host, port)
        print(f"pd-fsm bootstrap: listening on {listened(url, port, uds)}", flush=True)
        log.info(
            "cluster secret %s",
            "set: writes must be signed" if server.signed_writes else "not configured",
        )
        await stop.wait()
        log.info("shutting down")
        # hypercorn lets in-flight requests finish (graceful_timeout); this is the backstop.
        nursery.cancel_scope.deadline = trio.current_time() + STOP_GRACE_S
