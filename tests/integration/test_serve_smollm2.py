"""SmolLM2 behind the colocated worker: the chat template and real weights end to end."""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.integration.serve_support import start_worker, wait_idle

pytestmark = pytest.mark.slow


async def test_chat_capital_of_france(nursery: trio.Nursery) -> None:
    url, _ = await start_worker(
        nursery, model="smollm2", num_pages=64, page_size=16, context_length=1024,
        max_batched_tokens=512,
    )
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        r = await http.post(
            "/v1/chat/completions",
            json={
                "model": "smollm2",
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 24,
                "temperature": 0,
            },
        )
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert "Paris" in answer, answer
        await wait_idle(http)
