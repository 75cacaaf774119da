"""Helpers for the serving tests: an in-process worker on 127.0.0.1 and SSE reading."""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from pd_fsm.io_trio.worker.app import WorkerApp, serve_worker
from pd_fsm.io_trio.worker.colocated import ColocatedBackend
from pd_fsm.io_trio.worker.config import ServeConfig

TINY = {
    "model": "tiny",
    "num_pages": 96,
    "page_size": 4,
    "max_running": 4,
    "max_batched_tokens": 256,
    "context_length": 256,
    "max_body": 64 * 1024,
}


async def start_worker(nursery: trio.Nursery, **overrides: Any) -> tuple[str, WorkerApp]:
    config = ServeConfig(**{**TINY, **overrides, "port": 0})
    backend = ColocatedBackend(config.scheduler_args(), max_queued=config.max_queued)
    worker = WorkerApp(config, backend)
    url: str = await nursery.start(serve_worker, worker, "127.0.0.1", 0)
    with trio.fail_after(120):
        while not worker.ready():
            await trio.sleep(0.05)
    return url, worker


def sse_events(raw: str) -> list[Any]:
    """The JSON payloads of an SSE body, with ``"[DONE]"`` for the terminator."""
    out: list[Any] = []
    for block in raw.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def wait_idle(http: httpx.AsyncClient, timeout: float = 30) -> dict[str, Any]:
    """/get_load once nothing is running and every page is free again."""
    with trio.fail_after(timeout):
        while True:
            load = (await http.get("/get_load")).json()[0]
            if load["num_reqs"] == 0 and load["num_pages_free"] == load["num_pages_total"]:
                return dict(load)
            await trio.sleep(0.05)
