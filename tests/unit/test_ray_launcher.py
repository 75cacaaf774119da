"""What the Ray runner's launcher adds to the local runner's (`pd-fsm cluster --ray --max-workers`,
issue 30 §2), without Ray: its workers are known only once the cluster is up (the launcher adopts
them at ``ready``), and its trio loop runs in a thread of the synchronous driver
(``ray_launcher.LauncherThread``). Real HTTP, a real thread and a real trio loop; the workers
are not started (their ports refuse connections). The actors themselves are
`tests/integration/test_multihost_ray.py`."""

from __future__ import annotations

import socket
import threading

import httpx
import pytest
import trio

from pd_fsm.io_trio.cluster.launcher import Launcher, ProcessBackend
from pd_fsm.io_trio.cluster.ray_cluster import RayLaunchError
from pd_fsm.io_trio.cluster.ray_launcher import LauncherThread
from pd_fsm.io_trio.cluster.supervisor import Child, Cluster
from pd_fsm.io_trio.ports import free_ports


def _no_new_worker(role: str, name: str) -> Child:
    raise AssertionError("nothing is started here")


def _launcher(cluster: Cluster, max_workers: int = 2) -> Launcher:
    return Launcher(ProcessBackend(cluster, _no_new_worker), max_workers=max_workers,
                    proxy_url="", headers={}, host="127.0.0.1", port=0, start_timeout=5,
                    stop_timeout=5)


def _workers(roles: list[str]) -> list[Child]:
    return [Child(f"{role}-0", ["-"], f"http://127.0.0.1:{port}", role=role)
            for role, port in zip(roles, free_ports(len(roles)), strict=True)]


async def test_workers_known_only_once_the_cluster_is_up_are_adopted_at_ready(
    nursery: trio.Nursery,
) -> None:
    """On Ray the workers' URLs exist once their actors run: the launcher, made before, lists
    none; at ``ready`` it lists them serving, counts them against the bound and names on from
    them."""
    cluster = Cluster([], startup_timeout=10)
    launcher = _launcher(cluster)
    url: str = await nursery.start(launcher.serve)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{url}/workers")).json()["workers"] == []
        cluster.children.extend(_workers(["prefill", "decode"]))
        launcher.ready()
        listed = (await http.get(f"{url}/workers")).json()["workers"]
        r = await http.post(f"{url}/scale_up", json={"role": "decode"})
    assert [(w["name"], w["state"]) for w in listed] == [("prefill-0", "serving"),
                                                        ("decode-0", "serving")]
    assert r.status_code == 409 and "--max-workers 2" in r.text, r.text  # both counted


def test_the_launcher_thread_serves_from_before_ready_and_closes() -> None:
    """The thread's loop listens at once (503 until ``ready``), takes the proxy's URL at
    ``ready``, and ends within its deadline on ``close`` (which is no failure)."""
    cluster = Cluster(_workers(["prefill", "decode"]), startup_timeout=10)
    thread = LauncherThread(_launcher(cluster))
    url = thread.start()
    with httpx.Client(timeout=10) as http:
        assert http.get(f"{url}/health").json() == {"status": "starting"}
        assert http.post(f"{url}/scale_up", json={"role": "decode"}).status_code == 503
        thread.ready("http://127.0.0.1:9/")
        assert http.get(f"{url}/health").json() == {"status": "ok"}
        r = http.post(f"{url}/scale_up", json={"role": "decode"})
        assert r.status_code == 409, r.text  # ready: the bound, 2 of 2, answers now
    assert thread.launcher.proxy_url == "http://127.0.0.1:9"
    assert thread.failure() is None
    thread.close(10)
    assert not any(t.name == "pd-fsm-launcher" for t in threading.enumerate())
    assert thread.failure() is None  # closed: no failure



def test_a_launcher_that_cannot_listen_fails_the_start_with_the_reason() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        launcher = Launcher(ProcessBackend(Cluster([], startup_timeout=10), _no_new_worker),
                            max_workers=2, proxy_url="", headers={}, host="127.0.0.1",
                            port=port, start_timeout=5, stop_timeout=5)
        thread = LauncherThread(launcher)
        with pytest.raises(RayLaunchError, match="the launcher does not listen: the launcher "
                                                 "failed"):
            thread.start()
    assert thread.failure() is not None and "failed" in str(thread.failure())
