"""A worker drains (issue 32 §3): refuses new requests with 503 and Retry-After (a router retries
them elsewhere at once), says so on /health, and ``drain()`` returns once nothing is in flight.
In process, on the tiny model (the real-process SIGTERM is in test_failures_migration.py)."""

from __future__ import annotations

import httpx
import trio

from tests.integration.serve_support import start_worker


async def test_a_draining_worker_refuses_new_requests_and_finishes_what_it_has(
    nursery: trio.Nursery,
) -> None:
    url, worker = await start_worker(nursery)
    body = {"text": "hello", "stream": True,
            "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}}
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{url}/generate", json=body) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_raw()
            await chunks.__anext__()  # the request is in flight
            drained = trio.Event()

            async def drain() -> None:
                await worker.drain()
                drained.set()

            nursery.start_soon(drain)
            with trio.fail_after(5):
                while not worker.draining:
                    await trio.sleep(0.01)
            r = await http.post(f"{url}/generate", json={**body, "stream": False})
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "draining" in r.json()["error"]["message"]
            health = await http.get(f"{url}/health")
            assert health.status_code == 503 and health.json() == {"status": "draining"}
            rest = b"".join([c async for c in chunks])
        assert rest.endswith(b"data: [DONE]\n\n")  # the request in flight finished whole
        with trio.fail_after(10):
            await drained.wait()
