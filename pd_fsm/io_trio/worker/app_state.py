"""What the worker's HTTP route groups share (``WorkerState``): the configuration, the model, the
metrics, the role host (and through it the backend), the requests in flight, whether the worker
drains; and the checks every generation request goes through."""

from __future__ import annotations

import functools
import logging
import os
from importlib import metadata
from pathlib import Path

import attrs
from starlette.requests import Request

from pd_fsm.core.role_switch import EPOCH_HEADER, ROLE_HEADER, ROLES
from pd_fsm.io_trio.cluster.tpu_placement import no_tpu_report
from pd_fsm.io_trio.http_edge import BodyError, read_json
from pd_fsm.io_trio.worker.backend import ServeBackend
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.metrics import WorkerMetrics
from pd_fsm.io_trio.worker.roles import RoleHost
from pd_fsm.io_trio.worker.schemas import ApiError, JsonBody, Limits
from pd_fsm.jax_engine.model.registry import LoadedModel

log = logging.getLogger("pd_fsm.io_trio.worker.app")

DRAIN_RETRY_AFTER_S = 1  # a draining worker's Retry-After: another worker can take it now


# Read once: a lookup scans every distribution on sys.path (2.2 ms here), in the worker's event
# loop, and /server_info is polled by the proxy, the planner and routers.
@functools.cache
def version() -> str:
    try:
        return metadata.version("pd_fsm")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def model_path(name: str) -> str:
    """A LOCAL path for /server_info's ``model_path``: routers try to download anything that
    looks like a hub id. The tiny random model has no file: the package that defines it."""
    if name == "smollm2":
        from pd_fsm.jax_engine.model.gguf_loader import find_smollm2_gguf

        return str(find_smollm2_gguf())
    if name == "tiny":
        from pd_fsm.jax_engine.model import config as model_config

        return str(Path(model_config.__file__).resolve().parent)
    return str(Path(name).resolve())  # an HF checkpoint directory


def placement_info(config: ServeConfig, loaded: bool) -> dict[str, object]:
    """``/server_info``'s ``tpu``: the chips the worker was given (``--tpu-chips``) and the TPU
    variables as this process has them now; and ``devices``: what JAX sees, once the model is
    loaded (its backend started then: asking earlier would start it from the event loop)."""
    tpu = (no_tpu_report(os.environ) if config.tpu is None
           else config.tpu.report(os.environ))
    devices = None
    if loaded:
        import jax

        devices = [{"id": d.id, "platform": d.platform, "kind": d.device_kind,
                    "coords": list(getattr(d, "coords", []) or []) or None}
                   for d in jax.local_devices()]
    return {"tpu": tpu, "devices": devices}


@attrs.frozen(eq=False)
class ModelMeta:
    served_name: str
    model: LoadedModel
    context_length: int
    path: str

    @classmethod
    def of(cls, model: LoadedModel, config: ServeConfig) -> ModelMeta:
        limit = config.context_length or model.config.max_position
        if config.chat_template is not None:  # --chat-template replaces the model's own
            tokenizer = model.tokenizer.with_chat_template(config.chat_template)
            model = attrs.evolve(model, tokenizer=tokenizer)
        return cls(
            served_name=config.model_name,
            model=model,
            context_length=min(limit, model.config.max_position),
            path=model_path(config.model),
        )

    @property
    def limits(self) -> Limits:
        return Limits(self.context_length, self.model.config.vocab_size)


@attrs.define(eq=False)
class WorkerState:
    config: ServeConfig
    metrics: WorkerMetrics
    roles: RoleHost
    live: set[str]  # rids of the requests in flight (a role switch's drain waits for them)
    meta: ModelMeta | None = None  # once the model is loaded
    draining: bool = False  # SIGTERM: new requests get 503 + Retry-After (WorkerApp.drain)
    bad_requests: int = 0

    @property
    def backend(self) -> ServeBackend:
        """The backend of the role served now (a switch replaces it: ``roles``)."""
        return self.roles.backend

    def ready(self) -> bool:
        return self.meta is not None and self.backend.ready()

    def bad(self, endpoint: str, exc: ApiError) -> ApiError:
        if exc.status == 499:
            log.info("%s: %s", endpoint, exc.message)
            self.metrics.requests.labels(endpoint, "disconnected").inc()
            return exc
        self.bad_requests += 1
        outcome = "client_error" if exc.status < 500 else "server_error"
        self.metrics.requests.labels(endpoint, outcome).inc()
        return exc

    # ----------------------------------------------------------------- request plumbing

    async def read_json(self, request: Request) -> JsonBody:
        """The body as strict JSON (``http_edge``): one parse for every pd_fsm server."""
        try:
            return await read_json(request, self.config.max_body)
        except BodyError as exc:
            raise ApiError(exc.status, exc.message) from None

    def refuse_if_draining(self) -> None:
        if self.draining:
            # 503 with Retry-After: a router retries it elsewhere (pd-fsm proxy does, at once).
            raise ApiError(503, "the worker is draining (shutting down): send the request to "
                                "another worker", retry_after=DRAIN_RETRY_AFTER_S)
        if self.roles.refusing is not None:  # a role switch: the same answer, its own reason
            raise ApiError(503, self.roles.refusing, retry_after=DRAIN_RETRY_AFTER_S)

    def refuse_stale_role(self, request: Request) -> None:
        """A leg addressed to a role (``X-PD-Role``) this worker no longer has: 409 naming the
        current role and epoch, also in headers, so the router re-reads the registry. Without
        the header nothing is checked (sglang-router sends none)."""
        asked = request.headers.get(ROLE_HEADER)
        if asked is None:
            return
        if asked not in ROLES:
            raise ApiError(400, f"header {ROLE_HEADER} must be one of {', '.join(ROLES)}, "
                                f"got {asked!r}")
        role, epoch = self.roles.role, self.roles.epoch
        if asked != role:
            raise ApiError(409, f"this worker serves as {role} (role epoch {epoch}), not as "
                                f"{asked}: look it up again in the registry",
                           headers={ROLE_HEADER: role, EPOCH_HEADER: str(epoch)})

    def require_ready(self) -> ModelMeta:
        if self.meta is None:
            raise ApiError(503, "the worker is not ready (model loading)")
        if not self.backend.ready():
            if (exiting := self.backend.health.exiting()) is not None:
                # Its scheduler failed (a rank of its instance is gone, say): the cause, not
                # "not registered", which the failure's own deregistration would also say.
                raise ApiError(503, exiting)
            # A PD worker is ready only while the registry acknowledges it (a partition from
            # the bootstrap server makes it unready too).
            raise ApiError(503, "the worker is not ready (warming up, or not registered with "
                                "the bootstrap server)")
        return self.meta

