"""The prefill side (RFC-2 §5.4): ``PrefillRole``, ``SchedulerDisaggregationPrefillMixin`` and
``PrefillScheduler``.

P runs the prefill forward as the colocated scheduler does, samples the first token, then hands
the room to its core endpoint instead of decoding: the pages are gathered into packed arrays and
registered with the transfer server, READY goes to D once D has said hello, and the pages stay
held until D's DONE, an abort, or the lease runs out (``ReleaseKV``), which also removes the
registration from the transfer server.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import assert_never

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
from pd_fsm.schedulers.disaggregation.api import DisaggregationCommon
from pd_fsm.schedulers.disaggregation.args import DisaggregationArgs
from pd_fsm.schedulers.disaggregation.common import PDLink, kv_args_of
from pd_fsm.schedulers.request import FinishReason, Req, ReqState
from pd_fsm.schedulers.role import ColocatedRole
from pd_fsm.schedulers.scheduler import Scheduler

# The core's lease is the one that counts; the engine's own reaper is off. This is only what the
# engine records for a registration.
_ENGINE_LEASE_S = 24 * 3600.0


class PrefillRole(ColocatedRole):
    """P's part of a scheduler: its rooms' legs prefilled, their KV held for D.

    A plain request (a health check, a client that skipped the router) is served as on a
    colocated worker: the hooks it inherits from ``ColocatedRole`` do nothing."""

    kv_copy = "gather"

    def __init__(
        self,
        sched: Scheduler,
        args: DisaggregationArgs,
        engine: KVTransferEngine | None = None,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.sched = sched
        self.args = args
        self.clock = clock or time.monotonic
        self.engine = engine or JaxTransferKVEngine(args.transfer_host, reaper_interval_s=None)
        self.kv_args = kv_args_of(sched)
        core = PrefillEndpoint(
            # The OS's CSPRNG by default: transfer uuids are the data plane's only guard
            # (README "Security model"); tests pass a seeded Random.
            self.kv_args.layout_hash, rng or random.SystemRandom(), args.lease_config(),
            transfer_addr=self.engine.address, kv_shards=self.kv_args.kv_shards,
            kv_checksum=args.kv_checksum,
        )
        self.link: PDLink[ev.PrefillEvent, fx.PrefillEffect] = PDLink(
            sched, core, self.clock, self.carry_out)
        self.send_queue: dict[int, Req] = {}  # prefilled rooms waiting for D's hello or DONE
        # Streamed KV: chunk a room's prefill in parts of this many tokens (whole pages; 0: the
        # whole prompt goes with READY, after the prefill).
        page = args.page_size
        self.stream_tokens = args.stream_tokens // page * page
        self.held_pages: dict[int, list[int]] = {}  # room -> pages, after the leg answered
        self._step_started: float | None = None  # clock() when the current step began
        self.transfer_stats = {
            "registered": 0,
            "released": 0,
            "release_unverified": 0,
            "registered_bytes": 0,
        }

    # -- the scheduler's hooks (schedulers/role.py) ---------------------------------------------

    def keeps_shape(self, rows: int, tokens: int) -> bool:
        """P decodes only plain requests: every prefill shape, and decode one row at a time. A
        batch of several plain requests compiles on first use (``compiles_after_ready_total``
        counts it)."""
        return tokens > 1 or rows == 1

    def forks_here(self, req: Req) -> bool:
        return req.rid not in self.link.room_of  # D forks a room's sequences: no pages here

    def before_step(self) -> None:
        """Time-driven core work (lease expiry) before the step."""
        self._step_started = self.clock()
        self.link.deliver(ev.TimeAdvanced(), now=self._step_started)

    def on_admitted(self, req: Req) -> None:
        room = self.link.room_of.get(req.rid)
        if room is None:
            return
        self.link.phases.lap(room, "prefill_queue", "accepted", "admitted")
        if self.stream_tokens and req.prefilled >= self.args.page_size:
            # A prefix-cache hit: those pages hold their KV already, so they go to D as a part
            # now, pulled while the rest is prefilled, not with the first chunk's part (or with
            # READY, when the rest is one chunk).
            now = self.clock() if self._step_started is None else self._step_started
            self.link.drive(ev.PartPrefilled(room, req.prefilled // self.args.page_size), now)

    def chunk_cap(self, req: Req) -> int | None:
        """A room's prompt is prefilled in chunks of ``stream_tokens`` when streaming: each
        chunk's pages can be on their way to D while the next one runs."""
        if self.stream_tokens and req.rid in self.link.room_of:
            return self.stream_tokens
        return None

    def on_prefill_chunk(self, req: Req) -> None:
        room = self.link.room_of.get(req.rid)
        if room is None or not self.stream_tokens or req.state is ReqState.FINISHED:
            return
        # As PrefillFinished, as of the step's start (leases are judged after the heartbeats
        # that arrived during the forward).
        now = self.clock() if self._step_started is None else self._step_started
        self.link.drive(ev.PartPrefilled(room, req.prefilled // self.args.page_size), now)

    def take_prefilled(
        self, req: Req, first_token: int, first_logprob: float, first_top: TopLogprobs
    ) -> bool:
        if req.state is ReqState.FINISHED:
            return True  # its room failed (lease, abort) while this batch's forward ran
        room = self.link.room_of.get(req.rid)
        if room is None:  # a plain request on a P worker: decode it here
            return False
        self.link.phases.lap(room, "prefill_forward", "admitted", "prefilled")
        self.sched.prefilling.remove(req)
        self.send_queue[room] = req
        self.sched.outputs.record_token(req, first_token, first_logprob, first_top)
        finished = ev.PrefillFinished(
            room, first_token, self.link.prompt_pages(req), first_logprob,
            tuple(TokenLogprob(t, lp) for t, lp in first_top),
        )
        # As of the step's start, not now: D's heartbeats that arrived during a long forward (a
        # compile, a long prompt) still wait in the I/O layer's inbox, so judging leases at the
        # end of the forward would expire rooms whose D is alive. Leases are judged at the next
        # TimeAdvanced, after those heartbeats were delivered with their arrival times.
        now = self.clock() if self._step_started is None else self._step_started
        self.link.drive(finished, now)
        return True

    def abort(self, rid: str, message: str) -> bool:
        """A local abort of a live room: the core decides what to release and whom to tell."""
        room = self.link.live_room(rid)
        if room is None:
            return False
        self.link.deliver(ev.Aborted(room, message))
        return True

    # -- the worker's side ------------------------------------------------------------------------

    def add_pd_request(self, req: Req, room: int, accepted: float | None = None) -> None:
        """Queue the P leg of ``room``; raises ValueError (bad request) or DuplicateRoomError.
        ``accepted``: when the worker took the leg, on the role's clock (default: now)."""
        self.link.admit(req, ev.PrefillRequestAccepted(room), room, accepted)
        if req.state is not ReqState.FINISHED:  # failed at once: D refused the room first
            self.sched.waiting.append(req)

    def deliver(self, event: ev.PrefillEvent, now: float | None = None) -> None:
        self.link.deliver(event, now)

    def step_started(self) -> list[fx.BusyEffect]:
        return self.link.step_started(ev.StepStarted())

    def step_ended(self) -> None:
        self.link.deliver(ev.StepEnded())

    def next_deadline(self) -> float | None:
        return self.link.next_deadline()

    def close(self) -> None:
        """Nothing of P's own: the engine is the worker's to close."""

    # -- the core's effects -----------------------------------------------------------------------

    def carry_out(self, e: fx.PrefillEffect) -> int | None:
        """One effect of the core; the room it was about (None: the I/O layer's)."""
        match e:
            case fx.SendMessage():
                self.link.send(e)
                return None
            case fx.AckWhileBusy():
                self.link.busy(e)
                return None
            case fx.RejectRequest():  # the link's admit takes these before they get here
                raise TypeError(f"prefill scheduler cannot carry out {e!r}")
            case fx.RegisterKV():
                self._register_kv(e.room, e.uuid, e.skip_pages, e.spare_uuid)
            case fx.RegisterPart():
                self._register_kv(e.room, e.uuid, e.first_page, None,
                                  e.first_page + e.n_pages, e.checksum)
            case fx.NarrowKV():  # only what D lacks goes: the whole prompt's is let go
                for old in (e.replaces, e.replaces_spare):
                    if old is not None:
                        self.release_registration(old, "narrowed to the pages D lacks")
                self._register_kv(e.room, e.uuid, e.skip_pages, e.spare_uuid)
            case fx.CompleteRequest():
                req = self.link.req_of[e.room]
                # The leg is answered now; its pages stay held (apart from the request) until
                # ReleaseKV, which comes on DONE, abort or lease expiry.
                assert req.pages is not None
                self.sched.page_budget.cache_prompt(req)  # the rooms after it share its pages
                self.held_pages[e.room], req.pages = req.pages, None
                self.link.room_of.pop(req.rid, None)
                self.sched.finish(req, FinishReason("length"))
            case fx.ReleaseKV():
                if e.spare_uuid is not None:  # usually never pulled: D's pull needed no second go
                    self.release_registration(e.spare_uuid, "room over")
                for part in e.parts:
                    self.release_registration(part, "room over")
                self.release_kv(e.room, e.uuid)
            case fx.FailRequest():
                failed = self.link.req_of.get(e.room)
                if failed is not None:
                    self.link.fail_request(failed, e.status, e.reason)
            case _:
                assert_never(e)
        return e.room

    def _register_kv(
        self, room: int, uuid: int, skip_pages: int = 0, spare_uuid: int | None = None,
        end: int | None = None, checksum: bool = False,
    ) -> None:
        """Gather and register the prompt's pages after the ``skip_pages`` D holds already (up
        to ``end``: a part, default the prompt's end); with KV checksums (``spare_uuid``, or
        ``checksum`` for a part, which has no spare), checksum them and register them under
        the spare too (for D's one re-pull: a registration is pulled once), then tell the
        core."""
        req = self.link.req_of[room]
        assert req.pages is not None
        checksum = checksum or spare_uuid is not None
        phases = self.link.phases
        try:
            start = self.clock()
            pages = req.pages[skip_pages : self.link.prompt_pages(req) if end is None else end]
            arrays = gather_room(self.sched.kv_holder, self.kv_args, pages)
            # The checksums wait for the gather to run (its dispatch alone is what the phase
            # measures without them): "kv_gather" then lasts until the bytes are summed.
            sums = kv_checksums(arrays) if checksum else ()
            gathered = self.clock()
            for registration in (uuid, spare_uuid):
                if registration is not None:
                    self.engine.register(registration, arrays, _ENGINE_LEASE_S)
                    self.transfer_stats["registered"] += 1
        except Exception as exc:  # the room fails cleanly; the worker keeps serving
            self.link.defer(ev.PrefillFailed(room, f"KV registration failed: {exc}"))
            return
        if checksum:  # READY (or the part) waits for these (the core holds it until then)
            self.link.defer(ev.KVChecksummed(room, uuid, sums))
        phases.sample("kv_gather", gathered - start)
        phases.sample("kv_register", self.clock() - gathered)
        self.transfer_stats["registered_bytes"] += sum(int(a.nbytes) for a in arrays)

    def release_registration(self, uuid: int, why: str) -> None:
        """Drop one registration from the transfer server."""
        result = self.engine.release(uuid, why)
        self.transfer_stats["released"] += 1
        if result.released and not result.verified:
            self.transfer_stats["release_unverified"] += 1

    def release_kv(self, room: int, uuid: int | None) -> None:
        """The room is over: its registration and its pages go back."""
        if uuid is not None:
            self.release_registration(uuid, "room over")
        pages = self.held_pages.pop(room, None)
        req = self.send_queue.pop(room, None) or self.link.req_of.get(room)
        if pages is None and req is not None:
            pages, req.pages = req.pages, None  # a leg still queued or prefilling
            self.sched.queues.remove(req)
        if pages:
            self.sched.page_budget.free(pages)


class SchedulerDisaggregationPrefillMixin(DisaggregationCommon[PrefillRole]):
    """RFC-2 §5.4's prefill mixin: the colocated scheduler holding P's role (``self.role``),
    which is its PD API."""


class PrefillScheduler(SchedulerDisaggregationPrefillMixin):
    def __init__(
        self,
        args: DisaggregationArgs,
        *,
        model: LoadedModel | None = None,
        engine: KVTransferEngine | None = None,
        clock: Callable[[], float] | None = None,
        rng: random.Random | None = None,
        role: type[PrefillRole] = PrefillRole,
    ) -> None:
        """``role``: the role's class (the simulator plants bugs in a subclass of it)."""
        super().__init__(args, model=model,
                         role=lambda sched: role(sched, args, engine, clock, rng))
