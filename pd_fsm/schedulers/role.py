"""A scheduler's role: what a prefill or decode worker adds to the colocated scheduler, as an
object the scheduler holds and calls at named points, not a subclass overriding its
private methods.

``SchedulerRole`` lists those points; ``ColocatedRole`` is the role of a worker that runs its
requests from prompt to last token itself (every hook a no-op). The PD roles
(``disaggregation/prefill.py``, ``decode.py``) are built with the scheduler they serve and reach it
only through its public names; a scheduler's role is chosen when it is built (a worker switching
role builds the other role's scheduler, ``io_trio/worker/roles.py``).
"""

from __future__ import annotations

from typing import Protocol

from pd_fsm.jax_engine.sampling.params import TopLogprobs
from pd_fsm.schedulers.request import Req


class SchedulerRole(Protocol):
    def keeps_shape(self, rows: int, tokens: int) -> bool:
        """Whether warm-up compiles the forward shape ``(rows, tokens)`` (P decodes, and D
        prefills, only plain requests: one row at a time)."""

    def forks_here(self, req: Req) -> bool:
        """Whether this worker runs ``req``'s n sequences itself (and reserves their pages)."""

    def before_step(self) -> None:
        """A step begins (before the inbox is applied): time-driven work."""

    def after_step(self) -> None:
        """A step ended (its outputs drained)."""

    def on_admitted(self, req: Req) -> None:
        """``req`` got its pages and starts prefilling."""

    def chunk_cap(self, req: Req) -> int | None:
        """The most tokens of ``req`` one prefill forward may take (None: the budget alone)."""

    def on_prefill_chunk(self, req: Req) -> None:
        """A chunk of ``req``'s prompt was prefilled, not the last one."""

    def take_prefilled(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs
    ) -> bool:
        """``req``'s whole prompt is in the pool and its first token sampled: True if the role
        takes it from here (P hands a room's KV to D), False to decode it here."""

    def abort(self, rid: str, message: str) -> bool:
        """Abort ``rid`` if the role holds it (a live room, a hand-off); False: not the role's,
        the scheduler aborts it as a plain request."""

    def has_work(self) -> bool:
        """Work of the role's own that no forward does (D: transfers in flight)."""


class ColocatedRole:
    """A colocated worker's role: nothing to add."""

    def keeps_shape(self, rows: int, tokens: int) -> bool:
        return True

    def forks_here(self, req: Req) -> bool:
        return True

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def on_admitted(self, req: Req) -> None:
        pass

    def chunk_cap(self, req: Req) -> int | None:
        return None

    def on_prefill_chunk(self, req: Req) -> None:
        pass

    def take_prefilled(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs
    ) -> bool:
        return False

    def abort(self, rid: str, message: str) -> bool:
        return False

    def has_work(self) -> bool:
        return False
