"""The real sglang-router (PyPI, a Rust binary) in --pd-disaggregation mode in front of recording
P/D stand-ins: it registers them through our info endpoints' shape and relays a /generate with
the three bootstrap fields. Also the same stand-ins behind our own worker's info endpoints are
what the router reads, so this pins the wire shape both sides agree on."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from pd_fsm.core.messages import MAX_ROOM
from pd_fsm.io_trio.ports import free_ports
from tests.integration.pd_standins import serve_standin

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason="sglang-router is not installed (pip install sglang-router==0.3.2, the 'test' extra)",
)


async def test_sglang_router_pd_mode_registers_and_relays(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    p_url, p = await serve_standin(nursery, "prefill")
    d_url, d = await serve_standin(nursery, "decode")
    port, metrics_port = free_ports(2)  # held together while picked: never the same
    log = (tmp_path / "router.log").open("wb")
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", p_url, "8998", "--decode", d_url,
        "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
    ]
    proc = await trio.lowlevel.open_process(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            body = {"text": "hello", "sampling_params": {"max_new_tokens": 2}}
            r = None
            with trio.fail_after(60):
                while True:
                    if proc.poll() is not None:
                        pytest.fail(f"router exited {proc.returncode}: "
                                    f"{(tmp_path / 'router.log').read_text()[-3000:]}")
                    try:
                        r = await http.post("/generate", json=body)
                        if r.status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await trio.sleep(0.5)
            assert r is not None and r.json()["served_by"] == "decode"
            p_body = p.generations()[-1].body
            d_body = d.generations()[-1].body
            # The OpenAI endpoints: the router re-serialises chat with defaults of its own.
            chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 3}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            chat_body = p.generations()[-1].body
            completion = {"model": "m", "prompt": "hi", "max_tokens": 3}
            assert (await http.post("/v1/completions", json=completion)).status_code == 200
            completion_body = p.generations()[-1].body
    finally:
        proc.terminate()
        with trio.move_on_after(10):
            await proc.wait()
        if proc.poll() is None:
            proc.kill()
        log.close()
    # Registration: health first, then the info endpoints (model_path is a local file here).
    for standin in (p, d):
        assert "/health" in standin.gets
        assert {"/server_info", "/get_server_info"} & set(standin.gets), standin.gets
    assert p_body["bootstrap_host"] == "127.0.0.1" and p_body["bootstrap_port"] == 8998
    assert 0 <= p_body["bootstrap_room"] < MAX_ROOM
    assert d_body["bootstrap_room"] == p_body["bootstrap_room"]
    assert p_body["text"] == "hello"
    # What the router re-serialises must be a valid request for our own worker.
    from pd_fsm.io_trio.worker.schemas import Limits, parse_chat, parse_completion, parse_generate

    limits = Limits(context_length=1024, vocab_size=50000)
    parsed = parse_generate(p_body, limits)
    assert parsed.bootstrap is not None and parsed.bootstrap.room == p_body["bootstrap_room"]
    # Every default it fills in is one the worker accepts (schemas._TOP_LEVEL), and nothing it
    # adds is refused as unimplemented.
    assert parse_chat(chat_body, limits).sampling.max_new_tokens == 3
    assert parse_completion(completion_body, limits).text == "hi"
