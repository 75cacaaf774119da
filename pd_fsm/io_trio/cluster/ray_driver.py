"""`pd-fsm cluster --ray [ADDRESS]`'s driver: connect to Ray, start the services as actors
(``ray_cluster.RayCluster``), then print their output and watch them until Ctrl-C or SIGTERM (or
answer ``--ask``), and stop them in tiers. With ``--max-workers N`` it also serves the launcher
(``ray_launcher``), in a thread of its own, from before the services start.

Apart from ``ray_cluster``: every Ray actor process imports that module (for ``ServiceActor``),
and only the driver needs trio, httpx and the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from typing import Any

import trio

from pd_fsm.io_trio.cluster.ask import ask
from pd_fsm.io_trio.cluster.ray_cluster import STOP_GRACE, RayCluster, RayLaunchError
from pd_fsm.io_trio.cluster.ray_launcher import LauncherThread, launcher_thread

# The launcher's loop ends within this once cancelled (its actor calls are abandoned then: the
# tiered stop that follows stops every actor).
LAUNCHER_CLOSE_S = STOP_GRACE


def main(args: argparse.Namespace, worker_argv: list[str], quiet: list[str]) -> int:
    """Run the cluster on Ray until Ctrl-C / SIGTERM (or ``--ask`` is answered)."""
    try:
        import ray
    except ImportError:
        print("pd-fsm cluster: --ray needs Ray: pip install 'pd_fsm[ray]'", file=sys.stderr)
        return 2
    if args.tls:
        print("pd-fsm cluster: --tls is not supported with --ray yet (each node needs its own "
              "certificate)", file=sys.stderr)
        return 2
    if args.api_key_file is not None:
        # The key file would have to exist on every node; refuse rather than start unkeyed.
        print("pd-fsm cluster: --api-key-file is not supported with --ray yet", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=args.ray, log_to_driver=False, namespace="pd_fsm",
             configure_logging=False)
    cluster: RayCluster | None = None
    launcher: LauncherThread | None = None
    status = 0

    def _stop(signum: int, _frame: Any) -> None:
        print(f"pd-fsm cluster: {signal.Signals(signum).name}, stopping", flush=True)
        if cluster is not None:
            cluster.stop_requested = True
        raise KeyboardInterrupt

    old = {s: signal.signal(s, _stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        cluster = RayCluster(args, worker_argv, quiet)
        if args.max_workers:
            launcher = launcher_thread(cluster, args)
            launcher.start()
        cluster.start()
        if launcher is not None:
            launcher.ready(cluster.urls()["proxy"])
            print(f"  {'launcher':<12} {launcher.url}  ({launcher.launcher.extra})", flush=True)
        if args.ask is not None:
            status = trio.run(ask, cluster.urls(), args.ask, args.max_tokens, {})
        else:
            cluster.monitor(launcher.failure if launcher is not None else lambda: None)
    except KeyboardInterrupt:
        pass
    except RayLaunchError as exc:
        print(f"pd-fsm cluster: FAILED: {exc}", file=sys.stderr, flush=True)
        status = 1
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        with contextlib.suppress(KeyboardInterrupt):
            if launcher is not None:
                launcher.close(LAUNCHER_CLOSE_S)
            if cluster is not None:
                cluster.stop()
        print("pd-fsm cluster: stopped", flush=True)
        ray.shutdown()
    return status
