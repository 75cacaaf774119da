"""The prefill and decode backends of `pd-fsm serve --disaggregation-mode prefill|decode`.

One class, ``PDBackend``, runs the PD loop; what differs between P and D is the role adapter it
holds (``pd_adapter.PDAdapter``: ``PrefillAdapter``, ``decode_adapter.DecodeAdapter``). The
backend owns a PD scheduler (which owns its core endpoint) and, through ``PeerIO``
(peer_io.py), everything a PD worker talks to: the side channel (P binds a ROUTER, D opens a
DEALER per P), the bootstrap client (P and D register; D also resolves P through it) and the
transfer engine (inside the scheduler).
One trio task runs the loop; every touch of the scheduler happens in ``_tick``, on one worker
thread at a time, so scheduler and core need no locks and blocking JAX work never runs on the
event loop:

    side-channel messages (stamped with their arrival time), lookup answers, new jobs, aborts
        -> _tick (thread): deliver, admit, abort (what those made the core say goes out
           now, before the step: a KV part owed to a hello), step, collect outputs and outbox
        -> outbox: SendMessage -> side channel, ResolvePeer -> bootstrap lookup (a task)
        -> outputs -> the requests' streams (a PD failure becomes BackendError(status))
        -> phase samples (taken in the tick's thread) -> ``phase_observer`` (the histograms)
    then sleep until woken (a message, a job, a pull result) or the core's next deadline.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Generic

import attrs
import trio

from pd_fsm.core import effects as fx
from pd_fsm.io_trio.bootstrap.client import BootstrapClient, BootstrapError
from pd_fsm.io_trio.bootstrap.records import InstanceRecord, to_json
from pd_fsm.io_trio.worker.backend import (
    BackendError,
    GenerateJob,
    PhaseObserver,
    Stats,
)
from pd_fsm.io_trio.worker.colocated import SPMD_JOIN_TIMEOUT_S, common_stats
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.decode_adapter import DecodeAdapter
from pd_fsm.io_trio.worker.health import Health
from pd_fsm.io_trio.worker.pd_adapter import PDAdapter, PrefillAdapter, RoleParts, S
from pd_fsm.io_trio.worker.pd_ticks import RankTicks, fingerprint, job_of, leg_of
from pd_fsm.io_trio.worker.peer_io import Arrived, PeerIO
from pd_fsm.io_trio.worker.spmd.tick_inputs import TickInputs, shared_key
from pd_fsm.io_trio.worker.startup import Startup
from pd_fsm.io_trio.worker.streams import STREAM_CAPACITY, JobStream, StreamTable
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.jax_engine.transfer.thread_priority import DataPlanePriority
from pd_fsm.schedulers.args import same_named
from pd_fsm.schedulers.disaggregation import (
    DecodeScheduler,
    DisaggregationArgs,
    PrefillScheduler,
)
from pd_fsm.schedulers.disaggregation.common import warm_kv_copies
from pd_fsm.schedulers.disaggregation.decode import PeerPairing
from pd_fsm.schedulers.disaggregation.tick import TickResult, run_tick
from pd_fsm.schedulers.request import RequestOutput

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader

# Re-exported: rank > 0 of an instance spanning processes checks its state against rank 0's.
__all__ = ["DecodeBackend", "PDBackend", "PrefillBackend", "disaggregation_args", "fingerprint",
           "job_of", "leg_of", "make_pd_backend"]

log = logging.getLogger("pd_fsm.io_trio.worker.pd")

DATA_PLANE_SCAN_S = 0.5  # how often new transfer threads are looked for (a connection's pair)
# An instance spanning processes: how often rank 0 looks for the other ranks' pull reports
# while a pull is under way, and the longest it stays silent (each tick is a frame to them).
SPMD_REPORTS_S = 0.01
SPMD_IDLE_TICK_S = 5.0


def make_pd_backend(
    config: ServeConfig, spmd: SpmdLeader | None = None, pairing: PeerPairing | None = None,
    engine: KVTransferEngine | None = None,
) -> PrefillBackend | DecodeBackend:
    """The role's backend; ``spmd``: rank 0 of an instance spanning processes; ``pairing``: a
    D rank > 0's way to its P rank (its backend only builds the replica); ``engine``: the
    process's transfer engine, shared by the roles a worker switches between (worker/roles.py),
    or None for one of the backend's own."""
    if config.disaggregation_mode == "prefill":
        return PrefillBackend(config, spmd, engine=engine)
    if config.disaggregation_mode == "decode":
        return DecodeBackend(config, spmd, pairing, engine=engine)
    raise ValueError(f"no PD backend for mode {config.disaggregation_mode!r}")


def _always(rid: str) -> bool:
    return True


def disaggregation_args(config: ServeConfig) -> DisaggregationArgs:
    """The PD scheduler's knobs: the config's fields named ``x`` or ``disaggregation_x``, the
    scheduler's as ``scheduler_args`` makes them, and these, which differ."""
    return DisaggregationArgs(**{
        **same_named(config, DisaggregationArgs, prefix="disaggregation_"),
        **attrs.asdict(config.scheduler_args(), recurse=False),
        "instance_id": config.disaggregation_instance_id
        or _instance_name(config),
        # The data plane has no authentication: it listens on the advertised interface only.
        "transfer_host": config.public_host,
        "heartbeat_interval": config.disaggregation_bootstrap_heartbeat_interval,
        "pull_thread_nice": config.transfer_nice,
        # A P spanning processes registers through rank 0 after a forward all ranks ran; its
        # chunks are not streamed (the whole KV goes with READY).
        "stream_tokens": 0 if config.nnodes > 1 else config.disaggregation_stream_tokens,
    })


def _instance_name(config: ServeConfig) -> str:
    """The default instance id: the mode and where the worker listens (TCP, else its socket)."""
    c = config
    where = f"{c.public_host}-{c.port}" if c.port is not None else f"unix-{c.uds}"
    return f"{c.disaggregation_mode}-{where}"


def instance_record(config: ServeConfig, pd_args: DisaggregationArgs,
                    sched: PrefillScheduler | DecodeScheduler, zmq_addr: str,
                    bootstrap_port: int | None, role_epoch: int) -> InstanceRecord:
    """What the backend registers (its role's ``zmq_addr`` and ``bootstrap_port``)."""
    c = config
    curve = c.side_channel_curve
    return InstanceRecord(
        role=c.disaggregation_mode,
        instance_id=pd_args.instance_id,
        # Rank 0 of the instance; in one spanning processes each P process registers its
        # own transfer server under its first tp rank (pd_replica.py), and D's ranks
        # look theirs up by the full rank tuple (RFC-2 §6.2).
        tp_rank=0, tp_size=c.tp_size, cp_rank=0, cp_size=1, dp_rank=0, dp_size=1,
        pp_rank=0, pp_size=1,
        transfer_addr=sched.role.engine.address,
        zmq_addr=zmq_addr,
        page_size=c.page_size,
        kv_dtype=sched.pool_config.dtype,
        layout_hash=sched.role.kv_args.layout_hash,
        scheduler_addr=c.url,
        bootstrap_port=bootstrap_port,
        # kv_checksum: whether this P's READY carries KV checksums (D refuses a P that
        # disagrees with it, by name, before reserving a page).
        mesh_meta={"model": c.model_name, "devices": c.tp_size, "kv_shards": c.tp_size,
                   "processes": c.nnodes, "kv_checksum": c.disaggregation_kv_checksum},
        heartbeat_ttl=c.disaggregation_bootstrap_heartbeat_ttl,
        curve_public_key=curve.public.decode() if curve is not None else None,
        role_epoch=role_epoch,
    )


def compile_kv_copies(startup: Startup, scheduler: PrefillScheduler | DecodeScheduler) -> None:
    """What a PD role compiles besides the forward: its KV copies."""
    role = scheduler.role
    n = startup.timed(
        "kv_copy_compile", lambda: warm_kv_copies(scheduler, role.kv_args, role.kv_copy))
    log.info("compiled the KV %s for %d page buckets", role.kv_copy, n)


def close_pd_scheduler(sched: PrefillScheduler | DecodeScheduler,
                       engine: KVTransferEngine | None) -> None:
    """Free what ``sched`` holds besides memory: the role's part, then its transfer engine, or
    (``engine``: the process's, shared by the roles of a switching worker) what it registered
    there."""
    sched.role.close()
    if engine is None:
        sched.role.engine.close()
        return
    for uuid in list(sched.role.engine.registrations()):
        sched.role.engine.release(uuid, "the worker's role is switching")


def pd_snapshot(sched: PrefillScheduler | DecodeScheduler) -> tuple[Stats, dict[str, float]]:
    """The core's counts and the transfer counters, copied in the tick's thread."""
    return sched.role.link.pd_stats(), dict(sched.role.transfer_stats)


def fan_out_pd(streams: StreamTable, outputs: list[RequestOutput],
               failures: dict[str, tuple[int, str]], mode: str) -> None:
    """A tick's outputs to their streams; a request the PD protocol failed gets its error."""
    plain = []
    for out in outputs:
        failure = failures.get(out.rid)
        stream = streams.live.get(out.rid)
        if failure is None or stream is None:
            plain.append(out)
            continue
        streams.generated_tokens_total += len(out.new_token_ids)
        status, reason = failure
        # Operators see every failed room with its reason (counters alone say how many).
        log.info("%s request %s failed (%d): %s", mode, out.rid, status, reason)
        streams.fail(stream, BackendError(status, reason))
    streams.fan_out(plain)


async def keep_registered(client: BootstrapClient, scope: trio.CancelScope, *,
                          task_status: trio.TaskStatus[None]) -> None:
    """The registry record's heartbeats, until ``scope`` is cancelled (``withdraw``) or the
    end: its cancellation deregisters us (BootstrapClient.run)."""
    with scope:
        await client.run(task_status=task_status)


async def raise_data_plane(data_plane: DataPlanePriority) -> None:
    # The transfer server starts a thread pair per connection: look again now and then.
    while data_plane.refused is None and data_plane.nice != 0:
        data_plane.apply()
        await trio.sleep(DATA_PLANE_SCAN_S)


class PDBackend(Generic[S]):
    """The PD loop, the inbox, the bootstrap client; ``role`` supplies what P and D differ in."""

    def __init__(self, config: ServeConfig, role: Callable[[RoleParts], PDAdapter[S]],
                 spmd: SpmdLeader | None = None, *,
                 engine: KVTransferEngine | None = None) -> None:
        """``role(parts)``: the role object, given what it may use of this backend."""
        self.config = config
        self.pd_args = disaggregation_args(config)
        self.mode = config.disaggregation_mode
        self.streams = StreamTable(config.max_queued, STREAM_CAPACITY)
        self.outcomes = self.streams.outcomes  # requests by outcome (the table's counts)
        self.link = PeerIO(self.streams.wake)
        self._secret = config.cluster_secret()
        self.role: PDAdapter[S] = role(RoleParts(config, self.pd_args, self.link, self.streams,
                                              self._secret, spans_processes=spmd is not None))
        self.health = Health()
        self.startup = Startup(config.warmup)
        self.scheduler: S | None = None
        self._spmd = spmd
        # An instance spanning processes: every rank's clock and random numbers (tick_inputs),
        # and what rank 0 sends the other ranks each tick.
        self.tick_inputs: TickInputs | None = None
        self._ranks = None if spmd is None else RankTicks(spmd)
        # A shared engine outlives this backend (a role switch starts the next role on it: JAX
        # has no call that stops a transfer server), so closing the backend only releases what
        # it registered there.
        self._engine = engine
        # One tick at a time; the limiter keeps JAX work off trio's default thread pool.
        self._limiter = trio.CapacityLimiter(1)
        self.role_epoch = 0  # registered with the backend's record
        # Where each tick's phase samples go (the worker app sets its histograms' observe).
        self.phase_observer: PhaseObserver | None = None
        self.data_plane = DataPlanePriority(config.transfer_nice)
        # The core's counts and the transfer counters, as the tick thread last left them: the
        # HTTP task reads this snapshot, never the live objects the tick mutates.
        self._pd_snapshot: tuple[Stats, dict[str, float]] = ({}, {})
        self._registration = trio.CancelScope()  # withdraw() cancels the registry record
        # The loop's way out for what a tick's inbox made the core say, before its step.
        self._send_early: Callable[[list[fx.IOEffect]], None] | None = None

    # -- ServeBackend protocol ---

    def ready(self) -> bool:
        bootstrap = self.link.bootstrap
        return self.health.ready and bootstrap is not None and bootstrap.registered

    def generate(self, job: GenerateJob) -> AsyncGenerator[RequestOutput, None]:
        return self.streams.generate(job, self.health.refusal)

    def abort(self, rid: str) -> bool:
        return self.streams.abort(rid)

    def fail_in_flight(self, reason: str) -> int:
        """A role switch's drain deadline passed: abort every live request in the
        scheduler, as ``/abort_request`` does (its pages freed; its peer told), and answer its
        client 503 with ``reason``. Returns how many."""
        return self.streams.fail_in_flight(reason)

    async def withdraw(self) -> None:
        self._registration.cancel()

    def stats(self) -> Stats:
        sched = self.scheduler
        out = common_stats(self.streams, self.health, self.startup, self.config.page_size,
                           self._spmd, sched)
        pd_stats, transfer = self._pd_snapshot  # one reference read: a consistent pair
        if sched is not None:
            out["kvpoll"] = {k: v for k, v in pd_stats.items() if k.startswith("state_")}
            out["pd_events"] = {k: v for k, v in pd_stats.items() if not k.startswith("state_")}
            out["transfer"] = dict(transfer)
            # KV this process offers on its transfer server right now (P): each registration
            # pins the room's packed KV until released, so 0 once every room is over.
            out["transfer_registrations"] = len(sched.role.engine.registrations())
            out["pd_queues"] = self.role.queue_stats(sched)
        if self.link.side is not None:
            # Refused frames (bad or missing signature: "malformed") must be visible to operators.
            out["side_channel"] = self.link.side.stats.as_dict()
        out["inbox_dropped_total"] = self.link.inbox_dropped
        out["transfer_thread_priority"] = self.data_plane.as_dict()
        out["busy_liveness_total"] = self.link.busy_liveness_total
        if self.link.bootstrap is not None:
            # Registry heartbeats that failed would make a healthy instance flap out of routing.
            out.update({f"bootstrap_{k}": v for k, v in self.link.bootstrap.stats().items()})
        out.update(self.role.stats(sched, pd_stats))
        return out

    # -- RoleBackend and HandsOff ---

    def precompile(self) -> None:
        """Build and warm the role's scheduler, then close it (worker/roles.py)."""
        close_pd_scheduler(self.build_scheduler(), self._engine)

    def side_port(self) -> int | None:
        return self.role.side_port()

    def hand_off(self, lease_s: float) -> None:
        self.role.hand_off(lease_s)

    def release_handoff(self, uuid: int) -> bool:
        return self.role.release_handoff(uuid)

    async def handoff_peers(self) -> tuple[InstanceRecord, list[InstanceRecord]]:
        """For the drain's gate (``drain_gate.py``): our record and the registry's decode
        records. Raises BootstrapError."""
        bootstrap = self.link.bootstrap
        if bootstrap is None or bootstrap.record is None:
            raise BootstrapError("not registered yet")
        return bootstrap.record, await bootstrap.list("decode")

    def admit_job(self, sched: S, job: GenerateJob, accepted: float) -> None:
        """Open the request's room (``PDAdapter.admit_job``; a rank > 0 admits rank 0's legs)."""
        self.role.admit_job(sched, job, accepted)

    # -- start and stop ---

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.link.started()
        sched = await trio.to_thread.run_sync(
            self.build_scheduler, limiter=self._limiter, abandon_on_cancel=True
        )
        self.scheduler = sched
        # No tick runs yet: the first snapshot, before any request.
        self._pd_snapshot = pd_snapshot(sched)
        try:
            async with trio.open_nursery() as nursery:
                await self._start(nursery, sched)
                task_status.started()
                await self._pd_loop(sched, nursery)
        finally:
            self.health.stopped(self.streams)
            with trio.CancelScope(shield=True):
                if self._spmd is not None:
                    await trio.to_thread.run_sync(self._spmd.stop, limiter=self._limiter)
                await trio.to_thread.run_sync(close_pd_scheduler, sched, self._engine,
                                              limiter=self._limiter)

    async def _start(self, nursery: trio.Nursery, sched: S) -> None:
        """Open the side channel, register (after the other ranks joined), then ready."""
        zmq_addr, bootstrap_port = await self.role.start_io(nursery, sched)
        record = instance_record(self.config, self.pd_args, sched, zmq_addr, bootstrap_port,
                                 self.role_epoch)
        if self._spmd is not None:
            # The other ranks built and warmed the same scheduler alongside this one.
            await trio.to_thread.run_sync(self._spmd.wait_for_ranks, SPMD_JOIN_TIMEOUT_S,
                                          limiter=self._limiter)
            await trio.to_thread.run_sync(
                self._spmd.announce, json.dumps(to_json(record)), limiter=self._limiter)
        nursery.start_soon(raise_data_plane, self.data_plane)
        self.link.bootstrap = BootstrapClient(
            self.config.bootstrap_url,
            record,
            secret=self._secret,
            heartbeat_interval=self.config.disaggregation_bootstrap_heartbeat_interval,
            # The TTL assumed until the registry names its own (--...-heartbeat-ttl).
            stale_after=self.config.disaggregation_bootstrap_heartbeat_ttl,
            tls=self.config.tls,
        )
        await nursery.start(keep_registered, self.link.bootstrap, self._registration)
        self.health.ready = True
        log.info("%s backend ready: %s", self.mode, record)

    def build_scheduler(self) -> S:
        """Build and warm the role's scheduler (runs in a worker thread; every rank of an
        instance spanning processes builds its replica here, in step). Plain requests warm it
        too: either role can serve those."""
        if self.tick_inputs is None and self.config.nnodes > 1:
            self.tick_inputs = TickInputs(shared_key())
        tick_inputs = self.tick_inputs

        def warm_role(sched: S) -> None:
            compile_kv_copies(self.startup, sched)

        return self.startup.build(lambda: self.role.new_scheduler(self._engine, tick_inputs),
                                  warm_role)

    # -- the loop ---

    async def _pd_loop(self, sched: S, nursery: trio.Nursery) -> None:
        def check(record: InstanceRecord) -> str | None:
            return self.role.check_peer(record, self.scheduler)

        def start_resolve(bootstrap_addr: str) -> None:
            # Inside the core's own resolve deadline, so this clearer answer arrives first.
            nursery.start_soon(self.link.resolve, bootstrap_addr, check,
                               self.pd_args.resolve_timeout * 0.9, self.mode)

        def send_early(effects: list[fx.IOEffect]) -> None:
            self.link.send_from_thread(effects, start_resolve)

        self._send_early = send_early
        while True:
            woken = self.streams.rearm()
            result = await self._run_tick(sched)
            if self.phase_observer is not None:
                for phase, value in result.phases:
                    self.phase_observer(phase, value)
            self.link.carry_out(result.outbox, start_resolve)
            for stream, status, reason in result.refused:
                self.streams.fail(stream, BackendError(status, reason))
            for stream in result.unstarted:
                self.streams.abort_unstarted(stream)
            fan_out_pd(self.streams, result.outputs, result.failures, self.mode)
            self.role.after_tick(nursery)
            if result.forward_work:
                continue
            with trio.move_on_at(self._wake_at(sched, result.next_deadline)):
                await woken.wait()

    async def _run_tick(self, sched: S) -> TickResult[JobStream]:
        """This tick's inputs to the scheduler's thread, and its result back."""
        inbox = self.link.take_inbox()
        jobs = self.streams.take_jobs()
        aborts = self.streams.take_aborts()
        start = trio.current_time()
        self.link.busy_since = start
        try:
            result = await trio.to_thread.run_sync(
                self._tick, sched, inbox, jobs, aborts, limiter=self._limiter
            )
        except Exception as exc:
            self.health.step_failed(exc, self.streams)
            raise
        finally:
            self.link.busy_since = None
        self.health.stepped(trio.current_time() - start)
        return result

    def _wake_at(self, sched: S, next_deadline: float | None) -> float:
        """When the loop must tick again with nothing arriving (trio time)."""
        wake_at = math.inf
        if next_deadline is not None:
            wake_at = trio.current_time() + max(0.0, next_deadline - time.monotonic())
        if self._spmd is not None:
            # The other ranks hear a tick at least this often (they leave a silent rank 0),
            # and their pull reports are looked for while a pull is under way.
            wake_at = min(wake_at, trio.current_time() + (
                SPMD_REPORTS_S if self.role.pulls_under_way(sched) else SPMD_IDLE_TICK_S))
        return wake_at

    def _tick(
        self, sched: S, inbox: list[Arrived], jobs: list[JobStream], aborts: list[str]
    ) -> TickResult[JobStream]:
        """Everything that touches the scheduler, on one thread at a time (the limiter): the
        one tick the simulator runs too (``schedulers/disaggregation/tick.py``)."""
        streams = self.streams

        def busy(effects: tuple[fx.BusyEffect, ...]) -> None:
            self.link.while_busy = effects

        may_abort: Callable[[str], bool] = streams.in_scheduler
        if self._ranks is not None:
            assert self.tick_inputs is not None
            aborts, gate = self._ranks.tell(self.tick_inputs, inbox, jobs, aborts, may_abort,
                                            self.role.pulls_ready(sched))
            if gate is not None:
                self.role.set_pull_gate(sched, gate)
            may_abort = _always  # decided above, for every rank alike
        def first_tokens(outputs: list[RequestOutput],
                         failures: dict[str, tuple[int, str]]) -> None:
            # D's first token, pulled with the KV, reaches its client before the decode forward.
            self.link.on_loop(lambda: fan_out_pd(streams, outputs, failures, self.mode))

        result = run_tick(sched, inbox, jobs, aborts, rid=lambda s: s.job.rid,
                          admit=lambda s: self.role.admit_job(sched, s.job, s.accepted),
                          on_admitted=streams.admitted, on_busy=busy, may_abort=may_abort,
                          before_step=self._send_early, early_outputs=first_tokens)
        if self._ranks is not None:
            self._ranks.fingerprint = fingerprint(sched)
        self.role.after_run_tick(sched)
        # Copies for the HTTP task (see ``stats``), taken in the tick's thread.
        self._pd_snapshot = pd_snapshot(sched)
        return result

class PrefillBackend(PDBackend[PrefillScheduler]):
    """P: answers its leg once the room's KV is handed off to D (READY sent). Only a named
    constructor: the role object (``PrefillAdapter``) is all that differs."""

    def __init__(self, config: ServeConfig, spmd: SpmdLeader | None = None, *,
                 engine: KVTransferEngine | None = None) -> None:
        super().__init__(config, PrefillAdapter, spmd, engine=engine)


class DecodeBackend(PDBackend[DecodeScheduler]):
    """D: preallocates, pulls the KV from P, then streams the generation. Only a named
    constructor: the role object (``DecodeAdapter``) is all that differs."""

    def __init__(self, config: ServeConfig, spmd: SpmdLeader | None = None,
                 pairing: PeerPairing | None = None, *,
                 engine: KVTransferEngine | None = None) -> None:
        super().__init__(config, lambda parts: DecodeAdapter(parts, pairing), spmd, engine=engine)
