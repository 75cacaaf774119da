"""`pd-fsm planner`: the SLA planner as a process (the policy is
``pd_fsm.core.planner``, the scraping and acting ``service.py``)."""

from __future__ import annotations

import argparse
import logging
import sys

from pd_fsm.core.planner import Planner, PlannerConfig
from pd_fsm.io_trio.api_key import add_api_key_arguments, api_key_from_args, bearer
from pd_fsm.io_trio.cli_common import refuse_tls_on_unix, run_service, serve_until_signal
from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.flag_spec import add_flags
from pd_fsm.io_trio.planner.service import LAUNCHER_S, PlannerService, serve_planner
from pd_fsm.io_trio.tls import add_tls_arguments, tls_from_args
from pd_fsm.io_trio.unix_sockets import (
    port_from_args,
    service_url,
    uds_flags,
    uds_from_args,
)

log = logging.getLogger("pd_fsm.io_trio.planner.cli")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = PlannerConfig()
    p = sub.add_parser("planner", help="switch workers between prefill and decode (and, with "
                                       "--colocate, colocated) to meet TTFT and ITL targets")
    p.add_argument("--bootstrap-url", default=None,
                   help="observe the workers the bootstrap server lists (a URL or unix:PATH)")
    p.add_argument("--worker", action="append", default=[], metavar="URL",
                   help="observe this worker (repeat; instead of --bootstrap-url; a URL or "
                        "unix:PATH)")
    p.add_argument("--launcher-url", default=None, metavar="URL",
                   help="act on scale decisions through this launcher (`pd-fsm cluster "
                        "--max-workers`: POST /scale_up, /scale_down) and observe the workers "
                        "it lists; without one they are logged and counted not_actionable")
    p.add_argument("--launcher-timeout", type=float, default=LAUNCHER_S, metavar="SECONDS",
                   help=f"how long a scale may take (a new worker's start; default "
                        f"{LAUNCHER_S:g})")
    p.add_argument("--max-workers", type=int, default=d.max_workers, metavar="N",
                   help="ask for workers while fewer than N, give idle ones back (with a "
                        "launcher; default 0: only switch roles)")
    p.add_argument("--min-workers", type=int, default=d.min_workers, metavar="N",
                   help=f"never give a worker back below N (default {d.min_workers})")
    p.add_argument("--ttft-slo", type=float, default=d.ttft_slo, help="seconds (default 2)")
    p.add_argument("--itl-slo", type=float, default=d.itl_slo, help="seconds (default 0.1)")
    p.add_argument("--interval", type=float, default=5.0,
                   help="seconds between observations (default 5)")
    p.add_argument("--patience", type=int, default=d.patience,
                   help=f"observations a pressure must hold before it is acted on (default "
                        f"{d.patience})")
    p.add_argument("--cooldown", type=float, default=d.cooldown,
                   help=f"seconds after a decision before the next (default {d.cooldown:g})")
    p.add_argument("--min-prefill", type=int, default=d.min_prefill)
    p.add_argument("--min-decode", type=int, default=d.min_decode)
    p.add_argument("--max-step", type=int, default=d.max_step,
                   help="switches decided at once, at most (default 1; 0: no bound)")
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=False,
                   help="also make workers colocated (role null) when the P/D part is under "
                        "pressure, and split colocated workers into P and D when their ITL "
                        "misses with TTFT to spare; a D of fewer XLA pool threads than P, "
                        "over its ITL target, makes P colocated and stays a standby beside it "
                        "(workers need --roles prefill,decode,null; pd-fsm cluster --planner "
                        "passes it where its D is the narrower)")
    p.add_argument("--recall", type=float, default=d.recall,
                   help=f"with --colocate: seconds a mode's pressure is remembered after "
                        f"leaving it, and between two splits (default {d.recall:g})")
    _add_lever_arguments(p, d)
    p.add_argument("--dry-run", action="store_true", help="decide and log, never switch")
    p.add_argument("--paused", action="store_true",
                   help="start paused: observe and decide nothing until POST /resume (e.g. "
                        "while the workers warm up); POST /pause pauses it again")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None,
                   help="its /metrics and /decisions (default 0: any free port, or none beside "
                        "--uds)")
    add_flags(p, uds_flags("the planner's /metrics and /decisions"))
    p.add_argument("--log-level", default="INFO")
    add_tls_arguments(p)
    add_api_key_arguments(p, who="callers of /decisions, /pause and /resume")
    add_api_key_arguments(p, "worker-", who="the planner, to every worker and the launcher,")
    p.set_defaults(func=main)


def _add_lever_arguments(p: argparse.ArgumentParser, d: PlannerConfig) -> None:
    """The levers that need no drain: P's priority and the cores P and D split or share."""
    p.add_argument("--prefill-nices", type=_nices, default=d.prefill_nices, metavar="N,N,...",
                   help="where P and D share cores: the CPU priorities (nice values) the "
                        "planner may give prefill workers, least priority first (e.g. "
                        "19,10,5,0,-5); a pressed prefill side gets the next higher one, a "
                        "pressed decode side the next lower one, before any role moves "
                        "(POST /set_nice). Default: none (\"\": priorities left alone)")
    p.add_argument("--nice-cooldown", type=float, default=d.nice_cooldown,
                   help=f"seconds after a priority change before the next decision (default "
                        f"{d.nice_cooldown:g}: nothing drains)")
    p.add_argument("--cores", type=_cores, default=d.cores, metavar="LIST",
                   help="the cores P and D may split (P the first half, D the rest) or share "
                        "on this host, e.g. 0-1: the planner moves them between the two by the "
                        "prefill side's pressure and how busy D is (POST /set_cpus; workers "
                        "need --cpu-pools all). Default: none (cores left alone)")
    p.add_argument("--share-below", type=float, default=d.share_below, metavar="SHARE",
                   help=f"with --cores: a split P over its target shares the cores when the "
                        f"busiest D's steps ran under this share of the time (default "
                        f"{d.share_below:g})")
    p.add_argument("--split-above", type=float, default=d.split_above, metavar="SHARE",
                   help=f"with --cores: a shared P over its target splits the cores when the "
                        f"busiest D's steps ran over this share (default {d.split_above:g})")
    p.add_argument("--heavy-prompt", type=float, default=d.heavy_prompt, metavar="TOKENS",
                   help=f"with --colocate: a colocated worker beside a standby D becomes P "
                        f"again only where the prompts it took in the window average this many "
                        f"tokens (its prefills stall its decode steps; default "
                        f"{d.heavy_prompt:g}, one prefill chunk at the CPU default); a P "
                        f"beside a narrow D taking shorter ones while D decodes becomes "
                        f"colocated before D misses its target")
    p.add_argument("--move-standby", action=argparse.BooleanOptionalAction,
                   default=d.move_standby,
                   help="with --colocate, where the standby D shares its cores with the "
                        "worker made colocated beside it: once that worker serves, the standby "
                        "gives it its running streams of at most --heavy-prompt tokens so far "
                        "(POST /move_streams; the proxy prefills each again there). Off by "
                        "default: on this 2-core CPU those prefills stalled the colocated "
                        "worker more than the standby's decode beside it did "
                        "(bench/RESULTS_adaptive.md run 40: 112 vs 133 of 274 met)")
    p.add_argument("--merge-in-nice-cooldown", action=argparse.BooleanOptionalAction,
                   default=d.merge_in_nice_cooldown,
                   help="with --colocate: the merge of a P beside a narrow D on light prompts "
                        "(see --heavy-prompt) is not held by --nice-cooldown, the quiet after "
                        "a priority or cores change: it reads the prompts P takes, not the "
                        "latencies that quiet waits for (default on)")


def _nices(value: str) -> tuple[int, ...]:
    """``--prefill-nices 19,10,5`` (``""``: none, priorities left alone)."""
    if not value.strip():
        return ()
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not integers separated by commas"
                                         ) from None


def _cores(value: str) -> frozenset[int]:
    """``--cores 0-1`` (``""``: none, cores left alone)."""
    if not value.strip():
        return frozenset()
    try:
        return parse_cpus(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("--cpus", "--cores")) from None


def service_from_args(args: argparse.Namespace) -> PlannerService:
    """Raises ValueError naming a bad value."""
    workers = [service_url(url, "--worker URL") for url in args.worker]
    launcher_url, bootstrap_url = (None if url is None else service_url(url, flag) for flag, url
                                   in (("--launcher-url", args.launcher_url),
                                       ("--bootstrap-url", args.bootstrap_url)))
    if args.interval <= 0 or args.launcher_timeout <= 0:
        raise ValueError("--interval and --launcher-timeout must be positive")
    if args.max_workers < 0:
        raise ValueError("--max-workers must be >= 0 (0: the planner only switches roles)")
    config = PlannerConfig(ttft_slo=args.ttft_slo, itl_slo=args.itl_slo,
                           patience=args.patience, cooldown=args.cooldown,
                           min_prefill=args.min_prefill, min_decode=args.min_decode,
                           max_step=args.max_step, colocate=args.colocate,
                           recall=args.recall, prefill_nices=args.prefill_nices,
                           nice_cooldown=args.nice_cooldown, max_workers=args.max_workers,
                           min_workers=args.min_workers, cores=args.cores,
                           share_below=args.share_below, split_above=args.split_above,
                           heavy_prompt=args.heavy_prompt, move_standby=args.move_standby,
                           merge_in_nice_cooldown=args.merge_in_nice_cooldown)
    key = api_key_from_args(args, "worker-")
    return PlannerService(Planner(config), workers=workers,
                          bootstrap_url=bootstrap_url, interval=args.interval,
                          headers=bearer(key) if key else {}, tls=tls_from_args(args),
                          dry_run=args.dry_run, paused=args.paused,
                          api_key=api_key_from_args(args), launcher_url=launcher_url,
                          launcher_timeout=args.launcher_timeout)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(stream=sys.stderr, level=args.log_level.upper(),
                        format="pd-fsm planner: %(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        service = service_from_args(args)
        uds = uds_from_args(args)
        refuse_tls_on_unix(service.tls, uds)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    port = port_from_args(args.port, uds, 0)
    return run_service(serve_until_signal, "planner", serve_planner, service, args.host, port,
                       log, uds, host=args.host, port=port, log=log, uds=uds)

