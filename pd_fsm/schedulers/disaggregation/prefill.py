"""The prefill side (RFC-2 §5.4): ``SchedulerDisaggregationPrefillMixin`` and ``PrefillScheduler``.

P runs the prefill forward as the colocated scheduler does, samples the first token, then hands
the room to its core endpoint instead of decoding: the pages are gathered into packed arrays and
registered with the transfer server, READY goes to D once D has said hello, and the pages stay
held until D's DONE, an abort, or the lease runs out (``ReleaseKV``), which also removes the
registration from the transfer server.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, assert_never

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.messages import TokenLogprob
from pd_fsm.core.prefill_endpoint import PrefillEndpoint
from pd_fsm.jax_engine.kv.checksum import kv_checksums
from pd_fsm.jax_engine.kv.room import gather_room
from pd_fsm.jax_engine.model import LoadedModel
from pd_fsm.jax_engine.sampling.params import TopLogprobs
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import DisaggregationCommon
from pd_fsm.schedulers.request import FinishReason, Req, ReqState
from pd_fsm.schedulers.scheduler import Scheduler

# The core's lease is the one that counts; the engine's own reaper is off. This is only what the
# engine records for a registration.
_ENGINE_LEASE_S = 24 * 3600.0


class SchedulerDisaggregationPrefillMixin(DisaggregationCommon):
    KV_COPY = "gather"
    core: PrefillEndpoint

    def shape_plan(self) -> list[tuple[int, int]]:
        """P decodes only plain requests (a health check, a client that skipped the router):
        every prefill shape, and decode one row at a time. A batch of several plain requests
        compiles on first use (``compiles_after_ready_total`` counts it)."""
        return [(n, t) for n, t in super().shape_plan() if t > 1 or n == 1]

    def _init_prefill(
        self,
        args: DisaggregationArgs,
        engine: KVTransferEngine | None,
        clock: Callable[[], float] | None,
        rng: random.Random | None,
    ) -> None:
        self._init_common(
            engine or JaxTransferKVEngine(args.transfer_host, reaper_interval_s=None), clock
        )
        # D forks a room's sequences, not P: no pages for them here.
        self.page_budget.forks_here = lambda req: req.rid not in self.room_of
        self.core = PrefillEndpoint(
            # The OS's CSPRNG by default: transfer uuids are the data plane's only guard
            # (README "Security model"); tests pass a seeded Random.
            self.layout_hash, rng or random.SystemRandom(), args.lease_config(),
            transfer_addr=self.engine.address, kv_shards=self.kv_args.kv_shards,
            kv_checksum=args.kv_checksum,
        )
        self.send_queue = self._create_send_queue()
        # Streamed KV: chunk a room's prefill in parts of this many tokens (whole pages; 0: the
        # whole prompt goes with READY, after the prefill).
        page = args.page_size
        self.stream_tokens = args.stream_tokens // page * page
        self._held_pages: dict[int, list[int]] = {}  # room -> pages, after the leg answered
        self._step_started: float | None = None  # self.clock() when the current step began
        self.transfer_stats = {
            "registered": 0,
            "released": 0,
            "release_unverified": 0,
            "registered_bytes": 0,
        }

    def _create_send_queue(self) -> dict[int, Req]:
        """Rooms whose prefill is done, waiting for D's hello or D's DONE."""
        return {}

    # -- requests ---------------------------------------------------------------------------------

    def add_pd_request(self, req: Req, room: int, accepted: float | None = None) -> None:
        """Queue the P leg of ``room``; raises ValueError (bad request) or DuplicateRoomError.
        ``accepted``: when the worker took the leg, on ``self.clock`` (default: now)."""
        self._admit_pd(req, ev.PrefillRequestAccepted(room), accepted)
        if req.state is not ReqState.FINISHED:  # failed at once: D refused the room first
            self.waiting.append(req)

    def _event_loop_prefill_disagg(self) -> Any:
        """One iteration of P's loop: time-driven core work (lease expiry), then a step."""
        self._step_started = self.clock()
        self.deliver(ev.TimeAdvanced(), now=self._step_started)
        return super().step()

    def step(self) -> Any:
        return self._event_loop_prefill_disagg()

    def _admit_waiting(self) -> None:
        before = len(self.prefilling)
        super()._admit_waiting()
        for req in self.prefilling[before:]:  # admitted just now (appended in FIFO order)
            room = self.room_of.get(req.rid)
            if room is not None:
                self._lap(room, "prefill_queue", "accepted", "admitted")

    # -- the hand-off -----------------------------------------------------------------------------

    # -- streamed KV (issue 31 §1) ------------------------------------------------------------

    def _chunk_cap(self, req: Req) -> int | None:
        """A room's prompt is prefilled in chunks of ``stream_tokens`` when streaming: each
        chunk's pages can be on their way to D while the next one runs."""
        if self.stream_tokens and req.rid in self.room_of:
            return self.stream_tokens
        return None

    def _on_prefill_chunk(self, req: Req) -> None:
        room = self.room_of.get(req.rid)
        if room is None or not self.stream_tokens or req.state is ReqState.FINISHED:
            return
        # As PrefillFinished, as of the step's start (leases are judged after the heartbeats
        # that arrived during the forward).
        now = self.clock() if self._step_started is None else self._step_started
        self._drive(ev.PartPrefilled(room, req.prefilled // self.args.page_size), now)

    def _on_prefill_done(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs = ()
    ) -> None:
        if req.state is ReqState.FINISHED:
            return  # its room failed (lease, abort) while this batch's forward ran
        room = self.room_of.get(req.rid)
        if room is None:  # a plain request on a P worker: decode it here
            super()._on_prefill_done(req, first_token, first_logprob, first_top)
            return
        self._handle_completed_prefill(req, room, first_token, first_logprob, first_top)

    def _handle_completed_prefill(
        self, req: Req, room: int, first_token: int, first_logprob: float,
        first_top: TopLogprobs = (),
    ) -> None:
        self._lap(room, "prefill_forward", "admitted", "prefilled")
        self.prefilling.remove(req)
        self.send_queue[room] = req
        self.outputs.record_token(req, first_token, first_logprob, first_top)
        finished = ev.PrefillFinished(
            room, first_token, self.prompt_pages(req), first_logprob,
            tuple(TokenLogprob(t, lp) for t, lp in first_top),
        )
        # As of the step's start, not now: D's heartbeats that arrived during a long forward (a
        # compile, a long prompt) still wait in the I/O layer's inbox, so judging leases at the
        # end of the forward would expire rooms whose D is alive. Leases are judged at the next
        # TimeAdvanced, after those heartbeats were delivered with their arrival times.
        now = self.clock() if self._step_started is None else self._step_started
        self._drive(finished, now)

    # -- the core's effects -----------------------------------------------------------------------

    def _carry_out(self, e: fx.PrefillEffect) -> None:
        match e:
            case fx.RegisterKV():
                self._register_kv(e.room, e.uuid, e.skip_pages, e.spare_uuid)
            case fx.RegisterPart():
                self._register_kv(e.room, e.uuid, e.first_page, None,
                                  e.first_page + e.n_pages, e.checksum)
            case fx.NarrowKV():  # only what D lacks goes: the whole prompt's is let go
                for old in (e.replaces, e.replaces_spare):
                    if old is not None:
                        self._release_registration(old, "narrowed to the pages D lacks")
                self._register_kv(e.room, e.uuid, e.skip_pages, e.spare_uuid)
            case fx.CompleteRequest():
                req = self.req_of[e.room]
                # The leg is answered now; its pages stay held (apart from the request) until
                # ReleaseKV, which comes on DONE, abort or lease expiry.
                assert req.pages is not None
                self.page_budget.cache_prompt(req)  # the rooms after it share its pages
                self._held_pages[e.room], req.pages = req.pages, None
                self.room_of.pop(req.rid, None)
                self._finish(req, FinishReason("length"))
            case fx.ReleaseKV():
                if e.spare_uuid is not None:  # usually never pulled: D's pull needed no second go
                    self._release_registration(e.spare_uuid, "room over")
                for part in e.parts:
                    self._release_registration(part, "room over")
                self._release_kv(e.room, e.uuid)
            case fx.FailRequest():
                failed = self.req_of.get(e.room)
                if failed is not None:
                    self._fail_request(failed, e.status, e.reason)
            case fx.SendMessage() | fx.RejectRequest() | fx.AckWhileBusy():
                # Not ours: the outbox (_dispatch), _admit_pd and step_started take these.
                raise TypeError(f"prefill scheduler cannot carry out {e!r}")
            case _:
                assert_never(e)

    def _register_kv(
        self, room: int, uuid: int, skip_pages: int = 0, spare_uuid: int | None = None,
        end: int | None = None, checksum: bool = False,
    ) -> None:
        """Gather and register the prompt's pages after the ``skip_pages`` D holds already (up
        to ``end``: a part, default the prompt's end); with KV checksums (``spare_uuid``, or
        ``checksum`` for a part, which has no spare), checksum them and register them under
        the spare too (for D's one re-pull: a registration is pulled once), then tell the
        core."""
        req = self.req_of[room]
        assert req.pages is not None
        checksum = checksum or spare_uuid is not None
        try:
            start = self.clock()
            pages = req.pages[skip_pages : self.prompt_pages(req) if end is None else end]
            arrays = gather_room(self.kv_holder, self.kv_args, pages)
            # The checksums wait for the gather to run (its dispatch alone is what the phase
            # measures without them): "kv_gather" then lasts until the bytes are summed.
            sums = kv_checksums(arrays) if checksum else ()
            gathered = self.clock()
            for registration in (uuid, spare_uuid):
                if registration is not None:
                    self.engine.register(registration, arrays, _ENGINE_LEASE_S)
                    self.transfer_stats["registered"] += 1
        except Exception as exc:  # the room fails cleanly; the worker keeps serving
            self._deferred.append(ev.PrefillFailed(room, f"KV registration failed: {exc}"))
            return
        if checksum:  # READY (or the part) waits for these (the core holds it until then)
            self._deferred.append(ev.KVChecksummed(room, uuid, sums))
        self._phase_sample("kv_gather", gathered - start)
        self._phase_sample("kv_register", self.clock() - gathered)
        self.transfer_stats["registered_bytes"] += sum(int(a.nbytes) for a in arrays)

    def _release_registration(self, uuid: int, why: str) -> None:
        result = self.engine.release(uuid, why)
        self.transfer_stats["released"] += 1
        if result.released and not result.verified:
            self.transfer_stats["release_unverified"] += 1

    def _release_kv(self, room: int, uuid: int | None) -> None:
        if uuid is not None:
            self._release_registration(uuid, "room over")
        pages = self._held_pages.pop(room, None)
        req = self.send_queue.pop(room, None) or self.req_of.get(room)
        if pages is None and req is not None:
            pages, req.pages = req.pages, None  # a leg still queued or prefilling
            self._detach(req)
        if pages:
            self.page_budget.free(pages)


class PrefillScheduler(SchedulerDisaggregationPrefillMixin, Scheduler):
    def __init__(
        self,
        args: DisaggregationArgs,
        *,
        model: LoadedModel | None = None,
        engine: KVTransferEngine | None = None,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(args, model=model)
        self._init_prefill(args, engine, clock, rng)
