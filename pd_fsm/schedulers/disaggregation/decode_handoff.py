"""D's live hand-offs: the sequences it gives away and the ones it takes over.

Each hand-off's lifecycle is the core's (table kv_handoff, ``HandoffLedger``), keyed by the
offer's uuid here as the draining D, or by the pull's room (negative: never a PD room's) as the
taking D. See handoff.py for what travels.

A taking D with no free pages or no free batch slot (``--max-running-requests``, counted as for
a room) does not refuse (a refusal costs the client a re-prefill, which waits for pages like any
room): the claim waits, first in line — ahead of the rooms' page queue, since its client is
mid-stream — until a finished sequence frees enough (``place_waiting``, before every room's
allocation) or half the offer's lease has passed (``FailHandoff``: the proxy falls back to a
re-prefill).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection
from typing import assert_never

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import drive
from pd_fsm.core.handoff import HandoffLedger
from pd_fsm.core.tables import KV_HANDOFF as _HANDOFF
from pd_fsm.jax_engine.kv.checksum import kv_checksums
from pd_fsm.jax_engine.kv.pool_spec import KVArgs
from pd_fsm.jax_engine.kv.room import gather_room
from pd_fsm.jax_engine.parallel.tensor_parallel import kv_shard_counts
from pd_fsm.jax_engine.transfer.base import KVTransferEngine, new_uuid
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest, PullResult
from pd_fsm.schedulers.disaggregation.common import PDLink
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.request import FinishReason, Req, ReqState
from pd_fsm.schedulers.scheduler import Scheduler

log = logging.getLogger("pd_fsm.schedulers.decode")

# How long a claim waits for pages when its ticket does not say the offer's lease (an older
# draining D's): the drain timeout's default less a margin for the pull.
PAGE_WAIT_DEFAULT_S = 10.0


_ABORTABLE = (_HANDOFF.S.WAITING_FOR_PAGES, _HANDOFF.S.PULLING)


class HandoffDesk:
    """``held_pages``: D's pages of failed rooms whose pull may still write them (room -> pages),
    shared with the decode role; ``pulls``: D's pull executor (built after this desk);
    ``kv_checksum``: whether offers carry KV checksums (tickets must agree); ``slots_free``:
    the batch slots D has left (the decode role's count, which includes :attr:`joining`)."""

    def __init__(
        self,
        sched: Scheduler,
        link: PDLink[ev.DecodeEvent, fx.DecodeEffect],
        engine: KVTransferEngine,
        kv_args: KVArgs,
        held_pages: dict[int, list[int]],
        pulls: Callable[[], PullExecutor],
        kv_checksum: bool,
        slots_free: Callable[[], int],
    ) -> None:
        self.sched = sched
        self.link = link
        self.engine = engine
        self.kv_args = kv_args
        self.held_pages = held_pages
        self._pulls = pulls
        self.kv_checksum = kv_checksum
        self._slots_free = slots_free
        self.ledger = HandoffLedger()
        # What a taken one needs: room -> (request, ticket, text the client has).
        self._taking: dict[int, tuple[Req, HandoffTicket, int]] = {}
        self._waiting: deque[int] = deque()  # rooms of claims waiting for pages, FIFO
        self._rooms = 0
        self._given = 0
        self._queued = 0  # claims that had to wait for pages

    @property
    def layout_hash(self) -> str:
        return self.kv_args.layout_hash

    # -- giving ---------------------------------------------------------------------------------

    def hand_off(self, rids: Collection[str], lease_s: float) -> list[tuple[str, HandoffTicket]]:
        """Give away the running sequences of ``rids`` (single-sequence requests): each one's KV
        is gathered and registered for another D to pull within ``lease_s``, its pages go back at
        once (the gathered arrays are buffers of their own), and it leaves this scheduler without
        a final output: its stream ends with the ticket. A sequence whose KV cannot be registered
        stays and finishes here."""
        sched = self.sched
        out: list[tuple[str, HandoffTicket]] = []
        for req in list(sched.running):
            if (req.rid not in rids or req.family or req.parent is not None
                    or req.pages is None or not req.output_ids):
                continue
            kv_tokens = req.seq_len - 1  # the last output token has no KV yet
            pages = req.pages[: sched.pool_config.pages_for(kv_tokens)]
            try:
                arrays = gather_room(sched.kv_holder, self.kv_args, pages)
                sums = kv_checksums(arrays) if self.kv_checksum else ()
                uuid = new_uuid()
                self.engine.register(uuid, arrays, lease_s)
            except Exception as exc:  # it finishes here instead: nothing is lost
                log.warning("request %s: hand-off registration failed (%r)", req.rid, exc)
                continue
            self._given += 1
            self.drive(ev.HandoffOffered(uuid, lease_s))
            out.append((req.rid, HandoffTicket(
                self.engine.address, uuid, kv_tokens, req.output_ids[-1], self.layout_hash,
                self.kv_args.kv_shards, sums, lease_s)))
            # Gone from here: no output (what it produced so far was drained before this call).
            req.state = ReqState.FINISHED
            req.finish_reason = FinishReason("abort", message="handed off")
            sched.reqs.pop(req.rid, None)
            sched.queues.remove(req)
            sched.page_budget.release(req)
            sched.outputs.forget(req)
        return out

    def release(self, uuid: int) -> bool:
        """The proxy says hand-off ``uuid``'s KV was pulled (or never will be): drop its
        registration. False when it is not (or no longer) offered here: released once, on this
        word or at the lease's end."""
        if self.ledger.state_of(uuid) != _HANDOFF.S.OFFERED:
            return False
        self.drive(ev.HandoffPulled(uuid))
        return True

    @property
    def outstanding(self) -> int:
        return sum(h.state == _HANDOFF.S.OFFERED for h in self.ledger.handoffs.values())

    @property
    def stats(self) -> dict[str, int]:
        """Offers given and how they ended (released on the proxy's word, expired), pulls
        taken or failed here."""
        done = self.ledger.outcomes
        return {"given": self._given, "released": done[_HANDOFF.S.RELEASED],
                "expired": done[_HANDOFF.S.EXPIRED], "taken": done[_HANDOFF.S.TAKEN],
                "take_failed": done[_HANDOFF.S.FAILED], "waited_for_pages": self._queued,
                "withdrawn": done[_HANDOFF.S.WITHDRAWN]}

    # -- taking ---------------------------------------------------------------------------------

    @property
    def joining(self) -> int:
        """Sequences being taken that hold pages but have not joined the batch yet (pulling):
        each takes a batch slot, as a room being pulled does."""
        return sum(1 for req, _, _ in self._taking.values() if req.pages is not None)

    def _place(self, req: Req) -> bool:
        """A batch slot and pages for ``req``, or neither."""
        return self._slots_free() > 0 and self.sched.page_budget.reserve(req)

    def take(self, req: Req, ticket: HandoffTicket, text_sent: int) -> None:
        """Take over a sequence another D handed off: ``req`` was made with every output token
        but the last as its resumed tokens (their KV is what the ticket offers); reserve its
        pages and pull — or, with none free (or claims already waiting), wait for them.
        ``text_sent``: characters of the output the client already has. Raises ValueError for a
        ticket this worker cannot take (the proxy then re-prefills)."""
        sched = self.sched
        if ticket.layout_hash != self.layout_hash:
            raise ValueError("hand-off ticket: the KV layout differs from this worker's "
                             f"({ticket.layout_hash} != {self.layout_hash})")
        if ticket.kv_tokens != len(req.input_ids):
            raise ValueError(f"hand-off ticket covers {ticket.kv_tokens} positions, the prompt "
                             f"and resumed tokens are {len(req.input_ids)}")
        if ticket.kv_shards not in kv_shard_counts(sched.config.num_kv_heads):
            raise ValueError(f"hand-off ticket: {ticket.kv_shards} KV shards do not split this "
                             "model's kv-heads")
        if bool(ticket.kv_checksums) != self.kv_checksum:
            raise ValueError("hand-off ticket: KV checksums on one side only "
                             "(--disaggregation-kv-checksum)")
        sched.register(req)  # ValueError for a request that can never be served
        self._rooms -= 1
        room = self._rooms
        self._taking[room] = (req, ticket, text_sent)
        if not self._waiting and self._place(req):
            self.drive(ev.HandoffClaimed(room))
            return
        self._waiting.append(room)
        self._queued += 1
        wait = ticket.lease_s / 2 if ticket.lease_s > 0 else PAGE_WAIT_DEFAULT_S
        log.info("request %s: hand-off waits up to %.1f s for free KV pages and a batch slot",
                 req.rid, wait)
        self.drive(ev.HandoffQueued(room, wait))

    def place_waiting(self) -> bool:
        """Reserve a batch slot and pages for the claims waiting for them, first come first;
        True when none is left waiting (the rooms' page queue may go on)."""
        while self._waiting:
            room = self._waiting[0]
            if self.ledger.state_of(room) != _HANDOFF.S.WAITING_FOR_PAGES:
                self._waiting.popleft()  # its wait ended, or it was aborted
                continue
            if not self._place(self._taking[room][0]):
                return False
            self._waiting.popleft()
            self.drive(ev.HandoffPagesReserved(room))
        return True

    def takes(self, room: int) -> bool:
        """Whether ``room`` is a hand-off this D is taking (its pull's result is ours)."""
        return room in self._taking

    def pulled(self, result: PullResult) -> None:
        if result.ok:
            self.link.phases.sample("kv_pull", result.pull_seconds)
            self.drive(ev.PullSucceeded(result.room))
        else:
            self.drive(ev.PullFailed(result.room, result.reason))

    def abort(self, rid: str, message: str) -> bool:
        """Abort a hand-off being taken for ``rid``; False if there is none."""
        for room, (req, _, _) in self._taking.items():
            if req.rid == rid and self.ledger.state_of(room) in _ABORTABLE:
                self.drive(ev.Aborted(room, message))
                return True
        return False

    # -- the ledger's effects -------------------------------------------------------------------

    def drive(self, event: ev.HandoffEvent) -> None:
        drive(self.ledger.handle, event, self.link.clock(), self._carry_out)

    def _carry_out(self, e: fx.HandoffEffect) -> tuple[()]:
        sched = self.sched
        match e:
            case fx.ReleaseOffer():
                if e.reason == "hand-off lease expired":
                    log.warning("hand-off %d was not claimed within its lease: released", e.uuid)
                self.engine.release(e.uuid, e.reason)
            case fx.StartHandoffPull():
                req, ticket, _ = self._taking[e.room]
                assert req.pages is not None
                self._pulls().submit(PullRequest(
                    e.room, ticket.uuid, ticket.transfer_addr,
                    pages=req.pages[: sched.pool_config.pages_for(ticket.kv_tokens)],
                    remote_layout_hash=self.layout_hash, kv_shards=ticket.kv_shards,
                    kv_checksums=ticket.kv_checksums))
            case fx.EnterDecode():
                req, ticket, text_sent = self._taking.pop(e.room)
                sched.add_prefilled_request(req, ticket.next_token, 0.0)
                # The client has that token and its text already: only what follows is new.
                req.tokens_sent = len(req.output_ids)
                req.text_sent = max(req.text_sent, min(text_sent, len(req.text)))
                if not req.finished:  # nothing new yet: its next step's output is the first
                    sched.outputs.forget(req)
            case fx.FailHandoff():
                req = self._taking.pop(e.room)[0]
                sched.page_budget.release(req)
                self.link.fail_request(req, 502, f"hand-off pull failed: {e.reason}")
            case fx.FinishAborted():
                req = self._taking[e.room][0]
                if req.pages is not None:  # the pull may still write them
                    self.held_pages[e.room], req.pages = req.pages, None
                sched.finish(req, FinishReason("abort", message=e.reason))
            case fx.FreeHeldPages():
                self._taking.pop(e.room)
                held = self.held_pages.pop(e.room, None)
                if held:
                    sched.page_budget.free(held)
            case fx.FinishUnplaced():
                sched.finish(self._taking.pop(e.room)[0], FinishReason("abort", message=e.reason))
            case _:
                assert_never(e)
        return ()
