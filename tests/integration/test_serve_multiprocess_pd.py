"""A prefill and a decode instance that each span two processes (``pd-fsm serve --tp 2 --nnodes 2
--disaggregation-mode prefill|decode``), with real processes: RFC-2 §6.2's N:N pairing. Rank 0
of each runs the PD protocol; rank 1 runs the same ticks on rank 0's inputs. Each P rank
registers its own transfer server (its own ``tp_rank``) and its shard of every room's KV; each D
rank pulls its shard from the P rank in its place, found by ``GET /route`` with its full rank
tuple, and the ranks scatter a room's KV in the same tick once all have it. Answers equal a
one-process worker's; afterwards every page, room and registration is released
(rank 1's too: it would leave the instance on a mismatch with rank 0). A one-process D is
refused by name before any pull."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    HOST,
    Fleet,
    Proc,
    error_message,
    free_port_pair,
    greedy,
    leg,
    new_room,
    prompt,
    stats,
    wait_clean,
)

pytestmark = pytest.mark.slow

LENGTHS = (5, 23, 61)  # 2, 6 and 16 pages of 4 tokens
NEW_TOKENS = 10


def _ranks(fleet: Fleet, name: str, mode: str) -> Proc:
    """An instance of ``mode`` over two processes; its rank 0 (rank 1, the same flags but its
    rank, has no HTTP to wait on and is stopped with the fleet)."""
    role = fleet.prefill if mode == "prefill" else fleet.decode
    rank0 = role(f"{name}-rank0", extra=[
        "--tp", "2", "--nnodes", "2", "--node-rank", "0",
        "--dist-init-addr", f"{HOST}:{free_port_pair()}"])
    argv = list(rank0.argv)
    argv[argv.index("--node-rank") + 1] = "1"
    rank1 = Proc(f"{name}-rank1", argv, fleet.dir / f"{name}-rank1.log")
    fleet.procs[rank1.name] = rank1
    return rank0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("nnodes-pd"), secret=True, windows={})
    fleet.bootstrap()
    _ranks(fleet, "p", "prefill")
    _ranks(fleet, "d", "decode")
    # One process: not a partner for p. Its own prefills of plain requests are the reference
    # (tp=2 in one process answers as tp=1: test_serve_tp.py, tests/tp).
    fleet.decode("d-one", extra=["--tp", "2"])
    try:
        fleet.start(timeout=300)
        yield fleet
    finally:
        fleet.close()


async def _pd(http: httpx.AsyncClient, p: Proc, d: Proc,
              ids: list[int]) -> dict[str, httpx.Response]:
    body = leg(new_room(), ids, NEW_TOKENS, p)
    answers: dict[str, httpx.Response] = {}

    async def post(proc: Proc) -> None:
        answers[proc.name] = await http.post(f"{proc.url}/generate", json=body)

    async with trio.open_nursery() as nursery:
        for proc in (p, d):
            nursery.start_soon(post, proc)
    return answers


async def test_two_process_pd_equals_colocated(fleet: Fleet) -> None:
    p, d = fleet["p-rank0"], fleet["d-rank0"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
        for seed, n in enumerate(LENGTHS):
            ids = prompt(n, seed)
            want = await greedy(http, fleet["d-one"], ids, NEW_TOKENS)
            answers = await _pd(http, p, d, ids)
            assert answers[p.name].status_code == 200, answers[p.name].text
            assert answers[d.name].status_code == 200, answers[d.name].text
            assert answers[d.name].json()["output_ids"] == want, n
        s = await stats(http, d)
        assert s["transfer"]["pulls_ok"] == len(LENGTHS), s["transfer"]
        assert s["spmd"]["joined"] == 1 and s["spmd"]["frames_dropped"] == 0, s["spmd"]
        await wait_clean(http, p, d, timeout=30)
        # Rank 1 of P registered its own transfer server, as tp_rank 1 of the same instance.
        r = await http.get(f"{fleet.boot_url}/route", params={
            "role": "prefill", "host": HOST, "port": p.bootstrap_port, "tp_rank": 1})
        assert r.status_code == 200, r.text
        (record,) = r.json()["instances"]
        assert (record["tp_rank"], record["tp_size"]) == (1, 2)
        (entry,) = (await http.get(f"{fleet.boot_url}/route", params={
            "role": "prefill", "host": HOST, "port": p.bootstrap_port, "tp_rank": 0}
        )).json()["instances"]
        assert record["instance_id"] == entry["instance_id"]
        assert record["transfer_addr"] != entry["transfer_addr"]
    for proc in (fleet["p-rank1"], fleet["d-rank1"]):
        assert proc.alive(), proc.tail()  # never out of step with its rank 0


async def test_a_one_process_decode_is_refused_by_name(fleet: Fleet) -> None:
    """D's leg alone (P's would end at its KV lease, as with any P that D refuses)."""
    p, d = fleet["p-rank0"], fleet["d-one"]
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
        r = await http.post(f"{d.url}/generate", json=leg(new_room(), prompt(9), NEW_TOKENS, p))
        assert r.status_code == 502, r.text
        assert "spans 2 process(es) at tp 2, this decode 1 at tp 2" in error_message(r)
        await wait_clean(http, d, timeout=60)


async def test_a_killed_prefill_rank_fails_its_instance_loudly_and_decode_cleanly(
        fleet: Fleet) -> None:
    """Last (it breaks P): P's rank 1 gone, P's rank 0 answers its leg with an error naming it
    and exits; D answers its leg with a 502 once P is silent, and holds nothing afterwards, on
    either of its ranks (rank 1 would leave on any difference from rank 0).

    P's error is a 500 when the leg was in flight as the tick failed, and a 503 when an idle
    tick (every SPMD_IDLE_TICK_S) found rank 1 gone before the leg arrived (also once that
    failure's deregistration made P unready): a race this test does not control. Either way
    the answer names the cause, never a bare "shutting down" or "not registered"."""
    p, d = fleet["p-rank0"], fleet["d-rank0"]
    fleet["p-rank1"].kill()
    async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=120.0)) as http:
        answers = await _pd(http, p, d, prompt(7, 3))
        assert answers[p.name].status_code in (500, 503), answers[p.name].text
        assert "rank 1 is gone" in answers[p.name].text
        assert answers[d.name].status_code == 502, answers[d.name].text
        await wait_clean(http, d, timeout=60)
    assert p.popen is not None
    assert await trio.to_thread.run_sync(p.popen.wait, 90) != 0, p.tail()
    assert fleet["d-rank1"].alive(), fleet["d-rank1"].tail()
