"""What a PD worker's adapter supplies to the PD loop: ``PDAdapter``, and the prefill one.

Two layers: the scheduler's role (``sched.role``: schedulers/disaggregation) owns the core link
and plans; the adapter does the I/O around it and calls it directly.

The loop (pd_backends.py) is the same for P and D: inbox, jobs, aborts, one tick on the
scheduler's thread, outputs out. What differs is an adapter the backend holds, typed by its
scheduler (``S``): how the scheduler is made, which side channel it opens, how a job opens a room,
what the role adds after a tick (D: hand-offs, telling P of refused legs), what it counts.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import attrs
import trio

from pd_fsm.io_trio.bootstrap.records import InstanceRecord, split_host_port
from pd_fsm.io_trio.side_channel.channel import PrefillSideChannel
from pd_fsm.io_trio.side_channel.curve import CurveKeys
from pd_fsm.io_trio.unix_sockets import IPC_PREFIX
from pd_fsm.io_trio.worker.backend import GenerateJob, Stats, request_of
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.peer_io import PeerIO
from pd_fsm.io_trio.worker.spmd.tick_inputs import TickInputs
from pd_fsm.io_trio.worker.streams import StreamTable
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.schedulers.disaggregation import DecodeScheduler, DisaggregationArgs, PrefillScheduler

# The role's scheduler: every PD role is typed by the one it drives.
S = TypeVar("S", PrefillScheduler, DecodeScheduler)
PDScheduler = PrefillScheduler | DecodeScheduler


@attrs.frozen(eq=False)
class RoleParts:
    """What a role object may use of the backend that holds it."""

    config: ServeConfig
    pd_args: DisaggregationArgs
    link: PeerIO  # the side channel (the role opens it), the inbox, the registry client
    streams: StreamTable  # the live requests (D ends the ones it handed off)
    # The cluster secret: the side channel and the BootstrapClient each derive their own key
    # from it (pd_fsm.core.keys); neither sends it.
    secret: bytes | None
    spans_processes: bool  # rank 0 of an instance spanning processes (spmd/)

    @property
    def curve(self) -> CurveKeys | None:
        """CURVE keys for the side channel (pd_fsm.io_trio.side_channel.curve), or None: TCP."""
        return self.config.side_channel_curve


class PDAdapter(Protocol[S]):
    mode: str  # "prefill" | "decode"

    def new_scheduler(self, engine: KVTransferEngine | None,
                      tick_inputs: TickInputs | None) -> S:
        """The role's scheduler on ``engine`` (None: its own), with ``tick_inputs``' clock and
        random source if any (runs in a worker thread)."""
        ...

    async def start_io(self, nursery: trio.Nursery, sched: S) -> tuple[str, int | None]:
        """Open the side channel (``link.side``); the record's ``zmq_addr`` and
        ``bootstrap_port``."""
        ...

    def check_peer(self, record: InstanceRecord, sched: S | None) -> str | None:
        """Why this worker must not use the P in ``record`` (None: it may)."""
        ...

    def queue_stats(self, sched: S) -> dict[str, int]:
        """What the role holds for rooms: all zero once every room is over. Read from the HTTP
        task while a tick may run, so only len() and the engine's locked snapshot."""
        ...

    def admit_job(self, sched: S, job: GenerateJob, accepted: float) -> None:
        """Open the request's room in the scheduler (raises ValueError / DuplicateRoomError);
        ``accepted``: when the worker took it. A rank > 0 admits rank 0's legs with it too."""
        ...

    def after_run_tick(self, sched: S) -> None:
        """In the tick's thread, after ``run_tick`` (D: hand-offs given and released)."""
        ...

    def after_tick(self, nursery: trio.Nursery) -> None:
        """On the loop, after a tick's outputs went out (D: end handed-off streams, tell P of
        refused legs)."""
        ...

    def pulls_ready(self, sched: S) -> dict[int, str] | None:
        """Rooms whose pull finished on this rank ("" or why it failed); None: the role pulls
        nothing (P). For an instance spanning processes (pd_ticks.py)."""
        ...

    def set_pull_gate(self, sched: S, gate: dict[int, str]) -> None:
        """The pulls every rank collects in this tick."""
        ...

    def pulls_under_way(self, sched: S) -> bool:
        ...

    def stats(self, sched: S | None, pd_stats: Stats) -> Stats:
        """The role's own figures for ``stats()`` (``pd_stats``: the core's last counts)."""
        ...

    def hand_off(self, lease_s: float) -> None:
        """Draining: hand running streams to another D (nothing, for P)."""
        ...

    def release_handoff(self, uuid: int) -> bool:
        """Another D pulled hand-off ``uuid``: released on the next tick (False for P)."""
        ...

    def side_port(self) -> int | None:
        """The port P's side channel is bound to (None for D, and on a unix socket)."""
        ...


def bootstrap_of(mode: str, job: GenerateJob) -> tuple[str, int | None, int]:
    """The router's three fields (host, port, room); a PD leg without them is a 400."""
    if job.bootstrap is None:
        raise ValueError(
            f"a {mode} worker needs bootstrap_host, bootstrap_port and "
            "bootstrap_room in the request (a PD router adds them)"
        )
    boot = job.bootstrap
    return boot.host, boot.port, boot.room


class PrefillAdapter:
    """P: answers its leg once the room's KV is handed off to D (READY sent)."""

    mode = "prefill"

    def __init__(self, parts: RoleParts) -> None:
        self._config = parts.config
        self._pd_args = parts.pd_args
        self._link = parts.link
        self._secret = parts.secret
        self._curve = parts.curve
        self._side: PrefillSideChannel | None = None

    def new_scheduler(self, engine: KVTransferEngine | None,
                      tick_inputs: TickInputs | None) -> PrefillScheduler:
        if tick_inputs is None:
            return PrefillScheduler(self._pd_args, engine=engine)
        return PrefillScheduler(self._pd_args, engine=engine, clock=tick_inputs.clock,
                                rng=tick_inputs.rng)

    async def start_io(self, nursery: trio.Nursery,
                       sched: PrefillScheduler) -> tuple[str, int | None]:
        c = self._config
        # A worker on its unix socket alone binds its side channel beside it (ipc://PATH.zmq):
        # routers then know it by that endpoint, and no port.
        ipc = c.side_channel_ipc
        bind = ipc or f"{c.host}:{c.disaggregation_side_channel_port}"
        self._side = self._link.side = PrefillSideChannel(
            bind, self._link.deliver_message, secret=self._secret, curve=self._curve,
            ipc_mode=c.uds_mode)
        address: str = await nursery.start(self._side.run)
        if ipc is not None:
            return address, None
        _, port = split_host_port(address)  # the bound host may be 0.0.0.0: advertise ours
        # Routers know P by its side-channel port (DESIGN §5 "Who is P").
        return f"{self._config.public_host}:{port}", port

    def check_peer(self, record: InstanceRecord, sched: PrefillScheduler | None) -> str | None:
        return None  # P resolves nobody

    def queue_stats(self, sched: PrefillScheduler) -> dict[str, int]:
        return {
            "send_queue": len(sched.role.send_queue),
            "held_rooms": held_rooms(sched),
        }

    def admit_job(self, sched: PrefillScheduler, job: GenerateJob, accepted: float) -> None:
        _, _, room = bootstrap_of(self.mode, job)
        sched.role.add_pd_request(request_of(sched, job), room, accepted=accepted)

    def after_run_tick(self, sched: PrefillScheduler) -> None:
        """Nothing: P hands nothing off."""

    def after_tick(self, nursery: trio.Nursery) -> None:
        """Nothing: P refuses its legs with their answer alone."""

    def pulls_ready(self, sched: PrefillScheduler) -> dict[int, str] | None:
        return None

    def set_pull_gate(self, sched: PrefillScheduler, gate: dict[int, str]) -> None:
        """Never called: P pulls nothing (``pulls_ready`` is None)."""

    def pulls_under_way(self, sched: PrefillScheduler) -> bool:
        return False

    def stats(self, sched: PrefillScheduler | None, pd_stats: Stats) -> Stats:
        return {}

    def hand_off(self, lease_s: float) -> None:
        """Nothing: P has no streams to hand off (``drain_gate`` asks D only)."""

    def release_handoff(self, uuid: int) -> bool:
        return False

    def side_port(self) -> int | None:
        address = None if self._side is None else self._side.address
        if address is None or address.startswith(IPC_PREFIX):
            return None
        return int(address.rpartition(":")[2])


def held_rooms(sched: PDScheduler) -> int:
    """Rooms whose pages the scheduler still holds once their leg answered (P: until D pulled
    them; D: aborted hand-offs whose pull still runs)."""
    return len(sched.role.held_pages)
