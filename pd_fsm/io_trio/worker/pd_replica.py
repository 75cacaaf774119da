"""A rank > 0 of a prefill or decode instance that spans processes (RFC-2 §6.2's N:N pairing).

Rank 0 runs the PD protocol: HTTP, the side channel, the registry entry routers see. Every other
rank runs a replica of rank 0's PD scheduler and the same tick (``run_tick``) on the inputs rank 0
sends (``TickStarted``: its clock, side-channel and registry arrivals, legs and aborts), so the
replicas take the same decisions and launch the same sharded computations. The KV moves rank to
rank, never through rank 0:

* a P rank registers its own shards of a room's KV on its own transfer server, under the uuid
  rank 0's core drew (the same on every rank: ``tick_inputs``), and registers that server with
  the registry under the instance's entry address and its own ``tp_rank``;
* a D rank pulls its shards from the P rank in its own place, found by ``GET /route`` with its
  full rank tuple (:class:`RankPairing`), and reports to rank 0 when they have arrived; rank 0
  lets every rank scatter a room's KV in the same tick only once every rank has it.

After each tick the replica's state must equal rank 0's (``fingerprint``): a replica that drifts
leaves with :class:`~pd_fsm.io_trio.worker.spmd.follower.Divergence` rather than compute
something else. Its outputs and I/O effects are rank 0's business and are dropped here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic

import attrs
import trio

from pd_fsm.io_trio import strict_json
from pd_fsm.io_trio.bootstrap.client import BootstrapClient, BootstrapError
from pd_fsm.io_trio.bootstrap.records import (
    InstanceRecord,
    rank_query,
    record_from_json,
)
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.pd_adapter import S
from pd_fsm.io_trio.worker.pd_backends import PDBackend, PrefillBackend, make_pd_backend
from pd_fsm.io_trio.worker.pd_ticks import fingerprint, job_of
from pd_fsm.io_trio.worker.spmd.follower import Divergence, follow
from pd_fsm.io_trio.worker.spmd.frames import Announced, Frame, PullReported, TickStarted
from pd_fsm.jax_engine.transfer.base import PullError
from pd_fsm.schedulers.disaggregation.decode import DecodeRole
from pd_fsm.schedulers.disaggregation.tick import run_tick

log = logging.getLogger("pd_fsm.io_trio.worker.spmd")

PAIRING_TIMEOUT_S = 10.0  # a P rank registers just after its rank 0 is ready: wait that long
PAIRING_RETRY_S = 0.2


def first_tp_rank(config: ServeConfig) -> int:
    """The rank tuple's ``tp_rank`` of this process: its first device's place in the mesh."""
    return config.node_rank * (config.tp_size // config.nnodes)


class RankPairing:
    """A D rank's way to the P rank it pairs with (``decode.PeerPairing``): from the transfer
    address READY named (P's rank 0), P's entry in the registry, then ``GET /route`` with this
    rank's full rank tuple. Called on pull threads; the lookups run on the process's trio loop."""

    def __init__(self, client: BootstrapClient, config: ServeConfig,
                 token: trio.lowlevel.TrioToken) -> None:
        self._client = client
        self._tp_rank = first_tp_rank(config)
        self._tp_size = config.tp_size
        self._token = token
        self._known: dict[str, str] = {}  # P rank 0's transfer address -> our P rank's

    def paired(self, transfer_addr: str) -> str:
        known = self._known.get(transfer_addr)
        if known is not None:
            return known
        deadline = time.monotonic() + PAIRING_TIMEOUT_S
        while True:
            try:
                found = trio.from_thread.run(self._lookup, transfer_addr, trio_token=self._token)
            except BootstrapError as exc:
                if time.monotonic() > deadline:
                    raise PullError(str(exc)) from None
                time.sleep(PAIRING_RETRY_S)
                continue
            self._known[transfer_addr] = found
            return found

    async def _lookup(self, transfer_addr: str) -> str:
        with trio.fail_after(PAIRING_TIMEOUT_S):
            entries = [r for r in await self._client.list("prefill")
                       if r.transfer_addr == transfer_addr and r.tp_rank == 0]
            if not entries:
                raise BootstrapError(f"no prefill registered with transfer address "
                                     f"{transfer_addr}")
            entry = entries[0]
            host, port = entry.known_as
            records = [r for r in await self._client.resolve(host, port, "prefill",
                                                             rank_query(self._tp_rank))
                       if r.instance_id == entry.instance_id]
        if not records:
            raise BootstrapError(f"prefill {entry.instance_id} has no tp_rank {self._tp_rank}")
        if records[0].tp_size != self._tp_size:
            raise BootstrapError(f"prefill {entry.instance_id} is tp {records[0].tp_size}, "
                                 f"this decode tp {self._tp_size}")
        return records[0].transfer_addr

    def forget(self, transfer_addr: str) -> str | None:
        return self._known.pop(transfer_addr, None)


class PDReplica(Generic[S]):
    """Rank 0's frames applied to this rank's PD scheduler (``follower.Replica``)."""

    def __init__(self, backend: PDBackend[S], sched: S, rank: int,
                 announced: Callable[[InstanceRecord], None] | None = None) -> None:
        """``announced(record)``: called with rank 0's registry record (P: register ours)."""
        self._backend: PDBackend[S] = backend
        self._sched: S = sched
        self._rank = rank
        self._announced = announced
        self._fingerprint = ""
        self._reported: set[int] = set()  # rooms whose finished pull rank 0 was told of

    def apply(self, frame: Frame) -> None:
        if isinstance(frame, Announced):
            try:
                record = record_from_json(strict_json.loads(frame.record, what="record"))
            except ValueError as exc:  # json's, and RecordError's (a ValueError)
                raise Divergence(f"rank 0's registry record is unreadable: {exc}") from None
            if self._announced is not None:
                self._announced(record)
            return
        if not isinstance(frame, TickStarted):
            raise Divergence(f"a PD rank cannot apply {type(frame).__name__}")
        if frame.fingerprint != self._fingerprint:
            raise Divergence(f"before tick {frame.tick} rank 0's state was {frame.fingerprint}, "
                             f"this rank's {self._fingerprint}")
        sched = self._sched
        inputs = self._backend.tick_inputs
        assert inputs is not None  # a replica's backend is built with them
        inputs.start(frame.tick, frame.now)
        role = sched.role
        if isinstance(role, DecodeRole):
            gate = {p.room: p.failure for p in frame.pulls}
            missing = set(gate) - self._reported
            if missing:
                raise Divergence(f"rank 0 collects pulls {sorted(missing)} this rank never had")
            self._reported -= set(gate)
            role.set_pull_gate(gate)
        backend = self._backend
        run_tick(
            sched, [(a.arrived, a.event) for a in frame.arrivals], list(frame.legs),
            list(frame.aborts), rid=lambda leg: leg.rid,
            admit=lambda leg: backend.admit_job(sched, job_of(leg), leg.accepted),
        )
        self._fingerprint = fingerprint(sched)

    def reports(self) -> list[PullReported]:
        role = self._sched.role
        if not isinstance(role, DecodeRole):
            return []
        out = []
        for room, why in role.pull_executor.ready().items():
            if room not in self._reported:
                self._reported.add(room)
                out.append(PullReported(self._rank, room, not why, why))
        return out

    def waiting(self) -> bool:
        role = self._sched.role
        return isinstance(role, DecodeRole) and role.pull_executor.inflight > len(self._reported)


async def run_replica(config: ServeConfig, key: bytes | None) -> int:
    """A rank > 0 of a prefill or decode instance, until rank 0 stops (0) or it cannot follow
    rank 0 (1). Its trio loop runs the registry client; the replica runs on a thread."""
    c = config
    client = BootstrapClient(
        c.bootstrap_url,
        secret=c.cluster_secret(),
        heartbeat_interval=c.disaggregation_bootstrap_heartbeat_interval,
        stale_after=c.disaggregation_bootstrap_heartbeat_ttl, tls=c.tls,
    )
    token = trio.lowlevel.current_trio_token()
    pairing = RankPairing(client, c, token) if c.disaggregation_mode == "decode" else None
    backend = make_pd_backend(c, pairing=pairing)
    # Dispatched by role: the replica is typed by its scheduler's.
    if isinstance(backend, PrefillBackend):
        return await _follow(c, key, client, token, backend)
    return await _follow(c, key, client, token, backend)


async def _follow(config: ServeConfig, key: bytes | None, client: BootstrapClient,
                  token: trio.lowlevel.TrioToken, backend: PDBackend[S]) -> int:
    c = config
    sched = await trio.to_thread.run_sync(backend.build_scheduler)
    try:
        async with client, trio.open_nursery() as nursery:

            def announced(entry: InstanceRecord) -> None:
                if c.disaggregation_mode != "prefill":
                    return  # nothing looks a D rank up
                client.record = attrs.evolve(
                    entry, tp_rank=first_tp_rank(c), transfer_addr=sched.role.engine.address,
                    layout_hash=sched.role.kv_args.layout_hash,
                )
                log.info("registering rank %d's transfer server %s as tp_rank %d", c.node_rank,
                         sched.role.engine.address, first_tp_rank(c))
                trio.from_thread.run_sync(lambda: nursery.start_soon(client.run),
                                          trio_token=token)

            replica = PDReplica(backend, sched, c.node_rank, announced)
            log.info("rank %d ready: following rank 0 at %s", c.node_rank, c.spmd_addr())
            code: int = await trio.to_thread.run_sync(
                lambda: follow(replica, c.spmd_addr(), c.node_rank, key))
            nursery.cancel_scope.cancel()  # deregisters (BootstrapClient.run's finally)
    finally:
        if isinstance(sched.role, DecodeRole):
            sched.role.close()
        sched.role.engine.close()
    return code
