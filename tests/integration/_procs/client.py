"""Test-side handle on a p_server.py process: every read has a timeout."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from pd_fsm.jax_engine.kv.host_memory import hugepage_env

ROOT = Path(__file__).resolve().parents[3]


def stop(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP ``pid`` and wait until the kernel shows it stopped: the signal is delivered
    asynchronously, and a process not stopped yet can still answer (a pull finished after its
    P was "frozen" was seen here)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    # /proc/PID/stat: "pid (comm) state ..."; comm may hold spaces and parentheses.
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in "tT":
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped within {timeout:g} s")
        time.sleep(0.001)


class PServer:
    def __init__(
        self, seed: int, pools: list[str], start_timeout: float = 60.0, host_heap: str = "default"
    ) -> None:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
        env.pop("GLIBC_TUNABLES", None)
        if host_heap == "hugepages":  # as `pd-fsm serve --host-heap hugepages` starts a worker
            env = hugepage_env(env) or env
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration._procs.p_server", str(seed), ",".join(pools)],
            cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self._next(start_timeout)
        self.address: str = hello["address"]
        self.layout_hash: str = hello["layout_hash"]
        self.pid: int = hello["pid"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError("P helper did not answer in time") from None
        if line is None:
            raise RuntimeError(f"P helper exited (rc={self.proc.poll()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def call(self, timeout: float = 30.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._next(timeout)

    def rss_kib(self) -> int:
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.call(op="quit", timeout=10)
            self.kill()
