"""P and D on one TPU host, as real processes on a machine with no TPU: each worker the runner
starts (locally, and as a Ray actor given Ray's ``TPU`` resource) has exactly its chips' libtpu
variables, read from inside it (``/server_info`` → ``tpu.env``), and JAX in it sees its devices —
here the host CPU's, as many as its chips (its ``--tp``). What only a chip can show is
bench/tpu_one_chip_check.sh's (docs/tpu_hosts.md)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from tests.integration.netns_support import Hosts, NsClient, namespaces_unavailable
from tests.integration.serve_support import PDCluster, Proc, cli

pytestmark = pytest.mark.slow

SMALL = ["--model", "tiny", "--page-size", "4", "--num-pages", "64", "--context-length", "128",
         "--worker-args", "--warmup minimal"]


def _expected(chips: str, bounds: str, port: int) -> dict[str, str | None]:
    """A block's variables, spelled out (tpu_placement's docstring says where each is from)."""
    at = f"localhost:{port}"
    return {"TPU_VISIBLE_CHIPS": chips, "TPU_CHIPS_PER_PROCESS_BOUNDS": bounds,
            "TPU_PROCESS_BOUNDS": "1,1,1", "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": at, "CLOUD_TPU_TASK_ID": "0",
            "TPU_MESH_CONTROLLER_ADDRESS": at, "TPU_MESH_CONTROLLER_PORT": str(port),
            "TPU_VISIBLE_DEVICES": chips, "TPU_CHIPS_PER_HOST_BOUNDS": bounds,
            "TPU_HOST_BOUNDS": "1,1,1", "JAX_PLATFORMS": None}


def _check(info: dict[str, Any], host: str, chips: str, bounds: str, port: int) -> None:
    tpu = info["tpu"]
    assert (tpu["host"], tpu["chips"], tpu["port"]) == (
        host, [int(c) for c in chips.split(",")], port), tpu
    assert tpu["env"] == _expected(chips, bounds, port), tpu["env"]
    # No TPU here: JAX falls back to the host CPU, one device per chip (--tp).
    assert [d["platform"] for d in info["devices"]] == ["cpu"] * len(chips.split(",")), info


def test_the_local_runner_splits_a_v5e_4_between_p_and_d() -> None:
    cluster = PDCluster.start(["--tpu-host", "v5e-4", *SMALL])
    try:
        assert any("TPU chips of this v5e-4 (4 chips, 2x2): prefill 0-1; decode 2-3" in line
                   for line in cluster.proc.lines), cluster.proc.tail()
        with httpx.Client(timeout=30) as http:
            _check(http.get(f"{cluster.urls['prefill-0']}/server_info").json(),
                   "v5e-4", "0,1", "1,2,1", 8476)
            _check(http.get(f"{cluster.urls['decode-0']}/server_info").json(),
                   "v5e-4", "2,3", "1,2,1", 8478)
            r = http.post(f"{cluster.urls['proxy']}/generate", json={
                "text": "chips", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
            assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 4
    finally:
        cluster.stop()


_ROW = re.compile(r"^\s+(prefill-0|decode-0)\s+(http://\S+)\s+\(.*TPU chips ([\d,]+)\)")


def test_ray_actors_ask_for_tpu_chips_and_their_workers_get_them() -> None:
    why = namespaces_unavailable()
    if why is not None:  # Ray's own ports must not meet another test's: a namespace of its own
        pytest.skip(f"a namespace for Ray: {why}")
    pytest.importorskip("ray", reason="Ray is the test extra's (pip install -e .[test])")
    hosts = Hosts.make()
    # A one-node Ray started by the runner itself, its node given 8 TPU chips (no TPU here: Ray
    # counts the resource all the same, and sets TPU_VISIBLE_CHIPS in each actor it gives some).
    # Without RAY_AUTH_MODE=disabled a local Ray writes ~/.ray/auth_token, after which every
    # `ray start` of this machine wants it (test_multihost_ray's second node failed so).
    argv = ["env", 'RAY_OVERRIDE_RESOURCES={"TPU": 8}', "RAY_USAGE_STATS_ENABLED=0",
            "RAY_AUTH_MODE=disabled",
            *cli("cluster", "--ray", "local", "--tpu-host", "v6e-8", *SMALL)]
    proc = Proc.start("cluster", hosts.exec(hosts.a, argv))
    client = NsClient(hosts, hosts.a)
    try:
        deadline = time.monotonic() + 240
        while not any("pd-fsm cluster: ready in" in line for line in proc.lines):
            assert proc.alive() and time.monotonic() < deadline, proc.tail(80)
            time.sleep(0.3)
        time.sleep(0.3)  # the table follows the ready line
        rows = {m.group(1): (m.group(2), m.group(3)) for line in proc.lines
                if (m := _ROW.match(line))}
        # Half of the node each (its ids are Ray's to pick: 0-3 and 4-7, either way round).
        assert sorted(chips for _, chips in rows.values()) == ["0,1,2,3", "4,5,6,7"], rows
        for url, chips in rows.values():
            info = client.json("GET", f"{url}/server_info")
            _check(info, "v6e-8", chips, "2,2,1", 8476 + int(chips.split(",")[0]))
        proxy = next(line.split()[1] for line in proc.lines if line.strip().startswith("proxy "))
        out = client.call([{"method": "POST", "url": f"{proxy}/generate", "timeout": 60,
                            "json": {"text": "chips", "sampling_params": {
                                "max_new_tokens": 4, "temperature": 0}}}])[0]
        assert out["status"] == 200, out
        assert json.loads(out["body"])["meta_info"]["completion_tokens"] == 4
    finally:
        client.close()
        proc.stop(60)
        hosts.remove()
