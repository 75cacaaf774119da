"""`pd-fsm cluster --ray` on a two-node Ray cluster whose nodes are separate hosts (network
namespaces A = 10.77.0.1 and B = 10.77.0.2, netns_support.py).

`ray start --head` in A, `ray start --address` in B (Ray from PyPI, the test extra). The launcher
runs in A and places P on A by node IP and D on B by a custom resource (``hostB``); the bootstrap
server, the proxy and a colocated worker go to the driver's node (A). Then:

- answers through the proxy equal the colocated worker's;
- the P actor is SIGKILLed: its service process dies with it, Ray restarts the actor, the new one
  starts P again on the same URL, P re-registers, and the next requests are answered correctly;
- the launcher (``--max-workers 3``, issue 30 §2): the last D cannot be scaled down (409); a
  scale-up of a decode worker starts a D actor on host B (its role's node), answered once the
  proxy routes it; a further scale-up is over the bound (409); its process killed, Ray restarts
  it on the same URL (it serves: it is the cluster's); it serves requests, answered as colocated
  does; its scale-down takes it out of the proxy and stops its actor: it exits 0 and no process
  of it is left on B, and the answers stay equal;
- SIGINT to the launcher stops everything in tiers: no pd-fsm process is left on either host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.netns_support import Hosts, NsClient, namespaces_unavailable
from tests.integration.serve_support import Proc, cli

pytestmark = [pytest.mark.slow]

_WHY_NOT = namespaces_unavailable()
if _WHY_NOT is not None:
    pytest.skip(f"separate hosts need network namespaces: {_WHY_NOT}", allow_module_level=True)
pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e .[test])")

RAY = str(Path(sys.executable).with_name("ray"))
RAY_PORT = 6379
_LAUNCHER = re.compile(r"^\s+launcher\s+(http://\S+)")
_ROW = re.compile(r"^\s+(\S+)\s+(http://\S+).*\[node (\S+), actor pid (\d+), process pid (\d+)\]")


def _ray_start(hosts: Hosts, ns: str, *args: str, temp: Path) -> None:
    argv = [RAY, "start", "--num-cpus", "1", "--object-store-memory", "100000000",
            "--disable-usage-stats", "--temp-dir", str(temp), *args]
    done = subprocess.run(hosts.exec(ns, argv), capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def ray_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hosts]:
    hosts = Hosts.make()
    # Short: Ray's socket paths must stay under 108 bytes.
    temps = [Path(f"/tmp/ray-{hosts.a[-6:]}-{side}") for side in "ab"]
    try:
        _ray_start(hosts, hosts.a, "--head", "--node-ip-address", hosts.ip_a, "--port",
                   str(RAY_PORT), "--include-dashboard=false", "--resources", '{"hostA": 1}',
                   temp=temps[0])
        _ray_start(hosts, hosts.b, "--address", f"{hosts.ip_a}:{RAY_PORT}", "--node-ip-address",
                   hosts.ip_b, "--resources", '{"hostB": 1}', temp=temps[1])
        yield hosts
    finally:
        hosts.remove()  # Ray's own processes included: they run inside the namespaces
        for t in temps:
            subprocess.run(["rm", "-rf", str(t)], check=False)


def _services(lines: list[str], start: int) -> dict[str, dict[str, str]]:
    out = {}
    for line in lines[start:]:
        m = _ROW.match(line)
        if m:
            out[m.group(1)] = {"url": m.group(2), "node": m.group(3), "actor_pid": m.group(4),
                               "pid": m.group(5)}
    return out


def _wait_line(proc: Proc, needle: str, timeout: float, after: int = 0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        for i, line in enumerate(proc.lines[after:], after):
            if needle in line:
                return i
        assert proc.alive() and time.monotonic() < deadline, f"no {needle!r}:\n{proc.tail(80)}"
        time.sleep(0.2)


def _answers(client: NsClient, base: str, n: int = 4) -> list[str]:
    reqs = [{"method": "POST", "url": f"{base}/generate", "timeout": 60,
             "json": {"text": f"Ray test prompt {i}", "stream": i % 2 == 1,
                      "sampling_params": {"max_new_tokens": 8, "temperature": 0}}}
            for i in range(n)]
    out = []
    for a in client.call(reqs):
        assert a["status"] == 200, a
        body = a["body"]
        if body.startswith("data:"):
            body = [c[len("data: "):] for c in body.split("\n\n") if c.startswith("data: {")][-1]
        out.append(json.loads(body)["text"])
    return out


def _running(pid: int) -> bool:
    """Alive and not a zombie (an exited child waiting for its new parent to reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _pd_fsm_pids(hosts: Hosts, *namespaces: str) -> list[str]:
    """Every running pd-fsm process in these namespaces (default: both hosts)."""
    found = []
    for ns in namespaces or (hosts.a, hosts.b):
        for pid in hosts.pids(ns):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "pd_fsm.cli" in cmd:
                found.append(f"{ns} {pid} {cmd[:120]}")
    return found


def _requests_on(client: NsClient, worker: str) -> int:
    """How many requests ``worker`` has taken (its ``/server_info`` stats)."""
    info = client.json("GET", f"{worker}/server_info")
    return sum(info["internal_states"][0].get("requests_total", {}).values())


def _scale_a_decode_worker(hosts: Hosts, client: NsClient, launcher: Proc, proxy: str,
                           reference: list[str]) -> None:
    """The launcher's scale-up and scale-down of a D actor on host B, and two refusals."""
    (base,) = [m.group(1) for line in launcher.lines if (m := _LAUNCHER.match(line))]
    listed = client.json("GET", f"{base}/workers")
    assert listed["max_workers"] == 3, listed
    rows = {w["name"]: w for w in listed["workers"]}
    assert {n: w["state"] for n, w in rows.items()} == {"prefill-0": "serving",
                                                        "decode-0": "serving"}, listed
    last = client.call([{"method": "POST", "url": f"{base}/scale_down", "timeout": 30,
                         "json": {"worker": rows["decode-0"]["url"]}}])[0]
    assert last["status"] == 409 and "the last decode worker serving" in last["body"], last
    on_b = set(_pd_fsm_pids(hosts, hosts.b))

    up = client.json("POST", f"{base}/scale_up", {"role": "decode"}, timeout=240)
    added = up["worker"]
    assert (up["name"], up["role"]) == ("decode-1", "decode"), up
    assert added.startswith(f"http://{hosts.ip_b}:"), up  # its role's node: B
    (process,) = set(_pd_fsm_pids(hosts, hosts.b)) - on_b  # its process, on B
    assert added in client.json("GET", f"{proxy}/workers")["decode"]
    over = client.call([{"method": "POST", "url": f"{base}/scale_up", "timeout": 30,
                         "json": {"role": "prefill"}}])[0]
    assert over["status"] == 409 and "--max-workers 3" in over["body"], over

    # Serving, it is the cluster's like its siblings: its process killed, Ray restarts it.
    seen = len(launcher.lines)
    os.kill(int(process.split()[1]), signal.SIGKILL)
    restarted = _wait_line(launcher, "decode-1 restarted by Ray", 120, seen)
    assert f"same URL {added}" in launcher.lines[restarted]
    client.wait_ok([f"{added}/health"], timeout=120)
    assert _answers(client, proxy) == reference  # round robin over both Ds
    assert _requests_on(client, added) >= 1, "the added D (restarted) served no request"

    down = client.json("POST", f"{base}/scale_down", {"worker": added}, timeout=120)
    assert (down["name"], down["exit_status"], down["killed"]) == ("decode-1", 0, False), down
    assert added not in client.json("GET", f"{proxy}/workers")["decode"]
    assert added not in [w["url"] for w in client.json("GET", f"{base}/workers")["workers"]]
    deadline = time.monotonic() + 10  # its process exited; gone once its actor reaped it
    while (left := set(_pd_fsm_pids(hosts, hosts.b))) != on_b:
        assert time.monotonic() < deadline, (on_b, left)
        time.sleep(0.1)
    assert _answers(client, proxy) == reference


def test_ray_launch_restart_and_stop(ray_hosts: Hosts) -> None:
    hosts = ray_hosts
    argv = cli("cluster", "--ray", f"{hosts.ip_a}:{RAY_PORT}", "--model", "tiny",
               "--page-size", "4", "--context-length", "256", "--colocated",
               "--prefill-nodes", hosts.ip_a, "--decode-nodes", "resource:hostB",
               "--ray-max-restarts", "2", "--startup-timeout", "300", "--max-workers", "3",
               "--worker-args", "--disaggregation-bootstrap-heartbeat-interval 1 "
               "--disaggregation-bootstrap-heartbeat-ttl 3")
    launcher = Proc.start("cluster", hosts.exec(hosts.a, argv))
    client = NsClient(hosts, hosts.a)
    try:
        ready = _wait_line(launcher, "pd-fsm cluster: ready in", 300)
        time.sleep(0.3)  # the table follows the ready line
        services = _services(launcher.lines, ready)
        assert set(services) == {"bootstrap", "prefill-0", "decode-0", "colocated", "proxy"}
        assert services["prefill-0"]["node"] == hosts.ip_a
        assert services["decode-0"]["node"] == hosts.ip_b
        assert services["decode-0"]["url"].startswith(f"http://{hosts.ip_b}:")
        proxy, colocated = services["proxy"]["url"], services["colocated"]["url"]
        reference = _answers(client, colocated)
        assert _answers(client, proxy) == reference

        # Kill the P actor's process: P's service dies with it, Ray restarts the actor.
        old = services["prefill-0"]
        os.kill(int(old["actor_pid"]), signal.SIGKILL)
        restarted = _wait_line(launcher, "prefill-0 restarted by Ray", 120, ready)
        assert f"same URL {old['url']}" in launcher.lines[restarted]
        new_pid = re.search(r"process pid (\d+)", launcher.lines[restarted])
        assert new_pid and new_pid.group(1) != old["pid"]
        deadline = time.monotonic() + 10  # SIGKILLed with its actor; gone once reaped
        while _running(int(old["pid"])):
            assert time.monotonic() < deadline, "P's old process outlived its actor"
            time.sleep(0.1)
        client.wait_ok([f"{old['url']}/health"], timeout=120)
        deadline = time.monotonic() + 60
        while True:  # the first requests may still meet the old P's rooms ending
            try:
                after = _answers(client, proxy)
                break
            except AssertionError:
                assert time.monotonic() < deadline, launcher.tail(80)
                time.sleep(1)
        assert after == reference
        assert _answers(client, proxy) == reference  # and it stays so
        _scale_a_decode_worker(hosts, client, launcher, proxy, reference)

        launcher.popen.send_signal(signal.SIGINT)
        assert launcher.popen.wait(60) == 0, launcher.tail(80)
        # Ray's raylet prints to the driver's output on its own schedule: a line about an actor
        # killed on the way down may come after ours (seen once in a fresh-clone run).
        own = [line for line in launcher.lines if "(raylet)" not in line]
        assert own[-1] == "pd-fsm cluster: stopped", launcher.tail(20)
        deadline = time.monotonic() + 15
        while (left := _pd_fsm_pids(hosts)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, left
    finally:
        client.close()
        launcher.stop()


# A worker actor whose process exits before it is healthy (its model does not exist), driven as
# the launcher drives one: started on B, its exit seen, stopped. Run in A, beside the Ray head.
_FAILING_WORKER = r"""
import argparse, json, sys
import ray, trio
from pd_fsm.io_trio.cluster.ray_cluster import RayCluster
from pd_fsm.io_trio.cluster.ray_launcher import ActorBackend

ray.init(address=sys.argv[1], log_to_driver=False, namespace="pd_fsm", configure_logging=False)
args = argparse.Namespace(prefill_nodes=None, decode_nodes="resource:hostB", bootstrap_nodes=None,
                          proxy_nodes=None, colocated_nodes=None, ray_max_restarts=1)
cluster = RayCluster(args, ["--model", "/no/such/model"], [])
backend = ActorBackend(cluster, 60)

async def main():
    child = backend.new("decode", "decode-7")
    out = {"failure": await backend.start(child), "url": child.url, "why": None}
    if out["failure"] is None:
        with trio.fail_after(60):
            while out["why"] is None:
                out["why"] = await backend.exited(child)
                await trio.sleep(0.2)
        out["stopped"] = await backend.stop(child, 5)
    out["left"] = [s.name for s in cluster.snapshot()]
    try:
        ray.get_actor(f"pd-fsm-{cluster.cluster_id}-decode-7")
        out["actor"] = "still there"
    except ValueError:
        out["actor"] = "gone"
    return out

print("RESULT " + json.dumps(trio.run(main)), flush=True)
"""


def test_a_launched_worker_that_exits_before_it_serves_is_told_and_stopped(
    ray_hosts: Hosts,
) -> None:
    """What the launcher answers 502 with (its exit status and last lines, as the local runner's),
    and no actor nor process of it left."""
    hosts = ray_hosts
    done = subprocess.run(hosts.exec(hosts.a, [sys.executable, "-c", _FAILING_WORKER,
                                               f"{hosts.ip_a}:{RAY_PORT}"]),
                          capture_output=True, text=True, timeout=120)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-2000:] + done.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["failure"] is None and out["url"].startswith(f"http://{hosts.ip_b}:"), out
    # Not armed until it serves: the exit does not take its actor down, which tells how it ended.
    assert out["why"].startswith("exited with status 2 before it was healthy: "), out
    assert "unknown model '/no/such/model'" in out["why"], out
    assert out["stopped"] == [2, False], out
    assert out["left"] == [] and out["actor"] == "gone", out
    assert not _pd_fsm_pids(hosts, hosts.b)
