"""Simulated workers that run the **real** PD schedulers (``pd-fsm sim --schedulers real``).

Each worker is a real ``PrefillScheduler`` or ``DecodeScheduler`` on the tiny model (its real JAX
forward, page allocator, prefix cache, gather into packed KV and scatter into the pool), driven
exactly as a worker process drives it: every iteration is ``run_tick``
(``schedulers/disaggregation/tick.py``, what ``pd-fsm serve`` runs on its scheduler thread), on
the virtual clock (each host's own, skew included). What is simulated around them: the side
channel and the registry (the world's), and the transfer server — :class:`SimTransferEngine`
keeps P's registered arrays and hands them, once, to a D that reaches the P process that
registered them; :class:`SimPullExecutor` is the real ``PullExecutor`` (deadline, layout and page
checks, regroup, scatter on the forward thread) with each pull run at a virtual time instead of on
a thread, failing or arriving late as the seed says.

Every answer a client gets with a 200 must equal the colocated tiny model's greedy answer for the
same prompt (:class:`Reference`), so a room's KV landing in the wrong pages, or a stale page
reused, fails the seed; page, registration and room accounting is the schedulers' own.
"""

from __future__ import annotations

import abc
import functools
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, assert_never

import attrs
import jax
import numpy as np

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.tables import KV_RECEIVER
from pd_fsm.jax_engine.sampling.params import SamplingParams
from pd_fsm.jax_engine.transfer.base import (
    KVTransferEngine,
    PendingPull,
    PullError,
    ReleaseResult,
)
from pd_fsm.jax_engine.transfer.pull_executor import PullExecutor, PullRequest, PullResult
from pd_fsm.schedulers import Scheduler, SchedulerArgs
from pd_fsm.schedulers.disaggregation import (
    DecodeRole,
    DecodeScheduler,
    DisaggregationArgs,
    PrefillRole,
    PrefillScheduler,
)
from pd_fsm.schedulers.disaggregation.tick import TickResult, run_tick
from pd_fsm.sim.config import (
    DECODE,
    LEASE,
    PULL_DEADLINE,
    REGISTRY_HEARTBEAT,
    Violation,
    bootstrap_addr,
)
from pd_fsm.sim.workers import Client, Node, ShorteningPrefill, WorldView, live_rooms

PAGE_SIZE = 4
MODEL = "tiny"
VOCAB = 256
MAX_PROMPT = 40  # tokens: short prompts keep a seed's real forwards quick
POOL_PAGES = 96  # per worker, the null page included


def _args(mode: str, name: str, recompute: bool, kv_checksum: bool, stream_tokens: int = 0
          ) -> DisaggregationArgs:
    return DisaggregationArgs(
        model=MODEL, num_pages=POOL_PAGES, page_size=PAGE_SIZE, max_running=8,
        max_batched_tokens=256, context_length=128, disaggregation_mode=mode,
        instance_id=name, lease_initial=LEASE.initial, lease_extension=LEASE.extension,
        heartbeat_interval=DECODE.heartbeat_interval, peer_timeout=DECODE.peer_timeout,
        resolve_timeout=DECODE.resolve_timeout, queue_timeout=DECODE.queue_timeout,
        ready_timeout=DECODE.ready_timeout, transfer_timeout=DECODE.transfer_timeout,
        pull_deadline=PULL_DEADLINE, failure_policy="recompute" if recompute else "fail",
        radix_cache=mode == "prefill", kv_checksum=kv_checksum, stream_tokens=stream_tokens,
    )


def prompt_ids(client: Client) -> list[int]:
    """The client's prompt as tiny-model token ids (a function of its text)."""
    n = max(1, min(client.tokens, MAX_PROMPT))
    seed = sum(ord(c) * (i + 1) for i, c in enumerate(client.text[:64]))
    return [3 + (seed * 7 + i * 31 + client.id) % (VOCAB - 4) for i in range(n)]


def greedy(out: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=out, temperature=0.0, ignore_eos=True)


class Reference:
    """The colocated tiny model's greedy answers, computed once per (prompt, length)."""

    def __init__(self) -> None:
        self._sched = Scheduler(SchedulerArgs(model=MODEL, num_pages=POOL_PAGES,
                                              page_size=PAGE_SIZE, context_length=128,
                                              radix_cache=False))
        self._memo: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}

    def answer(self, ids: Sequence[int], out: int) -> tuple[int, ...]:
        key = (tuple(ids), out)
        if key not in self._memo:
            req = self._sched.make_request("ref", list(ids), greedy(out))
            self._sched.add_request(req)
            tokens: list[int] = []
            for o in self._sched.run_until_idle():
                tokens.extend(o.new_token_ids)
            self._memo[key] = tuple(tokens)
        return self._memo[key]


@functools.cache
def reference() -> Reference:
    return Reference()


# ------------------------------------------------------------------------------ transfer


def corrupted(array: jax.Array, garbage: bool = False) -> jax.Array:
    """A copy of ``array`` damaged as in flight: one bit flipped in its middle byte, the least
    a checksum must catch; or, ``garbage``, its first 4 KiB (the room's first page of layer 0)
    overwritten with 0xFF bytes (NaN in float32), which changes what a model computes from it."""
    host = np.array(array)  # a copy: the pulled array itself stays as it arrived
    raw = host.reshape(-1).view(np.uint8)
    if garbage:
        raw[: 4096] = 0xFF
    else:
        raw[raw.size // 2] ^= 0x10
    damaged: jax.Array = jax.device_put(host, array.sharding)
    return damaged


@attrs.define
class _Pending(PendingPull):
    peer: str
    uuid: int
    arrays: list[jax.Array]
    error: str = ""

    def wait(self) -> None:
        if self.error:
            raise PullError(f"pull of uuid {self.uuid} from {self.peer} failed: {self.error}")


class SimTransferEngine(KVTransferEngine):
    """A process's transfer server: registrations held until released or pulled (once)."""

    def __init__(self, world: WorldView, node: Node, address: str) -> None:
        self.world, self.node, self._address = world, node, address
        self.regs: dict[int, list[jax.Array]] = {}
        self.fail_next: dict[int, str] = {}  # uuid -> the failure the seed drew for its pull

    @property
    def address(self) -> str:
        return self._address

    def register(self, uuid: int, arrays: Sequence[jax.Array], lease_s: float) -> None:
        if uuid in self.regs:
            raise Violation(f"{self.node.name}: uuid {uuid} registered twice")
        self.regs[uuid] = list(arrays)

    def extend_lease(self, uuid: int, lease_s: float) -> bool:
        return uuid in self.regs

    def release(self, uuid: int, reason: str) -> ReleaseResult:
        arrays = self.regs.pop(uuid, None)
        nbytes = sum(int(a.nbytes) for a in arrays or ())
        return ReleaseResult(uuid, arrays is not None, arrays is not None, reason, nbytes, 0.0)

    def reap_expired(self) -> list[ReleaseResult]:
        return []

    def registrations(self) -> dict[int, int]:
        return {u: sum(int(a.nbytes) for a in arrays) for u, arrays in self.regs.items()}

    def start_pull(self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct],
                   deadline_s: float) -> PendingPull:
        source = self.world.transfer_server(peer)
        engine = getattr(source, "engine", None)
        if (source is None or not isinstance(engine, SimTransferEngine)
                or not self.world.network.reachable(self.node.name, source.name)):
            return _Pending(peer, uuid, [], f"connection to {peer} refused")
        arrays = engine.regs.get(uuid)
        if arrays is None:
            return _Pending(peer, uuid, [], f"nothing registered as {uuid}")
        if [a.shape for a in arrays] != [s.shape for s in specs]:
            return _Pending(peer, uuid, [], "shape mismatch")
        # One-shot, as jax.experimental.transfer: pulled means gone from P's table (P still
        # releases it on DONE, which then finds nothing).
        engine.regs[uuid] = []
        return _Pending(peer, uuid, arrays)

    def drop_connection(self, peer: str, reason: str) -> None:
        pass

    def close(self) -> None:
        self.regs.clear()


class SimPullExecutor(PullExecutor):
    """The real executor; each pull runs at a virtual time (its cost, or late or failing as the
    seed draws) on the simulation's thread, not on a thread of its own."""

    def __init__(self, node: RealDecodeWorker, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.node = node
        # uuid -> the pull, its ticket, its start
        self.pending: dict[int, tuple[PullRequest, int, float]] = {}

    def cancel_all(self, reason: str) -> None:
        """The role stops (a switch past its drain deadline): every pull not yet run reports
        failed now, as closing the executor ends its jobs, so the pages it would write into
        are freed by the scheduler's next step."""
        for _uuid, (req, ticket, start) in sorted(self.pending.items()):
            self._done.put((ticket, self._failed(req, start, f"pull cancelled: {reason}")))
        self.pending.clear()

    def submit(self, req: PullRequest) -> None:
        w, node = self.node.world, self.node
        ticket, start = self._accept(req.room)
        took = w.config.cost.pull(node.tokens_of(req.room)) + w.rng.uniform(0.001, 0.005)
        if w.config.faults:
            r = w.rng.random()
            if r < 0.04:
                took = w.rng.uniform(1.0, 2 * PULL_DEADLINE)  # slow: maybe past its deadline
            elif r < 0.07:
                node.failing_pulls.add(req.uuid)
            elif r < 0.13 and w.config.checksums:
                node.corrupt_pulls.add(req.uuid)  # arrives, damaged: only a checksum can tell
        if w.plant("unverified-kv"):
            req = attrs.evolve(req, kv_checksums=())  # the planted bug: nothing is verified
        self.pending[req.uuid] = (req, ticket, start)
        w.at(min(took, PULL_DEADLINE), f"{node.name} pull of room {req.room:x}", self._virtual_run,
             node.gen, req.uuid)

    def drop(self, peer: str) -> None:
        """The engine dropped its connections to ``peer``: every pull on them ends now."""
        for uuid, (req, _, _) in sorted(self.pending.items()):
            if req.peer == peer:
                self.node.world.at(0.0, f"{self.node.name} pull of room {req.room:x} dropped",
                                   self._virtual_run, self.node.gen, uuid,
                                   f"the connection to {peer} was dropped (P lost)")

    def writes_into(self, room: int) -> bool:
        """Whether a job of ``room`` is in flight and not cancelled (its KV may still land)."""
        with self._lock:
            return any(r == room and t not in self._cancelled for t, r in self._jobs.items())

    def pulling_from(self, peer: str) -> list[int]:
        return sorted(req.room for req, _, _ in self.pending.values() if req.peer == peer)

    def _virtual_run(self, gen: int, uuid: int, ended: str = "") -> None:
        """The pull runs now, or ends: ``ended`` says why (its connection dropped, or its
        deadline passed while its P was dead)."""
        node = self.node
        if gen != node.gen or not node.alive or uuid not in self.pending:
            return
        req, ticket, start = self.pending[uuid]
        if not ended and node.world.config.hung_pulls and (
                node.world.transfer_server(req.peer) is None):
            # P died: from a dead host nothing resets the connection, so the pull hangs until
            # its deadline (or until D drops the connection: drop).
            node.world.at(max(0.0, start + self._deadline_s - node.local()),
                          f"{node.name} pull of room {req.room:x} hung", self._virtual_run,
                          gen, uuid, f"timeout after {self._deadline_s:g}s")
            return
        del self.pending[uuid]
        if ended:
            self._done.put((ticket, self._failed(req, start, ended)))
            node.poke()
            return
        pages = req.page_map()
        if self.node.world.plant("kv-pages-reversed") and isinstance(pages, tuple):
            req = attrs.evolve(req, pages=pages[::-1])  # the planted bug
        self._run(ticket, req, start)


# ------------------------------------------------------------------------------ workers


class _RealWorker(Node):
    """What both roles share: the scheduler, its tick on the virtual clock, the legs."""

    mode = ""
    sched: Any

    def __init__(self, world: WorldView, name: str) -> None:
        super().__init__(world, name)
        self.legs: dict[int, tuple[int, Client]] = {}  # room -> (router gen, client)
        self.rid_room: dict[str, int] = {}
        self.inbox: list[tuple[float, Any]] = []
        self.jobs: list[tuple[int, Client, Any]] = []  # (room, client, extra) legs to admit
        self.aborts: list[str] = []
        self.relaying: set[int] = set()  # D's rooms whose answer streams (leg answered 200)
        self._tick_at = math.inf

    @property
    def core(self) -> Any:
        return self.sched.role.link.core

    def poke(self, delay: float = 0.0005) -> None:
        """Run a tick soon (a message, a leg, a pull result arrived)."""
        at = self.world.now + delay
        if at < self._tick_at:
            self._tick_at = at
            self.world.at_time(at, f"{self.name} tick", self._tick, self.gen, at)

    def feed(self, event: Any) -> None:  # the core's next deadline came (Node.schedule_wake)
        self.inbox.append((self.local(), event))
        self.poke(0.0)

    def receive(self, peer: str, message: Any) -> None:
        self.inbox.append((self.local(), ev.MessageReceived(peer, message)))
        self.poke()

    def crash(self) -> None:
        self.alive = False
        self._tick_at = math.inf
        for room, (gen, _) in sorted(self.legs.items()):
            self.world.proxy.leg_answer(gen, room, self.mode, False,
                                        f"{self.mode} connection reset", lost=True)
        self.legs, self.rid_room, self.jobs, self.inbox, self.aborts = {}, {}, [], [], []

    def _restart_books(self) -> None:
        self.gen += 1
        self.alive, self.wake, self._tick_at, self.withdrawn = True, math.inf, math.inf, False
        self.legs, self.rid_room, self.jobs, self.inbox, self.aborts = {}, {}, [], [], []

    def _tick(self, gen: int, at: float) -> None:
        if gen != self.gen or not self.alive or at != self._tick_at:
            return
        self._tick_at = math.inf
        inbox, jobs, aborts = self.inbox, self.jobs, self.aborts
        self.inbox, self.jobs, self.aborts = [], [], []
        ran_before = self.sched.stats()
        try:
            result: TickResult[tuple[int, Client, Any]] = run_tick(
                self.sched, inbox, jobs, aborts, rid=lambda leg: f"room-{leg[0]:x}",
                admit=self._admit, may_abort=lambda rid: rid in self.rid_room,
            )
        except Violation:
            raise
        except Exception as exc:  # a worker's loop would die of it: the seed fails
            raise Violation(f"{self.name}: its tick raised {exc!r}") from exc
        self._carry_out(result)
        for leg, _status, reason in result.refused:
            self._fail_leg(leg[0], reason)
        for leg in result.unstarted:
            self._fail_leg(leg[0], "aborted before it started")
        self._outputs(result)
        if result.forward_work:
            after = self.sched.stats()
            rows = max(after.running, ran_before.running, 1)
            self.poke(self.world.config.cost.step(rows))
        self.schedule_wake(self.sched.role.next_deadline())

    def _carry_out(self, result: TickResult[Any]) -> None:
        w = self.world
        for e in result.outbox:
            match e:
                case fx.SendMessage():
                    w.network.send(self._side_name(), e.peer, e.message)
                case fx.ResolvePeer():
                    w.registry.resolve(self, e.bootstrap_addr)  # type: ignore[arg-type]
                case fx.ForgetPeer():
                    pass  # the modelled side channel keeps nothing per peer
                case _:
                    assert_never(e)

    def _side_name(self) -> str:
        return self.name

    # Each role's own: P and D admit a leg and answer its client differently.
    @abc.abstractmethod
    def _admit(self, leg: tuple[int, Client, Any]) -> None: ...

    @abc.abstractmethod
    def _outputs(self, result: TickResult[Any]) -> None: ...

    def _fail_leg(self, room: int, reason: str) -> None:
        gen_client = self.legs.pop(room, None)
        self.rid_room.pop(f"room-{room:x}", None)
        if gen_client is not None:
            self.world.proxy.leg_answer(gen_client[0], room, self.mode, False, reason)

    def abort(self, room: int) -> None:
        if self.alive and room in self.legs:
            self.aborts.append(f"room-{room:x}")
            self.poke()

    def resolved(self, gen: int, answer: Any) -> None:
        if gen == self.gen and self.alive:
            self.inbox.append((self.local(), answer))
            self.poke()

    def fail_in_flight(self, reason: str) -> None:
        """Every request of the role fails as the worker fails it: legs not yet admitted
        answered, streams mid-relay broken off with ``reason``, every request aborted through
        the scheduler (``abort``: the core's Aborted while its room lives), pulls cancelled;
        then the scheduler's own steps release the rest, here and now."""
        if self.world.plant("switch-leaks"):  # planted bug: the legs answered, nothing freed
            for room in sorted(self.legs):
                self._fail_leg(room, reason)
            self.jobs = []
            return
        for room, _client, _extra in self.jobs:
            self._fail_leg(room, reason)
        self.jobs = []
        for room in sorted(self.relaying):  # the proxy hears the stream break off
            self._fail_leg(room, reason)
            self.relaying.discard(room)
        by_rid = dict(self.rid_room)
        for rid in sorted(by_rid):
            self.sched.abort(rid, reason)
        for room in sorted(self.sched.role.link.core.rooms):  # P's transfers: no rid names them now
            if self.sched.role.link.core.state_of(room) is not None:
                self.sched.role.deliver(ev.Aborted(room, reason))
        self._cancel_pulls(reason)
        for _ in range(4):  # the scheduler's steps: aborts, then the cancelled pulls' reports
            self._tick_at = self.world.now
            self._tick(self.gen, self._tick_at)
            if not self.leftovers(switching=True):
                break

    def _cancel_pulls(self, reason: str) -> None:
        """D's pull executor ends its jobs (P has none)."""

    def leftovers(self, switching: bool = False) -> str:
        s = self.sched
        stats = s.stats()
        rooms = (live_rooms(s.role.link.core, switching) if self.role == "prefill"
                 else sorted(s.role.link.core.rooms))
        parts = [f"rooms {rooms}"] if rooms else []
        if stats.free_pages + stats.cached_pages != stats.total_pages:
            parts.append(f"pages free {stats.free_pages} (+{stats.cached_pages} cached) of "
                         f"{stats.total_pages}")
        held = {u: n for u, n in s.role.engine.registrations().items() if n}
        parts += [f"registrations {sorted(held)}"] if held else []
        parts += [f"legs {sorted(self.legs)}"] if self.legs else []
        parts += ["scheduler busy"] if s.has_forward_work() else []
        return ", ".join(parts)


class RealPrefillWorker(_RealWorker):
    mode = role = "prefill"

    def __init__(self, world: WorldView, name: str) -> None:
        super().__init__(world, name)
        self.advertised = bootstrap_addr(name)
        self.side = f"{self.name}:side"
        self.transfer = ""
        self.engine: SimTransferEngine

    def _side_name(self) -> str:
        return self.side

    def start(self) -> None:
        w = self.world
        self._restart_books()
        self.transfer = f"{self.name}:{17000 + self.gen}"  # a new port per process
        self.engine = SimTransferEngine(w, self, self.transfer)
        role: type[PrefillRole] = PrefillRole
        if w.plant("missing-release-on-done"):
            role = _LeakyPrefill
        elif w.plant("part-leak"):
            role = _PartLeakingPrefill
        self.sched = PrefillScheduler(
            _args("prefill", self.name, w.config.recompute, w.config.checksums,
                  w.config.stream),
            engine=self.engine, clock=self.local, rng=random.Random(w.rng.getrandbits(64)),
            role=role)
        if w.plant("lease-shortens"):  # the planted bug: the same endpoint, shortening leases
            self.sched.role.link.core = ShorteningPrefill(
                self.sched.role.kv_args.layout_hash, random.Random(w.rng.getrandbits(64)), LEASE,
                transfer_addr=self.engine.address, kv_checksum=w.config.checksums)
        w.registry.register(self)  # type: ignore[arg-type]
        w.at(REGISTRY_HEARTBEAT, f"{self.name} registry heartbeat", self._heartbeat, self.gen)

    def _heartbeat(self, gen: int) -> None:
        if gen != self.gen or not self.alive or self.withdrawn:
            return
        self.world.registry.heartbeat(self)  # type: ignore[arg-type]
        self.world.at(REGISTRY_HEARTBEAT, f"{self.name} registry heartbeat", self._heartbeat, gen)

    def leg(self, gen: int, room: int, client: Client, bootstrap: str | None = None) -> None:
        if not self.alive:
            self.world.proxy.leg_answer(gen, room, "prefill", False, "prefill connection refused",
                                        refused=True)
            return
        self.legs[room] = (gen, client)
        self.jobs.append((room, client, None))
        self.poke()

    def _admit(self, leg: tuple[int, Client, Any]) -> None:
        room, client, _ = leg
        req = self.sched.make_request(f"room-{room:x}", prompt_ids(client), greedy(client.out))
        self.sched.role.add_pd_request(req, room, accepted=self.local())
        self.rid_room[req.rid] = room

    def _outputs(self, result: TickResult[Any]) -> None:
        for out in result.outputs:
            if out.finish_reason is None:
                continue
            room = self.rid_room.pop(out.rid, None)
            if room is None:
                continue
            gen_client = self.legs.pop(room, None)
            if gen_client is None:
                continue
            failure = result.failures.get(out.rid)
            ok = failure is None and out.finish_reason.kind != "abort"
            reason = "" if ok else (failure[1] if failure else out.finish_reason.kind)
            self.world.proxy.leg_answer(gen_client[0], room, "prefill", ok, reason)


class RealDecodeWorker(_RealWorker):
    mode = role = "decode"

    def __init__(self, world: WorldView, name: str) -> None:
        super().__init__(world, name)
        self.tokens: dict[int, list[int]] = {}  # room -> output so far
        self.failing_pulls: set[int] = set()  # uuids whose pull the seed made fail
        self.corrupt_pulls: set[int] = set()  # uuids whose pull the seed made arrive damaged

    def start(self) -> None:
        w = self.world
        self._restart_books()
        self.tokens, self.relaying, self.failing_pulls, self.corrupt_pulls = {}, set(), set(), set()
        engine = _FailingPulls(w, self, f"{self.name}:transfer")
        node = self

        double_free = w.plant("double-free")
        ignores_cancel = w.plant("release-without-cancel") or w.plant("held-until-pull-reports")
        held_until_report = w.plant("held-until-pull-reports")
        deferred: set[int] = set()  # the planted held-until-pull-reports: rooms waiting
        pull_failed: set[int] = set()  # rooms whose pull failed (the double-free plant)

        class _Decode(DecodeRole):
            def new_pull_executor(self, on_result: Callable[[int], None] | None
                                  ) -> PullExecutor:
                return SimPullExecutor(node, self.engine, self.sched.kv_holder, self.kv_args,
                                       deadline_s=self.args.pull_deadline, on_result=on_result,
                                       clock=node.local)

            def carry_out(self, e: fx.DecodeEffect) -> int | None:
                if isinstance(e, fx.CancelPull) and ignores_cancel:
                    return e.room  # the planted bug
                if isinstance(e, fx.ReleaseBlocks):
                    executor = self.pull_executor
                    assert isinstance(executor, SimPullExecutor)
                    if held_until_report and executor.writes_into(e.room):
                        deferred.add(e.room)  # the planted bug: freed when it reports
                        return e.room
                    if executor.writes_into(e.room):
                        raise Violation(f"{node.name}: room {e.room:x}'s pages freed while its "
                                        "pull, not cancelled, may still write them")
                req = self.link.req_of.get(getattr(e, "room", -1))
                held = self.held_pages.get(getattr(e, "room", -1)) or (
                    req.pages if req is not None else None)
                room = super().carry_out(e)
                if (isinstance(e, fx.ReleaseBlocks) and held and double_free
                        and e.room in pull_failed):
                    self.sched.page_budget.free(held)  # the planted bug: a failed room's pages
                return room

            def _pulled(self, result: PullResult) -> None:
                if not result.ok:
                    pull_failed.add(result.room)
                super()._pulled(result)
                if result.room in deferred:
                    deferred.discard(result.room)
                    super().carry_out(fx.ReleaseBlocks(result.room))

        self.sched = DecodeScheduler(
            _args("decode", self.name, w.config.recompute, w.config.checksums),
            engine=engine, clock=self.local, on_pull_result=lambda room: node.poke(),
            role=_Decode)
        if w.plant("no-ready-timeout"):  # the planted bug
            self.sched.role.link.core._state_timeout[KV_RECEIVER.S.WAITING_FOR_READY] = math.inf

    def _cancel_pulls(self, reason: str) -> None:
        executor = self.sched.role.pull_executor
        assert isinstance(executor, SimPullExecutor)
        executor.cancel_all(reason)

    def pulling_from(self, transfer_addr: str) -> list[int]:
        """The rooms whose pull from ``transfer_addr`` is in flight (scenarios.py)."""
        executor = self.sched.role.pull_executor
        assert isinstance(executor, SimPullExecutor)
        return executor.pulling_from(transfer_addr)

    def holds_pages(self, room: int) -> bool:
        s = self.sched
        req = s.role.link.req_of.get(room)
        return room in s.role.held_pages or (req is not None and req.pages is not None)

    def tokens_of(self, room: int) -> int:
        gen_client = self.legs.get(room)
        return min(gen_client[1].tokens, MAX_PROMPT) if gen_client else 0

    def leg(self, gen: int, room: int, client: Client, bootstrap: str | None) -> None:
        if not self.alive:
            self.world.proxy.leg_answer(gen, room, "decode", False, "decode connection refused",
                                        refused=True)
            return
        if room in self.legs:
            self.world.proxy.leg_answer(gen, room, "decode", False, f"room {room:x} is live here")
            return
        self.legs[room] = (gen, client)
        self.jobs.append((room, client, bootstrap))
        self.poke()

    def _admit(self, leg: tuple[int, Client, Any]) -> None:
        room, client, bootstrap = leg
        req = self.sched.make_request(f"room-{room:x}", prompt_ids(client), greedy(client.out))
        self.rid_room[req.rid] = room
        if bootstrap is None:  # no bootstrap fields: D prefills it itself
            self.sched.add_request(req)
            return
        self.sched.role.add_pd_request(req, bootstrap, room, accepted=self.local())

    def _outputs(self, result: TickResult[Any]) -> None:
        w = self.world
        for out in result.outputs:
            room = self.rid_room.get(out.rid)
            if room is None or room not in self.legs:
                continue
            gen, client = self.legs[room]
            failure = result.failures.get(out.rid)
            if failure is not None or (out.finish_reason is not None
                                       and out.finish_reason.kind == "abort"):
                self.rid_room.pop(out.rid, None)
                self.tokens.pop(room, None)
                if room in self.relaying:  # the relay breaks off; the proxy knows why
                    self.legs.pop(room)
                    self.relaying.discard(room)
                else:
                    self._fail_leg(room, failure[1] if failure else "aborted")
                continue
            got = self.tokens.setdefault(room, [])
            got.extend(out.new_token_ids)
            if got and room not in self.relaying:
                self.relaying.add(room)
                client.first_at = w.now
                w.proxy.leg_answer(gen, room, "decode", True, "")
            if out.finish_reason is not None:
                self.rid_room.pop(out.rid, None)
                self.legs.pop(room)
                self.relaying.discard(room)
                w.at(0.001, f"{self.name} relays room {room:x}", w.proxy.relayed, gen, room, client,
                     tuple(self.tokens.pop(room)))


class _LeakyPrefill(PrefillRole):
    """Planted bug: the pages of a room whose leg was answered are not freed when the room ends
    (D's DONE, an abort, the lease)."""

    def release_kv(self, room: int, uuid: int | None) -> None:
        if room in self.held_pages:
            if uuid is not None:
                self.release_registration(uuid, "room over")
            del self.held_pages[room]  # the leak
            self.send_queue.pop(room, None)
            return
        super().release_kv(room, uuid)


class _PartLeakingPrefill(PrefillRole):
    """Planted bug: a room's streamed parts stay registered when the room ends."""

    def carry_out(self, e: fx.PrefillEffect) -> int | None:
        if isinstance(e, fx.ReleaseKV) and e.parts:
            e = attrs.evolve(e, parts=())  # the leak
        return super().carry_out(e)


class _FailingPulls(SimTransferEngine):
    """D's engine: a pull the seed made fail fails, whatever P holds; one it made arrive damaged
    hands over a copy of P's first array with its first page overwritten."""

    def start_pull(self, peer: str, uuid: int, specs: Sequence[jax.ShapeDtypeStruct],
                   deadline_s: float) -> PendingPull:
        node = self.node
        assert isinstance(node, RealDecodeWorker)
        if uuid in node.failing_pulls:
            node.failing_pulls.discard(uuid)
            return _Pending(peer, uuid, [], "injected transfer failure")
        pending = super().start_pull(peer, uuid, specs, deadline_s)
        if uuid in node.corrupt_pulls and isinstance(pending, _Pending) and pending.arrays:
            node.corrupt_pulls.discard(uuid)
            first, *rest = pending.arrays
            pending.arrays = [corrupted(first, garbage=True), *rest]
        return pending

    def drop_connection(self, peer: str, reason: str) -> None:
        node = self.node
        assert isinstance(node, RealDecodeWorker)
        if not self.world.plant("held-until-pull-reports"):  # the old D dropped nothing
            executor = node.sched.role.pull_executor
            assert isinstance(executor, SimPullExecutor)
            executor.drop(peer)
