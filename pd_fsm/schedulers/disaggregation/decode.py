"""The decode side (RFC-2 §5.4): ``DecodeRole``, ``SchedulerDisaggregationDecodeMixin`` and
``DecodeScheduler``.

D opens the room in its core as soon as the request arrives; the core resolves P (through the
I/O layer's bootstrap lookup), then asks for pages. Pages are reserved for the whole sequence
(prompt + max_new_tokens) in FIFO order; while a request waits for them its P lease is kept alive
by the batched heartbeats. On READY the pull executor pulls and waits for readiness off the
scheduler thread; the loop submits, scatters what arrived between two steps (under the pool
lock) and moves requests. A transferred request joins the running decode batch with P's first
token and never runs the prefill forward. A room that fails mid-pull has its pull cancelled
(never scattered) and its pages freed at once, whatever the pull still takes.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol, assert_never

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.messages import Ready
from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.jax_engine.parallel.tensor_parallel import kv_shard_counts
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest, PullResult
from pd_fsm.schedulers.disaggregation.api import DisaggregationCommon
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import PDLink, kv_args_of
from pd_fsm.schedulers.disaggregation.decode_handoff import HandoffDesk
from pd_fsm.schedulers.request import Req, ReqState
from pd_fsm.schedulers.role import ColocatedRole
from pd_fsm.schedulers.scheduler import Scheduler

log = logging.getLogger("pd_fsm.schedulers.decode")

# Failures the recompute policy answers by prefilling on D: P or the transfer let us down (502,
# 504). Not a client abort (499), not overload (503: no pages here either).
RECOMPUTABLE = frozenset({500, 502, 504})


class PeerPairing(Protocol):
    """A rank > 0 of a D instance spanning processes pulls from the P rank it pairs with, not
    from the transfer address READY names (P's rank 0): RFC-2 §6.2's N:N pairing."""

    def paired(self, transfer_addr: str) -> str:
        """Where this rank pulls what P's rank 0 at ``transfer_addr`` offers (blocking; raises
        ``PullError``)."""

    def forget(self, transfer_addr: str) -> str | None:
        """Drop what was learnt about that P (it restarted); the paired address, if known."""


class DecodeRole(ColocatedRole):
    """D's part of a scheduler: its rooms' KV pulled from P into reserved pages, then decoded.

    A plain request (no bootstrap fields) is prefilled and decoded here as on a colocated
    worker, and so is a room the recompute policy takes back from a failed P."""

    kv_copy = "scatter"

    def __init__(
        self,
        sched: Scheduler,
        args: DisaggregationArgs,
        engine: KVTransferEngine | None = None,
        clock: Callable[[], float] | None = None,
        on_pull_result: Callable[[int], None] | None = None,
        incarnation: int | None = None,
        pairing: PeerPairing | None = None,
    ) -> None:
        self.sched = sched
        self.args = args
        self.clock = clock or time.monotonic
        self.engine = engine or JaxTransferKVEngine(args.transfer_host, reaper_interval_s=None)
        self.kv_args = kv_args_of(sched)
        self._pairing = pairing
        # None: collect every finished pull; else only these rooms (see set_pull_gate).
        self._pull_gate: Mapping[int, str] | None = None
        # A fresh incarnation per process: P frees what our previous process claimed.
        core = DecodeEndpoint(
            args.instance_id, self.kv_args.layout_hash, args.decode_config(),
            incarnation=(random.SystemRandom().getrandbits(63) | 1 if incarnation is None
                         else incarnation),
            pullable_kv_shards=kv_shard_counts(sched.config.num_kv_heads),
            kv_checksum=args.kv_checksum,
        )
        self.link: PDLink[ev.DecodeEvent, fx.DecodeEffect] = PDLink(
            sched, core, self.clock, self.carry_out, self._allocate_pages)
        self.recv_queue: dict[int, Req] = {}  # rooms between arrival and the end of their pull
        self.alloc_queue: deque[int] = deque()  # rooms waiting for pages, FIFO
        # Pages of rooms that failed before the core freed them: an aborted hand-off's while its
        # pull runs (a PD room's are freed in the row that fails it).
        self.held_pages: dict[int, list[int]] = {}
        # Live hand-off; an aborted one's pages wait in held_pages for its pull.
        self.handoffs = HandoffDesk(sched, self.link, self.engine, self.kv_args,
                                    self.held_pages, lambda: self.pull_executor,
                                    args.kv_checksum, self.slots_free)
        self.pull_executor = self.new_pull_executor(on_pull_result)
        # pulls_corrupted: the KV arrived but failed READY's checksums (not scattered);
        # parts_pulled: of pulls_ok, the parts P streamed while it prefilled;
        # pulls_cancelled: pulls whose room failed while they ran (reported after its pages
        # went back), and of those pulls_dropped: their KV arrived and was thrown away.
        self.transfer_stats = {"pulls_ok": 0, "pulls_failed": 0, "pulls_corrupted": 0,
                               "parts_pulled": 0, "pulls_cancelled": 0, "pulls_dropped": 0,
                               "bytes": 0, "seconds": 0.0}
        self._part_pulls: set[int] = set()  # rooms whose pull in flight is a part
        self.recomputed = 0
        # Iterations of this loop ended so far. Only the forward thread rebinds it; the pull
        # threads read it (an int, so they always see one published value).
        self.loop_iterations = 0

    def new_pull_executor(self, on_result: Callable[[int], None] | None) -> PullExecutor:
        """The pulls' executor (the simulator's role runs its pulls on the virtual clock)."""
        return PullExecutor(
            self.engine,
            self.sched.kv_holder,
            self.kv_args,
            max_workers=self.args.pull_workers,
            deadline_s=self.args.pull_deadline,
            on_result=on_result,  # e.g. wake the worker's loop (called on the pull thread)
            iterations=lambda: self.loop_iterations,
            thread_nice=self.args.pull_thread_nice,
            peer_for=None if self._pairing is None else self._pairing.paired,
        )

    # -- the scheduler's hooks (schedulers/role.py) ---------------------------------------------

    def keeps_shape(self, rows: int, tokens: int) -> bool:
        """D prefills only plain requests and recomputes (``--disaggregation-failure-policy
        recompute``): every decode batch, and prefill one row at a time. Several prefills in one
        batch compile on first use (``compiles_after_ready_total`` counts it)."""
        return tokens == 1 or rows == 1

    def before_step(self) -> None:
        """Collect finished pulls, let time act on the core and the hand-offs (heartbeats,
        deadlines), admit rooms to pages; the step's decode batch comes next."""
        for result in self.pull_executor.poll(self._pull_gate):
            if self.handoffs.takes(result.room):
                self.handoffs.pulled(result)
            else:
                self._pulled(result)
        self.handoffs.drive(ev.TimeAdvanced())  # leases come due
        self.link.deliver(ev.TimeAdvanced())

    def after_step(self) -> None:
        self.loop_iterations += 1
        # Sequences that finished in this step freed pages: a hand-off waiting for them starts
        # its pull now, not at the next event (the loop may go idle after this step). A room
        # waiting for pages or a slot keeps the loop busy (has_work): the next before_step
        # places it.
        self.handoffs.place_waiting()

    def slots_free(self) -> int:
        """Batch slots ``--max-running-requests`` leaves for another room: D's requests
        prefilling or running, and rooms whose pages are reserved but that have not joined the
        batch yet (their pull is on its way), and sequences being taken over (hand-offs
        pulling), each take one, as a request admitted on a colocated worker does."""
        joining = sum(1 for req in self.recv_queue.values() if req.pages is not None)
        return (self.sched.args.max_running - self.sched.queues.admitted - joining
                - self.handoffs.joining)

    def abort(self, rid: str, message: str) -> bool:
        """A hand-off being taken, or a live room: the ledger or the core decide what to
        release and whom to tell."""
        if self.handoffs.abort(rid, message):
            return True
        room = self.link.live_room(rid)
        if room is None:
            return False
        self.link.deliver(ev.Aborted(room, message))
        return True

    def has_work(self) -> bool:
        return bool(self.recv_queue) or self.pull_executor.inflight > 0

    # -- the worker's side ------------------------------------------------------------------------

    def add_pd_request(
        self, req: Req, bootstrap_addr: str, room: int, accepted: float | None = None
    ) -> None:
        """Open the D leg of ``room`` whose P registered as ``bootstrap_addr`` ("host:port");
        raises ValueError (bad request) or DuplicateRoomError. ``accepted``: when the worker
        took the leg, on the role's clock (default: now)."""
        event = ev.DecodeRequestAccepted(room, bootstrap_addr, self.link.prompt_pages(req))
        self.link.admit(req, event, room, accepted)
        if self.link.core.state_of(room) is not None:
            self.recv_queue[room] = req

    def deliver(self, event: ev.DecodeEvent, now: float | None = None) -> None:
        if isinstance(event, ev.MessageReceived) and isinstance(event.message, Ready):
            stamps = self.link.phases.stamps.get(event.message.room)
            if stamps is not None:  # kv_tail starts here: what of the transfer P did not hide
                stamps.setdefault("ready", self.clock() if now is None else now)
        self.link.deliver(event, now)

    def step_started(self) -> list[fx.BusyEffect]:
        return self.link.step_started(ev.StepStarted())

    def step_ended(self) -> None:
        self.link.deliver(ev.StepEnded())

    def set_pull_gate(self, rooms: Mapping[int, str] | None) -> None:
        """From now on collect only the finished pulls of ``rooms`` (room -> "" or why it failed
        on another rank: then it fails here too); None: every finished pull. An instance
        spanning processes sets it before each tick: every rank scatters the same rooms."""
        self._pull_gate = rooms

    def close(self) -> None:
        """The pull threads end (before the worker closes the engine they pull with)."""
        self.pull_executor.close(wait=True)

    def next_deadline(self) -> float | None:
        own = self.handoffs.ledger.next_deadline()
        core = self.link.next_deadline()
        return own if core is None else core if own is None else min(own, core)

    def _pulled(self, result: PullResult) -> None:
        stats, phases = self.transfer_stats, self.link.phases
        part = result.room in self._part_pulls  # one pull at a time per room: this one's
        self._part_pulls.discard(result.room)
        if result.cancelled:  # its room is over (CANCELLING): nothing was scattered
            stats["pulls_cancelled"] += 1
            stats["pulls_dropped"] += result.dropped
            self.link.deliver(ev.PullFailed(result.room, result.reason))
        elif result.ok:
            stats["pulls_ok"] += 1
            stats["bytes"] += result.bytes
            stats["seconds"] += result.seconds
            phases.sample("kv_pull", result.pull_seconds)
            phases.sample("kv_scatter", result.scatter_seconds)
            if result.scatter_iterations >= 0:
                phases.sample("kv_scatter_steps", result.scatter_iterations)
            phases.sample("kv_transfer_bytes", result.bytes)
            if result.transfer_seconds > 0:
                phases.sample("kv_transfer_gbps", result.bytes / result.transfer_seconds / 1e9)
            stamps = phases.stamps.get(result.room)
            if stamps is not None and "pull" in stamps and not part:
                # The pull thread's end, on our clock (after parts: this last pull's own start).
                start = stamps.get("last_pull", stamps["pull"])
                stamps["pulled"] = start + result.seconds
            if part:
                stats["parts_pulled"] += 1
            self.link.deliver(ev.PullSucceeded(result.room))
        elif result.checksum_mismatch:
            stats["pulls_corrupted"] += 1
            log.warning("room %d: %s", result.room, result.reason)
            self.link.deliver(ev.ChecksumMismatched(result.room, result.reason))
        else:
            stats["pulls_failed"] += 1
            self.link.deliver(ev.PullFailed(result.room, result.reason))

    # -- the core's effects -----------------------------------------------------------------------

    def carry_out(self, e: fx.DecodeEffect) -> int | None:
        """One effect of the core; the room it was about (None: a peer's, or the I/O layer's)."""
        phases = self.link.phases
        match e:
            case fx.SendMessage() | fx.ForgetPeer() | fx.ResolvePeer():
                self.link.send(e)
                return None
            case fx.RepeatWhileBusy():
                self.link.busy(e)
                return None
            case fx.RejectRequest():  # the link's admit takes these before they get here
                raise TypeError(f"decode scheduler cannot carry out {e!r}")
            case fx.ForgetTransfer():
                addr = e.transfer_addr if self._pairing is None else self._pairing.forget(
                    e.transfer_addr)
                if addr is not None:
                    self.engine.drop_connection(addr, "prefill lost or restarted")
                return None
            case fx.AllocateBlocks():
                phases.lap(e.room, "decode_bootstrap", "accepted", "page_request")
                self.alloc_queue.append(e.room)
            case fx.CancelAllocation():
                self.alloc_queue.remove(e.room)
            case fx.StartPull():
                self._start_pull(e)
            case fx.CancelPull():
                self.pull_executor.cancel(e.room)
            case fx.CompleteTransfer():
                phases.lap(e.room, "decode_pull_report", "pulled", "entered")
                phases.lap(e.room, "kv_tail", "ready", "joined")
                req = self.recv_queue.pop(e.room)
                self.link.room_of.pop(req.rid, None)
                first_top = tuple((t.token, t.logprob) for t in e.first_top)
                self.sched.add_prefilled_request(req, e.first_token, e.first_logprob, first_top)
            case fx.ReleaseBlocks():
                pages = self.held_pages.pop(e.room, None)
                if pages is None:
                    req = self.link.req_of[e.room]
                    pages, req.pages = req.pages, None
                if pages:
                    self.sched.page_budget.free(pages)
            case fx.FailRequest():
                self._fail_room(e)
            case _:
                assert_never(e)
        return e.room

    def _start_pull(self, e: fx.StartPull) -> None:
        phases = self.link.phases
        phases.lap(e.room, "decode_ready_wait", "pages", "pull")
        stamps = phases.stamps.get(e.room)
        if e.repull and stamps is not None:  # the pull that counts starts now
            stamps["pull"] = self.clock()
        if e.part:
            self._part_pulls.add(e.room)
        elif stamps is not None and "pull" in stamps:
            stamps["last_pull"] = self.clock()  # READY's pull, after parts
        req = self.link.req_of[e.room]
        assert req.pages is not None
        self.pull_executor.submit(
            PullRequest(
                e.room,
                e.uuid,
                e.transfer_addr,
                pages=req.pages[e.skip_pages : e.skip_pages + e.n_pages],
                remote_layout_hash=self.kv_args.layout_hash,  # the core compared READY's hash
                kv_shards=e.kv_shards,
                kv_checksums=e.kv_checksums,
            )
        )

    def _fail_room(self, e: fx.FailRequest) -> None:
        """The room failed: its request fails, or (the recompute policy, a failure of P's or
        the transfer's) is prefilled here instead, on fresh pages."""
        self.recv_queue.pop(e.room, None)
        req = self.link.req_of[e.room]
        if req.pages is not None:
            # Not the request's any more (a recompute gets fresh ones): the core frees them
            # (ReleaseBlocks) in a row of its own, once no pull can write them.
            self.held_pages[e.room], req.pages = req.pages, None
        if self.args.failure_policy != "recompute" or e.status not in RECOMPUTABLE:
            self.link.fail_request(req, e.status, e.reason)
            return
        self.link.room_of.pop(req.rid, None)
        req.state = ReqState.WAITING
        req.prefilled = 0
        self.sched.waiting.append(req)
        self.recomputed += 1
        log.info("room of %s failed (%s): recomputing its prefill here", req.rid, e.reason)

    def _allocate_pages(self) -> None:
        """After each event's effects: FIFO, the head waits for a batch slot and its pages;
        those behind it wait too (no starvation of big ones). The slot keeps D's batch within
        ``--max-running-requests``, the batch sizes its warm-up compiled. Without it a burst of
        16 rooms on ``pd-fsm cluster --pd-cores shared`` (a bound of 8) ran a decode batch of
        16 and compiled 4 executables while requests waited; with it, bursts of up to 32
        mixed requests compiled none (``compiles_after_ready_total`` 0)."""
        if not self.handoffs.place_waiting():
            return  # a hand-off's stream is mid-answer: its pages come first
        req_of = self.link.req_of
        while self.alloc_queue:
            room = self.alloc_queue[0]
            if self.slots_free() <= 0 or not self.sched.page_budget.reserve(req_of[room]):
                return
            self.alloc_queue.popleft()
            self.link.phases.lap(room, "decode_page_wait", "page_request", "pages")
            # The prompt's leading pages our prefix cache held (shared, pinned by the room)
            # are not pulled: P registers only the rest.
            cached = req_of[room].cached_tokens // self.args.page_size
            self.link.defer(ev.BlocksAllocated(room, cached))


class SchedulerDisaggregationDecodeMixin(DisaggregationCommon[DecodeRole]):
    """RFC-2 §5.4's decode mixin: the colocated scheduler holding D's role (``self.role``),
    which is its PD API."""


class DecodeScheduler(SchedulerDisaggregationDecodeMixin):
    def __init__(
        self,
        args: DisaggregationArgs,
        *,
        model: LoadedModel | None = None,
        engine: KVTransferEngine | None = None,
        clock: Callable[[], float] | None = None,
        on_pull_result: Callable[[int], None] | None = None,
        incarnation: int | None = None,
        pairing: PeerPairing | None = None,
        role: type[DecodeRole] = DecodeRole,
    ) -> None:
        """``role``: the role's class (the simulator runs its pulls, and plants bugs, in a
        subclass of it)."""
        super().__init__(args, model=model, role=lambda sched: role(
            sched, args, engine, clock, on_pull_result, incarnation, pairing))


__all__ = ["RECOMPUTABLE", "DecodeRole", "DecodeScheduler", "PeerPairing",
           "SchedulerDisaggregationDecodeMixin"]
