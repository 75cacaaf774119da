"""`pd-fsm cluster` as a real process tree: it starts its children, waits for their health,
stops them all on SIGTERM, and fails loudly (exit 1, the child's last lines) when one dies."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest
import trio

pytestmark = pytest.mark.slow

BASE = [sys.executable, "-m", "pd_fsm.cli", "cluster", "--prefill", "0", "--decode", "0",
        "--colocated", "--model", "tiny", "--num-pages", "64", "--page-size", "4"]


async def test_cluster_starts_and_stops_children_on_sigterm() -> None:
    proc = await trio.lowlevel.open_process(BASE, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    out = b""
    try:
        with trio.fail_after(120):
            async for chunk in proc.stdout:
                out += chunk
                if re.search(rb"colocated +http://\S+", out):
                    break
        found = re.search(rb"colocated +(http://\S+)", out)
        assert found is not None
        url = found.group(1).decode()
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/generate", json={"text": "hi",
                                                   "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            async for chunk in proc.stdout:
                out += chunk
            code = await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    assert code == 0, out.decode()[-3000:]
    assert b"SIGTERM, stopping" in out
    # The worker went with it.
    async with httpx.AsyncClient(timeout=2) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(f"{url}/health")


async def test_cluster_fails_with_the_dead_childs_log_tail() -> None:
    result = await trio.run_process(
        [*BASE, "--worker-args", "--max-running 0"], capture_stdout=True, capture_stderr=True,
        check=False,
    )
    assert result.returncode == 1
    err = result.stderr.decode()
    assert "FAILED: colocated exited with status 2" in err
    assert "last lines of colocated" in err and "--max-running must be > 0" in err
