"""A rank > 0 of a multi-process instance: no HTTP, only a replica of rank 0's scheduler that
applies rank 0's commands (``frames``) and runs the same steps, so that every sharded
computation has all its processes. Its outputs are rank 0's too, and are dropped here.

A plain blocking loop, not a trio program: it does one thing at a time and has nothing to do
concurrently. Every wait has a deadline: a rank 0 silent for ``silence`` seconds (it pings every
few seconds while idle) is taken for dead and this rank exits with an error.
"""

from __future__ import annotations

import logging
import time
from typing import Protocol

import zmq

from pd_fsm.io_trio.worker.spmd.frames import (
    MAX_FRAME,
    Frame,
    Hello,
    Pinged,
    PullReported,
    RequestAdded,
    SpmdProtocolError,
    StepOrdered,
    Stopped,
    decode,
    encode,
)
from pd_fsm.schedulers.scheduler import Scheduler

log = logging.getLogger("pd_fsm.io_trio.worker.spmd")


class Divergence(RuntimeError):
    """This replica no longer does what rank 0's scheduler did: it cannot stay in step."""


def apply_step(scheduler: Scheduler, frame: StepOrdered) -> None:
    """Rank 0's commands, then its step, on this rank's replica."""
    for command in frame.commands:
        if isinstance(command, RequestAdded):
            req = scheduler.make_request(command.rid, list(command.input_ids), command.sampling,
                                         logprobs=command.logprobs)
            try:
                scheduler.add_request(req)
            except ValueError as exc:
                raise Divergence(f"rank 0 took request {command.rid!r}, this rank refuses it: "
                                 f"{exc}") from None
        else:
            scheduler.abort(command.rid, command.message)
    scheduler.drain_outputs()
    if not scheduler.has_work():
        raise Divergence("rank 0 steps, this rank's scheduler has nothing to do")
    scheduler.step()


class Replica(Protocol):
    """What a rank > 0 runs: rank 0's frames applied to its replica of rank 0's scheduler."""

    def apply(self, frame: Frame) -> None:
        """Apply one of rank 0's frames (not Hello, Pinged or Stopped); raises
        :class:`Divergence` when this replica cannot follow it."""

    def reports(self) -> list[PullReported]:
        """What to tell rank 0 now (a D rank's finished pulls)."""

    def waiting(self) -> bool:
        """Whether :meth:`reports` may soon have something (then it is asked again shortly)."""


class StepReplica:
    """A colocated instance's rank > 0: every step rank 0 takes, with its commands."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def apply(self, frame: Frame) -> None:
        if not isinstance(frame, StepOrdered):
            raise Divergence(f"a colocated rank cannot apply {type(frame).__name__}")
        apply_step(self.scheduler, frame)

    def reports(self) -> list[PullReported]:
        return []

    def waiting(self) -> bool:
        return False


REPORT_POLL_S = 0.005  # while a report may come (a pull under way), how often to look


def follow(replica: Replica | Scheduler, leader: str, rank: int, key: bytes | None, *,
           silence: float = 60.0) -> int:
    """Connect to rank 0 at ``leader`` (``host:port``), say hello, and replay its commands until
    it stops (exit status 0) or fails to be followed (1). A bare scheduler is a colocated
    instance's replica."""
    if isinstance(replica, Scheduler):
        replica = StepReplica(replica)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{leader}")
    sock.send(encode(Hello(rank), 0, key))
    expected, steps, dropped, sent = 1, 0, 0, 0
    heard = time.monotonic()
    try:
        while True:
            for report in replica.reports():
                sent += 1
                sock.send(encode(report, sent, key))
            wait = REPORT_POLL_S if replica.waiting() else silence
            if not sock.poll(int(wait * 1000)):
                if time.monotonic() - heard < silence:
                    continue
                log.error("rank 0 at %s silent for %g s: leaving the instance", leader, silence)
                return 1
            heard = time.monotonic()
            try:
                seq, frame = decode(sock.recv(), key)
            except SpmdProtocolError as exc:
                dropped += 1
                log.warning("dropped a frame from rank 0 (%d so far): %s", dropped, exc)
                continue
            if seq < expected or isinstance(frame, Hello | PullReported):
                dropped += 1
                log.warning("dropped a replayed or misdirected frame (seq %d, expecting %d)",
                            seq, expected)
                continue
            if seq > expected:
                log.error("frames %d..%d from rank 0 never arrived: out of step", expected,
                          seq - 1)
                return 1
            expected += 1
            if isinstance(frame, Stopped):
                log.info("rank 0 stopped after %d steps: leaving", steps)
                return 0
            if isinstance(frame, Pinged):
                continue
            try:
                replica.apply(frame)
            except Divergence as exc:
                log.error("%s", exc)
                return 1
            steps += 1
    finally:
        sock.close(linger=0)
