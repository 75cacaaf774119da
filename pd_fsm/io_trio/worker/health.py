"""A backend's health: whether it takes requests, why not once its scheduler failed, and its
steps. Shared by the colocated backend (colocated.py) and the PD ones (pd_backends.py); the
HTTP layer reads it through ``ServeBackend.health``."""

from __future__ import annotations

import attrs

from pd_fsm.io_trio.worker.backend import BackendError
from pd_fsm.io_trio.worker.streams import StreamTable


@attrs.define
class Health:
    """Whether a backend takes requests, and why not once its scheduler failed; its steps."""

    ready: bool = False
    # Why a scheduler step failed, once one did: the process is on its way out, and a request
    # arriving meanwhile is told that reason, not "loading" or "shutting down".
    failure: str | None = None
    steps_total: int = 0
    step_seconds_total: float = 0.0

    def exiting(self) -> str | None:
        """The answer to a request arriving after a failure (None: no failure)."""
        return None if self.failure is None else f"the worker is exiting: {self.failure}"

    def refusal(self) -> BackendError | None:
        """Why a new request is refused now (None: it is taken)."""
        if (exiting := self.exiting()) is not None:
            return BackendError(503, exiting)
        if not self.ready:
            return BackendError(503, "the model is still loading")
        return None

    def step_failed(self, exc: Exception, streams: StreamTable) -> None:
        """The scheduler's state is unknown now: stop taking requests, fail everyone in flight
        with the reason (a 500), and let the process die (serve_worker first lets the HTTP
        server send those answers)."""
        self.ready = False
        self.failure = f"scheduler step failed: {exc!r}"
        streams.fail_all(BackendError(500, self.failure))

    def stopped(self, streams: StreamTable) -> None:
        """The loop ended (a failure, or the worker stopping): no more requests, and the ones
        still held (those that arrived after a failure, too) get a 503 naming why."""
        self.ready = False
        streams.fail_all(BackendError(503, self.exiting() or "worker shutting down"))

    def stepped(self, seconds: float) -> None:
        self.steps_total += 1
        self.step_seconds_total += seconds
