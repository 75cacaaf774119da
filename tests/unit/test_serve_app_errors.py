"""The HTTP layer over a scripted backend: BackendError statuses reach the client as JSON before
a stream starts, and as a final abort chunk + [DONE] once it has; bootstrap fields reach the job."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import httpx
import pytest
import trio

from pd_fsm.io_trio.worker.app import WorkerApp
from pd_fsm.io_trio.worker.backend import BackendError, BootstrapInfo, GenerateJob
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.health import Health
from pd_fsm.io_trio.worker.streams import StreamTable
from pd_fsm.jax_engine.model import load_model
from pd_fsm.schedulers.request import FinishReason, RequestOutput
from tests.integration.serve_support import sse_events


class ScriptedBackend:
    """Yields ``tokens`` outputs, then raises ``fail_with`` (or finishes)."""

    mode = "decode"

    def __init__(self, tokens: int, fail_with: BackendError | None) -> None:
        self.tokens = tokens
        self.fail_with = fail_with
        self.jobs: list[GenerateJob] = []
        self.health = Health(ready=True)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    async def generate(self, job: GenerateJob) -> AsyncGenerator[RequestOutput, None]:
        self.jobs.append(job)
        for i in range(self.tokens):
            await trio.sleep(0)
            last = i == self.tokens - 1 and self.fail_with is None
            yield RequestOutput(job.rid, (65 + i,), (-0.5,), chr(65 + i),
                                FinishReason("length") if last else None,
                                len(job.input_ids), i + 1)
        if self.fail_with is not None:
            raise self.fail_with

    def abort(self, rid: str) -> bool:
        return False

    def ready(self) -> bool:
        return self.health.ready

    def stats(self) -> dict[str, Any]:
        return {"kvpoll": {"Bootstrapping": 1, "Transferring": 2}, "transfer_bytes_total": 7}


def _client(backend: ScriptedBackend) -> httpx.AsyncClient:
    worker = WorkerApp(ServeConfig(model="tiny", disaggregation_mode="decode"), backend,
                       model=load_model("tiny"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=worker.app), base_url="http://w")


BOOT = {"bootstrap_host": "10.1.2.3", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}


@pytest.mark.parametrize("status", [500, 502, 503, 504, 400])
async def test_error_before_first_output_keeps_its_status(status: int) -> None:
    backend = ScriptedBackend(0, BackendError(status, "no KV from prefill"))
    async with _client(backend) as http:
        for path, body in (("/generate", {"text": "hi"}),
                           ("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                r = await http.post(path, json={**body, **BOOT, "stream": stream})
                assert r.status_code == status, (path, stream)
                assert r.json()["error"] == {"message": "no KV from prefill",
                                             "type": r.json()["error"]["type"], "code": status}
    assert backend.jobs[0].bootstrap == BootstrapInfo("10.1.2.3", 8998, 2**63 - 1)


async def test_error_mid_stream_ends_with_abort_chunk() -> None:
    backend = ScriptedBackend(3, BackendError(502, "transfer failed"))
    async with _client(backend) as http:
        r = await http.post("/generate", json={"text": "hi", "stream": True, **BOOT})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        # sglang's abort shape, its status too: a proxy migrates a stream on a 5xx one.
        assert events[-2]["meta_info"]["finish_reason"] == {"type": "abort",
                                                            "message": "transfer failed",
                                                            "status_code": 502}
        assert events[-2]["text"] == "ABC"
        r = await http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "stream": True, **BOOT})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "abort"
        assert events[-2]["error"]["message"] == "transfer failed"
        # Non-streaming: the status, never a 200 with partial tokens.
        r = await http.post("/generate", json={"text": "hi", **BOOT})
        assert r.status_code == 502
        metrics = (await http.get("/metrics")).text
        assert 'pd_fsm_worker_backend_kvpoll{key="Transferring"} 2.0' in metrics
        assert "pd_fsm_worker_backend_transfer_bytes_total 7.0" in metrics
        assert (await http.get("/health")).status_code == 200
        hg = await http.get("/health_generate")
        assert hg.status_code == 200 and hg.json()["generated"] is False


async def test_a_failed_worker_names_its_failure_not_readiness() -> None:
    """A request arriving after the scheduler failed (its deregistration makes the worker
    unready too) is told the failure, not "not registered": a CI flake once showed the latter
    where a rank of P's instance was gone."""
    backend = ScriptedBackend(1, None)
    async with _client(backend) as http:
        assert (await http.post("/generate", json={"text": "hi", **BOOT})).status_code == 200
        backend.health.step_failed(RuntimeError("rank 1 is gone"), StreamTable(max_queued=1))
        r = await http.post("/generate", json={"text": "hi", **BOOT})
        assert r.status_code == 503
        assert r.json()["error"]["message"] == (
            "the worker is exiting: scheduler step failed: RuntimeError('rank 1 is gone')")
    assert len(backend.jobs) == 1
