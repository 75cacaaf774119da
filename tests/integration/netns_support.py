"""Two hosts on one machine: network namespaces joined by a veth pair (docs/design.md, "Facts
the design rests on").

``Hosts`` makes namespaces A and B with addresses from 10.77.0.0/24 and removes them (after
killing whatever still runs in them). Processes go in with ``ip netns exec``. The test process
itself stays in the root namespace and can reach neither, so HTTP calls to the namespaces go
through ``NsClient``: a small child process inside one namespace that runs the requests it is sent
(several at once, each with its own timeout) and answers with status, body and elapsed time.

``Hosts.shape`` puts a token bucket (``tc``'s ``tbf``) on both ends of the veth pair, so the link is
as slow as a real one (1 or 10 Gbit/s); ``raw_socket_seconds`` times a plain TCP stream across it,
the baseline a KV pull on the same link is compared with (issue 31 §2).

Only the namespaces' own addresses are contacted.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # for the annotation only: NsFleet imports failure_support when made
    from tests.integration.failure_support import Proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    tc = shutil.which("tc") or "/usr/sbin/tc"  # /usr/sbin is not on every root PATH
    return subprocess.run(["ip", "netns", "exec", ns, tc, *args], capture_output=True, text=True,
                          check=check, timeout=30)


class ShapingUnavailable(RuntimeError):
    """``tc`` is missing, or the kernel refused the qdisc: the message is the skip reason."""


def tbf_burst_bytes(rate_bps: float) -> int:
    """The token bucket's depth for ``rate_bps`` (bits/s).

    One millisecond of the rate, and never under 64 KiB: veth hands the qdisc GSO super-packets
    of up to 64 KiB, and a bucket shallower than a packet makes tbf split every one (or drop it),
    which slows the link below its rate; deeper than ~1 ms and the first bytes of every pull go
    out at memory speed, which flatters short transfers (the bucket is what a NIC's line rate
    does not have). At 1 Gbit/s that is 125 kB (1 ms), at 10 Gbit/s 1.25 MB (1 ms)."""
    return max(64 * 1024, int(rate_bps / 8 / 1000))


# How long a packet may wait in the bucket's queue before tbf drops it (tc's ``latency``):
# enough for a TCP window in flight at these rates (25 ms is 3 MB at 1 Gbit/s), so the sender is
# paced by the bucket rather than by drops and retransmissions.
TBF_LATENCY = "25ms"


def namespaces_unavailable() -> str | None:
    """Why this machine cannot make namespaces (the test's skip reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    probe = f"pdfsm-probe-{uuid.uuid4().hex[:6]}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


CLONE_NEWNET = 0x40000000  # <sched.h>: setns(2)'s network-namespace type


def enter_namespace(ns: str) -> None:
    """Move the calling process into network namespace ``ns`` (as ``ip netns exec`` does, without
    its /sys remount): for a child spawned by ``multiprocessing`` that keeps its pipe to the
    parent (a pipe is no network). Call it first, before any thread starts: ``setns`` moves the
    calling thread only, and threads made afterwards inherit its namespace."""
    import ctypes

    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)


@attrs.define
class Hosts:
    """Namespaces ``a`` and ``b`` (10.77.0.1 and 10.77.0.2) on veth ends ``if_a`` / ``if_b``."""

    a: str
    b: str
    if_a: str
    if_b: str
    ip_a: str = "10.77.0.1"
    ip_b: str = "10.77.0.2"

    @classmethod
    def make(cls) -> Hosts:
        tag = uuid.uuid4().hex[:6]
        hosts = cls(f"pdfsm-a-{tag}", f"pdfsm-b-{tag}", f"pva{tag}", f"pvb{tag}")
        try:
            for ns in (hosts.a, hosts.b):
                _ip("netns", "add", ns)
            _ip("link", "add", hosts.if_a, "type", "veth", "peer", "name", hosts.if_b)
            for ns, dev, addr in ((hosts.a, hosts.if_a, hosts.ip_a),
                                  (hosts.b, hosts.if_b, hosts.ip_b)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            hosts.remove()
            raise
        return hosts

    def name_each_host(self) -> None:
        """Make this machine's host name resolve, inside each namespace, to that namespace's own
        address, as on real hosts (``ip netns exec`` mounts ``/etc/netns/NS/hosts`` over
        ``/etc/hosts``). Gloo's collectives bind the address the host name resolves to."""
        name = socket.gethostname()
        for ns, addr in ((self.a, self.ip_a), (self.b, self.ip_b)):
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{addr} {name}\n")

    def exec(self, ns: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def link(self, up: bool) -> None:
        """Partition (down) or heal (up) the link, from A's end.

        Healing returns once both ends have carrier again, with both neighbour caches flushed:
        during the partition B's entry for A went FAILED, and until it is probed again a connect
        from B fails at once with "No route to host" (a CI run hit exactly that right after the
        link came back up)."""
        _ip("-n", self.a, "link", "set", self.if_a, "up" if up else "down")
        if not up:
            return
        deadline = time.monotonic() + 10
        while not all("LOWER_UP" in _ip("-n", ns, "link", "show", dev).stdout
                      for ns, dev in ((self.a, self.if_a), (self.b, self.if_b))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.if_a}/{self.if_b} have no carrier 10 s after link up")
            time.sleep(0.05)
        for ns in (self.a, self.b):
            _ip("-n", ns, "neigh", "flush", "all", check=False)

    def shape(self, rate_bps: float | None) -> None:
        """Limit both directions of the link to ``rate_bps`` bits/s with a ``tbf`` on each veth
        end (a root qdisc shapes what leaves its interface: A's end carries the KV from P to D,
        B's the requests and heartbeats back); ``None`` removes both (the veth's own speed).
        Raises :class:`ShapingUnavailable` with ``tc``'s own words where it cannot be done."""
        if shutil.which("tc") is None and not Path("/usr/sbin/tc").exists():
            raise ShapingUnavailable("the `tc` tool (iproute2) is not installed")
        for ns, dev in ((self.a, self.if_a), (self.b, self.if_b)):
            if rate_bps is None:
                _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)  # none there: fine
                continue
            done = _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                       "rate", f"{int(rate_bps)}bit", "burst", str(tbf_burst_bytes(rate_bps)),
                       "latency", TBF_LATENCY, check=False)
            if done.returncode != 0:
                raise ShapingUnavailable(f"`tc qdisc replace ... tbf` failed on {dev}: "
                                         f"{(done.stderr or done.stdout).strip()}")

    def netem_missing(self) -> str | None:
        """Why added latency (``netem``) cannot be had on this kernel, or None: tried on B's end
        and removed at once."""
        done = _tc(self.b, "qdisc", "add", "dev", self.if_b, "root", "netem", "delay", "1ms",
                   check=False)
        if done.returncode != 0:
            return f"`tc qdisc add ... netem` failed: {(done.stderr or done.stdout).strip()}"
        _tc(self.b, "qdisc", "del", "dev", self.if_b, "root", check=False)
        return None

    def raw_socket_seconds(self, nbytes: int, timeout: float = 120) -> float:
        """Seconds a plain TCP stream takes to carry ``nbytes`` from A to B (the direction of
        the KV): a receiver in B times from its first byte in to its last."""
        recv = subprocess.Popen(self.exec(self.b, [sys.executable, "-c", _RAW_RECEIVER,
                                                   self.ip_b, str(nbytes)]),
                                stdout=subprocess.PIPE, text=True)
        try:
            assert recv.stdout is not None
            port = recv.stdout.readline().strip()
            if not port.isdigit():
                raise RuntimeError(f"the raw-socket receiver did not start: {port!r}")
            subprocess.run(self.exec(self.a, [sys.executable, "-c", _RAW_SENDER, self.ip_b, port,
                                              str(nbytes)]), check=True, timeout=timeout)
            out, _ = recv.communicate(timeout=timeout)
            return float(out)
        finally:
            if recv.poll() is None:
                recv.kill()
                recv.wait()

    def pids(self, ns: str) -> list[int]:
        out = _ip("netns", "pids", ns, check=False).stdout.split()
        return [int(p) for p in out if p.isdigit()]

    def remove(self) -> None:
        """Kill what still runs in either namespace, then delete both (the veth pair goes with
        them)."""
        for ns in (self.a, self.b):
            for pid in self.pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(self.pids(ns) for ns in (self.a, self.b)) and time.monotonic() < deadline:
            time.sleep(0.1)
        for ns in (self.a, self.b):
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


_RAW_RECEIVER = r"""
import socket, sys, time
host, n = sys.argv[1], int(sys.argv[2])
srv = socket.create_server((host, 0))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
buf = memoryview(bytearray(1 << 20))
first = got = conn.recv_into(buf)
t = time.perf_counter()  # from the first bytes in: the connection's set-up is not the link's
while got < n:
    k = conn.recv_into(buf)
    if not k:
        raise SystemExit(f"sender closed after {got} of {n} bytes")
    got += k
# The seconds for all n bytes at the rate the bytes after the first read came in.
print((time.perf_counter() - t) * n / max(1, n - first), flush=True)
"""

_RAW_SENDER = r"""
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
chunk = bytes(1 << 20)
with socket.create_connection((host, port), timeout=60) as s:
    left = n
    while left:
        left -= s.send(memoryview(chunk)[: min(left, len(chunk))])
"""

_CLIENT = r"""
import concurrent.futures, json, ssl, sys, time
import httpx

def one(req):
    t0 = time.monotonic()
    ca = req.get("ca")  # verify HTTPS against this CA file
    verify = ssl.create_default_context(cafile=ca) if ca else True
    first = None  # a streamed answer: seconds to its first event (time to first token)
    try:
        with httpx.Client(timeout=req.get("timeout", 30), verify=verify) as http:
            with http.stream(req["method"], req["url"], json=req.get("json"),
                             content=req.get("content")) as r:
                parts = []
                for chunk in r.iter_text():
                    if first is None and "data: {" in chunk:
                        first = time.monotonic() - t0
                    parts.append(chunk)
        return {"status": r.status_code, "body": "".join(parts), "first": first,
                "elapsed": time.monotonic() - t0}
    except (httpx.HTTPError, ssl.SSLError) as exc:
        return {"status": None, "body": f"{type(exc).__name__}: {exc}",
                "elapsed": time.monotonic() - t0}

pool = concurrent.futures.ThreadPoolExecutor(64)
for line in sys.stdin:
    reqs = json.loads(line)
    print(json.dumps(list(pool.map(one, reqs))), flush=True)
"""


def _end(proc: subprocess.Popen[str]) -> None:
    """Close a helper's stdin (its signal to finish) and reap it; kill it if it lingers."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_SNIFFER = r"""
import socket, sys
# Every frame on one interface, as a packet capture would see it (AF_PACKET, root in the
# namespace), appended to a file until stdin closes.
iface, out = sys.argv[1], sys.argv[2]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
s.bind((iface, 0))
s.settimeout(0.1)
print("capturing", flush=True)
import select
with open(out, "wb") as f:
    while True:
        try:
            frame = s.recv(65536)
            f.write(len(frame).to_bytes(4, "big") + frame)
        except socket.timeout:
            pass
        if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
            break
"""


class Sniffer:
    """A packet capture of one interface inside a namespace, without tcpdump: every frame the
    interface sees (both directions), appended raw to ``path`` until ``stop``."""

    def __init__(self, hosts: Hosts, ns: str, iface: str, path: Path) -> None:
        self.path = path
        self.proc = subprocess.Popen(
            hosts.exec(ns, [sys.executable, "-c", _SNIFFER, iface, str(path)]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "capturing"

    def stop(self) -> list[bytes]:
        """The captured Ethernet frames, in order."""
        _end(self.proc)
        raw, frames, at = self.path.read_bytes(), [], 0
        while at + 4 <= len(raw):
            n = int.from_bytes(raw[at:at + 4], "big")
            frames.append(raw[at + 4:at + 4 + n])
            at += 4 + n
        return frames


def tcp_ports(frames: list[bytes]) -> set[int]:
    """Source and destination ports of the IPv4 TCP segments among Ethernet ``frames``."""
    ports: set[int] = set()
    for f in frames:
        if len(f) < 34 or f[12:14] != b"\x08\x00" or f[23] != 6:  # IPv4, TCP
            continue
        ihl = (f[14] & 0x0F) * 4
        tcp = 14 + ihl
        if len(f) >= tcp + 4:
            ports.add(int.from_bytes(f[tcp:tcp + 2], "big"))
            ports.add(int.from_bytes(f[tcp + 2:tcp + 4], "big"))
    return ports


class NsClient:
    """An HTTP client process inside namespace ``ns``: ``call`` sends a batch of requests (run
    at once) and waits for all their answers; ``send`` / ``receive`` split that in two, so the
    test can act (take the link down) while the batch is in flight."""

    def __init__(self, hosts: Hosts, ns: str) -> None:
        self.proc = subprocess.Popen(
            hosts.exec(ns, [sys.executable, "-c", _CLIENT]),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )

    def send(self, reqs: list[dict[str, Any]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(reqs) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> list[dict[str, Any]]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # every request inside carries its own timeout
        if not line:
            raise RuntimeError("the namespace's HTTP client exited")
        answers: list[dict[str, Any]] = json.loads(line)
        return answers

    def call(self, reqs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.send(reqs)
        return self.receive()

    def get(self, url: str, timeout: float = 10, ca: Path | None = None) -> dict[str, Any]:
        return self.call([{"method": "GET", "url": url, "timeout": timeout,
                           "ca": ca and str(ca)}])[0]

    def json(self, method: str, url: str, body: Any = None, timeout: float = 60,
             ca: Path | None = None) -> Any:
        answer = self.call([{"method": method, "url": url, "json": body, "timeout": timeout,
                             "ca": ca and str(ca)}])[0]
        assert answer["status"] == 200, f"{method} {url}: {answer}"
        return json.loads(answer["body"])

    def metric_sums(self, url: str, names: dict[str, str]) -> dict[str, float]:
        """``url``'s ``/metrics`` samples named by ``names``' values (a histogram's ``_sum`` or
        ``_count``, a counter), summed over labels, under ``names``' keys (0 where absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        answer = self.get(f"{url}/metrics", timeout=10)
        assert answer["status"] == 200, answer
        wanted = {v: k for k, v in names.items()}
        out = dict.fromkeys(names, 0.0)
        for family in text_string_to_metric_families(answer["body"]):
            for sample in family.samples:
                if sample.name in wanted:
                    out[wanted[sample.name]] += sample.value
        return out

    def wait_ok(self, urls: list[str], timeout: float = 240, logs: Sequence[Path] = (),
                ca: Path | None = None) -> None:
        deadline = time.monotonic() + timeout
        pending = list(urls)
        while pending:
            answers = self.call([{"method": "GET", "url": u, "timeout": 2, "ca": ca and str(ca)}
                                 for u in pending])
            pending = [u for u, a in zip(pending, answers, strict=True) if a["status"] != 200]
            if pending and time.monotonic() > deadline:
                tails = "\n".join(p.read_text(errors="replace")[-3000:] for p in logs)
                raise RuntimeError(f"not ready within {timeout:g} s: {pending}\n{tails}")
            if pending:
                time.sleep(0.3)

    def close(self) -> None:
        _end(self.proc)


class NsFleet:
    """Processes started in the namespaces of ``hosts`` (``start``), each logging to a file in
    ``logs``, and one HTTP client in ``client_ns``; ``close`` stops them all and removes the
    namespaces. For the module fixtures of the multi-host tests."""

    def __init__(self, logs: Path, client_ns: str = "b") -> None:
        from tests.integration import failure_support

        self._support = failure_support  # its Proc and stop_all
        self.hosts = Hosts.make()
        self.logs = logs
        self.procs: dict[str, Proc] = {}
        try:
            self.client = NsClient(self.hosts, getattr(self.hosts, client_ns))
        except BaseException:
            self.hosts.remove()
            raise

    def start(self, name: str, ns: str, argv: list[str]) -> None:
        fs = self._support
        tier = {"bootstrap": fs.REGISTRY_TIER, "proxy": fs.ROUTER_TIER}.get(name, fs.WORKER_TIER)
        proc = fs.Proc(name, self.hosts.exec(ns, argv), self.logs / f"{name}.log", tier=tier)
        self.procs[name] = proc
        proc.start()

    def wait_ok(self, urls: list[str], ca: Path | None = None) -> None:
        self.client.wait_ok(urls, logs=[p.log_path for p in self.procs.values()], ca=ca)

    def tails(self, n: int = 20) -> str:
        return "\n".join(p.tail(n) for p in self.procs.values())

    def close(self) -> None:
        self._support.stop_all(self.procs.values())
        self.client.close()
        self.hosts.remove()
