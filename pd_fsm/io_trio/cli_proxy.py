"""`pd-fsm proxy`: the PD proxy as a process (RFC-2 §5.7, DESIGN §8).

``--prefill URL [BOOTSTRAP_PORT]`` and ``--decode URL`` repeat, as in sglang-router; or
``--bootstrap-url`` discovers the workers from the bootstrap server's ``/list``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

import trio

from pd_fsm.core.config import RouterConfig
from pd_fsm.io_trio.api_key import add_api_key_arguments, api_key_from_args
from pd_fsm.io_trio.cli_common import STOP_GRACE_S, run_service, stop_on_signal
from pd_fsm.io_trio.proxy import PrefillTarget, Proxy, serve_proxy
from pd_fsm.io_trio.tls import add_tls_arguments, tls_from_args

log = logging.getLogger("pd_fsm.io_trio.cli_proxy")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("proxy", help="run the PD proxy (posts each request to one P and one D)")
    p.add_argument("--prefill", nargs="+", action="append", default=[],
                   metavar=("URL", "BOOTSTRAP_PORT"),
                   help="a prefill worker and the bootstrap port it is known by (or 'none')")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode worker")
    p.add_argument("--bootstrap-url", default=None,
                   help="discover workers from this bootstrap server's /list instead")
    p.add_argument("--refresh-interval", type=float, default=5.0,
                   help="seconds between /list refreshes (default 5)")
    p.add_argument("--room-timeout", type=float, default=RouterConfig().room_timeout,
                   help="every room ends by this many seconds (default 600)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="INFO")
    add_tls_arguments(p)
    add_api_key_arguments(p)
    add_api_key_arguments(p, "worker-", who="the proxy sends to every worker; workers expect")
    p.set_defaults(func=main)


def parse_prefill(items: list[list[str]]) -> list[PrefillTarget]:
    targets = []
    for item in items:
        if not 1 <= len(item) <= 2:
            raise ValueError(f"--prefill takes URL [BOOTSTRAP_PORT], got {' '.join(item)}")
        url = item[0]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--prefill URL must start with http:// or https://, got {url!r}")
        port: int | None = None
        if len(item) == 2 and item[1].lower() not in ("none", "null"):
            if not item[1].isdigit() or not 0 < int(item[1]) < 65536:
                raise ValueError(f"bootstrap port must be 1..65535 or none, got {item[1]!r}")
            port = int(item[1])
        targets.append(PrefillTarget.from_url(url, port))
    return targets


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level.upper(),
        format="pd-fsm proxy: %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        prefill = parse_prefill(args.prefill)
        for url in args.decode:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--decode URL must start with http:// or https://, got {url!r}")
        if args.bootstrap_url is None and (not prefill or not args.decode):
            raise ValueError("give --prefill and --decode workers, or --bootstrap-url")
        if args.refresh_interval <= 0 or args.room_timeout <= 0:
            raise ValueError("--refresh-interval and --room-timeout must be positive")
        api_key = api_key_from_args(args)
        worker_api_key = api_key_from_args(args, "worker-")
        tls = tls_from_args(args)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    proxy = Proxy(prefill, args.decode, bootstrap_url=args.bootstrap_url,
                  refresh_interval=args.refresh_interval, room_timeout=args.room_timeout,
                  api_key=api_key, worker_api_key=worker_api_key, tls=tls)
    return run_service(_run, proxy, args.host, args.port, host=args.host, port=args.port, log=log)


async def _run(proxy: Proxy, host: str, port: int) -> None:
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_on_signal, stop, log)
        url = await nursery.start(functools.partial(serve_proxy, shutdown_trigger=stop.wait),
                                  proxy, host, port)
        print(f"pd-fsm proxy: listening on {url}", flush=True)
        await stop.wait()
        nursery.cancel_scope.deadline = trio.current_time() + STOP_GRACE_S
