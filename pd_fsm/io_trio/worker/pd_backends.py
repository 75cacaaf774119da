"""The prefill and decode backends of `pd-fsm serve --disaggregation-mode prefill|decode`.

Each owns a PD scheduler (which owns its core endpoint) and everything a PD worker talks to: the
side channel (P binds a ROUTER, D opens a DEALER per P), the bootstrap client (P and D register;
D also resolves P through it) and the transfer engine (inside the scheduler). One trio task runs
the loop; every touch of the scheduler happens in ``_tick``, on one worker thread at a time, so
scheduler and core need no locks and blocking JAX work never runs on the event loop:

    side-channel messages (stamped with their arrival time), lookup answers, new jobs, aborts
        -> _tick (thread): deliver, admit, abort (what those made the core say goes out
           now, before the step: a KV part owed to a hello), step, collect outputs and outbox
        -> outbox: SendMessage -> side channel, ResolvePeer -> bootstrap lookup (a task)
        -> outputs -> the requests' streams (a PD failure becomes BackendError(status))
        -> phase samples (taken in the tick's thread) -> ``phase_observer`` (the histograms)
    then sleep until woken (a message, a job, a pull result) or the core's next deadline.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.messages import (
    Message,
)
from pd_fsm.io_trio.bootstrap.client import BootstrapClient, BootstrapError, BootstrapResolver
from pd_fsm.io_trio.bootstrap.records import (
    InstanceRecord,
    rank_query,
    split_host_port,
    to_json,
)
from pd_fsm.io_trio.driver import SideChannel, carry_out_io, resolve_within
from pd_fsm.io_trio.side_channel.channel import DecodeSideChannel, PrefillSideChannel
from pd_fsm.io_trio.worker.backend import (
    BackendError,
    BootstrapInfo,
    GenerateJob,
    HandedOff,
    request_of,
)
from pd_fsm.io_trio.worker.colocated import SPMD_JOIN_TIMEOUT_S, ColocatedBackend, _Stream
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.spmd.frames import (
    Arrival,
    InboxEvent,
    LegAdded,
    PullAgreed,
    TickStarted,
)
from pd_fsm.io_trio.worker.spmd.tick_inputs import TickInputs, shared_key
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.jax_engine.transfer.thread_priority import DataPlanePriority
from pd_fsm.schedulers.args import same_named
from pd_fsm.schedulers.disaggregation import (
    DecodeScheduler,
    DisaggregationArgs,
    PrefillScheduler,
)
from pd_fsm.schedulers.disaggregation.decode import PeerPairing
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.disaggregation.tick import TickResult, run_tick
from pd_fsm.schedulers.request import RequestOutput, Resume
from pd_fsm.schedulers.scheduler import Scheduler

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader

log = logging.getLogger("pd_fsm.io_trio.worker.pd")

INBOX_SIZE = 4096  # side-channel messages and lookup answers waiting for the loop
DATA_PLANE_SCAN_S = 0.5  # how often new transfer threads are looked for (a connection's pair)
# D: refused legs whose P(s) are still to be told (bounded: a flood drops the oldest).
REFUSALS_PENDING = 1024
# An instance spanning processes: how often rank 0 looks for the other ranks' pull reports
# while a pull is under way, and the longest it stays silent (each tick is a frame to them).
SPMD_REPORTS_S = 0.01
SPMD_IDLE_TICK_S = 5.0


def make_pd_backend(
    config: ServeConfig, spmd: SpmdLeader | None = None, pairing: PeerPairing | None = None,
    engine: KVTransferEngine | None = None,
) -> PDBackend:
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


def fingerprint(sched: Any) -> str:
    """What two replicas of one PD scheduler must agree on after every tick (cheap to take)."""
    s = sched.stats()
    states = sorted((k, v) for k, v in sched.pd_stats().items() if k.startswith("state_"))
    # The transfer registrations too: a rank > 0 whose KV offers leak (it has no HTTP to show
    # them) leaves the instance at the next tick.
    return repr((states, s.free_pages, s.waiting, s.prefilling, s.running, s.cached_pages,
                 len(sched.engine.registrations())))


def job_of(leg: LegAdded) -> GenerateJob:
    boot = (None if leg.room is None or leg.bootstrap_host is None
            else BootstrapInfo(leg.bootstrap_host, leg.bootstrap_port, leg.room))
    return GenerateJob(leg.rid, leg.input_ids, leg.sampling, boot, logprobs=leg.logprobs)


def leg_of(job: GenerateJob, accepted: float) -> LegAdded:
    boot = job.bootstrap
    return LegAdded(job.rid, job.input_ids, job.sampling, job.logprobs, accepted,
                    None if boot is None else boot.host, None if boot is None else boot.port,
                    None if boot is None else boot.room)


def disaggregation_args(config: ServeConfig) -> DisaggregationArgs:
    """The PD scheduler's knobs: the config's fields named ``x`` or ``disaggregation_x``, the
    scheduler's as ``scheduler_args`` makes them, and these, which differ."""
    return DisaggregationArgs(**{
        **same_named(config, DisaggregationArgs, prefix="disaggregation_"),
        **attrs.asdict(config.scheduler_args(), recurse=False),
        "instance_id": config.disaggregation_instance_id
        or f"{config.disaggregation_mode}-{config.public_host}-{config.port}",
        # The data plane has no authentication: it listens on the advertised interface only.
        "transfer_host": config.public_host,
        "heartbeat_interval": config.disaggregation_bootstrap_heartbeat_interval,
        "pull_thread_nice": config.transfer_nice,
        # A P spanning processes registers through rank 0 after a forward all ranks ran; its
        # chunks are not streamed (the whole KV goes with READY, as before streaming).
        "stream_tokens": 0 if config.nnodes > 1 else config.disaggregation_stream_tokens,
    })


class PDBackend(ColocatedBackend, ABC):
    """What the two roles share: the loop, the inbox, the bootstrap client."""

    scheduler: PrefillScheduler | DecodeScheduler | None

    def __init__(self, config: ServeConfig, spmd: SpmdLeader | None = None, *,
                 engine: KVTransferEngine | None = None) -> None:
        super().__init__(
            config.scheduler_args(), max_queued=config.max_queued, warmup=config.warmup,
            spmd=spmd,
        )
        self.config = config
        # A shared engine outlives this backend (a role switch starts the next role on it: JAX
        # has no call that stops a transfer server), so closing the backend only releases what
        # it registered there.
        self._engine = engine
        # Registered with the backend's record (issue 30 §1): the worker's switches so far.
        self.role_epoch = 0
        # An instance spanning processes: every rank's clock and random numbers (tick_inputs),
        # the ticks sent so far, rank 0's state after the last one, and (D) the other ranks'
        # finished pulls: room -> rank -> "" or why it failed.
        self.tick_inputs: TickInputs | None = None
        self._ticks = 0
        self._fingerprint = ""
        self._rank_pulls: dict[int, dict[int, str]] = {}
        self.pd_args = disaggregation_args(config)
        self.mode = config.disaggregation_mode
        # The side channel and the BootstrapClient each derive their own key from it
        # (pd_fsm.core.keys); neither sends it.
        self._secret = config.cluster_secret()
        # CURVE keys for the side channel (pd_fsm.io_trio.side_channel.curve), or None: plain TCP.
        self._curve = config.side_channel_curve
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[tuple[float, InboxEvent]](
            INBOX_SIZE)
        self._token: trio.lowlevel.TrioToken | None = None
        self.bootstrap: BootstrapClient | None = None
        self.inbox_dropped = 0
        # trio time the running scheduler tick began (None between ticks): a first forward of a
        # new shape compiles for many seconds, and liveness must not wait for it.
        self.busy_since: float | None = None
        # What the core said to do while the running tick keeps it busy (ev.StepStarted):
        # published by the tick's thread at its start, emptied at its end; the loop's tasks
        # read the reference (a tuple of frozen effects) and carry it out.
        self._while_busy_effects: tuple[fx.BusyEffect, ...] = ()
        # The loop's way out for what a tick's inbox made the core say, before its step.
        self._send_early: Callable[[list[fx.IOEffect]], None] | None = None
        self.busy_liveness_total = 0
        # Where each tick's phase samples go (the worker app sets its histograms' observe).
        self.phase_observer: Callable[[str, float], None] | None = None
        self.data_plane = DataPlanePriority(config.transfer_nice)
        # The core's counts and the transfer counters, as the tick thread last left them: the
        # HTTP task reads this snapshot, never the live objects the tick mutates.
        self._pd_snapshot: tuple[dict[str, Any], dict[str, int]] = ({}, {})
        self._registration = trio.CancelScope()  # withdraw() cancels the registry record

    # -- Backend protocol ---

    def ready(self) -> bool:
        return self._ready and self.bootstrap is not None and self.bootstrap.registered

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        sched = self.scheduler
        if sched is not None:
            pd_stats, transfer = self._pd_snapshot  # one reference read: a consistent pair
            out["kvpoll"] = {k: v for k, v in pd_stats.items() if k.startswith("state_")}
            out["pd_events"] = {k: v for k, v in pd_stats.items() if not k.startswith("state_")}
            out["transfer"] = dict(transfer)
            # KV this process offers on its transfer server right now (P): each registration
            # pins the room's packed KV until released, so 0 once every room is over.
            out["transfer_registrations"] = len(sched.engine.registrations())
            out["pd_queues"] = self._queue_stats(sched)
            if isinstance(sched, DecodeScheduler):
                out["recomputed_total"] = sched.recomputed
                # Pulls whose KV failed READY's checksums (corrupted in flight) and the second
                # pulls they caused (also under pd_events, without the _total).
                out["kv_checksum_mismatches_total"] = pd_stats.get("kv_checksum_mismatches", 0)
                out["kv_checksum_repulls_total"] = pd_stats.get("kv_checksum_repulls", 0)
        side = getattr(self, "side", None)
        if side is not None:
            # Refused frames (bad or missing signature: "malformed") must be visible to operators.
            out["side_channel"] = side.stats.as_dict()
        out["inbox_dropped_total"] = self.inbox_dropped
        out["transfer_thread_priority"] = self.data_plane.as_dict()
        out["busy_liveness_total"] = self.busy_liveness_total
        if self.bootstrap is not None:
            # Registry heartbeats that failed would make a healthy instance flap out of routing.
            out.update({f"bootstrap_{k}": v for k, v in self.bootstrap.stats().items()})
        return out

    @abstractmethod
    def _queue_stats(self, sched: Any) -> dict[str, int]:
        """What the role holds for rooms: all zero once every room is over. Read from the HTTP
        task while a tick may run, so only len() and the engine's locked snapshot."""

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._token = trio.lowlevel.current_trio_token()
        sched = await trio.to_thread.run_sync(
            self._build, limiter=self._limiter, abandon_on_cancel=True
        )
        self.scheduler = sched
        self._publish_stats(sched)  # no tick runs yet: the first snapshot, before any request
        try:
            async with trio.open_nursery() as nursery:
                record = await self._start_io(nursery, sched)
                if self._spmd is not None:
                    # The other ranks built and warmed the same scheduler alongside this one.
                    await trio.to_thread.run_sync(self._spmd.wait_for_ranks, SPMD_JOIN_TIMEOUT_S,
                                                  limiter=self._limiter)
                    await trio.to_thread.run_sync(
                        self._spmd.announce, json.dumps(to_json(record)), limiter=self._limiter)
                nursery.start_soon(self._raise_data_plane)
                self.bootstrap = BootstrapClient(
                    self._bootstrap_url(),
                    record,
                    secret=self._secret,
                    heartbeat_interval=self.config.disaggregation_bootstrap_heartbeat_interval,
                    # The TTL assumed until the registry names its own (--...-heartbeat-ttl).
                    stale_after=self.config.disaggregation_bootstrap_heartbeat_ttl,
                    tls=self.config.tls,
                )
                await nursery.start(self._registration_task, self.bootstrap)
                self._ready = True
                task_status.started()
                log.info("%s backend ready: %s", self.mode, record)
                await self._pd_loop(sched, nursery)
        finally:
            self._stopped()
            with trio.CancelScope(shield=True):
                if self._spmd is not None:
                    await trio.to_thread.run_sync(self._spmd.stop, limiter=self._limiter)
                await trio.to_thread.run_sync(self._close, sched, limiter=self._limiter)

    async def _registration_task(
        self, client: BootstrapClient, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """The registry record's heartbeats, until ``withdraw`` (or the end): its cancellation
        deregisters us (BootstrapClient.run)."""
        with self._registration:
            await client.run(task_status=task_status)

    async def withdraw(self) -> None:
        self._registration.cancel()

    async def _raise_data_plane(self) -> None:
        # The transfer server starts a thread pair per connection: look again now and then.
        while self.data_plane.refused is None and self.data_plane.nice != 0:
            self.data_plane.apply()
            await trio.sleep(DATA_PLANE_SCAN_S)

    def _warm_role(self, scheduler: Scheduler) -> None:
        assert isinstance(scheduler, PrefillScheduler | DecodeScheduler)
        n = self._timed("kv_copy_compile", scheduler.warm_kv_copies)
        log.info("compiled the KV %s for %d page buckets", scheduler.KV_COPY, n)

    # -- pieces each role supplies ---

    def _build(self) -> PrefillScheduler | DecodeScheduler:
        """Build and warm the role's scheduler (runs in a worker thread; every rank of an
        instance spanning processes builds its replica here, in step)."""
        if self.tick_inputs is None and self.config.nnodes > 1:
            self.tick_inputs = TickInputs(shared_key())
        sched = self._timed("model_load", self._new_scheduler)
        self._warm(sched)  # plain requests: either role can serve those too
        return sched

    @abstractmethod
    def _new_scheduler(self) -> PrefillScheduler | DecodeScheduler:
        """The role's scheduler, with ``tick_inputs``' clock and random source if any."""

    @abstractmethod
    async def _start_io(self, nursery: trio.Nursery, sched: Any) -> InstanceRecord:
        """Start the side channel; return the record to register."""

    @abstractmethod
    def _side(self) -> SideChannel:
        """The running side channel."""

    def _send(self, peer: str, message: Message) -> bool:
        """Send on the side channel (non-blocking; False when dropped)."""
        return self._side().send(peer, message)

    @abstractmethod
    def admit_job(self, sched: Any, job: GenerateJob, accepted: float) -> None:
        """Open the request's room in the scheduler (raises ValueError / DuplicateRoomError);
        ``accepted``: when the worker took it. A rank > 0 admits rank 0's legs with it too."""

    def _close(self, sched: Any) -> None:
        self._close_engine(sched)

    def close_scheduler(self, scheduler: Scheduler) -> None:
        self._close(scheduler)

    def _close_engine(self, sched: Any) -> None:
        if self._engine is None:
            sched.engine.close()
            return
        for uuid in list(sched.engine.registrations()):
            sched.engine.release(uuid, "the worker's role is switching")

    # -- shared machinery ---

    def _bootstrap_of(self, job: GenerateJob) -> BootstrapInfo:
        """The router's three fields; a PD leg without them is a 400."""
        if job.bootstrap is None:
            raise ValueError(
                f"a {self.mode} worker needs bootstrap_host, bootstrap_port and "
                "bootstrap_room in the request (a PD router adds them)"
            )
        return job.bootstrap

    def _bootstrap_url(self) -> str:
        c = self.config
        # TLS is on for the whole cluster or none of it (pd_fsm.io_trio.tls).
        return (f"{c.tls.scheme}://{c.disaggregation_bootstrap_host}:"
                f"{c.disaggregation_bootstrap_port}")

    def _record(self, sched: Any, zmq_addr: str, bootstrap_port: int | None) -> InstanceRecord:
        c = self.config
        return InstanceRecord(
            role=self.mode,
            instance_id=self.pd_args.instance_id,
            # Rank 0 of the instance; in one spanning processes each P process registers its
            # own transfer server under its first tp rank (spmd/pd_replica.py), and D's ranks
            # look theirs up by the full rank tuple (RFC-2 §6.2).
            tp_rank=0,
            tp_size=c.tp_size,
            cp_rank=0,
            cp_size=1,
            dp_rank=0,
            dp_size=1,
            pp_rank=0,
            pp_size=1,
            transfer_addr=sched.engine.address,
            zmq_addr=zmq_addr,
            page_size=c.page_size,
            kv_dtype=sched.pool_config.dtype,
            layout_hash=sched.layout_hash,
            scheduler_addr=f"{c.tls.scheme}://{c.public_host}:{c.port}",
            bootstrap_port=bootstrap_port,
            # kv_checksum: whether this P's READY carries KV checksums (D refuses a P that
            # disagrees with it, by name, before reserving a page).
            mesh_meta={"model": c.model_name, "devices": c.tp_size, "kv_shards": c.tp_size,
                       "processes": c.nnodes, "kv_checksum": c.disaggregation_kv_checksum},
            heartbeat_ttl=c.disaggregation_bootstrap_heartbeat_ttl,
            curve_public_key=self._curve.public.decode() if self._curve is not None else None,
            role_epoch=self.role_epoch,
        )

    def _check_peer(self, record: InstanceRecord) -> str | None:
        """Hook: why D must not use the P in ``record`` (DecodeBackend: its CURVE key)."""
        return None

    async def _deliver_message(self, peer: str, message: Message) -> None:
        """The side channel's callback: stamp the arrival time, queue, wake the loop; while a
        tick runs, answer at once what the core's ``AckWhileBusy`` answers."""
        for effect in self._while_busy_effects:
            reply = effect.answer(message) if isinstance(effect, fx.AckWhileBusy) else None
            if reply is not None:
                self.busy_liveness_total += 1
                self._send(peer, reply)
        self._put(ev.MessageReceived(peer, message))

    def _put(self, event: InboxEvent) -> None:
        try:
            self._inbox_send.send_nowait((time.monotonic(), event))
        except trio.WouldBlock:
            self.inbox_dropped += 1  # bounded: a flood is dropped and counted, never queued
        self._wake.set()

    def _wake_from_thread(self, _: object = None) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):  # the worker is shutting down
                trio.from_thread.run_sync(self._wake.set, trio_token=self._token)

    async def _pd_loop(self, sched: Any, nursery: trio.Nursery) -> None:
        def start_resolve(bootstrap_addr: str) -> None:
            nursery.start_soon(self._resolve, bootstrap_addr)

        def send_early(effects: list[fx.IOEffect]) -> None:
            """From the tick's thread, before its step: out on the loop now (run_tick)."""
            def send() -> None:
                for effect in effects:
                    carry_out_io(effect, self._side(), start_resolve)

            with contextlib.suppress(trio.RunFinishedError):  # the worker is shutting down
                trio.from_thread.run_sync(send, trio_token=self._token)

        self._send_early = send_early

        while True:
            self._wake = trio.Event()
            inbox: list[tuple[float, Any]] = []
            while True:
                try:
                    inbox.append(self._inbox_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            jobs: list[_Stream] = []
            while True:
                try:
                    jobs.append(self._jobs_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            aborts = [rid for rid in self._aborts]
            self._aborts.clear()
            start = trio.current_time()
            self.busy_since = start
            try:
                result = await trio.to_thread.run_sync(
                    self._tick, sched, inbox, jobs, aborts, limiter=self._limiter
                )
            except Exception as exc:
                self._step_failed(exc)
                raise
            finally:
                self.busy_since = None
            self.steps_total += 1
            self.step_seconds_total += trio.current_time() - start
            if self.phase_observer is not None:
                for phase, value in result.phases:
                    self.phase_observer(phase, value)
            for effect in result.outbox:
                carry_out_io(effect, self._side(), start_resolve)
            for stream, status, reason in result.refused:
                self._fail(stream, BackendError(status, reason))
            self._after_refusals(nursery)
            for stream in result.unstarted:
                self._abort_unstarted(stream)
            self._fan_out_pd(result.outputs, result.failures)
            self._after_tick()
            if result.forward_work:
                continue
            wake_at = math.inf
            if result.next_deadline is not None:
                wake_at = trio.current_time() + max(0.0, result.next_deadline - time.monotonic())
            if self._spmd is not None:
                # The other ranks hear a tick at least this often (they leave a silent rank 0),
                # and their pull reports are looked for while a pull is under way.
                wake_at = min(wake_at, trio.current_time() + (
                    SPMD_REPORTS_S if self._pulls_under_way(sched) else SPMD_IDLE_TICK_S))
            with trio.move_on_at(wake_at):
                await self._wake.wait()

    def _tick(
        self, sched: Any, inbox: list[tuple[float, Any]], jobs: list[_Stream], aborts: list[str]
    ) -> TickResult[_Stream]:
        """Everything that touches the scheduler, on one thread at a time (the limiter): the
        one tick the simulator runs too (``schedulers/disaggregation/tick.py``)."""

        def admitted(stream: _Stream) -> None:
            stream.in_scheduler = True
            self.prompt_tokens_total += len(stream.job.input_ids)

        def may_abort(rid: str) -> bool:
            stream = self._streams.get(rid)
            return stream is not None and stream.in_scheduler

        def busy(effects: tuple[fx.BusyEffect, ...]) -> None:
            self._while_busy_effects = effects

        if self._spmd is not None:
            aborts = self._tell_ranks(sched, inbox, jobs, aborts, may_abort)
            may_abort = _always  # decided above, for every rank alike
        result = run_tick(sched, inbox, jobs, aborts, rid=lambda s: s.job.rid,
                          admit=lambda s: self.admit_job(sched, s.job, s.accepted),
                          on_admitted=admitted, on_busy=busy, may_abort=may_abort,
                          before_step=self._send_early)
        if self._spmd is not None:
            self._fingerprint = fingerprint(sched)
        self._publish_stats(sched)
        return result

    def _tell_ranks(
        self, sched: Any, inbox: list[tuple[float, Any]], jobs: list[_Stream], aborts: list[str],
        may_abort: Callable[[str], bool],
    ) -> list[str]:
        """An instance spanning processes, before a tick (in the tick's thread): send the other
        ranks this tick's inputs and set this rank's clock and random source as theirs. Returns
        the aborts every rank applies."""
        assert self._spmd is not None and self.tick_inputs is not None
        rids = {s.job.rid for s in jobs}
        aborts = [r for r in aborts if r in rids or may_abort(r)]
        gate = self._agree_pulls(sched)
        self._ticks += 1
        now = time.monotonic()
        self._spmd.tick_started(TickStarted(
            self._ticks, now, self._fingerprint,
            tuple(Arrival(at, event) for at, event in inbox),
            tuple(leg_of(s.job, s.accepted) for s in jobs), tuple(aborts),
            tuple(PullAgreed(room, why) for room, why in (gate or {}).items()),
        ))
        self.tick_inputs.start(self._ticks, now)
        if gate is not None:
            sched.set_pull_gate(gate)
        return aborts

    def _after_tick(self) -> None:
        """Hook (on the loop, after a tick's outputs went out): D ends handed-off streams."""

    def _agree_pulls(self, sched: Any) -> dict[int, str] | None:
        """Hook (D): the finished pulls every rank collects in this tick."""
        return None

    def _pulls_under_way(self, sched: Any) -> bool:
        return False

    def _publish_stats(self, sched: Any) -> None:
        """In the tick's thread, after the tick: copies for the HTTP task (see ``stats``)."""
        self._pd_snapshot = (sched.pd_stats(), dict(sched.transfer_stats))

    def _after_refusals(self, nursery: trio.Nursery) -> None:
        """Hook (on the loop, after a tick's refused legs were answered): D tells their P."""

    def _fan_out_pd(
        self, outputs: list[RequestOutput], failures: dict[str, tuple[int, str]]
    ) -> None:
        plain = []
        for out in outputs:
            failure = failures.get(out.rid)
            stream = self._streams.get(out.rid)
            if failure is None or stream is None:
                plain.append(out)
                continue
            self.generated_tokens_total += len(out.new_token_ids)
            status, reason = failure
            # Operators see every failed room with its reason (counters alone say how many).
            log.info("%s request %s failed (%d): %s", self.mode, out.rid, status, reason)
            self._fail(stream, BackendError(status, reason))
        self._fan_out(plain)

    async def _resolve(self, bootstrap_addr: str) -> None:
        assert self.bootstrap is not None
        resolver = BootstrapResolver(
            self.bootstrap, rank_query(),
            check=self._check_peer,
        )
        # Inside the core's own resolve deadline, so this clearer answer arrives first.
        self._put(await resolve_within(resolver, bootstrap_addr,
                                       self.pd_args.resolve_timeout * 0.9, self.mode))


class PrefillBackend(PDBackend):
    """P: answers its leg once the room's KV is handed off to D (READY sent)."""

    def __init__(self, config: ServeConfig, spmd: SpmdLeader | None = None, *,
                 engine: KVTransferEngine | None = None) -> None:
        super().__init__(config, spmd, engine=engine)
        self.side: PrefillSideChannel | None = None

    def _new_scheduler(self) -> PrefillScheduler:
        ti = self.tick_inputs
        if ti is None:
            return PrefillScheduler(self.pd_args, engine=self._engine)
        return PrefillScheduler(self.pd_args, engine=self._engine, clock=ti.clock, rng=ti.rng)

    async def _start_io(self, nursery: trio.Nursery, sched: Any) -> InstanceRecord:
        bind = f"{self.config.host}:{self.config.disaggregation_side_channel_port}"
        self.side = PrefillSideChannel(bind, self._deliver_message, secret=self._secret,
                                       curve=self._curve)
        address: str = await nursery.start(self.side.run)
        _, port = split_host_port(address)  # the bound host may be 0.0.0.0: advertise ours
        # Routers know P by its side-channel port (DESIGN §5 "Who is P").
        return self._record(sched, f"{self.config.public_host}:{port}", port)

    def _side(self) -> SideChannel:
        assert self.side is not None
        return self.side

    def _queue_stats(self, sched: Any) -> dict[str, int]:
        return {
            "send_queue": len(sched.send_queue),
            "held_rooms": len(sched._held_pages),
        }

    def admit_job(self, sched: Any, job: GenerateJob, accepted: float) -> None:
        boot = self._bootstrap_of(job)
        req = request_of(sched, job)
        sched.add_pd_request(req, boot.room, accepted=accepted)


class DecodeBackend(PDBackend):
    """D: preallocates, pulls the KV from P, then streams the generation."""

    def __init__(self, config: ServeConfig, spmd: SpmdLeader | None = None,
                 pairing: PeerPairing | None = None, *,
                 engine: KVTransferEngine | None = None) -> None:
        super().__init__(config, spmd, engine=engine)
        self._pairing = pairing
        self.side: DecodeSideChannel | None = None
        # P address -> (last heartbeat seq, rooms) as of the last tick: what to keep sending
        # while a long tick runs, so P's leases do not lapse because D is compiling.
        # (bootstrap_host, room, reason) of PD legs refused before any room opened here (a null
        # bootstrap_port, no default): their P leg would wait a whole lease for our RECV_INIT.
        # Appended in the tick's thread, drained by _tell_prefills on the loop.
        self._refusals: deque[tuple[str, int, str]] = deque(maxlen=REFUSALS_PENDING)
        self._telling = False
        self.refusals_told_total = 0  # ABORTs sent to Ps for such legs
        self.local_prefills_total = 0  # requests without bootstrap fields, prefilled here
        # Live hand-off (issue 32 §2). While draining with --drain-handoff: until when (time.
        # monotonic) running streams are handed off; tickets a tick made, for the loop to end
        # their streams with; hand-offs whose KV was pulled, to release on the next tick.
        self._handoff_until: float | None = None
        self._handed: list[tuple[str, HandoffTicket]] = []
        self._releases: deque[int] = deque(maxlen=REFUSALS_PENDING)

    def _check_peer(self, record: InstanceRecord) -> str | None:
        assert self.side is not None
        ours = None if self.scheduler is None else self.scheduler.pool_config.dtype
        if ours is not None and record.kv_dtype != ours:
            # The layout hashes differ too (READY would be refused); this says why, and before
            # any page is reserved for the room.
            return (f"prefill {record.instance_id} keeps its KV in {record.kv_dtype}, this "
                    f"decode in {ours}: start P and D with the same --kv-dtype")
        theirs = record.mesh_meta.get("kv_checksum", False) is True
        if theirs != self.config.disaggregation_kv_checksum:
            # Checked at READY too (a D that verifies refuses KV without checksums); this says
            # why, and before any page is reserved for the room. Refused both ways: checksums
            # nobody verifies would only cost P time and suggest a protection that is not there.
            p_side = "checksums its KV" if theirs else "sends no KV checksums"
            d_side = "does not verify them" if theirs else "verifies every pull"
            return (f"prefill {record.instance_id} {p_side}, this decode {d_side}: start P and D "
                    "both with or both without --disaggregation-kv-checksum")
        processes = record.mesh_meta.get("processes", 1)
        if processes != self.config.nnodes or (processes > 1
                                               and record.tp_size != self.config.tp_size):
            # Each rank pulls from the P rank in its own place (RFC-2 §6.2): one for one, the
            # same shards on the same places (a one-process D regroups any P tp instead).
            return (f"prefill {record.instance_id} spans {processes} process(es) at tp "
                    f"{record.tp_size}, this decode {self.config.nnodes} at tp "
                    f"{self.config.tp_size}: instances spanning processes pair rank for rank")
        return self.side.set_server_key(record.zmq_addr, record.curve_public_key)

    def _agree_pulls(self, sched: Any) -> dict[int, str] | None:
        """Rooms whose pull has finished on this rank and on every other (their reports), each
        with "" or the first failure: every rank then scatters, or fails, the same rooms."""
        assert self._spmd is not None
        for report in self._spmd.reports():
            self._rank_pulls.setdefault(report.room, {})[report.rank] = (
                "" if report.ok else f"rank {report.rank}: {report.reason}")
        gate = {}
        for room, why in sched.pull_executor.ready().items():
            theirs = self._rank_pulls.get(room, {})
            if len(theirs) < self._spmd.ranks - 1:
                continue
            gate[room] = why or next((w for _, w in sorted(theirs.items()) if w), "")
            del self._rank_pulls[room]
        return gate

    def _pulls_under_way(self, sched: Any) -> bool:
        return bool(sched.pull_executor.inflight)

    async def _keepalive(self) -> None:
        """Carry out the core's ``RepeatWhileBusy`` while a tick outlasts its interval (a first
        forward of a new shape compiles for seconds): P's acks keep D from losing it."""
        while True:
            await trio.sleep(self.pd_args.heartbeat_interval)
            since = self.busy_since
            for effect in self._while_busy_effects:
                if not isinstance(effect, fx.RepeatWhileBusy) or since is None:
                    continue
                if trio.current_time() - since < effect.interval:
                    continue
                for send in effect.heartbeats:
                    self._send(send.peer, send.message)
                self.busy_liveness_total += 1

    def _new_scheduler(self) -> DecodeScheduler:
        ti = self.tick_inputs
        if ti is None:
            return DecodeScheduler(self.pd_args, engine=self._engine,
                                   on_pull_result=self._wake_from_thread)
        return DecodeScheduler(
            self.pd_args, engine=self._engine, clock=ti.clock,
            on_pull_result=self._wake_from_thread,
            # One incarnation for every rank (the replicas' cores check P's answers with it).
            incarnation=ti.rng.getrandbits(63) | 1, pairing=self._pairing,
        )

    async def _start_io(self, nursery: trio.Nursery, sched: Any) -> InstanceRecord:
        self.side = DecodeSideChannel(
            self.pd_args.instance_id, self._deliver_message, secret=self._secret,
            curve=self._curve,
        )
        await nursery.start(self.side.run)
        nursery.start_soon(self._keepalive)
        # D binds no side-channel socket; its record names its HTTP address for routers.
        return self._record(sched, f"{self.config.public_host}:{self.config.port}", None)

    def _side(self) -> SideChannel:
        assert self.side is not None
        return self.side

    def _queue_stats(self, sched: Any) -> dict[str, int]:
        return {
            "recv_queue": len(sched.recv_queue),
            "alloc_queue": len(sched.alloc_queue),
            "held_rooms": len(sched._held_pages),
            "pulls_inflight": sched.pull_executor.inflight,
        }

    # -- live hand-off (issue 32 §2) ---

    def hand_off(self, lease_s: float) -> None:
        """Draining: from the next tick on, hand each running stream that allows it to another
        D (its KV registered for ``lease_s`` at most, counted from now)."""
        if self._spmd is not None:
            log.warning("hand-off is not supported across processes: streams finish here")
            return
        self._handoff_until = time.monotonic() + lease_s
        self._wake.set()

    async def handoff_peers(self) -> tuple[InstanceRecord, list[InstanceRecord]]:
        """For the drain's gate (``drain_gate.py``): our record and the registry's decode
        records. Raises BootstrapError."""
        if self.bootstrap is None or self.bootstrap.record is None:
            raise BootstrapError("not registered yet")
        return self.bootstrap.record, await self.bootstrap.list("decode")

    def release_handoff(self, uuid: int) -> bool:
        """Another D pulled hand-off ``uuid`` (the proxy says so): released on the next tick."""
        self._releases.append(uuid)
        self._wake.set()
        return True

    def _tick(
        self, sched: Any, inbox: list[tuple[float, Any]], jobs: list[_Stream], aborts: list[str]
    ) -> TickResult[_Stream]:
        result = super()._tick(sched, inbox, jobs, aborts)
        while self._releases:
            sched.release_handoff(self._releases.popleft())
        until = self._handoff_until
        if until is not None and until - time.monotonic() > 0:
            # The streams' earlier outputs are in ``result``: they go out before the tickets.
            allowed = {s.job.rid for s in list(self._streams.values())
                       if s.job.accept_handoff and s.in_scheduler and not s.done}
            self._handed += sched.hand_off(allowed, until - time.monotonic())
        self._publish_stats(sched)
        return result

    def _after_tick(self) -> None:
        handed, self._handed = self._handed, []
        for rid, ticket in handed:
            stream = self._streams.get(rid)
            if stream is None:  # its client left meanwhile: the ticket's lease releases it
                continue
            log.info("request %s handed off (KV of %d positions, uuid %d)", rid,
                     ticket.kv_tokens, ticket.uuid)
            stream.put(HandedOff(ticket))
            self._finish(stream, "handed_off")

    def admit_job(self, sched: Any, job: GenerateJob, accepted: float) -> None:
        if job.handoff is not None:
            if self._spmd is not None:
                raise ValueError("this decode instance spans processes: it takes no hand-off")
            assert job.resume is not None  # the schema requires it with handoff
            done = job.resume.output_ids
            if done[-1] != job.handoff.next_token:
                raise ValueError("hand-off ticket: its next token is not resume's last")
            # The KV covers the prompt and every token but the last, which the next step feeds.
            req = sched.make_request(job.rid, list(job.input_ids), job.sampling,
                                     logprobs=job.logprobs, resume=Resume(done[:-1]))
            sched.add_handoff_request(req, job.handoff, job.resume.text_sent)
            return
        if job.bootstrap is None:
            # No P leg (a router's conditional disaggregation, or a plain client): D prefills it
            # itself, with its prefix cache if it runs one.
            sched.add_request(request_of(sched, job))
            self.local_prefills_total += 1
            return
        boot = job.bootstrap
        port = boot.port or self.config.disaggregation_prefill_port
        if port is None:
            reason = (
                "bootstrap_port is null and no --disaggregation-prefill-port default is configured"
            )
            self._refusals.append((boot.host, boot.room, reason))  # told after our 400 is out
            raise ValueError(reason)
        req = request_of(sched, job)
        sched.add_pd_request(req, f"{boot.host}:{port}", boot.room, accepted=accepted)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["refused_rooms_told_total"] = self.refusals_told_total
        out["local_prefills_total"] = self.local_prefills_total
        sched = self.scheduler
        if isinstance(sched, DecodeScheduler):
            # given / released / expired by this worker, taken (pulled) / take_failed here.
            out["handoffs_total"] = dict(sched.handoff_stats)
        return out

    def _after_refusals(self, nursery: trio.Nursery) -> None:
        if self._refusals and not self._telling:
            self._telling = True
            nursery.start_soon(self._tell_prefills)

    async def _tell_prefills(self) -> None:
        """ABORT each refused leg's room to every P registered at its ``bootstrap_host``, so P's
        leg of the room fails at once (kv_sender REFUSED) rather than at lease expiry. Without
        the port we cannot tell which P the router picked: the others just forget the room at
        their lease expiry. One registry read per batch; never delays our own 400."""
        try:
            while self._refusals:
                batch = []
                while self._refusals:
                    batch.append(self._refusals.popleft())
                assert self.bootstrap is not None
                try:
                    with trio.fail_after(self.pd_args.resolve_timeout):
                        records = await self.bootstrap.list("prefill")
                except (BootstrapError, trio.TooSlowError) as exc:
                    log.warning("cannot tell the prefill of %d refused rooms: %s", len(batch), exc)
                    continue
                for host, room, reason in batch:
                    peers = sorted({
                        r.zmq_addr for r in records
                        if split_host_port(r.advertised)[0].lower() == host.lower()
                    })
                    why = f"decode refused the request: {reason} (HTTP 400)"
                    self._put(ev.LegRefused(room, tuple(peers), why))  # the core sends the ABORTs
                    self.refusals_told_total += len(peers)
                    log.info("refused room %d (%s): told %d prefill(s) at %s",
                             room, reason, len(peers), host)
        finally:
            self._telling = False

    def _close(self, sched: Any) -> None:
        sched.close()
        self._close_engine(sched)
