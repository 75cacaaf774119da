"""The simulated network between the hosts (``pd_fsm.sim``): partitions that cut P from D for a
while, and the side channel, which carries the real codec's signed frames, each delayed, dropped,
duplicated, delayed out of order or corrupted as the seed says."""

from __future__ import annotations

from collections.abc import Iterator

from pd_fsm.core.codec import decode, encode
from pd_fsm.core.errors import RemoteProtocolError
from pd_fsm.core.messages import Message
from pd_fsm.sim.config import SECRET
from pd_fsm.sim.process import Process
from pd_fsm.sim.workers import Clock


class Network:
    def __init__(self, world: Clock, procs: dict[str, Process], serial: Iterator[int]) -> None:
        """``procs``: the worker processes by name (``switch.Processes.procs``), whose nodes the
        frames reach; ``serial``: the world's counter, which numbers the frames' nonces between
        the clock queue's entries (a seed replays bit for bit only with the same numbers)."""
        self.world, self.procs, self.serial = world, procs, serial
        self.cut: set[frozenset[str]] = set()  # host pairs partitioned now

    def reachable(self, a: str, b: str) -> bool:
        return frozenset((a.split(":")[0], b.split(":")[0])) not in self.cut

    def send(self, src: str, dst: str, message: Message) -> None:
        """One side-channel frame: signed, then delayed, dropped, duplicated or corrupted."""
        w = self.world
        frame = encode(message, SECRET, sent_at=1.0, nonce=next(self.serial))
        copies, rng = 1, w.rng
        if w.config.faults:
            r = rng.random()
            if r < 0.02:
                copies = 0
            elif r < 0.04:
                copies = 2
            elif r < 0.05:
                i = rng.randrange(len(frame))
                frame = frame[:i] + bytes((frame[i] ^ 0x40,)) + frame[i + 1:]
        for _ in range(copies):
            delay = rng.uniform(0.0005, 0.003)
            if w.config.faults and rng.random() < 0.03:
                delay = rng.uniform(0.05, 2.0)  # overtaken by later frames
            w.at(delay, f"frame {type(message).__name__} {src} -> {dst}", self._deliver,
                 src, dst, frame)

    def _deliver(self, src: str, dst: str, frame: bytes) -> None:
        host = dst.split(":")[0]
        proc = self.procs.get(host)
        node = None if proc is None else proc.node
        # P listens at "name:side", D at its name: a frame for the role the worker left finds
        # that role's side channel closed (a switch stopped it).
        if node is None or not node.alive or not self.reachable(src, dst) or (
                (dst != host) != (node.role == "prefill")):
            return
        try:
            message = decode(frame, SECRET)
        except RemoteProtocolError:
            self.world.trace_line(f"  {host}: corrupt frame refused")
            return
        node.receive(src, message)
