"""`pd-fsm proxy`: the PD proxy as a process (RFC-2 §5.7, DESIGN §8).

``--prefill URL [BOOTSTRAP_PORT]`` and ``--decode URL`` repeat, as in sglang-router (a URL may be
``unix:PATH``: docs/unix_sockets.md); or
``--bootstrap-url`` discovers the workers from the bootstrap server's ``/list``.
``--colocated URL`` repeats too: a worker in role ``null`` that serves whole requests (the
registry lists no such worker, so these are given statically either way).
"""

from __future__ import annotations

import argparse
import logging
import sys

from pd_fsm.core.config import RouterConfig
from pd_fsm.core.routing import POLICIES, RoutingConfig
from pd_fsm.io_trio.api_key import add_api_key_arguments, api_key_from_args
from pd_fsm.io_trio.cli_common import refuse_tls_on_unix, run_service, serve_until_signal
from pd_fsm.io_trio.flag_spec import add_flags
from pd_fsm.io_trio.proxy.server import ProxyServer, serve_proxy
from pd_fsm.io_trio.proxy.workers import PrefillTarget
from pd_fsm.io_trio.tls import add_tls_arguments, tls_from_args
from pd_fsm.io_trio.unix_sockets import (
    IPC_PREFIX,
    port_from_args,
    service_url,
    uds_flags,
    uds_from_args,
)

log = logging.getLogger("pd_fsm.io_trio.proxy.cli")

DEFAULT_PORT = 8000


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("proxy", help="run the PD proxy (posts each request to one P and one D)")
    p.add_argument("--prefill", nargs="+", action="append", default=[],
                   metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill worker (http(s)://... or unix:PATH) and the bootstrap port "
                        "it is known by (or 'none'; or, for a P on a unix socket alone, its "
                        "side channel's ipc:// endpoint: by default unix:PATH's PATH.zmq)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode worker")
    p.add_argument("--colocated", action="append", default=[], metavar="URL",
                   help="a colocated worker (role null: serves whole requests); it gets a request "
                        "when it has fewer in flight than the chosen decode worker, or when there "
                        "is no prefill or no decode worker. The registry lists none: with "
                        "--bootstrap-url give them here")
    p.add_argument("--bootstrap-url", default=None,
                   help="discover workers from this bootstrap server's /list instead")
    p.add_argument("--refresh-interval", type=float, default=5.0,
                   help="seconds between /list refreshes (default 5)")
    p.add_argument("--role-probe-interval", type=float, default=2.0,
                   help="static lists: seconds between probes of each worker's /server_info for "
                        "its current role (a worker switched with /switch_role is routed as its "
                        "new role within one interval, or at once after a 409; default 2; 0: "
                        "never, the command line's roles stand)")
    p.add_argument("--room-timeout", type=float, default=RouterConfig().room_timeout,
                   help="every room ends by this many seconds (default 600)")
    p.add_argument("--decode-recomputes", action="store_true",
                   help="the decode workers run --disaggregation-failure-policy recompute: a "
                        "failed prefill leg leaves the room to D's answer instead of failing it")
    rc = RouterConfig()
    p.add_argument("--retry-limit", type=int, default=rc.retry_limit,
                   help="a leg refused before any byte of its answer (connect error, 503) is "
                        "retried on other workers, with exponential backoff and jitter, at most "
                        f"this many times per request, within its room timeout (default "
                        f"{rc.retry_limit}; 0: never)")
    p.add_argument("--migration-limit", type=int, default=rc.migration_limit,
                   help="a stream whose decode worker breaks off goes on in a new room from the "
                        "tokens the client has, at most this many times per request (default "
                        f"{rc.migration_limit}; 0: the stream ends in an error, as before)")
    p.add_argument("--breaker-threshold", type=int, default=rc.breaker_threshold,
                   help="a worker with this many consecutive faults (refused, broke off "
                        "mid-stream) is skipped for --breaker-cooldown, then probed by one "
                        f"request (default {rc.breaker_threshold}; 0: no breaker)")
    p.add_argument("--breaker-cooldown", type=float, default=rc.breaker_cooldown,
                   help=f"seconds an open breaker keeps its worker out (default "
                        f"{rc.breaker_cooldown:g})")
    add_routing_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help=f"default {DEFAULT_PORT}, or none beside --uds (no TCP listener)")
    add_flags(p, uds_flags("the proxy"))
    p.add_argument("--log-level", default="INFO")
    add_tls_arguments(p)
    add_api_key_arguments(p)
    add_api_key_arguments(p, "worker-", who="the proxy sends to every worker; workers expect")
    p.set_defaults(func=main)


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    d = RoutingConfig()
    g = p.add_argument_group("routing (core/routing.py)")
    for leg in ("prefill", "decode"):
        g.add_argument(f"--{leg}-policy", choices=POLICIES, default=getattr(d, f"{leg}_policy"),
                       help=f"how a {leg} worker is chosen (default round_robin)")
    g.add_argument("--cache-threshold", type=float, default=d.cache_threshold,
                   help="cache_aware: share of the prompt a worker's index must hold to be "
                        "chosen for it (default 0.5)")
    g.add_argument("--balance-abs-threshold", type=int, default=d.balance_abs,
                   help="cache_aware routes by load alone when the loads differ by more than "
                        "this ... (default 32)")
    g.add_argument("--balance-rel-threshold", type=float, default=d.balance_rel,
                   help="... and the largest is above this times the smallest (default 1.5)")
    g.add_argument("--max-tree-blocks", type=int, default=d.index_blocks,
                   help="cache_aware: prompt blocks remembered per worker (default 65536)")
    g.add_argument("--local-prefill-tokens", type=int, default=0, metavar="N",
                   help="conditional disaggregation: D prefills alone a prompt whose uncached "
                        "part is at most N tokens (text estimated at 4 characters a token; "
                        "default 0: off)")
    g.add_argument("--local-prefill-queue", type=int, default=0, metavar="N",
                   help="conditional disaggregation: D prefills alone while every prefill "
                        "worker has at least N requests (default 0: off)")
    g.add_argument("--local-prefill-cached-ratio", type=float, default=0.0, metavar="R",
                   help="conditional disaggregation (Dynamo's cached-to-raw threshold): D "
                        "prefills alone a prompt of which its cache_aware index holds at least "
                        "R (0..1; default 0: off)")
    g.add_argument("--local-prefill-decode-guard", type=int, default=0, metavar="N",
                   help="decode-busy guard: no local prefill on a D that has N or more "
                        "requests, whatever the rules above say (default 0: off)")
    g.add_argument("--local-prefill-without-prefill", action="store_true",
                   help="D prefills alone while no prefill worker is listed (all draining for "
                        "a role switch, or gone) instead of answering 503 (default: off; "
                        "`pd-fsm cluster --planner` turns it on)")
    g.add_argument("--max-queue-per-worker", type=int, default=0, metavar="N",
                   help="shed load: when every worker of a role has at least N requests (the "
                        "proxy's own, or its last polled /get_load), answer 429 with "
                        "Retry-After at once (default 0: off)")
    g.add_argument("--load-interval", type=float, default=1.0,
                   help="seconds between polls of the workers' /get_load, for power_of_two, "
                        "cache_aware and --local-prefill-queue (default 1)")


def routing_from_args(args: argparse.Namespace) -> RoutingConfig:
    """Raises ValueError naming a bad value."""
    if args.load_interval <= 0:
        raise ValueError("--load-interval must be positive")
    try:
        return RoutingConfig(
            prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
            cache_threshold=args.cache_threshold, balance_abs=args.balance_abs_threshold,
            balance_rel=args.balance_rel_threshold, index_blocks=args.max_tree_blocks,
            local_prefill_tokens=args.local_prefill_tokens,
            local_prefill_queue=args.local_prefill_queue,
            local_prefill_cached_ratio=args.local_prefill_cached_ratio,
            local_prefill_decode_guard=args.local_prefill_decode_guard,
            local_prefill_without_prefill=args.local_prefill_without_prefill,
            max_queue=args.max_queue_per_worker,
        )
    except ValueError as exc:
        message = str(exc)
        for attr, flag in _FLAG_OF.items():
            message = message.replace(f"'{attr}'", flag).replace(attr, flag)
        raise ValueError(message) from None


_FLAG_OF = {"balance_abs": "--balance-abs-threshold", "balance_rel": "--balance-rel-threshold",
            "index_blocks": "--max-tree-blocks", "prefill_policy": "--prefill-policy",
            "decode_policy": "--decode-policy", "cache_threshold": "--cache-threshold",
            "local_prefill_tokens": "--local-prefill-tokens",
            "local_prefill_queue": "--local-prefill-queue",
            "local_prefill_cached_ratio": "--local-prefill-cached-ratio",
            "local_prefill_decode_guard": "--local-prefill-decode-guard",
            "max_queue": "--max-queue-per-worker"}


def parse_prefill(items: list[list[str]]) -> list[PrefillTarget]:
    targets = []
    for item in items:
        if not 1 <= len(item) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(item)}")
        url = service_url(item[0], "--prefill URL")
        port: int | None = None
        host: str | None = None
        if len(item) == 2 and item[1].startswith(IPC_PREFIX):  # a P on a unix socket alone
            host = item[1]
        elif len(item) == 2 and item[1].lower() not in ("none", "null"):
            if not item[1].isdigit() or not 0 < int(item[1]) < 65536:
                raise ValueError(f"bootstrap port must be 1..65535, none or an ipc:// "
                                 f"endpoint, got {item[1]!r}")
            port = int(item[1])
        targets.append(PrefillTarget.from_url(url, port, host))
    return targets


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="pd-fsm proxy: %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        prefill = parse_prefill(args.prefill)
        decode = [service_url(url, "--decode URL") for url in args.decode]
        colocated = [service_url(url, "--colocated URL") for url in args.colocated]
        bootstrap_url = (None if args.bootstrap_url is None
                         else service_url(args.bootstrap_url, "--bootstrap-url"))
        uds = uds_from_args(args)
        if args.bootstrap_url is None and not args.colocated and (
                not (prefill or args.local_prefill_without_prefill) or not args.decode):
            raise ValueError("give --prefill and --decode workers (or --decode workers alone "
                             "with --local-prefill-without-prefill), or --colocated workers, or "
                             "--bootstrap-url")
        if args.refresh_interval <= 0 or args.room_timeout <= 0:
            raise ValueError("--refresh-interval and --room-timeout must be positive")
        if args.role_probe_interval < 0:
            raise ValueError("--role-probe-interval must be 0 (off) or positive")
        api_key = api_key_from_args(args)
        worker_api_key = api_key_from_args(args, "worker-")
        tls = tls_from_args(args)
        refuse_tls_on_unix(tls, uds)
        routing = routing_from_args(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    proxy = ProxyServer(prefill, decode, bootstrap_url=bootstrap_url,
                  refresh_interval=args.refresh_interval, room_timeout=args.room_timeout,
                  api_key=api_key, worker_api_key=worker_api_key, tls=tls, routing=routing,
                  load_interval=args.load_interval, decode_recomputes=args.decode_recomputes,
                  retry_limit=args.retry_limit, migration_limit=args.migration_limit,
                  breaker_threshold=args.breaker_threshold,
                  breaker_cooldown=args.breaker_cooldown,
                  role_probe_interval=args.role_probe_interval, colocated=colocated)
    port = port_from_args(args.port, uds, DEFAULT_PORT)
    return run_service(serve_until_signal, "proxy", serve_proxy, proxy, args.host, port, log,
                       uds, host=args.host, port=port, log=log, uds=uds)

