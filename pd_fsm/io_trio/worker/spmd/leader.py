"""Rank 0 of a multi-process instance: it serves HTTP and tells every other rank what its
scheduler does (``frames``), over one ZMQ ROUTER socket the other ranks connect to.

Every method blocks and is called from the colocated backend's scheduler thread (one at a time,
its limiter), never from the trio loop. Nothing queues without bound: a rank runs each step's
sharded computations together with rank 0, so it can never be more than the frame of the step
now running behind; a send that cannot leave within ``send_timeout`` (a rank gone or stuck) is
an error, and so is a rank whose connection is gone (``ROUTER_MANDATORY``).
"""

from __future__ import annotations

import logging
import time

import attrs
import zmq

from pd_fsm.io_trio.worker.spmd.frames import (
    MAX_FRAME,
    Announced,
    Command,
    Frame,
    Hello,
    Pinged,
    PullReported,
    SpmdProtocolError,
    StepOrdered,
    Stopped,
    TickStarted,
    decode,
    encode,
)

log = logging.getLogger("pd_fsm.io_trio.worker.spmd")


@attrs.frozen
class SpmdStats:
    """What ``/server_info`` shows of the command stream: a snapshot the leader publishes from
    its (scheduler) thread after every change, read as a whole from the HTTP task."""

    ranks: int
    joined: int  # ranks > 0 that said hello
    frames_sent: int
    frames_dropped: int  # on the rank socket: not a valid hello


class SpmdError(RuntimeError):
    """The instance cannot go on as one: a rank did not join, or is gone."""


class SpmdLeader:
    def __init__(self, bind: str, ranks: int, key: bytes | None, *,
                 send_timeout: float = 30.0) -> None:
        """``bind``: ``host:port`` the other ranks connect to; ``ranks``: processes in the
        instance, this one included."""
        self.ranks = ranks
        self._key = key
        self._seq = 0
        self._peers: dict[int, bytes] = {}  # rank -> its ZMQ routing id
        self._reported: dict[int, int] = {}  # rank -> seq of its last report taken
        self._dropped = 0
        self.stats = SpmdStats(ranks, 0, 0, 0)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout * 1000))
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{bind}")

    def wait_for_ranks(self, timeout: float) -> None:
        """Block until every rank > 0 said hello; :class:`SpmdError` naming the missing ranks
        after ``timeout`` seconds. A frame that is not a valid hello is dropped and counted."""
        deadline = time.monotonic() + timeout
        while len(self._peers) < self.ranks - 1:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                missing = sorted(set(range(1, self.ranks)) - set(self._peers))
                raise SpmdError(f"ranks {missing} did not join within {timeout:g} s")
            received = self._receive()
            if received is None:
                continue
            routing_id, _, frame = received
            if not isinstance(frame, Hello) or frame.rank >= self.ranks:
                self._drop(f"{frame!r} (an instance of {self.ranks} ranks)")
                continue
            if frame.rank in self._peers:
                raise SpmdError(f"rank {frame.rank} said hello twice (two processes with "
                                "one --node-rank?)")
            self._peers[frame.rank] = routing_id
            self._publish()
            log.info("rank %d joined (%d of %d)", frame.rank, len(self._peers) + 1, self.ranks)

    def step_started(self, commands: tuple[Command, ...]) -> None:
        """Before rank 0 runs a scheduler step: the others apply ``commands`` and step too."""
        self._send(StepOrdered(commands))

    def announce(self, record_json: str) -> None:
        """Rank 0's registry record, before its first tick (see ``Announced``)."""
        self._send(Announced(record_json))

    def tick_started(self, frame: TickStarted) -> None:
        """Before rank 0 runs a PD tick: the others run it too, on the same inputs."""
        self._send(frame)

    def reports(self) -> list[PullReported]:
        """What the ranks reported since the last call (never blocks): each rank's reports in
        its own numbering; a frame not from a joined rank, out of order or invalid is dropped
        and counted."""
        out = []
        while self._sock.poll(0):
            received = self._receive()
            if received is None:
                continue
            routing_id, seq, frame = received
            if not isinstance(frame, PullReported) or self._peers.get(frame.rank) != routing_id:
                self._drop(f"{type(frame).__name__} not from the rank it names")
                continue
            if seq <= self._reported.get(frame.rank, 0):
                self._drop(f"a replayed report of rank {frame.rank} (seq {seq})")
                continue
            self._reported[frame.rank] = seq
            out.append(frame)
        return out

    def ping(self) -> None:
        self._send(Pinged())

    def stop(self) -> None:
        """Best effort: the other ranks exit (they would also give up on a silent rank 0)."""
        try:
            self._send(Stopped())
        except SpmdError as exc:
            log.info("could not tell every rank to stop: %s", exc)

    def _receive(self) -> tuple[bytes, int, Frame] | None:
        """The next frame on the rank socket with its sender and number (blocks until one is
        there: poll first); None when it does not decode (dropped and counted)."""
        routing_id, data = self._sock.recv_multipart()
        try:
            seq, frame = decode(data, self._key)
        except SpmdProtocolError as exc:
            self._drop(f"a frame: {exc}")
            return None
        return routing_id, seq, frame

    def _drop(self, what: str) -> None:
        self._dropped += 1
        self._publish()
        log.warning("dropped %s on the rank socket", what)

    def _publish(self) -> None:
        self.stats = SpmdStats(self.ranks, len(self._peers), self._seq, self._dropped)

    def close(self) -> None:
        self._sock.close(linger=0)

    def _send(self, frame: Frame) -> None:
        self._seq += 1
        self._publish()
        data = encode(frame, self._seq, self._key)
        for rank, routing_id in sorted(self._peers.items()):
            try:
                self._sock.send_multipart([routing_id, data])
            except zmq.Again:
                raise SpmdError(f"rank {rank} took no frame for the send timeout") from None
            except zmq.ZMQError as exc:  # EHOSTUNREACH: its connection is gone
                raise SpmdError(f"rank {rank} is gone: {exc}") from None
