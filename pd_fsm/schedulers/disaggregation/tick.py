"""One iteration of a PD worker's loop, without I/O: everything that touches the scheduler.

The worker (``io_trio/worker/pd_backends.py``) runs :func:`run_tick` on its scheduler thread, one
call at a time; the simulator (``pd_fsm/sim``, with real schedulers) runs the same function on its
virtual clock. In order: the step starts (``ev.StepStarted``: what the I/O side must do meanwhile
goes to ``on_busy``), side-channel messages and lookup answers are delivered with their arrival
times, new legs are admitted (or refused: 409 for a live room's number, 400 otherwise) unless
aborted first, aborts of admitted legs are applied, one scheduler step runs, and the step ends.
What comes back is for the caller to carry out: outputs (a PD failure named with its status),
refusals, the I/O effects (``SendMessage``, ``ResolvePeer``, ``ForgetPeer``), whether forward work
remains and when the core next needs time to pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

import attrs

from pd_fsm.core import effects as fx
from pd_fsm.schedulers.disaggregation.common import DuplicateRoomError, PDLink
from pd_fsm.schedulers.disaggregation.decode import DecodeScheduler
from pd_fsm.schedulers.disaggregation.prefill import PrefillScheduler
from pd_fsm.schedulers.request import RequestOutput

L = TypeVar("L")  # a leg, as the embedder tracks it (an HTTP stream, a simulated client)


@attrs.frozen
class TickResult(Generic[L]):
    outputs: list[RequestOutput]
    failures: dict[str, tuple[int, str]]  # rid -> (HTTP status, reason) of failed PD requests
    refused: list[tuple[L, int, str]]  # legs never admitted: (leg, HTTP status, reason)
    unstarted: list[L]  # aborted before they reached the scheduler
    outbox: list[fx.IOEffect]  # the I/O layer's effects, in order
    forward_work: bool
    next_deadline: float | None  # on the scheduler's clock
    phases: list[tuple[str, float]]  # (phase key, value) samples of this tick


@attrs.frozen
class _Admission(Generic[L]):
    refused: list[tuple[L, int, str]]
    unstarted: list[L]


def _admit_legs(
    legs: Sequence[L],
    aborts: list[str],
    rid: Callable[[L], str],
    admit: Callable[[L], None],
    on_admitted: Callable[[L], None],
) -> _Admission[L]:
    """Admit each leg unless it was aborted first (its rid leaves ``aborts``); a refusal is 409
    for a live room's number, 400 otherwise."""
    out: _Admission[L] = _Admission([], [])
    for leg in legs:
        if rid(leg) in aborts:
            aborts.remove(rid(leg))
            out.unstarted.append(leg)
            continue
        try:
            admit(leg)
        except DuplicateRoomError as exc:
            out.refused.append((leg, 409, str(exc)))
            continue
        except ValueError as exc:
            out.refused.append((leg, 400, str(exc)))
            continue
        on_admitted(leg)
    return out


def run_tick(
    sched: PrefillScheduler | DecodeScheduler,
    # Any: P's inbox holds PrefillEvents, D's DecodeEvents; the worker keeps one list type
    # for either role, and the role's own ``deliver`` is typed by its events.
    inbox: Sequence[tuple[float, Any]],
    legs: Sequence[L],
    aborts: list[str],
    *,
    rid: Callable[[L], str],
    admit: Callable[[L], None],
    on_admitted: Callable[[L], None] = lambda leg: None,
    on_busy: Callable[[tuple[fx.BusyEffect, ...]], None] = lambda effects: None,
    may_abort: Callable[[str], bool] = lambda rid: True,
    before_step: Callable[[list[fx.IOEffect]], None] | None = None,
    early_outputs: Callable[[list[RequestOutput], dict[str, tuple[int, str]]], None]
    | None = None,
) -> TickResult[L]:
    """One iteration (see the module docstring). ``inbox``: ``(arrived, event)`` pairs on the
    scheduler's clock; ``admit(leg)`` hands a leg to the scheduler (raises ``ValueError`` or
    ``DuplicateRoomError`` to refuse it); ``aborts``: rids to abort (consumed; one of a leg
    admitted earlier only if ``may_abort`` says so). ``before_step``: if given, what delivering
    the inbox made the core say goes to it before the step runs, not with the step's: a KV part
    P owes a D whose hello came during the last step then travels while this step computes
    (streamed KV), instead of after it. ``early_outputs``: if given, outputs ready before the
    step's decode forward (a first token D just pulled) go to it as that forward starts, with
    their failures, and not in the result (``Scheduler.step``'s ``early``)."""
    role = sched.role
    link = role.link
    on_busy(tuple(role.step_started()))
    try:
        for arrived, event in inbox:
            role.deliver(event, now=arrived)
        admission = _admit_legs(legs, aborts, rid, admit, on_admitted)
        for r in aborts:
            if may_abort(r):
                sched.abort(r, "aborted by request")
        if before_step is not None:
            said = link.take_outbox()
            if said:
                before_step(said)
        first = None if early_outputs is None else (
            lambda outs: early_outputs(outs, _failures(link, outs)))
        outputs = sched.step(first)
        return TickResult(
            outputs, _failures(link, outputs), admission.refused, admission.unstarted,
            link.take_outbox(), sched.has_forward_work(), role.next_deadline(),
            link.phases.take(),
        )
    finally:
        role.step_ended()
        on_busy(())


def _failures(link: PDLink[Any, Any],
              outputs: list[RequestOutput]) -> dict[str, tuple[int, str]]:
    """The PD failures behind ``outputs``' aborts: rid -> (HTTP status, reason)."""
    failures = {}
    for out in outputs:
        if out.finish_reason is not None and out.finish_reason.kind == "abort":
            failure = link.failures.pop(out.rid, None)
            if failure is not None:
                failures[out.rid] = failure
    return failures
