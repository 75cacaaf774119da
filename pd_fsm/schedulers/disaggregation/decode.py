"""The decode side (RFC-2 §5.4): ``SchedulerDisaggregationDecodeMixin`` and ``DecodeScheduler``.

D opens the room in its core as soon as the request arrives; the core resolves P (through the
I/O layer's bootstrap lookup), then asks for pages. Pages are reserved for the whole sequence
(prompt + max_new_tokens) in FIFO order; while a request waits for them its P lease is kept alive
by the batched heartbeats. On READY the pull executor pulls, waits for readiness and scatters the
KV into the reserved pages under the pool lock, off the scheduler thread; the loop only submits,
polls and moves requests. A transferred request joins the running decode batch with P's first
token and never runs the prefill forward.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol, assert_never

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.decode_endpoint import DecodeEndpoint
from pd_fsm.core.drive import drive
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.messages import Ready
from pd_fsm.core.tables import KV_HANDOFF as _HANDOFF
from pd_fsm.jax_engine.kv.checksum import kv_checksums
from pd_fsm.jax_engine.kv.room import gather_room
from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.jax_engine.parallel.tensor_parallel import kv_shard_counts
from pd_fsm.jax_engine.transfer.base import KVTransferEngine, new_uuid
from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest, PullResult
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import DisaggregationCommon
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.request import FinishReason, Req, ReqState, RequestOutput
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


class SchedulerDisaggregationDecodeMixin(DisaggregationCommon):
    KV_COPY = "scatter"
    core: DecodeEndpoint

    def shape_plan(self) -> list[tuple[int, int]]:
        """D prefills only plain requests and recomputes (``--disaggregation-failure-policy
        recompute``): every decode batch, and prefill one row at a time. Several prefills in one
        batch compile on first use (``compiles_after_ready_total`` counts it)."""
        return [(n, t) for n, t in super().shape_plan() if t == 1 or n == 1]

    def _init_decode(
        self,
        args: DisaggregationArgs,
        engine: KVTransferEngine | None,
        clock: Callable[[], float] | None,
        on_pull_result: Callable[[int], None] | None = None,
        incarnation: int | None = None,
        pairing: PeerPairing | None = None,
    ) -> None:
        self._pairing = pairing
        # None: collect every finished pull; else only these rooms (see set_pull_gate).
        self._pull_gate: Mapping[int, str] | None = None
        self._init_common(
            engine or JaxTransferKVEngine(args.transfer_host, reaper_interval_s=None), clock
        )
        # A fresh incarnation per process: P frees what our previous process claimed.
        self.core = DecodeEndpoint(
            args.instance_id, self.layout_hash, args.decode_config(),
            incarnation=(random.SystemRandom().getrandbits(63) | 1 if incarnation is None
                         else incarnation),
            pullable_kv_shards=kv_shard_counts(self.config.num_kv_heads),
            kv_checksum=args.kv_checksum,
        )
        self.recv_queue = self._create_recv_queue()
        self.alloc_queue: deque[int] = deque()  # rooms waiting for pages, FIFO
        self._held_pages: dict[int, list[int]] = {}  # failed rooms whose pull is still running
        self.pull_executor = self._create_pull_executor(args, on_pull_result)
        # pulls_corrupted: the KV arrived but failed READY's checksums (not scattered);
        # parts_pulled: of pulls_ok, the parts P streamed while it prefilled (issue 31 §1).
        self.transfer_stats = {"pulls_ok": 0, "pulls_failed": 0, "pulls_corrupted": 0,
                               "parts_pulled": 0, "bytes": 0, "seconds": 0.0}
        self._part_pulls: set[int] = set()  # rooms whose pull in flight is a part
        self.recomputed = 0
        # Live hand-off (issue 32 §2): each one's lifecycle is the core's (table kv_handoff),
        # keyed by the offer's uuid here as the draining D, or by the pull's room (negative:
        # never a PD room's) as the taking D. What a taken one needs: room -> (request, ticket,
        # text the client has); an aborted one's pages wait in _held_pages for its pull.
        self.handoffs = HandoffLedger()
        self._handoffs_in: dict[int, tuple[Req, HandoffTicket, int]] = {}
        self._handoff_rooms = 0
        self._handoffs_given = 0
        # Iterations of this loop ended so far. Only the forward thread rebinds it; the pull
        # threads read it (an int, so they always see one published value).
        self.loop_iterations = 0

    def _create_pull_executor(
        self, args: DisaggregationArgs, on_pull_result: Callable[[int], None] | None
    ) -> PullExecutor:
        """The pulls' executor (the simulator runs its pulls on the virtual clock instead)."""
        return PullExecutor(
            self.engine,
            self.kv_holder,
            self.kv_args,
            max_workers=args.pull_workers,
            deadline_s=args.pull_deadline,
            on_result=on_pull_result,  # e.g. wake the worker's loop (called on the pull thread)
            iterations=lambda: self.loop_iterations,
            thread_nice=args.pull_thread_nice,
            peer_for=None if self._pairing is None else self._pairing.paired,
        )

    def _create_recv_queue(self) -> dict[int, Req]:
        """Rooms between arrival and the end of their transfer."""
        return {}

    # -- requests ---------------------------------------------------------------------------------

    def add_pd_request(
        self, req: Req, bootstrap_addr: str, room: int, accepted: float | None = None
    ) -> None:
        """Open the D leg of ``room`` whose P registered as ``bootstrap_addr`` ("host:port");
        raises ValueError (bad request) or DuplicateRoomError. ``accepted``: when the worker
        took the leg, on ``self.clock`` (default: now)."""
        event = ev.DecodeRequestAccepted(room, bootstrap_addr, self.prompt_pages(req))
        self._admit_pd(req, event, accepted)
        if self.core.state_of(room) is not None:
            self.recv_queue[room] = req

    def deliver(self, event: Any, now: float | None = None) -> None:
        if isinstance(event, ev.MessageReceived) and isinstance(event.message, Ready):
            stamps = self._stamps.get(event.message.room)
            if stamps is not None:  # kv_tail starts here: what of the transfer P did not hide
                stamps.setdefault("ready", self.clock() if now is None else now)
        super().deliver(event, now)

    def _event_loop_decode_disagg(self) -> list[RequestOutput]:
        """One iteration of D's loop: collect finished pulls, let time act on the core (heart-
        beats, deadlines), admit rooms to pages, then one ordinary step (the decode batch)."""
        self._process_decode_queue()
        outputs = super().step()
        self.loop_iterations += 1
        return outputs

    def step(self) -> list[RequestOutput]:
        return self._event_loop_decode_disagg()

    def set_pull_gate(self, rooms: Mapping[int, str] | None) -> None:
        """From now on collect only the finished pulls of ``rooms`` (room -> "" or why it failed
        on another rank: then it fails here too); None: every finished pull. An instance
        spanning processes sets it before each tick: every rank scatters the same rooms."""
        self._pull_gate = rooms

    def _process_decode_queue(self) -> None:
        for result in self.pull_executor.poll(self._pull_gate):
            if result.room in self._handoffs_in:
                self._handoff_pulled(result)
            else:
                self._handle_recv_complete(result)
        self._drive_handoff(ev.TimeAdvanced())  # leases come due
        self.deliver(ev.TimeAdvanced())

    # -- live hand-off (issue 32 §2) ------------------------------------------------------------

    def hand_off(self, rids: Collection[str], lease_s: float) -> list[tuple[str, HandoffTicket]]:
        """Give away the running sequences of ``rids`` (single-sequence requests): each one's KV
        is gathered and registered for another D to pull within ``lease_s``, its pages go back at
        once (the gathered arrays are buffers of their own), and it leaves this scheduler without
        a final output: its stream ends with the ticket. A sequence whose KV cannot be registered
        stays and finishes here."""
        out: list[tuple[str, HandoffTicket]] = []
        for req in list(self.running):
            if (req.rid not in rids or req.family or req.parent is not None
                    or req.pages is None or not req.output_ids):
                continue
            kv_tokens = req.seq_len - 1  # the last output token has no KV yet
            pages = req.pages[: self.pool_config.pages_for(kv_tokens)]
            try:
                arrays = gather_room(self.kv_holder, self.kv_args, pages)
                sums = kv_checksums(arrays) if self.args.kv_checksum else ()
                uuid = new_uuid()
                self.engine.register(uuid, arrays, lease_s)
            except Exception as exc:  # it finishes here instead: nothing is lost
                log.warning("request %s: hand-off registration failed (%r)", req.rid, exc)
                continue
            self._handoffs_given += 1
            self._drive_handoff(ev.HandoffOffered(uuid, lease_s))
            out.append((req.rid, HandoffTicket(
                self.engine.address, uuid, kv_tokens, req.output_ids[-1], self.layout_hash,
                self.kv_args.kv_shards, sums)))
            # Gone from here: no output (what it produced so far was drained before this call).
            req.state = ReqState.FINISHED
            req.finish_reason = FinishReason("abort", message="handed off")
            self.reqs.pop(req.rid, None)
            self._detach(req)
            self.page_budget.release(req)
            self.outputs.forget(req)
        return out

    def release_handoff(self, uuid: int) -> bool:
        """The proxy says hand-off ``uuid``'s KV was pulled (or never will be): drop its
        registration. False when it is not (or no longer) offered here: released once, on this
        word or at the lease's end."""
        if self.handoffs.state_of(uuid) != _HANDOFF.S.OFFERED:
            return False
        self._drive_handoff(ev.HandoffPulled(uuid))
        return True

    @property
    def handoffs_outstanding(self) -> int:
        return sum(h.state == _HANDOFF.S.OFFERED for h in self.handoffs.handoffs.values())

    @property
    def handoff_stats(self) -> dict[str, int]:
        """Offers given and how they ended (released on the proxy's word, expired), pulls
        taken or failed here."""
        done = self.handoffs.outcomes
        return {"given": self._handoffs_given, "released": done[_HANDOFF.S.RELEASED],
                "expired": done[_HANDOFF.S.EXPIRED], "taken": done[_HANDOFF.S.TAKEN],
                "take_failed": done[_HANDOFF.S.FAILED]}

    def next_deadline(self) -> float | None:
        own = self.handoffs.next_deadline()
        core = super().next_deadline()
        return own if core is None else core if own is None else min(own, core)

    def _drive_handoff(self, event: ev.HandoffEvent) -> None:
        drive(self.handoffs.handle, event, self.clock(), self._carry_out_handoff)

    def _carry_out_handoff(self, e: fx.HandoffEffect) -> tuple[()]:
        match e:
            case fx.ReleaseOffer():
                if e.reason == "hand-off lease expired":
                    log.warning("hand-off %d was not claimed within its lease: released", e.uuid)
                self.engine.release(e.uuid, e.reason)
            case fx.StartHandoffPull():
                req, ticket, _ = self._handoffs_in[e.room]
                assert req.pages is not None
                self.pull_executor.submit(PullRequest(
                    e.room, ticket.uuid, ticket.transfer_addr,
                    pages=req.pages[: self.pool_config.pages_for(ticket.kv_tokens)],
                    remote_layout_hash=self.layout_hash, kv_shards=ticket.kv_shards,
                    kv_checksums=ticket.kv_checksums))
            case fx.EnterDecode():
                req, ticket, text_sent = self._handoffs_in.pop(e.room)
                self.add_prefilled_request(req, ticket.next_token, 0.0)
                # The client has that token and its text already: only what follows is new.
                req.tokens_sent = len(req.output_ids)
                req.text_sent = max(req.text_sent, min(text_sent, len(req.text)))
                if not req.finished:  # nothing new yet: its next step's output is the first
                    self.outputs.forget(req)
            case fx.FailHandoff():
                req = self._handoffs_in.pop(e.room)[0]
                self.page_budget.release(req)
                self._fail_request(req, 502, f"hand-off pull failed: {e.reason}")
            case fx.FinishAborted():
                req = self._handoffs_in[e.room][0]
                if req.pages is not None:  # the pull may still write them
                    self._held_pages[e.room], req.pages = req.pages, None
                self._finish(req, FinishReason("abort", message=e.reason))
            case fx.FreeHeldPages():
                self._handoffs_in.pop(e.room)
                held = self._held_pages.pop(e.room, None)
                if held:
                    self.page_budget.free(held)
            case _:
                assert_never(e)
        return ()

    def add_handoff_request(self, req: Req, ticket: HandoffTicket, text_sent: int) -> None:
        """Take over a sequence another D handed off: ``req`` was made with every output token
        but the last as its resumed tokens (their KV is what the ticket offers); reserve its
        pages and pull. ``text_sent``: characters of the output the client already has. Raises
        ValueError for a ticket this worker cannot take (the proxy then re-prefills)."""
        if ticket.layout_hash != self.layout_hash:
            raise ValueError("hand-off ticket: the KV layout differs from this worker's "
                             f"({ticket.layout_hash} != {self.layout_hash})")
        if ticket.kv_tokens != len(req.input_ids):
            raise ValueError(f"hand-off ticket covers {ticket.kv_tokens} positions, the prompt "
                             f"and resumed tokens are {len(req.input_ids)}")
        if ticket.kv_shards not in kv_shard_counts(self.config.num_kv_heads):
            raise ValueError(f"hand-off ticket: {ticket.kv_shards} KV shards do not split this "
                             "model's kv-heads")
        if bool(ticket.kv_checksums) != self.args.kv_checksum:
            raise ValueError("hand-off ticket: KV checksums on one side only "
                             "(--disaggregation-kv-checksum)")
        self._register(req)  # ValueError for a request that can never be served
        if not self.reserve_pages(req):
            del self.reqs[req.rid]
            raise ValueError("no free KV pages for the hand-off")
        self._handoff_rooms -= 1
        room = self._handoff_rooms
        self._handoffs_in[room] = (req, ticket, text_sent)
        self._drive_handoff(ev.HandoffClaimed(room))

    def _handoff_pulled(self, result: PullResult) -> None:
        if result.ok:
            self._phase_sample("kv_pull", result.pull_seconds)
            self._drive_handoff(ev.PullSucceeded(result.room))
        else:
            self._drive_handoff(ev.PullFailed(result.room, result.reason))

    def abort(self, rid: str, message: str = "aborted") -> bool:
        for room, (req, _, _) in self._handoffs_in.items():
            if req.rid == rid and self.handoffs.state_of(room) == _HANDOFF.S.PULLING:
                self._drive_handoff(ev.Aborted(room, message))
                return True
        return super().abort(rid, message)

    def _handle_recv_complete(self, result: PullResult) -> None:
        stats = self.transfer_stats
        part = result.room in self._part_pulls  # one pull at a time per room: this one's
        self._part_pulls.discard(result.room)
        if result.ok:
            stats["pulls_ok"] += 1
            stats["bytes"] += result.bytes
            stats["seconds"] += result.seconds
            self._phase_sample("kv_pull", result.pull_seconds)
            self._phase_sample("kv_scatter", result.scatter_seconds)
            if result.scatter_iterations >= 0:
                self._phase_sample("kv_scatter_steps", result.scatter_iterations)
            self._phase_sample("kv_transfer_bytes", result.bytes)
            if result.transfer_seconds > 0:
                self._phase_sample("kv_transfer_gbps", result.bytes / result.transfer_seconds / 1e9)
            stamps = self._stamps.get(result.room)
            if stamps is not None and "pull" in stamps and not part:
                # The pull thread's end, on our clock (after parts: this last pull's own start).
                start = stamps.get("last_pull", stamps["pull"])
                stamps["pulled"] = start + result.seconds
            if part:
                stats["parts_pulled"] += 1
            self.deliver(ev.PullSucceeded(result.room))
        elif result.checksum_mismatch:
            stats["pulls_corrupted"] += 1
            log.warning("room %d: %s", result.room, result.reason)
            self.deliver(ev.ChecksumMismatched(result.room, result.reason))
        else:
            stats["pulls_failed"] += 1
            self.deliver(ev.PullFailed(result.room, result.reason))

    def has_work(self) -> bool:
        return super().has_work() or bool(self.recv_queue) or self.pull_executor.inflight > 0

    # -- the core's effects -----------------------------------------------------------------------

    def _carry_out(self, e: fx.DecodeEffect) -> None:
        if isinstance(e, fx.AllocateBlocks):
            self._lap(e.room, "decode_bootstrap", "accepted", "page_request")
            self.alloc_queue.append(e.room)
        elif isinstance(e, fx.CancelAllocation):
            self.alloc_queue.remove(e.room)
        elif isinstance(e, fx.StartPull):
            self._lap(e.room, "decode_ready_wait", "pages", "pull")
            stamps = self._stamps.get(e.room)
            if e.repull and stamps is not None:  # the pull that counts starts now
                stamps["pull"] = self.clock()
            if e.part:
                self._part_pulls.add(e.room)
            elif stamps is not None and "pull" in stamps:
                stamps["last_pull"] = self.clock()  # READY's pull, after parts
            req = self.req_of[e.room]
            assert req.pages is not None
            self.pull_executor.submit(
                PullRequest(
                    e.room,
                    e.uuid,
                    e.transfer_addr,
                    pages=req.pages[e.skip_pages : e.skip_pages + e.n_pages],
                    remote_layout_hash=self.layout_hash,  # the core compared READY's hash already
                    kv_shards=e.kv_shards,
                    kv_checksums=e.kv_checksums,
                )
            )
        elif isinstance(e, fx.ForgetTransfer):
            addr = e.transfer_addr if self._pairing is None else self._pairing.forget(
                e.transfer_addr)
            if addr is not None:
                self.engine.drop_connection(addr, "prefill restarted")
        elif isinstance(e, fx.CompleteTransfer):
            self._lap(e.room, "decode_pull_report", "pulled", "entered")
            self._lap(e.room, "kv_tail", "ready", "joined")
            req = self.recv_queue.pop(e.room)
            self.room_of.pop(req.rid, None)
            first_top = tuple((t.token, t.logprob) for t in e.first_top)
            self.add_prefilled_request(req, e.first_token, e.first_logprob, first_top)
        elif isinstance(e, fx.ReleaseBlocks):
            pages = self._held_pages.pop(e.room, None)
            if pages is None:
                req = self.req_of[e.room]
                pages, req.pages = req.pages, None
            if pages:
                self.page_budget.free(pages)
        elif isinstance(e, fx.FailRequest):
            self.recv_queue.pop(e.room, None)
            req = self.req_of[e.room]
            if req.pages is not None:
                # A pull may still write these pages: the core frees them (ReleaseBlocks) once
                # the pull has reported.
                self._held_pages[e.room], req.pages = req.pages, None
            if self.args.failure_policy == "recompute" and e.status in RECOMPUTABLE:
                self._recompute(req, e.reason)
            else:
                self._fail_request(req, e.status, e.reason)
        elif isinstance(e, fx.IOEffect | fx.RejectRequest | fx.RepeatWhileBusy):
            # Not ours: the outbox (_dispatch), _admit_pd and step_started take these.
            raise TypeError(f"decode scheduler cannot carry out {e!r}")
        else:
            assert_never(e)

    def _recompute(self, req: Req, reason: str) -> None:
        """The KV will not come from P: prefill the request here instead (fresh pages; the old
        ones are released by the core's own ReleaseBlocks, once no pull can write them)."""
        self.room_of.pop(req.rid, None)
        req.state = ReqState.WAITING
        req.prefilled = 0
        self.waiting.append(req)
        self.recomputed += 1
        log.info("room of %s failed (%s): recomputing its prefill here", req.rid, reason)

    def _after_effects(self) -> None:
        # FIFO: the head waits for pages; those behind it wait too (no starvation of big ones).
        while self.alloc_queue:
            room = self.alloc_queue[0]
            if not self.reserve_pages(self.req_of[room]):
                return
            self.alloc_queue.popleft()
            self._lap(room, "decode_page_wait", "page_request", "pages")
            # The prompt's leading pages our prefix cache held (shared, pinned by the room)
            # are not pulled: P registers only the rest (issue 16 §3).
            cached = self.req_of[room].cached_tokens // self.args.page_size
            self._deferred.append(ev.BlocksAllocated(room, cached))

    def close(self) -> None:
        self.pull_executor.close(wait=True)


class DecodeScheduler(SchedulerDisaggregationDecodeMixin, Scheduler):
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
    ) -> None:
        super().__init__(args, model=model)
        self._init_decode(args, engine, clock, on_pull_result, incarnation, pairing)
