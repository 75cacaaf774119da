"""The contract between the worker's HTTP layer and the scheduler behind it.

The HTTP layer (routes, schemas, SSE, metrics) is the same for every disaggregation mode; what
changes is the backend: colocated (a plain Scheduler), prefill (answers its leg once the room's KV
is handed off to D) or decode (preallocates, pulls the KV, then decodes). A backend owns its
scheduler and runs it from one trio task (`serve`), moving blocking JAX work to a worker thread.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import trio

from pd_fsm.io_trio.bootstrap.records import InstanceRecord
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.request import NO_LOGPROBS, LogprobSpec, Req, RequestOutput, Resume
from pd_fsm.schedulers.scheduler import Scheduler

# Where a PD backend's per-tick phase samples go: (phase key, seconds); the worker app sets its
# histograms' observe.
PhaseObserver = Callable[[str, float], None]

# A backend's gauges and counters by name (``stats()``): numbers, and dicts of them by state or
# queue, read by /metrics, /get_load and /server_info. Any: the values are as varied as JSON's.
Stats = dict[str, Any]


@attrs.frozen
class BootstrapInfo:
    """The three top-level fields a PD router injects (COMPAT.md)."""

    host: str
    port: int | None  # sglang's mini-lb may send null: the worker's default applies
    room: int


@attrs.frozen
class GenerateJob:
    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    bootstrap: BootstrapInfo | None = None  # required by prefill/decode backends
    return_logprob: bool = False
    logprobs: LogprobSpec = NO_LOGPROBS
    resume: Resume | None = None  # tokens generated before, on a worker that failed
    # Live hand-off: the KV another D offers for those tokens (a decode worker
    # pulls it instead of prefilling), and whether this stream may end with a ticket of ours.
    handoff: HandoffTicket | None = None
    accept_handoff: bool = False
    # Whether this stream may end with a move event (``Moved``): the proxy continues it on
    # another worker, which prefills the prompt and the tokens so far (no KV moves).
    accept_move: bool = False


def request_of(scheduler: Scheduler, job: GenerateJob) -> Req:
    """The scheduler's record of ``job`` (made on the scheduler's thread, like every call)."""
    return scheduler.make_request(job.rid, list(job.input_ids), job.sampling,
                                  logprobs=job.logprobs, resume=job.resume)


class BackendError(Exception):
    """A request the backend could not serve: HTTP ``status`` and a reason for the client."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class HandedOff(BackendError):
    """Not a failure: a draining decode worker gave this stream to another. The
    stream ends with ``ticket`` for the proxy, which continues it on another D."""

    def __init__(self, ticket: HandoffTicket) -> None:
        super().__init__(200, "handed off to another decode worker")
        self.ticket = ticket


class Moved(BackendError):
    """Not a failure: the planner asked this worker to give its running streams to another
    (``POST /move_streams``: a standby decode worker beside the colocated one it merged into).
    The stream ends with a move event for the proxy, which re-prefills it elsewhere. Only an
    answered stream is moved; were one raised before the first output, its 503 would send the
    request to another worker as a refused leg."""

    def __init__(self, reason: str) -> None:
        super().__init__(503, reason)


class BackendHealth(Protocol):
    """What the HTTP layer reads of a backend's health (``health.Health``)."""

    def exiting(self) -> str | None:
        """Why the worker is on its way out (its scheduler failed; a rank of its instance is
        gone), once it is: what a request arriving meanwhile is told. None otherwise."""
        ...


class ServeBackend(Protocol):
    mode: str  # "null" | "prefill" | "decode"

    @property
    def health(self) -> BackendHealth: ...

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the scheduler loop until cancelled; ``started()`` once requests can be accepted."""
        ...

    def generate(self, job: GenerateJob) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of ``job`` in order; the last has ``finish_reason`` set. Raises BackendError
        (before or during the stream) when the request fails; leaving the iterator early (the
        client went away) aborts the request and frees everything it held."""
        ...

    def abort(self, rid: str) -> bool:
        """Abort a live request by rid (``/abort_request``); False when unknown."""
        ...

    def ready(self) -> bool:
        """True once the model is loaded and compiled and (PD) the worker is registered."""
        ...

    def stats(self) -> Stats:
        """Gauges and counters for /metrics and /get_load: free/total pages, queue lengths,
        KVPoll state counts, transfer bytes/seconds, requests by outcome."""
        ...

    async def withdraw(self) -> None:
        """Drain's first step: leave the registry, so that routers discovering workers there
        stop sending requests (a colocated worker is in none)."""
        ...


@runtime_checkable
class HandsOff(Protocol):
    """A backend that may hand its running streams to another decode worker while it drains:
    the PD backends (a prefill one by its ``mode`` never does)."""

    mode: str

    async def handoff_peers(self) -> tuple[InstanceRecord, list[InstanceRecord]]:
        """Our registry record and the registry's decode records (``drain_gate.py``). Raises
        BootstrapError."""
        ...

    def hand_off(self, lease_s: float) -> None:
        """From the next tick on, hand each running stream that allows it to another D (its KV
        registered for ``lease_s`` at most)."""
        ...


@runtime_checkable
class RoleBackend(ServeBackend, Protocol):
    """What the worker needs of a backend it built (``roles.make_backend``), beyond the HTTP
    layer's ``ServeBackend``: every real backend has it all; a test's stand-in may have less, so
    the app and the role host look for it with ``isinstance``."""

    role_epoch: int  # registered with a PD backend's record: the switches so far
    phase_observer: PhaseObserver | None

    def precompile(self) -> None:
        """Build and warm the role's scheduler as ``serve`` would, then drop it: its shapes stay
        compiled for a later switch to this role (in a worker thread)."""
        ...

    def fail_in_flight(self, reason: str) -> int:
        """Abort every live request, its client answered 503 with ``reason``; how many."""
        ...

    def side_port(self) -> int | None:
        """The port P's side channel is bound to (what routers know it by); None otherwise."""
        ...

    def release_handoff(self, uuid: int) -> bool:
        """Another D pulled hand-off ``uuid``: release it on the next tick (False: not ours to
        release, a backend that hands nothing off)."""
        ...


def in_flight(stats: Stats) -> list[str]:
    """What a backend's ``stats()`` says it still holds for requests (rooms, queues, transfer
    registrations): empty once a draining worker may stop without failing anyone's request."""
    out = [f"rooms {k}={v}" for k, v in stats.get("kvpoll", {}).items() if v]
    out += [f"queue {k}={v}" for k, v in stats.get("pd_queues", {}).items() if v]
    if stats.get("transfer_registrations"):
        out.append(f"transfer registrations {stats['transfer_registrations']}")
    return out


# A hand-off's registration must be claimed or released before the drain's deadline stops the
# role (SIGTERM: the process; a role switch: the backend): its lease ends this much earlier.
HANDOFF_LEASE_MARGIN_S = 0.5
HANDOFF_LEASE_MIN_S = 0.5


def start_hand_off(backend: ServeBackend, left_s: float) -> bool:
    """Draining, once ``drain_gate`` found another D to take them: a decode
    backend hands each running stream it may to another D, its KV leased until just before the
    drain's deadline, ``left_s`` from now. False for a backend that hands nothing off."""
    if not isinstance(backend, HandsOff):
        return False
    backend.hand_off(max(HANDOFF_LEASE_MIN_S, left_s - HANDOFF_LEASE_MARGIN_S))
    return True
