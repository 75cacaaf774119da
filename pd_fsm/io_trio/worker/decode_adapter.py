"""The decode side of the PD loop (pd_adapter.PDAdapter): the I/O around D's scheduler role,
which preallocates, pulls the KV from P and decodes; this opens the side channel, admits each
job into the role, tells P of legs it refused before any room opened, and hands its running
streams to another D while it drains."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import deque

import trio

from pd_fsm.core import events as ev
from pd_fsm.io_trio.bootstrap.client import BootstrapError
from pd_fsm.io_trio.bootstrap.records import InstanceRecord
from pd_fsm.io_trio.side_channel.channel import DecodeSideChannel
from pd_fsm.io_trio.unix_sockets import IPC_PREFIX, ipc_path
from pd_fsm.io_trio.worker.backend import GenerateJob, HandedOff, Stats, request_of
from pd_fsm.io_trio.worker.pd_adapter import RoleParts, bootstrap_of, held_rooms
from pd_fsm.io_trio.worker.peer_io import PeerIO
from pd_fsm.io_trio.worker.spmd.tick_inputs import TickInputs
from pd_fsm.jax_engine.transfer.base import KVTransferEngine
from pd_fsm.schedulers.disaggregation import DecodeScheduler
from pd_fsm.schedulers.disaggregation.decode import PeerPairing
from pd_fsm.schedulers.disaggregation.handoff import HandoffTicket
from pd_fsm.schedulers.request import Resume

log = logging.getLogger("pd_fsm.io_trio.worker.pd")

# D: refused legs whose P(s) are still to be told (bounded: a flood drops the oldest).
REFUSALS_PENDING = 1024


class RefusalTeller:
    """PD legs refused before any room opened here (a null ``bootstrap_port``, no default):
    their P leg would wait a whole lease for our RECV_INIT unless told."""

    def __init__(self, link: PeerIO, resolve_timeout: float) -> None:
        self._link = link
        self._resolve_timeout = resolve_timeout
        # (bootstrap_host, room, reason): appended in the tick's thread, drained on the loop.
        self._refusals: deque[tuple[str, int, str]] = deque(maxlen=REFUSALS_PENDING)
        self._telling = False
        self.told_total = 0  # ABORTs sent to Ps for such legs

    def refused(self, host: str, room: int, reason: str) -> None:
        self._refusals.append((host, room, reason))

    def start(self, nursery: trio.Nursery) -> None:
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
                bootstrap = self._link.bootstrap
                assert bootstrap is not None
                try:
                    with trio.fail_after(self._resolve_timeout):
                        records = await bootstrap.list("prefill")
                except (BootstrapError, trio.TooSlowError) as exc:
                    log.warning("cannot tell the prefill of %d refused rooms: %s", len(batch), exc)
                    continue
                for host, room, reason in batch:
                    self._tell(records, host, room, reason)
        finally:
            self._telling = False

    def _tell(self, records: list[InstanceRecord], host: str, room: int, reason: str) -> None:
        peers = sorted({
            r.zmq_addr for r in records
            if r.known_as[0].lower() == host.lower()
        })
        why = f"decode refused the request: {reason} (HTTP 400)"
        self._link.put(ev.LegRefused(room, tuple(peers), why))  # the core sends the ABORTs
        self.told_total += len(peers)
        log.info("refused room %d (%s): told %d prefill(s) at %s",
                 room, reason, len(peers), host)


def unix_only_elsewhere(record: InstanceRecord) -> str | None:
    """Why D cannot take a P whose side channel is a unix socket that is not on this host, or
    None. Such a P serves on unix sockets alone: only a D on its host reaches it, and the KV
    pull goes over TCP regardless (jax.experimental.transfer listens on TCP only)."""
    path = ipc_path(record.zmq_addr)
    if path is None:
        return None
    try:
        here = stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        here = False
    if here:
        return None
    return (f"prefill {record.instance_id} is reachable only over a unix socket ({record.zmq_addr}"
            ") that is not on this host: a P on unix sockets alone serves the D on its own host "
            f"only (its KV pull goes over TCP to {record.transfer_addr} regardless: "
            "jax.experimental.transfer listens on TCP only); give that P a TCP --port")


class DecodeAdapter:
    mode = "decode"

    def __init__(self, parts: RoleParts, pairing: PeerPairing | None = None) -> None:
        """``pairing``: a D rank > 0's way to its P rank (its backend only builds the
        replica)."""
        self._config = parts.config
        self._pd_args = parts.pd_args
        self._link = parts.link
        self._streams = parts.streams
        self._secret = parts.secret
        self._curve = parts.curve
        self._spans_processes = parts.spans_processes
        self._pairing = pairing
        self._side: DecodeSideChannel | None = None
        self.refusals = RefusalTeller(parts.link, parts.pd_args.resolve_timeout)
        self.local_prefills_total = 0  # requests without bootstrap fields, prefilled here
        # Live hand-off. While draining with --drain-handoff: until when (time.
        # monotonic) running streams are handed off; tickets a tick made, for the loop to end
        # their streams with; hand-offs whose KV was pulled, to release on the next tick.
        self._handoff_until: float | None = None
        self._handed: list[tuple[str, HandoffTicket]] = []
        self._releases: deque[int] = deque(maxlen=REFUSALS_PENDING)

    def new_scheduler(self, engine: KVTransferEngine | None,
                      tick_inputs: TickInputs | None) -> DecodeScheduler:
        wake = self._link.wake_from_thread
        if tick_inputs is None:
            return DecodeScheduler(self._pd_args, engine=engine, on_pull_result=wake)
        return DecodeScheduler(
            self._pd_args, engine=engine, clock=tick_inputs.clock, on_pull_result=wake,
            # One incarnation for every rank (the replicas' cores check P's answers with it).
            incarnation=tick_inputs.rng.getrandbits(63) | 1, pairing=self._pairing,
        )

    async def start_io(self, nursery: trio.Nursery,
                       sched: DecodeScheduler) -> tuple[str, int | None]:
        self._side = self._link.side = DecodeSideChannel(
            self._pd_args.instance_id, self._link.deliver_message, secret=self._secret,
            curve=self._curve,
        )
        await nursery.start(self._side.run)
        nursery.start_soon(self._link.keepalive, self._pd_args.heartbeat_interval)
        # D binds no side-channel socket; its record names its HTTP address for routers (on a
        # unix socket alone, the endpoint it would bind as P: an address the registry takes).
        c = self._config
        return c.side_channel_ipc or f"{c.public_host}:{c.port}", None

    def check_peer(self, record: InstanceRecord, sched: DecodeScheduler | None) -> str | None:
        assert self._side is not None
        ours = None if sched is None else sched.pool_config.dtype
        if ours is not None and record.kv_dtype != ours:
            # The layout hashes differ too (READY would be refused); this says why, and before
            # any page is reserved for the room.
            return (f"prefill {record.instance_id} keeps its KV in {record.kv_dtype}, this "
                    f"decode in {ours}: start P and D with the same --kv-dtype")
        return (self._layout_mismatch(record) or unix_only_elsewhere(record)
                or self._side.set_server_key(record.zmq_addr, record.curve_public_key))

    def _layout_mismatch(self, record: InstanceRecord) -> str | None:
        c = self._config
        theirs = record.mesh_meta.get("kv_checksum", False) is True
        if theirs != c.disaggregation_kv_checksum:
            # Checked at READY too (a D that verifies refuses KV without checksums); this says
            # why, and before any page is reserved for the room. Refused both ways: checksums
            # nobody verifies would only cost P time and suggest a protection that is not there.
            p_side = "checksums its KV" if theirs else "sends no KV checksums"
            d_side = "does not verify them" if theirs else "verifies every pull"
            return (f"prefill {record.instance_id} {p_side}, this decode {d_side}: start P and D "
                    "both with or both without --disaggregation-kv-checksum")
        processes = record.mesh_meta.get("processes", 1)
        if processes != c.nnodes or (processes > 1 and record.tp_size != c.tp_size):
            # Each rank pulls from the P rank in its own place (RFC-2 §6.2): one for one, the
            # same shards on the same places (a one-process D regroups any P tp instead).
            return (f"prefill {record.instance_id} spans {processes} process(es) at tp "
                    f"{record.tp_size}, this decode {c.nnodes} at tp "
                    f"{c.tp_size}: instances spanning processes pair rank for rank")
        return None

    def queue_stats(self, sched: DecodeScheduler) -> dict[str, int]:
        return {
            "recv_queue": len(sched.role.recv_queue),
            "alloc_queue": len(sched.role.alloc_queue),
            "held_rooms": held_rooms(sched),
            "pulls_inflight": sched.role.pull_executor.inflight,
        }

    def admit_job(self, sched: DecodeScheduler, job: GenerateJob, accepted: float) -> None:
        if job.handoff is not None:
            self._admit_handoff(sched, job, job.handoff)
            return
        if job.bootstrap is None:
            # No P leg (a router's conditional disaggregation, or a plain client): D prefills it
            # itself, with its prefix cache if it runs one.
            sched.add_request(request_of(sched, job))
            self.local_prefills_total += 1
            return
        host, port, room = bootstrap_of(self.mode, job)
        if host.startswith(IPC_PREFIX):  # a P on a unix socket alone: known by its endpoint
            sched.role.add_pd_request(request_of(sched, job), host, room, accepted=accepted)
            return
        port = port or self._config.disaggregation_prefill_port
        if port is None:
            reason = (
                "bootstrap_port is null and no --disaggregation-prefill-port default is configured"
            )
            self.refusals.refused(host, room, reason)  # told after our 400 is out
            raise ValueError(reason)
        sched.role.add_pd_request(request_of(sched, job), f"{host}:{port}", room,
                                 accepted=accepted)

    def _admit_handoff(self, sched: DecodeScheduler, job: GenerateJob,
                       ticket: HandoffTicket) -> None:
        if self._spans_processes:
            raise ValueError("this decode instance spans processes: it takes no hand-off")
        assert job.resume is not None  # the schema requires it with handoff
        done = job.resume.output_ids
        if done[-1] != ticket.next_token:
            raise ValueError("hand-off ticket: its next token is not resume's last")
        # The KV covers the prompt and every token but the last, which the next step feeds.
        req = sched.make_request(job.rid, list(job.input_ids), job.sampling,
                                 logprobs=job.logprobs, resume=Resume(done[:-1]))
        sched.role.handoffs.take(req, ticket, job.resume.text_sent)

    # -- live hand-off ---

    def hand_off(self, lease_s: float) -> None:
        """Draining: from the next tick on, hand each running stream that allows it to another
        D (its KV registered for ``lease_s`` at most, counted from now)."""
        if self._spans_processes:
            log.warning("hand-off is not supported across processes: streams finish here")
            return
        self._handoff_until = time.monotonic() + lease_s
        self._streams.wake()

    def release_handoff(self, uuid: int) -> bool:
        """Another D pulled hand-off ``uuid`` (the proxy says so): released on the next tick."""
        self._releases.append(uuid)
        self._streams.wake()
        return True

    def after_run_tick(self, sched: DecodeScheduler) -> None:
        while self._releases:
            sched.role.handoffs.release(self._releases.popleft())
        until = self._handoff_until
        if until is not None and until - time.monotonic() > 0:
            # The streams' earlier outputs are in the tick's result: they go out before the
            # tickets.
            allowed = {s.job.rid for s in list(self._streams.live.values())
                       if s.job.accept_handoff and s.in_scheduler and not s.done}
            self._handed += sched.role.handoffs.hand_off(allowed, until - time.monotonic())

    def after_tick(self, nursery: trio.Nursery) -> None:
        self.refusals.start(nursery)
        handed, self._handed = self._handed, []
        for rid, ticket in handed:
            stream = self._streams.live.get(rid)
            if stream is None:  # its client left meanwhile: the ticket's lease releases it
                continue
            log.info("request %s handed off (KV of %d positions, uuid %d)", rid,
                     ticket.kv_tokens, ticket.uuid)
            stream.put(HandedOff(ticket))
            self._streams.finish(stream, "handed_off")

    # -- an instance spanning processes (pd_ticks.py) ---

    def pulls_ready(self, sched: DecodeScheduler) -> dict[int, str] | None:
        return sched.role.pull_executor.ready()

    def set_pull_gate(self, sched: DecodeScheduler, gate: dict[int, str]) -> None:
        sched.role.set_pull_gate(gate)

    def pulls_under_way(self, sched: DecodeScheduler) -> bool:
        return bool(sched.role.pull_executor.inflight)

    def stats(self, sched: DecodeScheduler | None, pd_stats: Stats) -> Stats:
        out: Stats = {}
        if sched is not None:
            out["recomputed_total"] = sched.role.recomputed
            # Pulls whose KV failed READY's checksums (corrupted in flight) and the second
            # pulls they caused (also under pd_events, without the _total).
            out["kv_checksum_mismatches_total"] = pd_stats.get("kv_checksum_mismatches", 0)
            out["kv_checksum_repulls_total"] = pd_stats.get("kv_checksum_repulls", 0)
            # given / released / expired by this worker, taken (pulled) / take_failed here.
            out["handoffs_total"] = dict(sched.role.handoffs.stats)
        out["refused_rooms_told_total"] = self.refusals.told_total
        out["local_prefills_total"] = self.local_prefills_total
        return out

    def side_port(self) -> int | None:
        return None  # D binds no side-channel socket
