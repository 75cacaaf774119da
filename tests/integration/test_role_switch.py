"""A worker switches its role at runtime (issue 30 §1), in real processes on the tiny model: a
bootstrap server, worker ``a`` (prefill), ``b`` (decode), both ``--roles prefill,decode``, and
``c`` (decode, ``--roles decode,null``, a 1 s ``--drain-timeout``). This module is the router:
it posts both legs of each PD request itself (failure_support.leg).

Checked: ``/switch_role``'s answers; a switch waits for the leg in flight (new legs 503 with
Retry-After, a second switch 409, out of the registry) and ends with nothing held; past the drain
deadline the leg fails naming the switch; a 1P1D flip serves the same request the other way
round with the same tokens, compiling nothing at switch time; a leg addressed to a stale role
gets 409 with the current role and epoch in its headers; after every switch, pages, rooms,
queues and registrations are zero on both sides.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from pd_fsm.io_trio.cluster.cpu_placement import parse_cpus
from pd_fsm.io_trio.worker.switch_cli import switch_role
from tests.integration.failure_support import (
    HOST,
    SLACK,
    Fleet,
    Proc,
    both_legs,
    error_message,
    free_port,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
    wait_until,
)

ROLES = ["--roles", "prefill,decode", "--drain-timeout", "20"]
# c on the first core with pools of one thread (`--cpu-pools 1`, as `pd-fsm cluster` starts a
# D beside P on shared cores), movable to every core it had at start (the planner's cores
# lever, POST /set_cpus), where this machine lets the test use two cores or more. `--cpu-pools
# all` (the same after load) is what the planner's clusters start (test_observability).
CORES = sorted(os.sched_getaffinity(0))
C_CORES = ["--cpus", str(CORES[0]), "--cpu-pools", "1"] if len(CORES) >= 2 else []
# d's side-channel port, for its prefill role: the test holds it, so that role cannot start.
D_SIDE_PORT = free_port()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("role_switch"))
    f.bootstrap()
    f.prefill("a", extra=ROLES)
    f.decode("b", extra=ROLES)
    # Its priority follows its role (positive values: no privilege needed).
    f.decode("c", extra=["--roles", "decode,null", "--drain-timeout", "1",
                         "--role-nice", "decode=2,null=5", *C_CORES])
    f.decode("d", extra=["--roles", "decode,prefill",
                         "--disaggregation-side-channel-port", str(D_SIDE_PORT)])
    f.start()
    yield f
    f.close()


def thread_nices(pid: int) -> set[int]:
    """The nice values of every thread of process ``pid`` (Linux keeps one per thread)."""
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended since the listing
            nices.add(os.getpriority(os.PRIO_PROCESS, int(tid)))
    return nices


async def info(http: httpx.AsyncClient, proc: Proc) -> dict[str, Any]:
    r = await http.get(f"{proc.url}/server_info")
    r.raise_for_status()
    return dict(r.json())


async def serving(http: httpx.AsyncClient, proc: Proc, role: str, epoch: int,
                  timeout: float = 30.0) -> dict[str, Any]:
    """/server_info once ``proc`` serves as ``role`` under ``epoch``."""
    async def check() -> dict[str, Any] | None:
        i = await info(http, proc)
        ok = (i["role_state"], i["disaggregation_mode"], i["role_epoch"]) == (
            "SERVING", role, epoch)
        return i if ok else None

    got, _ = await wait_until(check, timeout, f"{proc.name} serving as {role} (epoch {epoch})")
    return got


async def switch(http: httpx.AsyncClient, proc: Proc, role: str) -> dict[str, Any]:
    """Ask ``proc`` to become ``role``: the 202, checked."""
    before = await info(http, proc)
    r = await http.post(f"{proc.url}/switch_role", json={"role": role})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body == {"from": before["disaggregation_mode"], "to": role,
                    "role_epoch": before["role_epoch"] + 1}
    return dict(body)


async def registered(http: httpx.AsyncClient, fleet: Fleet) -> dict[str, tuple[str, int]]:
    """scheduler address -> (role, role_epoch) of every instance the registry lists."""
    r = await http.get(f"{fleet.boot_url}/list")
    r.raise_for_status()
    return {i["scheduler_addr"]: (i["role"], i["role_epoch"]) for i in r.json()["instances"]}


async def d_room_open(http: httpx.AsyncClient, d: Proc) -> bool | None:
    s = await stats(http, d)
    return True if sum(s.get("kvpoll", {}).values()) else None


async def hold_d_leg(http: httpx.AsyncClient, nursery: trio.Nursery, p: Proc, d: Proc,
                     seed: int) -> tuple[dict[str, Any], dict[str, httpx.Response]]:
    """D's leg alone, posted in the background: its room waits for P's READY, which waits for
    P's leg (posted only if the test does). Returns once D holds the room: the body, and where
    D's answer lands (key "d")."""
    body = leg(new_room(), prompt(12, seed=seed), 6, p)
    got: dict[str, httpx.Response] = {}

    async def d_leg() -> None:
        got["d"] = await http.post(f"{d.url}/generate", json=body)

    nursery.start_soon(d_leg)
    await wait_until(lambda: d_room_open(http, d), SLACK, f"{d.name}'s room open")
    return body, got


async def test_switch_role_answers(fleet: Fleet) -> None:
    c = fleet["c"]
    async with httpx.AsyncClient(timeout=30) as http:
        i = await info(http, c)
        assert (i["disaggregation_mode"], i["role_epoch"], i["roles"], i["role_state"]) == (
            "decode", 0, ["decode", "null"], "SERVING")
        assert i["nice"] == 2 and 2 in thread_nices(c.popen.pid)  # started at decode's
        for body, names in (([1], "JSON object"), ({"role": 1}, "body.role"),
                            ({"role": "decode", "now": True}, "now"),
                            ({"role": "colocated"}, "must be one of null, prefill, decode"),
                            ({"role": "prefill"}, "allowed roles are decode, null")):
            r = await http.post(f"{c.url}/switch_role", json=body)
            assert r.status_code == 400 and names in error_message(r), (body, r.text)
        r = await http.post(f"{c.url}/switch_role", content=b'{"role": "decode", "role": "null"}')
        assert r.status_code == 400, r.text  # strict JSON: a key given twice
        r = await http.post(f"{c.url}/switch_role", json={"role": "decode"})
        assert r.status_code == 200 and r.json() == {"role": "decode", "role_epoch": 0,
                                                     "switched": False}
        # A leg addressed to another role: 409 naming the current one, in headers too.
        for endpoint, body in (("/generate", {"text": "hi"}),
                               ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}]})):
            r = await http.post(f"{c.url}{endpoint}", json=body, headers={"X-PD-Role": "prefill"})
            assert r.status_code == 409, r.text
            assert (r.headers["x-pd-role"], r.headers["x-pd-role-epoch"]) == ("decode", "0")
            assert "serves as decode (role epoch 0)" in error_message(r)
        r = await http.post(f"{c.url}/generate", json={"text": "hi"}, headers={"X-PD-Role": "P"})
        assert r.status_code == 400 and "header X-PD-Role must be one of" in error_message(r)
        # The right role, or no header (sglang-router sends none): served (D prefills a leg
        # without bootstrap fields itself).
        for headers in ({"X-PD-Role": "decode"}, {}):
            r = await http.post(f"{c.url}/generate", headers=headers, json={
                "text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            assert r.status_code == 200, r.text


async def test_set_nice_moves_the_compute_threads_and_refuses_what_it_cannot_do(
    fleet: Fleet,
) -> None:
    """The planner's priority lever (issue 30 §3): POST /set_nice moves every thread at the
    compute priority, leaves the transfer threads at theirs, and refuses bad values by name."""
    c = fleet["c"]
    async with httpx.AsyncClient(timeout=30) as http:
        before = thread_nices(c.popen.pid)
        assert (await info(http, c))["nice"] == 2 and 7 not in before
        r = await http.post(f"{c.url}/set_nice", json={"nice": 7})
        assert r.status_code == 200 and r.json()["nice"] == 7 and r.json()["threads"] > 0, r.text
        after = thread_nices(c.popen.pid)
        assert 7 in after and 2 not in after  # every compute thread moved
        assert after - {7} == before - {2}  # the others (transfer threads) kept theirs
        assert (await info(http, c))["nice"] == 7
        for body, names in (([7], "JSON object"), ({"nice": True}, "body.nice"),
                            ({"nice": 20}, "-20..19"), ({"nice": "5"}, "body.nice"),
                            ({"nice": 5, "role": "decode"}, "unknown field(s) role"),
                            ({"nice": -10}, "KV transfer threads'")):
            r = await http.post(f"{c.url}/set_nice", json=body)
            assert r.status_code == 400 and names in error_message(r), (body, r.text)
        assert thread_nices(c.popen.pid) == after  # a refusal moved nothing
        r = await http.post(f"{c.url}/set_nice", json={"nice": 2})  # back for the next tests
        assert r.status_code == 200 and thread_nices(c.popen.pid) == before


def thread_cpus(pid: int) -> set[frozenset[int]]:
    """The cores each thread of process ``pid`` may run on (the kernel's lists, parsed)."""
    listed: set[frozenset[int]] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended since the listing
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
            listed.update(parse_cpus(line.split(":", 1)[1].strip())
                          for line in status.splitlines()
                          if line.startswith("Cpus_allowed_list:"))
    return listed


@pytest.mark.skipif(not C_CORES, reason="needs two cores or more to move a worker between them")
async def test_set_cpus_moves_every_thread_within_the_cores_the_worker_had_at_start(
    fleet: Fleet,
) -> None:
    """The planner's cores lever: a worker whose pools are not sized to --cpus (here one
    thread) is on --cpus once its pools exist (every thread), POST /set_cpus moves every thread
    within the cores it had at start, /server_info reports the cores, and what it cannot do is
    refused by name, moving nothing."""
    c, first, every = fleet["c"], str(CORES[0]), ",".join(map(str, CORES))
    one, all_cores = frozenset(CORES[:1]), frozenset(CORES)
    async with httpx.AsyncClient(timeout=30) as http:
        assert thread_cpus(c.popen.pid) == {one}
        assert (await info(http, c))["cpus"] == [CORES[0]]
        # Its pools were made on one thread: what the planner reads (core/planner.py).
        assert (await info(http, c))["cpu_pool_threads"] == 1
        outside = max(CORES) + 1
        for body, names in (({"cpus": [0]}, "body.cpus must be a string"),
                            ({"cpus": "0-"}, "body.cpus: --cpus '0-'"),
                            ({"cpus": f"{outside}"}, f"cores [{outside}] are not this worker's"),
                            ({"cpus": first, "nice": 1}, "unknown field(s) nice")):
            r = await http.post(f"{c.url}/set_cpus", json=body)
            assert r.status_code == 400 and names in error_message(r), (body, r.text)
        assert thread_cpus(c.popen.pid) == {one}  # a refusal moved nothing
        r = await http.post(f"{c.url}/set_cpus", json={"cpus": every})
        assert r.status_code == 200 and r.json()["cpus"] == CORES and r.json()["threads"] > 0
        assert thread_cpus(c.popen.pid) == {all_cores} and (await info(http, c))["cpus"] == CORES
        r = await http.post(f"{c.url}/set_cpus", json={"cpus": first})
        assert r.status_code == 200 and thread_cpus(c.popen.pid) == {one}
        # The tests after this one run it on every core, as the other workers.
        r = await http.post(f"{c.url}/set_cpus", json={"cpus": every})
        assert r.status_code == 200 and thread_cpus(c.popen.pid) == {all_cores}


async def test_a_switch_lets_the_leg_in_flight_finish_and_refuses_new_ones(fleet: Fleet) -> None:
    a, b = fleet["a"], fleet["b"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        assert (await registered(http, fleet))[str(b.url)] == ("decode", 0)
        async with trio.open_nursery() as nursery:
            body, got = await hold_d_leg(http, nursery, a, b, seed=0)
            await switch(http, b, "prefill")
            i = await info(http, b)
            assert i["role_state"] == "DRAINING" and i["disaggregation_mode"] == "decode"
            r = await http.post(f"{b.url}/switch_role", json={"role": "decode"})
            assert r.status_code == 409 and "under way" in error_message(r), r.text
            r = await http.post(f"{b.url}/generate", json={"text": "hi"},
                                headers={"X-PD-Role": "decode"})
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "switching its role from decode to prefill" in error_message(r)
            health = await http.get(f"{b.url}/health")
            assert health.status_code == 503 and health.json()["status"] == "switching_role"

            async def withdrawn() -> bool | None:
                return True if str(b.url) not in await registered(http, fleet) else None

            await wait_until(withdrawn, SLACK, "b's record withdrawn")
            r = await http.post(f"{a.url}/generate", json=body)  # P's leg: the room goes on
            assert r.status_code == 200, r.text
        assert got["d"].status_code == 200, got["d"].text
        assert len(got["d"].json()["output_ids"]) == 6
        i = await serving(http, b, "prefill", 1)
        assert i["prefill_bootstrap_port"] is not None
        assert i["last_role_switch"]["failed_in_flight"] == 0
        assert (await registered(http, fleet))[str(b.url)] == ("prefill", 1)
        await wait_clean(http, a, b, timeout=SLACK)
        # Back, as an operator does: pd-fsm switch-role waits until it serves.
        code, said = await switch_role(str(b.url), "decode", None, 30.0)
        assert code == 0 and "serves as decode (role epoch 2) after" in said, said
        await serving(http, b, "decode", 2)
        # P again: where routers knew it, the same bootstrap port. Then D, for the tests below.
        port = i["prefill_bootstrap_port"]
        await switch(http, b, "prefill")
        assert (await serving(http, b, "prefill", 3))["prefill_bootstrap_port"] == port
        await switch(http, b, "decode")
        await serving(http, b, "decode", 4)
        await wait_clean(http, a, b, timeout=SLACK)


async def test_past_the_drain_deadline_the_leg_fails_naming_the_switch(fleet: Fleet) -> None:
    a, c = fleet["a"], fleet["c"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        async with trio.open_nursery() as nursery:
            # P's leg never comes: only the deadline ends D's.
            _, got = await hold_d_leg(http, nursery, a, c, seed=1)
            await switch(http, c, "null")
        assert got["d"].status_code == 503, got["d"].text
        message = error_message(got["d"])
        assert "switched its role from decode to null" in message
        assert "drain timeout (1 s)" in message
        i = await serving(http, c, "null", 1)
        assert i["last_role_switch"]["failed_in_flight"] == 1
        # The null role's priority: every thread that was at decode's moved; none is left there
        # (the transfer threads keep --transfer-nice where this process may raise them).
        assert i["nice"] == 5
        threads = thread_nices(c.popen.pid)
        assert 5 in threads and 2 not in threads, threads
        assert i["prefill_bootstrap_port"] is None
        assert str(c.url) not in await registered(http, fleet)  # a colocated worker is in none
        # P heard D's ABORT: its room is gone too, and c serves as a colocated worker.
        await wait_clean(http, a, c, timeout=SLACK)
        r = await http.post(f"{c.url}/generate", json={
            "input_ids": prompt(8), "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 3, r.text
        await wait_clean(http, c, timeout=SLACK)


async def test_a_client_abort_during_the_drain_ends_it_at_once(fleet: Fleet) -> None:
    a, b = fleet["a"], fleet["b"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        epoch = (await info(http, b))["role_epoch"]
        async with trio.open_nursery() as nursery:
            body, got = await hold_d_leg(http, nursery, a, b, seed=3)
            await switch(http, b, "prefill")
            r = await http.post(f"{b.url}/abort_request", json={"rid": body["rid"]})
            assert r.json() == {"aborted": [body["rid"]]}, r.text
        assert got["d"].status_code == 499, got["d"].text
        # Nothing left in flight: the switch goes on at once, not at the 20 s drain deadline.
        i = await serving(http, b, "prefill", epoch + 1, timeout=SLACK)
        assert i["last_role_switch"]["failed_in_flight"] == 0
        assert i["last_role_switch"]["seconds"] < SLACK
        await wait_clean(http, a, b, timeout=SLACK)  # P heard D's ABORT
        await switch(http, b, "decode")
        await serving(http, b, "decode", epoch + 2)


async def test_a_prefill_killed_during_the_drain(fleet: Fleet) -> None:
    a, b = fleet["a"], fleet["b"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        epoch = (await info(http, b))["role_epoch"]
        async with trio.open_nursery() as nursery:
            _, got = await hold_d_leg(http, nursery, a, b, seed=4)
            await switch(http, b, "prefill")
            a.kill()  # SIGKILL: P, and the room it held, gone
        # D finds P lost (2 s peer timeout) and fails the room: the drain is over, the role goes.
        assert got["d"].status_code == 502, got["d"].text
        assert "silent" in error_message(got["d"]), got["d"].text
        i = await serving(http, b, "prefill", epoch + 1, timeout=SLACK)
        assert i["last_role_switch"]["failed_in_flight"] == 0
        await wait_clean(http, b, timeout=SLACK)
        await trio.to_thread.run_sync(fleet.restart, "a")  # same argv: P again, epoch 0
        await wait_clean(http, a, timeout=SLACK)
        await switch(http, b, "decode")
        await serving(http, b, "decode", epoch + 2)


async def test_a_role_that_cannot_start_gives_way_to_the_old_one(fleet: Fleet) -> None:
    d = fleet["d"]
    async with httpx.AsyncClient(timeout=30) as http:
        with socket.socket() as holder:  # P's side channel cannot bind its port
            holder.bind((HOST, D_SIDE_PORT))
            holder.listen()
            await switch(http, d, "prefill")

            async def over() -> dict[str, Any] | None:
                i = await info(http, d)
                return i if i["last_role_switch"] is not None else None

            i, _ = await wait_until(over, SLACK, "d serving again")
        assert (i["role_state"], i["disaggregation_mode"], i["role_epoch"]) == (
            "SERVING", "decode", 0)
        assert i["last_role_switch"]["outcome"] == "restored"
        assert (await registered(http, fleet))[str(d.url)] == ("decode", 0)
        metrics = (await http.get(f"{d.url}/metrics")).text
        assert ('pd_fsm_worker_role_switches_total{from="decode",outcome="restored",'
                'to="prefill"} 1.0') in metrics
        # It serves as D (a plain request: D prefills it itself), and holds nothing.
        r = await http.post(f"{d.url}/generate", json={
            "input_ids": prompt(8), "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert r.status_code == 200, r.text
        await wait_clean(http, d, timeout=SLACK)
        # The port free again, the same request succeeds.
        await switch(http, d, "prefill")
        await serving(http, d, "prefill", 1)
        await wait_clean(http, d, timeout=SLACK)


async def test_a_1p1d_flip_serves_the_same_request_the_other_way_round(fleet: Fleet) -> None:
    a, b = fleet["a"], fleet["b"]
    ids = prompt(20, seed=2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=60.0)) as http:
        p_r, d_r = await both_legs(http, a, b, leg(new_room(), ids, 8, a))
        assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
        before = d_r.json()["output_ids"]
        epochs = {p.name: (await info(http, p))["role_epoch"] for p in (a, b)}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(switch, http, a, "decode")
            nursery.start_soon(switch, http, b, "prefill")
        a_info = await serving(http, a, "decode", epochs["a"] + 1)
        b_info = await serving(http, b, "prefill", epochs["b"] + 1)
        for i in (a_info, b_info):  # every role was compiled at start
            assert i["last_role_switch"]["compiles"] == 0, i["last_role_switch"]
        await wait_clean(http, a, b, timeout=SLACK)
        listed = await registered(http, fleet)
        assert listed[str(a.url)] == ("decode", epochs["a"] + 1)
        assert listed[str(b.url)] == ("prefill", epochs["b"] + 1)
        # b as P: known by the bootstrap port its /server_info names.
        b_as_p = attrs.evolve(b, bootstrap_port=b_info["prefill_bootstrap_port"])
        p_r, d_r = await both_legs(http, b_as_p, a, leg(new_room(), ids, 8, b_as_p))
        assert p_r.status_code == 200 and d_r.status_code == 200, (p_r.text, d_r.text)
        assert d_r.json()["output_ids"] == before  # the same weights, the same greedy answer
        assert d_r.json()["meta_info"]["cached_tokens"] == 0  # pulled from b, not prefilled
        # A router that still thinks a is P gets a 409 naming what a is now.
        r = await http.post(f"{a.url}/generate", json={"text": "hi"},
                            headers={"X-PD-Role": "prefill"})
        assert r.status_code == 409, r.text
        assert r.headers["x-pd-role"] == "decode"
        assert r.headers["x-pd-role-epoch"] == str(epochs["a"] + 1)
        await wait_clean(http, a, b, timeout=SLACK)
        metrics = (await http.get(f"{a.url}/metrics")).text
        assert 'pd_fsm_worker_role{key="decode"} 1.0' in metrics
        assert ('pd_fsm_worker_role_switches_total{from="prefill",outcome="switched",'
                'to="decode"} 1.0') in metrics


def test_when_no_role_can_start_the_worker_exits_non_zero(tmp_path: Path) -> None:
    """Neither the new role nor the old one can start (the worker's cluster-secret file is gone:
    both PD roles read it when built): the worker exits non-zero, naming both failures."""
    f = Fleet(tmp_path, secret=True)
    secret = tmp_path / "worker.secret"  # the worker's own copy: the registry keeps its file
    assert f.secret_file is not None
    secret.write_bytes(f.secret_file.read_bytes())
    f.bootstrap()
    e = f.prefill("e", extra=[*ROLES, "--cluster-secret-file", str(secret)])
    f.start()
    try:
        secret.unlink()
        r = httpx.post(f"{e.url}/switch_role", json={"role": "decode"}, timeout=30)
        assert r.status_code == 202, r.text
        assert e.popen is not None
        code = e.popen.wait(SLACK)
        assert code != 0
        log = e.log_path.read_text()
        assert "switching from prefill to decode failed" in log, e.tail()
        assert log.count("No such file or directory") >= 2, e.tail()
    finally:
        f.close()
