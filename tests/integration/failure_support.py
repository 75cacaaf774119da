"""Real `pd-fsm` processes for the failure tests: start, SIGSTOP/SIGCONT, SIGKILL, restart with
the same flags, and the checks every failure test ends with (pages, rooms, registrations).

Processes are plain ``subprocess.Popen`` children (module-scoped fixtures are synchronous; the
tests themselves are trio). Each child's output goes to a log file under the test's temporary
directory, and its last lines are attached to any failure that involves it.

Windows are short (``WINDOWS``) so every fault is detected in seconds; every wait in a test is a
deadline (the window plus generous ``SLACK``), never a performance threshold.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import attrs
import httpx
import trio

from pd_fsm.io_trio.ports import free_port, free_port_pair  # noqa: F401 (the tests' helpers)
from tests.integration._procs.client import stop

HOST = "127.0.0.1"
# Generous on purpose: 2 cores are shared with other test processes; a deadline, not a benchmark.
SLACK = 8.0

# The PD windows the failure tests run with (docs/design.md's defaults in brackets).
HEARTBEAT = 0.5  # D -> P heartbeats and registry heartbeats [5 s]
PEER_TIMEOUT = 2.0  # D: P silent this long, 2 heartbeats unanswered -> lost [15 s]
LEASE_INITIAL = 3.0  # P: KV held this long before D's first heartbeat [30 s]
LEASE_EXTENSION = 2.0  # P: each heartbeat extends the lease to now + this [20 s]
READY_TIMEOUT = 30.0  # D: waiting for READY (tests hold P's leg on purpose) [300 s]
TRANSFER_TIMEOUT = 8.0  # D: backstop for one transfer [120 s]
PULL_DEADLINE = 4.0  # D: the pull executor's own deadline [60 s]
QUEUE_TIMEOUT = 8.0  # D: waiting for free pages, then 503 [300 s]
REGISTRY_TTL = 3.0  # bootstrap: instance listed this long without a heartbeat [15 s]

WINDOWS: dict[str, float] = {
    "--disaggregation-bootstrap-heartbeat-interval": HEARTBEAT,
    "--disaggregation-bootstrap-heartbeat-ttl": REGISTRY_TTL,
    "--disaggregation-peer-timeout": PEER_TIMEOUT,
    "--disaggregation-lease-initial": LEASE_INITIAL,
    "--disaggregation-lease-extension": LEASE_EXTENSION,
    "--disaggregation-ready-timeout": READY_TIMEOUT,
    "--disaggregation-transfer-timeout": TRANSFER_TIMEOUT,
    "--disaggregation-pull-deadline": PULL_DEADLINE,
    "--disaggregation-queue-timeout": QUEUE_TIMEOUT,
}

PAGE_SIZE = 4
# The tiny model everywhere; page size and model seed must match between P, D and colocated.
TINY = ["--model", "tiny", "--page-size", str(PAGE_SIZE), "--max-running", "8",
        "--max-batched-tokens", "256", "--context-length", "256"]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pd_fsm.cli", *args]


# The order ``stop_all`` stops processes in: routers, workers, bootstrap server.
ROUTER_TIER, WORKER_TIER, REGISTRY_TIER = 0, 1, 2
STOP_TIERS = (ROUTER_TIER, WORKER_TIER, REGISTRY_TIER)


@attrs.define(eq=False)
class Proc:
    """One child process, restartable with exactly the same argv."""

    name: str
    argv: list[str]
    log_path: Path
    url: str | None = None  # HTTP base URL that answers GET /health with 200 once ready
    base: str | None = None  # HTTP base URL of a process without our /health (a router)
    bootstrap_port: int | None = None  # P: the port routers and D know it by (side channel)
    popen: subprocess.Popen[bytes] | None = None
    pids: list[int] = attrs.field(factory=list)  # every pid this Proc has had, in order
    tier: int = WORKER_TIER  # when ``stop_all`` stops it (STOP_TIERS)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"==== start: {' '.join(self.argv)}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        self.pids.append(self.popen.pid)

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def pause(self) -> None:
        """SIGSTOP: freezes the process at a known stage (its sockets stay open); returns once
        it is stopped."""
        stop(self.pid)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the process dies without any cleanup of its own."""
        assert self.popen is not None
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(30)

    def stop(self, grace: float = 10.0) -> None:
        self.terminate()
        self.reap(grace)

    def terminate(self) -> None:
        """SIGTERM (after a SIGCONT: a paused child cannot act on SIGTERM), if alive."""
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGCONT)
        self.popen.terminate()

    def reap(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for it to exit, then SIGKILL it."""
        if self.popen is None:
            return
        try:
            self.popen.wait(max(grace, 0.0))
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(30)

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        # Registry heartbeats (two a second per worker) would drown everything else.
        lines = [line for line in lines if "/heartbeat" not in line]
        return "\n".join(f"[{self.name}] {line}" for line in lines[-n:])


def stop_all(procs: Iterable[Proc], grace: float = 10.0) -> None:
    """Stop ``procs`` in tiers, as `pd-fsm cluster` stops its children (cluster/local.py): the
    routers first (no new rooms), then the workers, the bootstrap server last (the workers
    deregister from a registry still there); a tier at once, each given ``grace`` seconds. One
    at a time, a module's teardown paid every process's exit in turn."""
    procs = list(procs)
    for tier in STOP_TIERS:
        level = [p for p in procs if p.tier == tier]
        for p in level:
            p.terminate()
        deadline = time.monotonic() + grace
        for p in level:
            p.reap(deadline - time.monotonic())


def wait_healthy(procs: Iterable[Proc], timeout: float = 240.0) -> None:
    """Block until every proc's /health answers 200; fail with the log tail of any that died."""
    pending = [p for p in procs if p.url is not None]
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as http:
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited with {p.popen and p.popen.returncode}"
                                       f":\n{p.tail()}")
                try:
                    if http.get(f"{p.url}/health").status_code == 200:
                        pending.remove(p)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                tails = "\n".join(p.tail() for p in pending)
                raise RuntimeError(f"not healthy within {timeout:g} s:\n{tails}")
            if pending:
                time.sleep(0.2)


class Fleet:
    """Named processes sharing one bootstrap server and (optionally) one cluster secret."""

    def __init__(self, workdir: Path, *, secret: bool = False,
                 windows: dict[str, float] | None = None, ttl: float = REGISTRY_TTL,
                 model: list[str] | None = None) -> None:
        """``windows``: the PD flags every worker gets (default: the short ``WINDOWS``; ``{}``
        for the production defaults); ``ttl``: the registry's; ``model``: the workers' model
        flags (default ``TINY``; benches run SmolLM2)."""
        self.dir = workdir
        self.model = TINY if model is None else model
        self.windows = WINDOWS if windows is None else windows
        self.ttl = ttl
        self.procs: dict[str, Proc] = {}
        self.boot_port = free_port()
        self.secret: bytes | None = None
        self.secret_file: Path | None = None
        if secret:
            self.secret = secrets.token_hex(16).encode()
            self.secret_file = workdir / "cluster.secret"
            self.secret_file.write_bytes(self.secret + b"\n")

    def __getitem__(self, name: str) -> Proc:
        return self.procs[name]

    @property
    def boot_url(self) -> str:
        return f"http://{HOST}:{self.boot_port}"

    def _add(self, name: str, argv: list[str], url: str | None, **kw: Any) -> Proc:
        proc = Proc(name, argv, self.dir / f"{name}.log", url, **kw)
        self.procs[name] = proc
        return proc

    def _secret_args(self, flag: str) -> list[str]:
        return [flag, str(self.secret_file)] if self.secret_file is not None else []

    def bootstrap(self, name: str = "bootstrap") -> Proc:
        argv = cli("bootstrap", "--host", HOST, "--port", str(self.boot_port),
                   "--ttl", str(self.ttl), *self._secret_args("--secret-file"))
        return self._add(name, argv, self.boot_url, tier=REGISTRY_TIER)

    def _worker(self, name: str, mode: str, num_pages: int, extra: list[str]) -> tuple[
            list[str], str]:
        port = free_port()
        argv = cli("serve", *self.model, "--host", HOST, "--port", str(port),
                   "--num-pages", str(num_pages), "--disaggregation-mode", mode,
                   "--disaggregation-bootstrap-host", HOST,
                   "--disaggregation-bootstrap-port", str(self.boot_port),
                   *[str(x) for kv in self.windows.items() for x in kv],
                   *self._secret_args("--cluster-secret-file"), *extra)
        return argv, f"http://{HOST}:{port}"

    def prefill(self, name: str, num_pages: int = 64, extra: list[str] | None = None) -> Proc:
        side = free_port()
        argv, url = self._worker(name, "prefill", num_pages,
                                 ["--disaggregation-side-channel-port", str(side),
                                  *(extra or [])])
        return self._add(name, argv, url, bootstrap_port=side)

    def decode(self, name: str, num_pages: int = 64, extra: list[str] | None = None) -> Proc:
        argv, url = self._worker(name, "decode", num_pages, extra or [])
        return self._add(name, argv, url)

    def colocated(self, name: str = "colocated", extra: list[str] | None = None) -> Proc:
        port = free_port()
        argv = cli("serve", *self.model, "--host", HOST, "--port", str(port), "--num-pages",
                   "64", "--disaggregation-mode", "null", *(extra or []))
        return self._add(name, argv, f"http://{HOST}:{port}")

    def proxy(self, name: str, prefill: list[Proc], decode: list[Proc],
              extra: list[str] | None = None) -> Proc:
        port = free_port()
        argv = cli("proxy", "--host", HOST, "--port", str(port), *(extra or []))
        for p in prefill:
            argv += ["--prefill", str(p.url), str(p.bootstrap_port)]
        for d in decode:
            argv += ["--decode", str(d.url)]
        return self._add(name, argv, f"http://{HOST}:{port}", tier=ROUTER_TIER)

    def planner(self, name: str, workers: list[Proc], extra: list[str] | None = None) -> Proc:
        """``pd-fsm planner`` observing ``workers`` (and switching their roles)."""
        port = free_port()
        argv = cli("planner", "--host", HOST, "--port", str(port), *(extra or []))
        for w in workers:
            argv += ["--worker", str(w.url)]
        return self._add(name, argv, f"http://{HOST}:{port}", tier=ROUTER_TIER)

    def sglang_router(self, name: str, prefill: Proc, decode: Proc) -> Proc:
        """The real sglang-router (PyPI) in PD mode over one P and one D; it has no /health of
        ours to wait on: ready once it relays a request (``wait_relays``)."""
        port, metrics = free_port(), free_port()
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                "--prefill", str(prefill.url), str(prefill.bootstrap_port),
                "--decode", str(decode.url), "--host", HOST, "--port", str(port),
                "--policy", "round_robin", "--prometheus-host", HOST,
                "--prometheus-port", str(metrics)]
        proc = self._add(name, argv, None, tier=ROUTER_TIER)
        proc.base = f"http://{HOST}:{port}"
        return proc

    def start(self, timeout: float = 240.0) -> None:
        """Start every process not started yet (the bootstrap server first), wait for health."""
        fresh = [p for p in self.procs.values() if p.popen is None]
        for p in sorted(fresh, key=lambda p: p.name != "bootstrap"):
            p.start()
        try:
            wait_healthy(fresh, timeout)
        except BaseException:
            self.close()
            raise

    def restart(self, name: str, timeout: float = 120.0) -> None:
        """SIGKILL (if alive) and start again with the same argv, ports included."""
        proc = self.procs[name]
        if proc.alive():
            proc.kill()
        proc.start()
        wait_healthy([proc], timeout)

    def close(self) -> None:
        stop_all(self.procs.values())

    def tails(self) -> str:
        return "\n".join(p.tail(25) for p in self.procs.values())


# ----------------------------------------------------------------------------- requests

async def freeze_streaming_decode(http: httpx.AsyncClient, decodes: list[Proc]) -> Proc | None:
    """Freeze every D and find the one holding a request (thawing each alone for its
    /get_load); every D is left frozen, so what the caller does next lands mid-stream. None,
    with every D thawed again, when none holds one: the stream was decoded to its end before
    the freeze landed (the tiny model decodes a 150-token stream's last 144 tokens in ~0.13 s;
    a client descheduled that long on a loaded 2-core machine reads its 6th event after that,
    seen in CI). ``stream_acting_midway`` then runs the stream again."""
    for d in decodes:
        os.kill(d.pid, signal.SIGSTOP)
    victim = None
    try:
        for d in decodes:
            os.kill(d.pid, signal.SIGCONT)
            r = await http.get(f"{d.url}/get_load", timeout=10)
            busy = sum(int(rank["num_reqs"]) for rank in r.json())
            os.kill(d.pid, signal.SIGSTOP)
            if busy and victim is None:
                victim = d
    except BaseException:  # a D left frozen would fail every later test of the module
        victim = None
        raise
    finally:
        if victim is None:
            for d in decodes:
                os.kill(d.pid, signal.SIGCONT)
    return victim


async def signal_streaming_decode(http: httpx.AsyncClient, decodes: list[Proc],
                                  how: signal.Signals = signal.SIGKILL) -> Proc | None:
    """Signal the D holding a request (SIGKILL; a SIGTERM waits for the thaw) while every D is
    frozen, then let the others go on: the signal lands mid-stream, whatever the speeds. None
    when none held one (``freeze_streaming_decode``): nothing signalled."""
    victim = await freeze_streaming_decode(http, decodes)
    if victim is None:
        return None
    if how == signal.SIGKILL:
        victim.kill()
    else:
        os.kill(victim.pid, how)
    for d in decodes:
        if d.alive():
            os.kill(d.pid, signal.SIGCONT)
    return victim


def leg(room: int, input_ids: list[int], max_new_tokens: int, prefill: Proc, *,
        rid: str | None = None, stream: bool = False) -> dict[str, Any]:
    """The body a PD router posts to both legs of ``room`` (the test is the router here)."""
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "stream": stream,
        "rid": rid or f"room-{room:x}",
        "bootstrap_host": HOST,
        "bootstrap_port": prefill.bootstrap_port,
        "bootstrap_room": room,
    }


async def both_legs(http: httpx.AsyncClient, p: Proc, d: Proc, body: dict[str, Any]
                         ) -> tuple[httpx.Response, httpx.Response]:
    """P's and D's answers to ``body`` (``leg``), both legs posted at once as a router does."""
    out: dict[str, httpx.Response] = {}

    async def post(name: str, proc: Proc) -> None:
        out[name] = await http.post(f"{proc.url}/generate", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "p", p)
        nursery.start_soon(post, "d", d)
    return out["p"], out["d"]


async def d_leg_first(http: httpx.AsyncClient, p: Proc, d: Proc, body: dict[str, Any]
                   ) -> tuple[httpx.Response, httpx.Response]:
    """Both legs, D's first: P takes its leg only once D's hello has reached it (P holds a
    room in EARLY_PEER: none other may be there), so that D is bound before P's first chunk.
    The tiny model prefills a prompt in milliseconds, faster than D resolves P and says hello;
    a real prompt's prefill takes far longer (the router's order, both at once, streams too)."""
    out: dict[str, httpx.Response] = {}

    async def post(name: str, proc: Proc) -> None:
        out[name] = await http.post(f"{proc.url}/generate", json=body)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "d", d)
        with trio.fail_after(SLACK):
            while not (await stats(http, p)).get("kvpoll", {}).get("state_EARLY_PEER"):
                await trio.sleep(0.02)
        nursery.start_soon(post, "p", p)
    return out["p"], out["d"]


async def refused_by_name(http: httpx.AsyncClient, p: Proc, d: Proc, input_ids: list[int]
                          ) -> str:
    """D refuses a PD request for a P it must not use (its registry record says why): D's leg is
    a JSON error, P's leg ends too (no D ever claims the room), nothing is pulled, and both hold
    nothing afterwards. D's message, for the test to check it names the reason."""
    before = (await stats(http, d))["transfer"]
    p_r, d_r = await both_legs(http, p, d, leg(new_room(), input_ids, 4, p))
    assert d_r.status_code >= 400, d_r.text
    assert p_r.status_code >= 400, p_r.text
    assert (await stats(http, d))["transfer"] == before  # nothing pulled
    await wait_clean(http, p, d, timeout=SLACK)
    return error_message(d_r)


def warm_pd(prefills: list[Proc], decode: Proc, lengths: tuple[int, ...]) -> None:
    """One PD request per (P, prompt length), both legs at once: every P compiles the prefill
    and gather shapes the tests will use before any test holds it to a 3 s lease (a cold
    compile on a loaded 2-core machine can take longer than that)."""

    async def one(http: httpx.AsyncClient, p: Proc, n: int) -> None:
        body = leg(new_room(), prompt(n, seed=99), 2, p)
        async def post(url: str) -> None:
            r = await http.post(url, json=body)
            assert r.status_code == 200, f"warm-up {url}: {r.text}"

        async with trio.open_nursery() as nursery:
            for proc in (p, decode):
                nursery.start_soon(post, f"{proc.url}/generate")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
            for p in prefills:
                for n in lengths:
                    await one(http, p, n)

    trio.run(main)


def new_room() -> int:
    return secrets.randbits(63)


def prompt(n: int, seed: int = 0) -> list[int]:
    """``n`` token ids well inside the tiny model's vocabulary, different per seed."""
    return [(7 + 13 * i + 31 * seed) % 250 + 3 for i in range(n)]


async def greedy(http: httpx.AsyncClient, colocated: Proc, input_ids: list[int],
                 max_new_tokens: int) -> list[int]:
    """The colocated worker's greedy answer: what every PD answer must equal."""
    r = await http.post(f"{colocated.url}/generate", json={
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


async def proxied_and_greedy(http: httpx.AsyncClient, fleet: Fleet, seed: int,
                             proxy: str = "proxy") -> tuple[list[int], list[int]]:
    """One greedy prompt through ``fleet``'s proxy (``proxy`` names it) and to its colocated
    reference: the two answers' token ids (the proxy's answered 200)."""
    ids = prompt(10, seed=seed)
    r = await http.post(f"{fleet[proxy].url}/generate", json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"]), await greedy(http, fleet["colocated"], ids, 6)


async def prefill_record(http: httpx.AsyncClient, fleet: Fleet, p: Proc) -> dict[str, Any]:
    """``p``'s record in ``fleet``'s registry, found by its side-channel address (a fleet may
    list other prefill workers too)."""
    listed = (await http.get(f"{fleet.boot_url}/list", params={"role": "prefill"})).json()
    mine = [r for r in listed["instances"] if r["zmq_addr"] == f"{HOST}:{p.bootstrap_port}"]
    assert len(mine) == 1, (p.name, listed)
    return dict(mine[0])


def error_message(r: httpx.Response) -> str:
    """The message of a JSON error body (asserts the body is one)."""
    body = r.json()
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), r.text
    message = body["error"]["message"]
    assert isinstance(message, str) and message, r.text
    return message


# ----------------------------------------------------------------------------- state checks

class Reachable(Protocol):
    """A worker the checks read over HTTP: a ``Proc``, or one that ``pd-fsm cluster`` started."""

    @property
    def name(self) -> str: ...

    @property
    def url(self) -> str | None: ...


async def stats(http: httpx.AsyncClient, proc: Reachable) -> dict[str, Any]:
    """The backend's stats() as /server_info reports them."""
    r = await http.get(f"{proc.url}/server_info")
    r.raise_for_status()
    return dict(r.json()["internal_states"][0])


async def stream_acting_midway(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                               act: Callable[[], Awaitable[bool]], attempts: int = 5) -> bytes:
    """The client's whole SSE stream of ``body`` POSTed to ``url`` (a 200); ``act`` runs once,
    six events in, the stream waiting meanwhile. ``act`` answers whether it landed mid-stream;
    when not (every worker had already decoded the stream to its end:
    ``freeze_streaming_decode``), the stream is read to its end and POSTed again, ``attempts``
    times in all."""
    for _ in range(attempts):
        raw, acted, landed = b"", False, False
        async with http.stream("POST", url, json=body) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                raw += chunk
                if not acted and raw.count(b"data: ") >= 6:
                    acted = True
                    landed = await act()
        assert acted, f"the stream ended before its 6th event: {raw[-500:]!r}"
        if landed:
            return raw
    raise AssertionError(f"{attempts} streams of {url} were each decoded to their end before "
                         "the 6th event reached the client: nothing held one mid-stream")


async def proxy_counts(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    """Our proxy's ``rooms_reopened_total`` and ``handoffs_total``, as "family:key"."""
    r = await http.get(f"{url}/metrics")
    r.raise_for_status()
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        for family in ("rooms_reopened_total", "handoffs_total"):
            if line.startswith(f"pd_fsm_proxy_{family}{{"):
                key = line.split('key="')[1].split('"')[0]
                out[f"{family}:{key}"] = float(line.rsplit(" ", 1)[1])
    return out


def kvpoll(s: dict[str, Any], state: str) -> int:
    return int(s.get("kvpoll", {}).get(f"state_{state}", 0))


T = TypeVar("T")


async def wait_until(check: Callable[[], Awaitable[T | None]], timeout: float, what: str,
                     *, interval: float = 0.05) -> tuple[T, float]:
    """Poll ``check`` until it returns something other than None; (value, seconds waited)."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        while True:
            value = await check()
            if value is not None:
                return value, trio.current_time() - start
            await trio.sleep(interval)
    raise AssertionError(f"not within {timeout:g} s: {what}")


async def wait_routed_as_decode(http: httpx.AsyncClient, proxy: Proc, decodes: list[Proc]
                                ) -> None:
    """Until our proxy routes every one of ``decodes`` as a decode worker: it learns a restart or
    a switch back only at its next probe, and a test that starts before that finds a D missing
    from its list (seen in CI: a hand-off room sent straight to the live D, not the dead one
    the test lists first)."""
    urls = {str(d.url) for d in decodes}

    async def routed() -> bool | None:
        workers = (await http.get(f"{proxy.url}/workers")).json()
        return True if urls <= set(workers["decode"]) else None

    await wait_until(routed, SLACK * 2, f"the proxy routing {sorted(urls)} as decode")


def leftovers(s: dict[str, Any]) -> list[str]:
    """What a worker still holds for requests; empty when it is back to idle."""
    out = []
    # Pages held by the prefix cache alone are no request's (evicted when wanted).
    if s.get("free_pages", 0) + s.get("cached_pages", 0) != s.get("total_pages"):
        out.append(f"pages free {s.get('free_pages')} (+{s.get('cached_pages', 0)} cached) "
                   f"of {s.get('total_pages')}")
    for key in ("waiting", "prefilling", "running", "queued", "live_requests"):
        if s.get(key):
            out.append(f"{key} {s[key]}")
    live = {k: v for k, v in s.get("kvpoll", {}).items() if v}
    if live:
        out.append(f"rooms {live}")
    if s.get("pd_events", {}).get("rooms_live"):
        out.append(f"rooms_live {s['pd_events']['rooms_live']}")
    queues = {k: v for k, v in s.get("pd_queues", {}).items() if v}
    if queues:
        out.append(f"queues {queues}")
    if s.get("transfer_registrations"):
        out.append(f"transfer registrations {s['transfer_registrations']}")
    return out


async def wait_clean(http: httpx.AsyncClient, *procs: Reachable, timeout: float) -> float:
    """Wait until every worker in ``procs`` holds nothing (all pages free, no room, no queue,
    no transfer registration); seconds waited. Fails naming what is still held."""
    start = trio.current_time()
    last: dict[str, list[str]] = {}
    with trio.move_on_after(timeout):
        while True:
            last = {p.name: leftovers(await stats(http, p)) for p in procs}
            if not any(last.values()):
                return trio.current_time() - start
            await trio.sleep(0.05)
    raise AssertionError(f"not clean within {timeout:g} s: {last}")


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket the process owns (from /proc)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            found.append((_ip(hex_addr, width), int(hex_port, 16)))
    return found


def _ip(hex_addr: str, width: int) -> str:
    raw = bytes.fromhex(hex_addr)
    if width == 8:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6: four little-endian 32-bit words.
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)
