"""Recording stand-ins for a prefill and a decode worker: small ASGI apps on 127.0.0.1 that log
every request and answer as a scripted P or D would. They are outside the unit under test (the
proxy, sglang-router): they only let a test see what those send and control what they get back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pd_fsm.io_trio.http_server import serve_app


def local_model_path() -> str:
    """A path that exists here (routers try to download anything that looks like a hub id)."""
    from pd_fsm.jax_engine.model.gguf_loader import find_smollm2_gguf

    try:
        return str(find_smollm2_gguf())
    except FileNotFoundError:
        return str(Path(__file__).resolve().parent)


@attrs.define
class Script:
    """How the stand-in answers generation requests."""

    status: int = 200
    error: str = "scripted failure"
    delay: float = 0.0
    hold: bool = False  # answer only once /abort_request names the rid (or never)
    wait_for: trio.Event | None = None  # do not answer before this is set (concurrency check)
    chunks: int = 3  # SSE chunks when streaming
    chunk_gate: trio.Event | None = None  # after the first chunk, wait for this
    input_logprobs: list[Any] | None = None
    output_text: str = "hello"


@attrs.define
class Received:
    path: str
    body: Any
    headers: dict[str, str]
    at: float


class StandIn:
    def __init__(self, role: str) -> None:
        self.role = role
        # A worker that can switch roles reports its epoch and state in /server_info and
        # answers a leg whose X-PD-Role names another role 409 (issue 30 §1); None: it reports
        # neither and checks nothing, as an sglang worker.
        self.role_epoch: int | None = None
        self.role_state = "SERVING"
        self.metrics = ""  # what /metrics answers (a real WorkerMetrics' text, for the planner)
        self.switches: list[Any] = []  # /switch_role bodies; each switches at once
        self.nice: int | None = None  # reported in /server_info when set; /set_nice sets it
        self.nices: list[Any] = []  # /set_nice bodies
        self.cpus: list[int] | None = None  # reported in /server_info when set; /set_cpus sets it
        self.cpu_moves: list[Any] = []  # /set_cpus bodies
        self.script = Script()
        self.received: list[Received] = []
        self.aborts: list[str] = []
        self.disconnects: list[str] = []
        self.arrived = trio.Event()  # set at the first generation request
        self._abort_events: dict[str, trio.Event] = {}
        self.gets: list[str] = []
        routes = [Route(p, self._generate, methods=["POST"])
                  for p in ("/generate", "/v1/completions", "/v1/chat/completions")]
        routes += [Route("/abort_request", self._abort, methods=["POST"]),
                   Route("/switch_role", self._switch_role, methods=["POST"]),
                   Route("/set_nice", self._set_nice, methods=["POST"]),
                   Route("/set_cpus", self._set_cpus, methods=["POST"])]
        for path in ("/health", "/server_info", "/get_server_info", "/model_info", "/metrics",
                     "/get_model_info", "/get_load", "/v1/models", "/health_generate"):
            routes.append(Route(path, self._get, methods=["GET"]))
        self.app = Starlette(routes=routes)

    def generations(self) -> list[Received]:
        return [r for r in self.received if r.path != "/abort_request"]

    async def _get(self, request: Request) -> Response:
        path = request.url.path
        self.gets.append(path)
        if path in ("/health", "/health_generate"):
            return JSONResponse({"status": "ok"})
        if path in ("/server_info", "/get_server_info"):
            info: dict[str, Any] = {"model_path": local_model_path(),
                                    "tokenizer_path": local_model_path(),
                                    "disaggregation_mode": self.role, "page_size": 16}
            if self.role_epoch is not None:
                info.update(role_epoch=self.role_epoch, role_state=self.role_state,
                            prefill_bootstrap_port=8998)
            if self.nice is not None:
                info.update(nice=self.nice)
            if self.cpus is not None:
                info.update(cpus=self.cpus)
            return JSONResponse(info)
        if path in ("/model_info", "/get_model_info"):
            return JSONResponse({"model_path": local_model_path(), "is_generation": True})
        if path == "/metrics":
            return Response(self.metrics, media_type="text/plain; version=0.0.4")
        if path == "/get_load":
            return JSONResponse([{"num_tokens": 0, "num_reqs": 0}])
        return JSONResponse({"object": "list", "data": [{"id": "standin", "object": "model"}]})

    async def _switch_role(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.switches.append(body)
        if self.role_epoch is None:
            return JSONResponse({"error": {"message": "not found"}}, status_code=404)
        was, self.role = self.role, body["role"]
        self.role_epoch += 1
        return JSONResponse({"from": was, "to": self.role, "role_epoch": self.role_epoch},
                            status_code=202)

    async def _set_nice(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.nices.append(body)
        self.nice = body["nice"]
        return JSONResponse({"nice": self.nice, "threads": 1})

    async def _set_cpus(self, request: Request) -> Response:
        body = json.loads(await request.body())
        self.cpu_moves.append(body)
        self.cpus = sorted(int(c) for c in body["cpus"].split(","))
        return JSONResponse({"cpus": self.cpus, "threads": 1})

    async def _abort(self, request: Request) -> Response:
        body = json.loads(await request.body())
        rid = body.get("rid", "")
        self.received.append(Received("/abort_request", body, dict(request.headers),
                                      trio.current_time()))
        self.aborts.append(rid)
        if rid in self._abort_events:
            self._abort_events[rid].set()
        return JSONResponse({"aborted": [rid]})

    async def _generate(self, request: Request) -> Any:
        raw = await request.body()
        body = json.loads(raw)
        self.received.append(Received(request.url.path, body, dict(request.headers),
                                      trio.current_time()))
        leg_role = request.headers.get("x-pd-role")
        if self.role_epoch is not None and self.role_state != "SERVING":
            # Draining for a switch, as a pd-fsm worker: no new leg, come back later.
            return JSONResponse(
                {"error": {"message": f"the worker is switching its role from {self.role}",
                           "code": 503}}, status_code=503, headers={"retry-after": "1"})
        if self.role_epoch is not None and leg_role not in (None, self.role):
            return JSONResponse(
                {"error": {"message": f"this worker is {self.role} (role epoch "
                                      f"{self.role_epoch}), not {leg_role}", "code": 409}},
                status_code=409,
                headers={"x-pd-role": self.role, "x-pd-role-epoch": str(self.role_epoch)})
        self.arrived.set()
        return _Answer(self, request.url.path, body)


class _Answer:
    """The stand-in's ASGI answer; it notices a client (the proxy) that hangs up."""

    def __init__(self, standin: StandIn, path: str, body: dict[str, Any]) -> None:
        self.standin = standin
        self.path = path
        self.body = body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        rid = str(self.body.get("rid", ""))
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self.standin.disconnects.append(rid)
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await self._answer(rid, send)
            nursery.cancel_scope.cancel()

    async def _answer(self, rid: str, send: Any) -> None:
        s = self.standin.script
        if s.wait_for is not None:
            with trio.fail_after(5):
                await s.wait_for.wait()
        if s.delay:
            await trio.sleep(s.delay)
        if s.hold:
            event = self.standin._abort_events.setdefault(rid, trio.Event())
            await event.wait()
        if s.status != 200:
            await _json(send, s.status, {"error": {"message": s.error, "type": "scripted",
                                                   "code": s.status}})
            return
        meta: dict[str, Any] = {"id": rid, "finish_reason": {"type": "length", "length": 2}}
        if self.body.get("return_logprob"):
            meta["input_token_logprobs"] = s.input_logprobs or []
            if self.standin.role == "decode":
                meta["output_token_logprobs"] = [[-0.1, 7, None], [-0.2, 8, None]]
        result = {"text": s.output_text, "output_ids": [7, 8], "meta_info": meta,
                  "served_by": self.standin.role}
        if not self.body.get("stream"):
            await _json(send, 200, result)
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(s.chunks):
            chunk = {"text": s.output_text[: i + 1], "index": i, "served_by": self.standin.role}
            await send({"type": "http.response.body", "more_body": True,
                        "body": f"data: {json.dumps(chunk)}\n\n".encode()})
            if i == 0 and s.chunk_gate is not None:
                with trio.fail_after(5):
                    await s.chunk_gate.wait()
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})


async def _json(send: Any, status: int, body: Any) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode(),
                "more_body": False})


async def serve_standin(nursery: trio.Nursery, role: str) -> tuple[str, StandIn]:
    standin = StandIn(role)
    binds: list[str] = await nursery.start(
        lambda task_status: serve_app(standin.app, "127.0.0.1", 0, task_status=task_status)
    )
    return binds[0], standin
