"""The worker's control and information endpoints: health, server and model info, load,
metrics, aborts, hand-off releases, role switches, CPU priorities (``AdminRoutes``)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import aclosing

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_fsm.core.role_switch import ROLES
from pd_fsm.io_trio.cluster.cpu_placement import cpu_list, parse_cpus
from pd_fsm.io_trio.worker.app_state import (
    DRAIN_RETRY_AFTER_S,
    WorkerState,
    model_path,
    placement_info,
    version,
)
from pd_fsm.io_trio.worker.backend import BackendError, GenerateJob, RoleBackend, Stats
from pd_fsm.io_trio.worker.generation import GenerationRoutes
from pd_fsm.io_trio.worker.schemas import ApiError, JsonObject
from pd_fsm.io_trio.worker.sse import until_disconnect
from pd_fsm.io_trio.worker.streams import HoldsStreams
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.args import prefill_budget, weights_dtype


class AdminRoutes:
    def __init__(self, state: WorkerState, generation: GenerationRoutes,
                 stats: Callable[[], Stats]) -> None:
        """``generation``: what ``/health_generate`` runs its request through; ``stats``: the
        worker's figures for ``/server_info``."""
        self._state = state
        self._generation = generation
        self._stats = stats

    async def handoff_release(self, request: Request) -> Response:
        """The KV of a stream this worker handed off was pulled (or never will be): drop its
        registration now rather than at its lease's end (the proxy posts it)."""
        body = await self._state.read_json(request)
        uuid_ = body.get("uuid") if isinstance(body, dict) else None
        if isinstance(uuid_, bool) or not isinstance(uuid_, int):
            raise ApiError(400, "give uuid (an integer): the hand-off ticket's")
        backend = self._state.backend
        queued = isinstance(backend, RoleBackend) and backend.release_handoff(uuid_)
        return JSONResponse({"queued": queued})

    async def _one_field(self, request: Request, field: str, shape: str) -> dict[str, object]:
        """A control endpoint's body: a JSON object of ``field`` alone (400 naming what is not)."""
        body = await self._state.read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, f"the body must be a JSON object: {shape}")
        unknown = sorted(set(body) - {field})
        if unknown:
            raise ApiError(400, f"unknown field(s) {', '.join(unknown)} @ body: give only {field}")
        return body

    async def switch_role(self, request: Request) -> Response:
        """Switch the worker's role at runtime: 202 at once, the switch runs on
        (``/server_info``'s ``role_state`` and ``role_epoch`` say when it serves)."""
        body = await self._one_field(request, "role", '{"role": "prefill"|"decode"|"null"}')
        role = body.get("role")
        if not isinstance(role, str):
            raise ApiError(400, f"body.role must be a string, one of {', '.join(ROLES)}")
        if self._state.config.nnodes > 1:
            raise ApiError(400, "an instance spanning processes (--nnodes > 1) cannot switch "
                                "its role: restart it in the new role")
        if self._state.draining:
            raise ApiError(503, "the worker is draining (shutting down)",
                           retry_after=DRAIN_RETRY_AFTER_S)
        answer = self._state.roles.request(role)
        if answer.error is not None:
            raise ApiError(answer.status, answer.error, "conflict" if answer.status == 409
                           else None)
        return JSONResponse(answer.body, status_code=answer.status)

    async def set_nice(self, request: Request) -> Response:
        """The compute threads' CPU priority at runtime (the planner's lever where
        P and D share cores): ``{"nice": N}``, -20..19, until the next role switch."""
        body = await self._one_field(request, "nice", '{"nice": N}')
        nice = body.get("nice")
        if isinstance(nice, bool) or not isinstance(nice, int) or not -20 <= nice <= 19:
            raise ApiError(400, "body.nice must be an integer in -20..19")
        c = self._state.config
        if c.nnodes > 1:
            raise ApiError(400, "an instance spanning processes (--nnodes > 1) cannot change "
                                "its priority at runtime: each rank is a process of its own")
        if c.transfer_nice and nice == c.transfer_nice:
            # renice_threads moves threads by their value: the two would become one group.
            raise ApiError(400, f"nice {nice} is the KV transfer threads' (--transfer-nice): "
                                "give another value")
        try:
            moved = self._state.roles.priority.move_to(nice, "POST /set_nice")
        except PermissionError as exc:
            raise ApiError(403, str(exc)) from None
        return JSONResponse({"nice": nice, "threads": moved})

    async def set_cpus(self, request: Request) -> Response:
        """The cores every thread runs on, at runtime (the planner's lever between
        P and D splitting the cores and sharing them): ``{"cpus": "0-1"}``, as ``--cpus``
        lists them, within the cores the worker had at start."""
        body = await self._one_field(request, "cpus", '{"cpus": "0-1"}')
        spec = body.get("cpus")
        if not isinstance(spec, str):
            raise ApiError(400, 'body.cpus must be a string of cores, e.g. "0", "0-1", "0,2"')
        try:
            cpus = parse_cpus(spec)
        except ValueError as exc:
            raise ApiError(400, f"body.cpus: {exc}") from None
        c = self._state.config
        if c.nnodes > 1:
            raise ApiError(400, "an instance spanning processes (--nnodes > 1) cannot move its "
                                "cores at runtime: each rank is a process of its own")
        cores = self._state.roles.cores
        missing = cores.unavailable(cpus)
        if missing:  # refused here, not by move_to: the answer says why the worker is so bound
            pools = ("" if c.cpus is None or c.cpus_after_pools else
                     f" (started pinned with --cpus {c.cpus}: its pools are sized to them; "
                     "start it with --cpu-pools all to move it wider)")
            raise ApiError(400, f"body.cpus {spec!r}: cores {missing} are not this worker's; "
                                f"it may use {cpu_list(cores.available)}{pools}")
        moved = cores.move_to(cpus, "POST /set_cpus")
        return JSONResponse({"cpus": sorted(cpus), "threads": moved})

    async def move_streams(self, request: Request) -> Response:
        """Give the running streams the proxy lets move (``accept_move``) to other workers
        (the planner's standby decode worker after a merge, whose streams would
        otherwise slow the colocated worker beside it on the same cores): ``{"max_context":
        N}``, only streams of at most N tokens so far (prompt and output), each of which the
        next worker prefills again. Each ends with a move event the proxy continues."""
        body = await self._one_field(request, "max_context", '{"max_context": N}')
        limit = body.get("max_context")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ApiError(400, "body.max_context must be a positive integer (tokens)")
        backend = self._state.backend
        if backend.mode == "prefill" or not isinstance(backend, HoldsStreams):
            raise ApiError(400, f"a {backend.mode} worker holds no streams to move")
        moved = backend.streams.move(limit, "moved by POST /move_streams")
        return JSONResponse({"moved": moved})

    async def abort_request(self, request: Request) -> Response:
        body = await self._state.read_json(request)
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        if body.get("abort_all") is True:
            rids = sorted(self._state.live)
        else:
            rid = body.get("rid")
            if not isinstance(rid, str) or not rid:
                raise ApiError(400, "give rid (a string) or abort_all: true")
            rids = [rid]
        aborted = [rid for rid in rids if self._state.backend.abort(rid)]
        return JSONResponse({"aborted": aborted})

    async def health(self, request: Request) -> Response:
        if self._state.draining:  # load balancers stop sending here
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"retry-after": str(DRAIN_RETRY_AFTER_S)})
        if self._state.roles.refusing is not None:  # and while the role changes
            return JSONResponse({"status": "switching_role", "role_state": self._state.roles.state},
                                status_code=503,
                                headers={"retry-after": str(DRAIN_RETRY_AFTER_S)})
        if not self._state.ready():
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def health_generate(self, request: Request) -> Response:
        meta = self._state.require_ready()
        mode = self._state.backend.mode
        if mode != "null":
            # A PD leg cannot run alone: it needs a room and its peer (the proxy's job).
            return JSONResponse({"status": "ok", "generated": False, "mode": mode})
        job = GenerateJob(
            rid=f"health-{uuid.uuid4().hex}",
            input_ids=tuple(meta.model.tokenizer.encode("ping")) or (1,),
            sampling=SamplingParams(max_new_tokens=1, temperature=0.0),
        )

        async def run() -> ApiError | int:
            n = 0
            try:
                async with aclosing(self._generation.outputs(job)) as outputs:
                    async for out in outputs:
                        n += len(out.new_token_ids)
            except BackendError as exc:
                return ApiError(503, f"generation check failed: {exc.reason}")
            return n

        connected, result = await until_disconnect(request.receive, run)
        if not connected:
            return Response(status_code=499)
        if isinstance(result, ApiError):
            raise result
        return JSONResponse({"status": "ok", "generated": True, "tokens": result})

    def _info_common(self) -> JsonObject:
        meta = self._state.meta
        c = self._state.config
        info: JsonObject = {
            "model_path": meta.path if meta else model_path(c.model),
            "tokenizer_path": meta.path if meta else model_path(c.model),
            "served_model_name": c.model_name,
        }
        return info

    async def server_info(self, request: Request) -> Response:
        c = self._state.config
        info = self._info_common()
        info.update(
            version=version(),
            # The role now and its epoch, the roles it may take, the switch's state and P's
            # bootstrap port (its side channel's) while it is P.
            **self._state.roles.info(),
            disaggregation_transfer_backend=c.disaggregation_transfer_backend,
            disaggregation_bootstrap_host=c.disaggregation_bootstrap_host,
            disaggregation_bootstrap_port=c.disaggregation_bootstrap_port,
            page_size=c.page_size,
            max_total_num_tokens=(c.num_pages - 1) * c.page_size,
            max_running_requests=c.max_running,
            chunked_prefill_size=prefill_budget(c.max_batched_tokens),
            context_length=self._state.meta.context_length if self._state.meta else None,
            dtype=weights_dtype(c.dtype),
            host=c.host,
            port=c.port,
            ready=self._state.ready(),
            internal_states=[self._stats()],
            **placement_info(c, self._state.meta is not None),
        )
        return JSONResponse(info)

    async def model_info(self, request: Request) -> Response:
        info = self._info_common()
        info.update(
            is_generation=True,
            preferred_sampling_params=None,
            weight_version="default",
            has_image_understanding=False,
            has_audio_understanding=False,
            model_type="llama",
            architectures=["LlamaForCausalLM"],
        )
        return JSONResponse(info)

    async def models(self, request: Request) -> Response:
        entry: JsonObject = {
            "id": self._state.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "pd_fsm",
            "root": self._state.config.model_name,
        }
        if self._state.meta is not None:
            entry["max_model_len"] = self._state.meta.context_length
        return JSONResponse({"object": "list", "data": [entry]})

    async def get_load(self, request: Request) -> Response:
        s = self._state.backend.stats()
        total = int(s.get("total_pages", 0))
        free = int(s.get("free_pages", total))
        waiting = int(s.get("waiting", 0)) + int(s.get("queued", 0))
        reqs = waiting + int(s.get("prefilling", 0)) + int(s.get("running", 0))
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": reqs,
                    "num_waiting_reqs": waiting,
                    # KV tokens reserved right now (pages are reserved for the whole sequence).
                    "num_tokens": (total - free) * self._state.config.page_size,
                    "num_pages_free": free,
                    # Held by the prefix cache alone (--radix-cache): evicted when wanted.
                    "num_pages_cached": int(s.get("cached_pages", 0)),
                    "num_pages_total": total,
                }
            ]
        )

    async def metrics(self, request: Request) -> Response:
        return Response(self._state.metrics.render(), media_type="text/plain; version=0.0.4")

