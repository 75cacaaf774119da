"""One tensor-parallel instance over two processes (``pd-fsm serve --tp 2 --nnodes 2``), with
real processes: two JAX processes joined by ``jax.distributed`` (gloo on CPU), one device each,
one mesh; rank 0 serves HTTP and sends its scheduler's inputs to rank 1 over the signed command
stream. Every answer (greedy, seeded sampling, several sequences, log-probs, streams cut short)
equals the one-process tp=1 worker's, and afterwards every page is back. Then a rank killed makes
the next request fail with a 500 naming it and the rest of the instance exit by itself, within
the coordination service's heartbeat timeout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import trio

from tests.integration.failure_support import (
    HOST,
    TINY,
    Fleet,
    Proc,
    cli,
    free_port,
    free_port_pair,
    stats,
    wait_healthy,
)

pytestmark = pytest.mark.slow

HEARTBEAT_TIMEOUT = 30  # pd_fsm.jax_engine.parallel.distributed.initialize's default
EXIT_SLACK = 60  # on top of it: 2 cores shared with the rest of the suite


def _instance(fleet: Fleet, name: str) -> tuple[Proc, Proc]:
    port, coordinator = free_port(), free_port_pair()
    ranks = []
    for rank in range(2):
        argv = cli("serve", *TINY, "--host", HOST, "--port", str(port), "--num-pages", "64",
                   "--tp", "2", "--nnodes", "2", "--node-rank", str(rank),
                   "--dist-init-addr", f"{HOST}:{coordinator}",
                   "--cluster-secret-file", str(fleet.secret_file))
        url = f"http://{HOST}:{port}" if rank == 0 else None
        proc = Proc(f"{name}-rank{rank}", argv, fleet.dir / f"{name}-rank{rank}.log", url)
        fleet.procs[proc.name] = proc  # stopped with the fleet
        ranks.append(proc)
    for proc in ranks:
        proc.start()
    return ranks[0], ranks[1]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    fleet = Fleet(tmp_path_factory.mktemp("nnodes"), secret=True, windows={})
    fleet.colocated()
    fleet["colocated"].start()
    try:
        yield fleet
    finally:
        fleet.close()


BODIES: list[dict[str, Any]] = [
    {"input_ids": [5, 6, 7, 8, 9], "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
    {"input_ids": list(range(40, 101)), "sampling_params": {"max_new_tokens": 9,
                                                            "temperature": 0}},
    {"input_ids": [3, 1, 4, 1, 5], "sampling_params": {"max_new_tokens": 10, "temperature": 0.9,
                                                       "seed": 11}},
    {"input_ids": [2, 7, 1, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0.8,
                                                    "n": 2, "seed": 5}},
    {"input_ids": [9, 9, 8], "sampling_params": {"max_new_tokens": 5, "temperature": 0},
     "return_logprob": True, "top_logprobs_num": 3},
]


async def _answers(http: httpx.AsyncClient, url: str) -> dict[int, Any]:
    out: dict[int, Any] = {}

    async def one(i: int, body: dict[str, Any]) -> None:
        r = await http.post(f"{url}/generate", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        items = data if isinstance(data, list) else [data]
        out[i] = [(d["output_ids"], [lp for lp, _, _ in
                                     d["meta_info"].get("output_token_logprobs") or []])
                  for d in items]

    async def cut_short() -> None:
        body = {"input_ids": [4, 4, 4], "sampling_params": {"max_new_tokens": 200}, "stream": True}
        with trio.move_on_after(0.5):
            async with http.stream("POST", f"{url}/generate", json=body) as r:
                async for _ in r.aiter_bytes():
                    pass

    async with trio.open_nursery() as nursery:
        for i, body in enumerate(BODIES):
            nursery.start_soon(one, i, body)
        for _ in range(2):
            nursery.start_soon(cut_short)
    return out


def _ids(answers: dict[int, Any]) -> dict[int, list[list[int]]]:
    return {i: [ids for ids, _ in seqs] for i, seqs in answers.items()}


@pytest.fixture(scope="module")
def instance(fleet: Fleet) -> tuple[Proc, Proc]:
    """One instance for the module: first compared, then broken (SIGTERM's clean stop of both
    ranks is in test_multihost_nnodes.py, across hosts)."""
    rank0, rank1 = _instance(fleet, "a")
    wait_healthy([fleet["colocated"], rank0])
    return rank0, rank1


def test_two_process_instance_answers_as_one_process(
        fleet: Fleet, instance: tuple[Proc, Proc]) -> None:
    rank0, _ = instance

    async def main() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=180.0)) as http:
            want = await _answers(http, str(fleet["colocated"].url))
            for _ in range(2):  # the second round meets the prefix cache both sides filled
                got = await _answers(http, str(rank0.url))
                # Token ids exactly; log-probs within 1e-4 (tp sums partial products in another
                # order: 4e-6 apart measured, as in tests/tp).
                assert _ids(got) == _ids(want)
                for i, seqs in want.items():
                    for (_, lps), (_, got_lps) in zip(seqs, got[i], strict=True):
                        assert got_lps == pytest.approx(lps, abs=1e-4)
            with trio.fail_after(30):
                while True:
                    s = await stats(http, rank0)
                    if s["live_requests"] == 0:
                        break
                    await trio.sleep(0.2)
            assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s
            assert s["requests_total"]["error"] == 0, s
            assert s["spmd"]["joined"] == 1 and s["spmd"]["frames_dropped"] == 0, s
            assert s["spmd"]["frames_sent"] >= s["steps_total"], s  # a frame before each step

    trio.run(main)


def test_a_killed_rank_stops_the_instance_loudly(instance: tuple[Proc, Proc]) -> None:
    rank0, rank1 = instance
    rank1.kill()
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(f"{rank0.url}/generate", json=body, timeout=120)
    assert r.status_code == 500 and "rank 1 is gone" in r.text, r.text
    assert rank0.popen is not None
    # The coordination service notices the dead rank and ends rank 0 too (no half instance).
    assert rank0.popen.wait(HEARTBEAT_TIMEOUT + EXIT_SLACK) != 0, rank0.tail()
