"""Helpers for the serving tests: an in-process worker on 127.0.0.1, SSE reading, and (for the
PD tests) `pd-fsm` processes, request bodies per endpoint and answers folded for comparison."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import attrs
import httpx
import trio

from pd_fsm.io_trio.unix_sockets import service_url
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
    "warmup": "minimal",  # tests/conftest.py says why
}


async def start_worker(nursery: trio.Nursery, **overrides: Any) -> tuple[str, WorkerApp]:
    config = ServeConfig(**{**TINY, **overrides, "port": 0})
    backend = ColocatedBackend(
        config.scheduler_args(), max_queued=config.max_queued, warmup=config.warmup
    )
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


def idle_pages(load: dict[str, Any]) -> bool:
    """A /get_load row whose pages are all free or held by the prefix cache alone."""
    return bool(load["num_pages_free"] + load.get("num_pages_cached", 0)
                == load["num_pages_total"])


async def wait_idle(http: httpx.AsyncClient, timeout: float = 30) -> dict[str, Any]:
    """/get_load once nothing is running and every page is free again (or held by the prefix
    cache alone: evictable, no request's)."""
    with trio.fail_after(timeout):
        while True:
            load = (await http.get("/get_load")).json()[0]
            if load["num_reqs"] == 0 and idle_pages(load):
                return dict(load)
            await trio.sleep(0.05)


# ----------------------------------------------------------------------------- PD processes


@attrs.define
class Proc:
    """A child process whose merged output is drained by a thread (kept for error reports)."""

    name: str
    popen: subprocess.Popen[bytes]
    lines: list[str] = attrs.field(factory=list)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, argv: list[str]) -> Proc:
        popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc = cls(name, popen)
        proc._reader = threading.Thread(target=proc._drain, daemon=True)
        proc._reader.start()
        return proc

    def _drain(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            self.lines.append(raw.decode("utf-8", "replace").rstrip("\n"))

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.lines[-n:])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 20.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        if self._reader is not None:
            self._reader.join(5)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pd_fsm.cli", *args]


_URL_LINE = re.compile(r"^\s+(\S+)\s+(http://\S+|unix:\S+)(?:\s+\(bootstrap port (\d+)\))?")


@attrs.define
class PDCluster:
    """``pd-fsm cluster`` as a process: every child's URL (``http://unix:PATH:`` for a unix
    socket), and P's bootstrap (side-channel) ports, read from the table it prints once
    everything is healthy."""

    proc: Proc
    urls: dict[str, str]
    bootstrap_ports: dict[str, int]

    @classmethod
    def start(cls, argv: list[str], timeout: float = 240.0) -> PDCluster:
        proc = Proc.start("cluster", cli("cluster", *argv))
        deadline = time.monotonic() + timeout
        try:
            while True:
                ready = [i for i, line in enumerate(proc.lines)
                         if line.startswith("pd-fsm cluster: ready")]
                if ready:
                    break
                if not proc.alive() or time.monotonic() > deadline:
                    raise RuntimeError(f"pd-fsm cluster did not get ready:\n{proc.tail()}")
                time.sleep(0.2)
            time.sleep(0.2)  # the URL table follows the ready line
            urls: dict[str, str] = {}
            ports: dict[str, int] = {}
            for line in proc.lines[ready[0] + 1:]:
                m = _URL_LINE.match(line)
                if m is None:
                    continue
                urls[m.group(1)] = service_url(m.group(2), "a URL")  # unix:PATH as a URL
                if m.group(3):
                    ports[m.group(1)] = int(m.group(3))
            return cls(proc, urls, ports)
        except BaseException:
            proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()


def wait_http_ok(url: str, proc: Proc, timeout: float = 120.0) -> None:
    """Block until GET ``url`` answers 200 (or fail with the process's log tail)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if not proc.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name}: {url} not ready:\n{proc.tail()}")
        time.sleep(0.2)


# ----------------------------------------------------------------------------- answers


ENDPOINTS = ("generate", "completions", "chat")
PATHS = {"generate": "/generate", "completions": "/v1/completions",
         "chat": "/v1/chat/completions"}


def request_body(endpoint: str, prompt: str, max_tokens: int, *, stream: bool,
                 model: str = "tiny", **extra: Any) -> dict[str, Any]:
    """A greedy request; OpenAI bodies name ``model`` (sglang-router refuses them without)."""
    if endpoint == "generate":
        return {"text": prompt, "stream": stream,
                "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}, **extra}
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                            "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@attrs.frozen
class Answer:
    """What must be equal between PD and colocated for a greedy request."""

    text: str
    output_ids: tuple[int, ...] | None  # /generate only
    finish: str | None
    completion_tokens: int | None


def _generate_answer(body: dict[str, Any]) -> Answer:
    meta = body["meta_info"]
    finish = meta["finish_reason"]
    return Answer(body["text"], tuple(body["output_ids"]),
                  finish["type"] if isinstance(finish, dict) else None,
                  meta["completion_tokens"])


def full_length_stream(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A greedy /generate stream that runs to ``max_tokens`` (``ignore_eos``): long enough to
    act on mid-stream."""
    body = request_body("generate", prompt, max_tokens, stream=True)
    body["sampling_params"]["ignore_eos"] = True
    return body


async def fetch_answer(http: httpx.AsyncClient, base: str, endpoint: str,
                       body: dict[str, Any]) -> Answer:
    """POST ``body`` and fold the (possibly streamed) response into an Answer; any HTTP error
    or in-band error chunk fails the calling test with the response."""
    r = await http.post(base.rstrip("/") + PATHS[endpoint], json=body)
    assert r.status_code == 200, f"{base}{PATHS[endpoint]}: HTTP {r.status_code}: {r.text[:500]}"
    if not body.get("stream"):
        data = r.json()
        if endpoint == "generate":
            return _generate_answer(data)
        choice = data["choices"][0]
        text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
        return Answer(text, None, choice["finish_reason"], data["usage"]["completion_tokens"])
    assert r.headers["content-type"].startswith("text/event-stream"), r.headers
    events = sse_events(r.text)
    assert events and events[-1] == "[DONE]", r.text[-500:]
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    assert not any("error" in c for c in chunks), r.text[-500:]
    if endpoint == "generate":
        return _generate_answer(chunks[-1])  # sglang streams cumulative bodies
    text, finish, usage = "", None, None
    for c in chunks:
        for choice in c.get("choices") or []:
            piece = choice["delta"].get("content") if endpoint == "chat" else choice.get("text")
            text += piece or ""
            finish = choice.get("finish_reason") or finish
        if c.get("usage"):
            usage = c["usage"]["completion_tokens"]
    return Answer(text, None, finish, usage)


async def worker_stats(http: httpx.AsyncClient, base: str) -> dict[str, Any]:
    """The backend's stats() as /server_info reports them."""
    info = (await http.get(f"{base}/server_info")).json()
    return dict(info["internal_states"][0])
