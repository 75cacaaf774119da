"""When P dies mid-pull: how long a pull from it takes to end, and how long D takes to have every
page back (``RESULTS_dead_peer.md``).

``pulls``: the transfer alone, jax.experimental.transfer between two processes on 127.0.0.1 (a D
here, a P helper process, ``tests/integration/_procs/p_server.py``). Per case, ``--runs`` runs:
when the pull returned (failed) after the event that should end it, or that it did not by its
deadline (``--deadline``, default 8 s). Cases:

* wire, killed: a 256 MiB pull on the wire when P is SIGKILLed;
* waiting, killed: a pull waiting for a registration P never makes when P is SIGKILLed;
* cached connection, P dead: P SIGKILLed first, then a pull on the connection D had open;
* new connection, library: P SIGKILLed first, then a pull on a new connection, the library's
  connect alone (``TransferServer.connect``); and the same poisoned 50 ms later
  (``_poison_connection``, what ``drop_connection`` does);
* new connection, engine: the same through ``JaxTransferKVEngine.start_pull`` (its probe);
* frozen P: a pull on the wire when P is SIGSTOPped (a hung P, or a dead host: nothing resets
  the connection); and the same with ``drop_connection`` 50 ms later.

``cluster``: the check by hand that found the bug, repeated. One P and one D (production windows
but ``--peer-timeout``) behind ``pd-fsm proxy``; per run, ``--requests`` requests through the
proxy, P SIGKILLed once D has ``--min-pulls`` pulls in flight (or ``--kill-after`` seconds in,
whichever comes first), then: when every client had its answer, and when D's pages were all back
(free + cached = total) with no room, queue or pull left. P is restarted between runs. ``--beside``
runs a second such cluster under a steady load the whole time (the contention the bug was found
under). Asserts nothing; prints one line per run and a summary.

Run: ``.venv/bin/python bench/bench_dead_peer.py pulls [--runs 5]`` and
``.venv/bin/python bench/bench_dead_peer.py cluster [--runs 20] [--beside] [--model tiny]``.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB_ON_THE_WIRE = 256
DROP_AFTER_S = 0.05


# --------------------------------------------------------------------------------------- pulls


def _pulls(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp

    from pd_fsm.jax_engine.transfer import JaxTransferKVEngine, jax_private
    from pd_fsm.jax_engine.transfer.base import PullError
    from pd_fsm.jax_engine.transfer.jax_transfer import _library_timeout, _wait_ready
    from tests.integration._procs.client import PServer, stop

    d = JaxTransferKVEngine("127.0.0.1", reaper_interval_s=None)
    deadline = args.deadline

    def spec(mib: int) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct((mib << 18,), jnp.float32, sharding=d.sharding)]

    def engine_pull(p: Any, uuid: int, mib: int) -> Callable[[], str]:
        try:
            pending = d.start_pull(p.address, uuid, spec(mib), deadline)
        except PullError:  # refused at once (the probe of a new connection)
            return lambda: "failed"

        def wait() -> str:
            try:
                pending.wait()
            except PullError as exc:
                return "timeout" if "deadline" in str(exc) else "failed"
            return "ok"
        return wait

    def library_pull(p: Any, uuid: int, poison_after: float | None) -> Callable[[], str]:
        conn = d._server.connect(p.address)
        (array,) = conn.pull(uuid, spec(1), timeout=_library_timeout(deadline))

        def wait() -> str:
            if poison_after is not None:
                time.sleep(poison_after)
                jax_private.poison(conn)
            err = _wait_ready([array], time.monotonic() + deadline, time.monotonic)
            return "ok" if err is None else "timeout" if err == "timeout" else "failed"
        return wait

    def case(name: str, run: Callable[[int], tuple[float, str]]) -> None:
        if args.cases and args.cases not in name:
            return
        took, outcomes = [], set()
        for i in range(args.runs):
            t, outcome = run(i)
            took.append(t)
            outcomes.add(outcome)
        ms = sorted(t * 1e3 for t in took)
        print(f"| {name} | {'/'.join(sorted(outcomes))} | {statistics.median(ms):.1f} | "
              f"{ms[0]:.1f}-{ms[-1]:.1f} |", flush=True)

    def uuid_of(i: int) -> int:
        return 9000 + i + random.randrange(1 << 30)

    def killed(mib: int, after: float) -> Callable[[int], tuple[float, str]]:
        """P SIGKILLed ``after`` seconds into a pull of ``mib`` MiB (0: of a registration P
        never makes): when the pull returned after the kill."""
        def run(i: int) -> tuple[float, str]:
            p = PServer(1, ["main_kv"])
            try:
                uuid = uuid_of(i)
                if mib:
                    p.call(op="register_big", uuid=uuid, mib=mib, lease_s=60)
                wait = engine_pull(p, uuid, mib or 1)
                time.sleep(after)
                t = time.monotonic()
                p.kill()
                outcome = wait()
                return time.monotonic() - t, outcome
            finally:
                p.kill()
        return run

    def dead_before(how: str) -> Callable[[int], tuple[float, str]]:
        def run(i: int) -> tuple[float, str]:
            p = PServer(1, ["main_kv"])
            try:
                uuid = uuid_of(i)
                if how == "cached":  # one pull first: the connection is open and cached
                    p.call(op="register_big", uuid=uuid, mib=1, lease_s=60)
                    engine_pull(p, uuid, 1)()
                p.kill()
                time.sleep(0.1)
                t = time.monotonic()
                if how in ("cached", "engine"):
                    wait = engine_pull(p, uuid + 1, 1)
                else:
                    wait = library_pull(p, uuid + 1, DROP_AFTER_S if how == "poisoned" else None)
                outcome = wait()
                took = time.monotonic() - t
                return took - (DROP_AFTER_S if how == "poisoned" else 0.0), outcome
            finally:
                p.kill()
        return run

    def frozen(drop: bool) -> Callable[[int], tuple[float, str]]:
        def run(i: int) -> tuple[float, str]:
            p = PServer(1, ["main_kv"])
            try:
                uuid = uuid_of(i)
                p.call(op="register_big", uuid=uuid, mib=1, lease_s=60)
                engine_pull(p, uuid, 1)()  # the connection is open
                p.call(op="register_big", uuid=uuid + 1, mib=1, lease_s=60)
                stop(p.pid)
                wait = engine_pull(p, uuid + 1, 1)
                time.sleep(DROP_AFTER_S)
                t = time.monotonic()
                if drop:
                    d.drop_connection(p.address, "bench: P lost")
                outcome = wait()
                return time.monotonic() - t, outcome
            finally:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
        return run

    print(f"# bench_dead_peer pulls; jax {jax.__version__}, {jax.default_backend()}, "
          f"{os.cpu_count()} CPUs; {args.runs} runs a case, pull deadline {deadline:g} s\n")
    print("| case | outcome | ms after the event (median) | min-max |")
    print("|---|---|---|---|")
    case(f"wire ({MIB_ON_THE_WIRE} MiB), P SIGKILLed: after the kill",
         killed(MIB_ON_THE_WIRE, 0.02))
    case("waiting for a registration, P SIGKILLed: after the kill", killed(0, 0.3))
    case("cached connection, P dead before the pull: after start_pull", dead_before("cached"))
    case("new connection (library alone), P dead before the pull: after the pull",
         dead_before("library"))
    case("the same, poisoned 50 ms in: after the poison", dead_before("poisoned"))
    case("new connection (engine: probe first), P dead before the pull: after start_pull",
         dead_before("engine"))
    case("on the wire to a frozen P (SIGSTOP): after 50 ms", frozen(drop=False))
    case("the same, drop_connection 50 ms in: after the drop", frozen(drop=True))
    d.close()


# ------------------------------------------------------------------------------------- cluster


def _cluster(args: argparse.Namespace) -> int:
    model = ["--model", args.model, "--max-running", "16"]
    if args.model == "tiny":
        model += ["--page-size", "4", "--context-length", "256"]
    windows = {"--disaggregation-peer-timeout": args.peer_timeout}
    with tempfile.TemporaryDirectory() as tmp:
        fleets = [_fleet(Path(tmp) / "main", windows, model, args.num_pages)]
        if args.beside:
            fleets.append(_fleet(Path(tmp) / "beside", windows, model, args.num_pages))
        try:
            trio.run(_runs, fleets, args)
        finally:
            for f in fleets:
                f.close()
    return 0


def _fleet(workdir: Path, windows: dict[str, float], model: list[str], pages: int) -> Any:
    from tests.integration.failure_support import Fleet

    workdir.mkdir()
    fleet = Fleet(workdir, windows=windows, model=model)
    fleet.bootstrap()
    p = fleet.prefill("p", num_pages=pages)
    d = fleet.decode("d", num_pages=pages)
    fleet.proxy("proxy", [p], [d])
    fleet.start(timeout=900)
    return fleet


def _body(i: int, args: argparse.Namespace) -> dict[str, Any]:
    words = " ".join(f"w{(i * 7 + k) % 97}" for k in range(args.prompt_words))
    return {"text": f"Request {i}: {words}",
            "sampling_params": {"max_new_tokens": args.max_tokens, "temperature": 0,
                                "ignore_eos": True}}


async def _d_state(http: httpx.AsyncClient, d: Any) -> dict[str, Any]:
    r = await http.get(f"{d.url}/server_info", timeout=10)
    return dict(r.json()["internal_states"][0])


def _idle(s: dict[str, Any]) -> bool:
    from tests.integration.failure_support import leftovers

    return not leftovers(s)


async def _load(http: httpx.AsyncClient, fleet: Any, args: argparse.Namespace) -> None:
    """The cluster beside: requests back to back, several at once, for as long as it runs."""
    async def worker(k: int) -> None:
        i = 0
        while True:
            try:
                await http.post(f"{fleet['proxy'].url}/generate", json=_body(1000 * k + i, args))
            except httpx.HTTPError:
                await trio.sleep(0.5)
            i += 1

    async with trio.open_nursery() as nursery:
        for k in range(4):
            nursery.start_soon(worker, k)


async def _runs(fleets: list[Any], args: argparse.Namespace) -> None:
    fleet = fleets[0]
    p, d, proxy = fleet["p"], fleet["d"], fleet["proxy"]
    answered, back = [], []
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, read=300.0)) as http, \
            trio.open_nursery() as outer:
        for other in fleets[1:]:
            outer.start_soon(_load, http, other, args)
        for i in range(args.warmup):  # compiles: every shape the runs will use
            with trio.fail_after(600):  # a loaded machine's first requests can fail: again
                while (r := await http.post(f"{proxy.url}/generate",
                                            json=_body(i, args))).status_code != 200:
                    print(f"warm-up request {i}: {r.status_code} {r.text[:200]}", flush=True)
                    await trio.sleep(2)
        for run in range(args.runs):
            with trio.fail_after(600):
                while not _idle(await _d_state(http, d)):
                    await trio.sleep(0.2)
            statuses: list[int] = []
            errors: list[str] = []

            async def ask(i: int, statuses: list[int] = statuses,
                          errors: list[str] = errors) -> None:
                try:
                    r = await http.post(f"{proxy.url}/generate", json=_body(i, args))
                    statuses.append(r.status_code)
                    if r.status_code != 200:
                        errors.append(r.text[:200])
                except httpx.HTTPError as exc:
                    statuses.append(0)
                    errors.append(repr(exc))

            async with trio.open_nursery() as nursery:
                for i in range(args.requests):
                    nursery.start_soon(ask, 100 * run + i)
                start = trio.current_time()
                pulls = 0
                while trio.current_time() - start < args.kill_after:
                    pulls = (await _d_state(http, d))["pd_queues"]["pulls_inflight"]
                    if pulls >= args.min_pulls:
                        break
                p.kill()
                killed = trio.current_time()
            answered_s = trio.current_time() - killed
            while True:
                s = await _d_state(http, d)
                if _idle(s):
                    break
                if trio.current_time() - killed > 300:
                    print(f"run {run}: D not idle 300 s after the kill: {s}", flush=True)
                    break
                await trio.sleep(0.05)
            back_s = trio.current_time() - killed
            answered.append(answered_s)
            back.append(back_s)
            codes = {c: statuses.count(c) for c in sorted(set(statuses))}
            print(f"run {run}: killed with {pulls} pull(s) in flight "
                  f"({killed - start:.2f} s in); every client answered {answered_s:.2f} s "
                  f"after the kill {codes}; D idle, every page back, {back_s:.2f} s after"
                  + (f"; first error: {errors[0]}" if errors else ""), flush=True)
            await trio.to_thread.run_sync(fleet.restart, "p", 600.0)
        outer.cancel_scope.cancel()
    bound = args.peer_timeout + 3.0
    print(f"\n{args.runs} runs, peer timeout {args.peer_timeout:g} s: D idle after the kill, "
          f"median {statistics.median(back):.2f} s, max {max(back):.2f} s; within the peer "
          f"timeout + 3 s: {sum(b <= bound for b in back)} of {args.runs}; clients answered "
          f"within {max(answered):.2f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    pulls = sub.add_parser("pulls", help="a pull from a dead or hung P, the transfer alone")
    pulls.add_argument("--runs", type=int, default=5)
    pulls.add_argument("--deadline", type=float, default=8.0)
    pulls.add_argument("--cases", default="", help="only the cases whose name holds this")
    cluster = sub.add_parser("cluster", help="P SIGKILLed under load, D's pages back")
    cluster.add_argument("--runs", type=int, default=20)
    cluster.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    cluster.add_argument("--num-pages", type=int, default=256)
    cluster.add_argument("--requests", type=int, default=10)
    cluster.add_argument("--max-tokens", type=int, default=32)
    cluster.add_argument("--prompt-words", type=int, default=60)
    cluster.add_argument("--peer-timeout", type=float, default=6.0)
    cluster.add_argument("--kill-after", type=float, default=2.0,
                         help="kill P this long after the requests at the latest (seconds)")
    cluster.add_argument("--min-pulls", type=int, default=1,
                         help="kill P once D has this many pulls in flight (or --kill-after)")
    cluster.add_argument("--warmup", type=int, default=4)
    cluster.add_argument("--beside", action="store_true",
                         help="a second cluster under a steady load beside this one")
    args = ap.parse_args()
    if args.what == "pulls":
        _pulls(args)
        return 0
    return _cluster(args)


if __name__ == "__main__":
    sys.exit(main())
