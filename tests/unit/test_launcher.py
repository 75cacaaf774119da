"""The launcher's control endpoint (`pd-fsm cluster --max-workers`, issue 30 §2) and the proxy's
`POST /workers/add` / `/workers/remove`: every refusal answers a precise 4xx naming the field or
the bound, and the server goes on serving. The launcher serves over real HTTP here; its workers
are not started (their ports are free and refuse connections), which is what a scale-down's role
check sees of a worker that does not answer: it counts as serving no role. Starting and stopping
real workers is `tests/integration/test_launcher.py`."""

from __future__ import annotations

import sys
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.cli import build_parser
from pd_fsm.io_trio.cluster.launcher import Launcher, ProcessBackend
from pd_fsm.io_trio.cluster.local import Listen, launched_worker
from pd_fsm.io_trio.cluster.supervisor import Child, Cluster
from pd_fsm.io_trio.ports import free_ports
from pd_fsm.io_trio.proxy.server import ProxyServer
from pd_fsm.io_trio.proxy.workers import PrefillTarget
from pd_fsm.io_trio.tls import NO_TLS


def _cluster() -> Cluster:
    p_port, d_port, bootstrap = free_ports(3)
    children = [Child("bootstrap", ["-"], f"http://127.0.0.1:{bootstrap}"),
                Child("prefill-0", ["-"], f"http://127.0.0.1:{p_port}", role="prefill"),
                Child("decode-0", ["-"], f"http://127.0.0.1:{d_port}", role="decode")]
    return Cluster(children, startup_timeout=10)


async def _serve(nursery: trio.Nursery, *, max_workers: int = 2, api_key: str | None = None,
                 ready: bool = True) -> tuple[str, Launcher, Cluster]:
    cluster = _cluster()
    args = build_parser().parse_args(["cluster", "--model", "tiny"])

    def new_worker(role: str, name: str) -> Child:
        return launched_worker(args, NO_TLS, role, name, Listen(8998))

    (proxy_port,) = free_ports(1)
    launcher = Launcher(ProcessBackend(cluster, new_worker), max_workers=max_workers,
                        proxy_url=f"http://127.0.0.1:{proxy_port}", headers={},
                        host="127.0.0.1", port=0, start_timeout=5, stop_timeout=5,
                        api_key=api_key)
    url: str = await nursery.start(launcher.serve)
    if ready:
        launcher.ready()
    return url, launcher, cluster


def _message(r: httpx.Response) -> str:
    body = r.json()
    assert body["error"]["code"] == r.status_code, body
    return str(body["error"]["message"])


@pytest.mark.parametrize(("body", "status", "names"), [
    (b"{", 400, "JSON"),
    (b"[1]", 400, "JSON object"),
    (b'{"role": "prefill", "count": 2}', 400, "count"),
    (b"{}", 400, "body.role is missing"),
    (b'{"role": "null"}', 400, "body.role"),
    (b'{"role": 3}', 400, "body.role"),
])
async def test_scale_up_refuses_bad_bodies_by_field(nursery: trio.Nursery, body: bytes,
                                                    status: int, names: str) -> None:
    url, launcher, _ = await _serve(nursery)
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{url}/scale_up", content=body)
        assert r.status_code == status and names in _message(r), r.text
        assert (await http.get(f"{url}/health")).json() == {"status": "ok"}  # still serving
    assert len(launcher.workers) == 2  # nothing started


async def test_scale_up_past_max_workers_is_409_naming_the_bound(nursery: trio.Nursery) -> None:
    url, _, cluster = await _serve(nursery, max_workers=2)
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{url}/scale_up", json={"role": "decode"})
        listed = (await http.get(f"{url}/workers")).json()
    assert r.status_code == 409, r.text
    assert "max_workers" in _message(r) and "--max-workers 2" in _message(r)
    assert listed["max_workers"] == 2
    assert [(w["name"], w["role"], w["state"]) for w in listed["workers"]] == [
        ("prefill-0", "prefill", "serving"), ("decode-0", "decode", "serving")]
    assert [c.name for c in cluster.children] == ["bootstrap", "prefill-0", "decode-0"]


async def test_scale_down_refuses_an_unknown_url_and_the_last_worker_of_a_role(
    nursery: trio.Nursery,
) -> None:
    url, launcher, cluster = await _serve(nursery)
    p_url = str(cluster.children[1].url)
    async with httpx.AsyncClient(timeout=10) as http:
        r = await http.post(f"{url}/scale_down", json={"worker": "http://127.0.0.1:1"})
        assert r.status_code == 404 and "body.worker" in _message(r), r.text
        # The registry is a child too, but not a worker the launcher manages.
        boot = str(cluster.children[0].url)
        r = await http.post(f"{url}/scale_down", json={"worker": boot})
        assert r.status_code == 404, r.text
        r = await http.post(f"{url}/scale_down", json={"worker": 5})
        assert r.status_code == 400 and "body.worker" in _message(r), r.text
        r = await http.post(f"{url}/scale_down", json={"worker": p_url, "now": True})
        assert r.status_code == 400 and "now" in _message(r), r.text
        # The only P: its own /server_info does not answer (its launch role counts), and no
        # other worker serves prefill.
        r = await http.post(f"{url}/scale_down", json={"worker": p_url + "/"})
        assert r.status_code == 409, r.text
        assert f"{p_url} is the last prefill worker serving" in _message(r)
        listed = (await http.get(f"{url}/workers")).json()["workers"]
    assert [w["state"] for w in listed] == ["serving", "serving"]
    assert len(launcher.workers) == 2


async def test_before_the_cluster_is_ready_scales_are_503_with_retry_after(
    nursery: trio.Nursery,
) -> None:
    url, _, cluster = await _serve(nursery, ready=False)
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.get(f"{url}/health")).json() == {"status": "starting"}
        up = await http.post(f"{url}/scale_up", json={"role": "prefill"})
        down = await http.post(f"{url}/scale_down", json={"worker": cluster.children[2].url})
        listed = (await http.get(f"{url}/workers")).json()["workers"]
    for r in (up, down):
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert "not ready" in _message(r)
    assert {w["state"] for w in listed} == {"starting"}


async def test_with_a_key_only_its_holders_may_scale(nursery: trio.Nursery) -> None:
    url, _, _ = await _serve(nursery, api_key="sekrit")
    async with httpx.AsyncClient(timeout=10) as http:
        assert (await http.post(f"{url}/scale_up", json={"role": "prefill"})).status_code == 401
        assert (await http.get(f"{url}/workers")).status_code == 401
        assert (await http.get(f"{url}/health")).status_code == 200
        r = await http.post(f"{url}/scale_up", json={"role": "prefill"},
                            headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 409, r.text  # past the key: the bound (2 of 2) refuses it


async def test_a_worker_that_never_serves_is_stopped_and_the_request_told_why() -> None:
    """Real child processes that are no workers: one exits at once, one never answers. Each
    scale-up is answered with the reason (502 with the child's last lines, 504 at the start
    deadline), the child is stopped and forgotten, and the cluster runs on (neither exit is
    fatal)."""
    argv = {"prefill": [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"],
            "decode": [sys.executable, "-c", "import time; time.sleep(60)"]}

    def new_worker(role: str, name: str) -> Child:
        (port,) = free_ports(1)
        return Child(name, argv[role], f"http://127.0.0.1:{port}", role=role)

    cluster = Cluster([], startup_timeout=10)
    launcher = Launcher(ProcessBackend(cluster, new_worker), max_workers=3,
                        proxy_url="http://127.0.0.1:9", headers={}, host="127.0.0.1", port=0,
                        start_timeout=1.5, stop_timeout=5)
    cluster.services.append(launcher)
    got: dict[str, httpx.Response] = {}

    async def scale_ups(c: Cluster) -> int:
        async with httpx.AsyncClient(timeout=30) as http:
            for role in ("prefill", "decode"):
                got[role] = await http.post(f"{launcher.url}/scale_up", json={"role": role})
            got["workers"] = await http.get(f"{launcher.url}/workers")
        return 0

    assert await cluster.run(scale_ups) == 0 and cluster.failure is None
    assert got["prefill"].status_code == 502, got["prefill"].text
    assert "prefill-0" in _message(got["prefill"])
    assert "exited with status 3 before it was healthy: no model here" in _message(got["prefill"])
    assert got["decode"].status_code == 504, got["decode"].text
    assert "not healthy within 1.5 s" in _message(got["decode"])
    assert got["workers"].json()["workers"] == [] and cluster.children == []


# ----------------------------------------------------------------------------- the proxy's side

P, D, NEW = "http://127.0.0.1:40001", "http://127.0.0.1:40002", "http://127.0.0.1:40003"


def _proxy(**kw: Any) -> httpx.AsyncClient:
    proxy = ProxyServer([PrefillTarget.from_url(P, 40101)], [D], **kw)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy.app), base_url="http://p")


async def test_the_proxy_routes_an_added_worker_and_drops_a_removed_one() -> None:
    async with _proxy() as http:
        r = await http.post("/workers/add", json={"url": NEW + "/", "role": "decode"})
        assert r.status_code == 200 and r.json() == {"url": NEW, "role": "decode",
                                                     "added": True}, r.text
        assert (await http.get("/workers")).json()["decode"] == [D, NEW]
        r = await http.post("/workers/add", json={"url": NEW, "role": "prefill",
                                                  "bootstrap_port": 40103})
        assert r.json()["added"] is False  # routed already: now as a P
        listed = (await http.get("/workers")).json()
        assert (listed["prefill"], listed["decode"]) == ([P, NEW], [D])
        r = await http.post("/workers/remove", json={"url": P})
        assert r.status_code == 200 and r.json() == {"url": P, "removed": True}, r.text
        listed = (await http.get("/workers")).json()
        assert (listed["prefill"], listed["decode"]) == ([NEW], [D])
        assert P not in listed["breakers"]


@pytest.mark.parametrize(("path", "body", "status", "names"), [
    ("/workers/add", b"{", 400, "JSON"),
    ("/workers/add", b'"x"', 400, "JSON object"),
    ("/workers/add", b'{"url": "http://h:1", "role": "decode", "weight": 2}', 400, "weight"),
    ("/workers/add", b'{"role": "decode"}', 400, "body.url"),
    ("/workers/add", b'{"url": "h:1", "role": "decode"}', 400, "body.url"),
    ("/workers/add", b'{"url": "http://h:1", "role": "router"}', 400, "body.role"),
    ("/workers/add", b'{"url": "http://h:1", "role": "prefill", "bootstrap_port": 0}', 400,
     "body.bootstrap_port"),
    ("/workers/add", b'{"url": "http://h:1", "role": "prefill", "bootstrap_port": true}', 400,
     "body.bootstrap_port"),
    ("/workers/remove", b'{"url": "http://127.0.0.1:40009"}', 404, "body.url"),
    ("/workers/remove", b'{"url": 7}', 400, "body.url"),
])
async def test_the_proxy_refuses_bad_worker_changes_by_field(path: str, body: bytes, status: int,
                                                             names: str) -> None:
    async with _proxy() as http:
        r = await http.post(path, content=body)
        assert r.status_code == status and names in _message(r), r.text
        listed = (await http.get("/workers")).json()
    assert (listed["prefill"], listed["decode"]) == ([P], [D])  # nothing changed


async def test_a_proxy_that_reads_the_registry_refuses_changes_and_a_key_guards_them() -> None:
    async with _proxy(bootstrap_url="http://127.0.0.1:8998") as http:
        r = await http.post("/workers/add", json={"url": NEW, "role": "decode"})
        assert r.status_code == 409 and "--bootstrap-url" in _message(r), r.text
    async with _proxy(api_key="k") as http:
        r = await http.post("/workers/remove", json={"url": P})
        assert r.status_code == 401
        r = await http.post("/workers/remove", json={"url": P},
                            headers={"authorization": "Bearer k"})
        assert r.status_code == 200, r.text
