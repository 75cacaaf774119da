"""The registry's ``GET /list?role=...`` as its readers use it (the proxy routes the workers it
lists, the planner observes them)."""

from __future__ import annotations

from typing import Any

import httpx

from pd_fsm.io_trio.strict_json import loads as strict_loads


async def list_role(client: httpx.AsyncClient, bootstrap_url: str, role: str
                    ) -> list[dict[str, Any]]:
    """The records of ``role``'s instances, rank 0 of each. Raises httpx.HTTPError or
    ValueError (an answer that is not the registry's)."""
    r = await client.get(f"{bootstrap_url}/list", params={"role": role})
    r.raise_for_status()
    answer = strict_loads(r.content, what="the registry's answer")
    records = answer["instances"] if isinstance(answer, dict) else None
    if not isinstance(records, list):
        raise ValueError("the registry's answer has no list of instances")
    # An instance spanning processes registers every P rank's transfer server; routers
    # send requests to its entry, rank 0 (the others serve no HTTP).
    return [rec for rec in records if isinstance(rec, dict) and rec.get("tp_rank", 0) == 0]


def worker_url(rec: dict[str, Any]) -> str | None:
    """A record's HTTP URL (its ``scheduler_addr``), or None if it has none."""
    addr = rec.get("scheduler_addr")
    if not isinstance(addr, str) or not addr:
        return None
    return (addr if "://" in addr else f"http://{addr}").rstrip("/")
