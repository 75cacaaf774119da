"""A worker's role as state that changes at runtime: ``RoleHost``.

The host owns the backend the worker serves with and the core's ``RoleSwitch`` (table
role_switch), and carries out what the machine says, through the one driver step: leave the
registry, refuse new legs (503 + Retry-After), wait for what is in flight (``--drain-timeout``;
past it, fail what is left with a reason naming the switch), stop the old backend (its serve task
cancelled, its scheduler closed: pages, rooms, queues and registrations back to zero), build the
new role's backend from the same loaded weights and start it, registered under the next role
epoch. A new role that fails to start gives way to the old one; if that fails too the host raises
``RoleSwitchFailed`` and the worker exits non-zero.

Nothing compiles at switch time: at start, before the worker says ready, the host builds and
warms a scheduler of every other role in ``--roles`` once and drops it; their executables stay in
the process's tables (``jax_engine/compilation/executables.py``), so the switch's build only
looks them up.
The KV transfer server is the process's for good (JAX has no call that stops one): every PD role
of a switching worker runs on the one engine, which a stopped role leaves with nothing
registered. P's side-channel port is kept too: a worker that is P again is where routers knew it.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio

from pd_fsm.core import effects as fx
from pd_fsm.core import events as ev
from pd_fsm.core.drive import drive
from pd_fsm.core.role_switch import RoleSwitch
from pd_fsm.core.tables import ROLE_SWITCH
from pd_fsm.io_trio.cluster.cpu_placement import ComputePriority, CorePlacement
from pd_fsm.io_trio.worker.backend import RoleBackend, ServeBackend, in_flight
from pd_fsm.io_trio.worker.config import ServeConfig
from pd_fsm.io_trio.worker.drain_gate import DrainDecision, drain_streams
from pd_fsm.io_trio.worker.metrics import RoleSnapshot
from pd_fsm.io_trio.worker.schemas import JsonObject

if TYPE_CHECKING:
    from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader
    from pd_fsm.jax_engine.transfer.base import KVTransferEngine

log = logging.getLogger("pd_fsm.io_trio.worker.roles")

DRAIN_POLL_S = 0.05  # how often a draining role looks whether its work is over
# After the drain deadline failed what was left: how long the aborts get to reach the scheduler
# and the peers (pages freed, ABORTs sent) before the old role is stopped regardless.
STOP_AFTER_FAIL_S = 5.0


class RoleSwitchFailed(RuntimeError):
    """Neither the new role nor the old one could start: the worker cannot serve."""


@attrs.frozen
class SwitchAnswer:
    """What ``POST /switch_role`` answers: an HTTP status and its JSON body (an error's
    message in ``error``)."""

    status: int
    body: JsonObject
    error: str | None = None


@attrs.frozen
class LastSwitch:
    """The last switch's figures once the worker served again (``/server_info``)."""

    outcome: str  # "switched", or "restored": the new role failed to start, the old one serves
    seconds: float  # from the request to serving in the new role
    # From the old role's stop to serving in the new one (building, warming, registering), and
    # the executables compiled or loaded meanwhile: 0 when --roles did its work at start (the
    # drain before it may compile what the old role's last requests needed).
    start_seconds: float
    compiles: int
    failed_in_flight: int  # requests the drain deadline failed


def make_backend(config: ServeConfig, engine: KVTransferEngine | None = None) -> RoleBackend:
    """The backend of ``config``'s role (``--disaggregation-mode``); ``engine``: the transfer
    engine a PD role runs on, shared by every role of a worker that switches (None: its own)."""
    spmd: SpmdLeader | None = None
    if config.nnodes > 1:
        from pd_fsm.io_trio.worker.spmd.leader import SpmdLeader

        spmd = SpmdLeader(config.spmd_addr(), config.nnodes, config.spmd_key())
    if config.disaggregation_mode == "null":
        from pd_fsm.io_trio.worker.colocated import ColocatedBackend

        return ColocatedBackend(
            config.scheduler_args(), max_queued=config.max_queued, warmup=config.warmup,
            spmd=spmd,
        )
    # Imported here: the PD backends bring the transfer engine and the side channel.
    from pd_fsm.io_trio.worker.pd_backends import make_pd_backend

    return make_pd_backend(config, spmd, engine=engine)


def shared_engine(config: ServeConfig) -> KVTransferEngine | None:
    """The one transfer engine of a worker that may switch between roles of which one is P or
    D; None otherwise (a fixed role's scheduler makes its own)."""
    roles = config.role_list
    if len(roles) < 2 or all(r == "null" for r in roles):
        return None
    from pd_fsm.jax_engine.transfer.jax_transfer import JaxTransferKVEngine

    # As the PD schedulers make their own: the core's lease is the one that counts (no reaper).
    return JaxTransferKVEngine(config.public_host, reaper_interval_s=None)


def _side_port(backend: ServeBackend) -> int | None:
    """The port a prefill backend's side channel is bound to (None for any other backend)."""
    if backend.mode != "prefill" or not isinstance(backend, RoleBackend):
        return None
    return backend.side_port()


class RoleHost:
    """The worker's current backend and its role switches (see the module docstring)."""

    def __init__(
        self, config: ServeConfig, backend: ServeBackend, *, engine: KVTransferEngine | None = None,
        live: Callable[[], int] = lambda: 0,
        configure: Callable[[ServeBackend], None] = lambda backend: None,
        drained: Callable[[DrainDecision], None] = lambda decision: None,
    ) -> None:
        """``live``: requests the HTTP layer has in flight; ``configure``: what the worker sets
        on each backend it serves with (its phase histograms); ``drained``: told each switch's
        drain decision (hand off or not: its /metrics counter)."""
        self.config = config
        self.backend = backend
        self.machine = RoleSwitch(config.disaggregation_mode, config.role_list)
        self._engine = engine
        self._live = live
        self._configure = configure
        self._drained = drained
        configure(backend)
        self._nursery: trio.Nursery | None = None
        self._serving: tuple[trio.CancelScope, trio.Event] | None = None
        self._work: deque[fx.StopRole | fx.StartRole] = deque()
        self._withdraw = False
        # RefuseLegs' reason while legs are refused; RefuseSwitch's for the request that asked.
        self.refusing: str | None = None
        self._refused: str | None = None
        self._exit: str | None = None
        self._failed_in_flight = 0
        self._switch_started = 0.0
        self._drain_started = 0.0  # time.monotonic() of the request that began the drain
        self._stopped_at = 0.0
        self._compiles_at_stop = 0
        self.last_switch: LastSwitch | None = None
        self.started = False
        # P's side-channel port once bound: a later P role binds it again.
        self._side_port = config.disaggregation_side_channel_port
        # Its compute threads' priority: a role's (``--role-nice``) or POST /set_nice's.
        self.priority = ComputePriority(config.nice_of(config.disaggregation_mode))
        # Its threads' cores: POST /set_cpus moves them within those it had at start.
        # A worker whose pools are sized to --cpus stays within them (widening buys nothing).
        now = frozenset(os.sched_getaffinity(0))
        at_start = (config.cores_at_start or now) if config.cpus_after_pools else now
        self.cores = CorePlacement(at_start, now)
        # XLA sizes its pools by the affinity when the model loads, after this and before
        # --cpu-pools all|N widens the worker (app.py): the planner splits P from a busy D only
        # when D's pools spin on more than one thread (core/planner.py).
        self.pool_threads = len(now)

    # -- what the HTTP layer reads ----------------------------------------------------------------

    @property
    def role(self) -> str:
        return self.machine.role

    @property
    def epoch(self) -> int:
        return self.machine.epoch

    @property
    def state(self) -> str:
        return self.machine.state

    def bootstrap_port(self) -> int | None:
        """P's bootstrap port (its side-channel port, what routers know it by), when P serves."""
        return _side_port(self.backend) if self.role == "prefill" else None

    def bootstrap_host(self) -> str | None:
        """What routers know P by when its side channel is on a unix socket (its ``ipc://``
        endpoint, with no port), when P serves; None otherwise (its host: the URL's)."""
        return self.config.side_channel_ipc if self.role == "prefill" else None

    # -- running ----------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Compile every other role, then serve the current backend (``started()`` once it
        serves) and whatever switches bring, until cancelled; raises ``RoleSwitchFailed`` when
        no role can start, and whatever a backend's loop raises."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for role in self.machine.roles[1:]:
                await self._compile(role)
            await self._start(self.backend)
            self.started = True
            task_status.started()
            await trio.sleep_forever()

    async def _compile(self, role: str) -> None:
        """Build and warm ``role``'s scheduler once, then drop it: its shapes stay compiled."""
        from pd_fsm.jax_engine.kv.tiered import total_compiles

        before, start = sum(total_compiles()), time.perf_counter()
        backend = self._make(role, 0)
        await trio.to_thread.run_sync(backend.precompile, abandon_on_cancel=True)
        log.info("role %s compiled for a later switch: %d executables in %.1f s", role,
                 sum(total_compiles()) - before, time.perf_counter() - start)

    def _make(self, role: str, epoch: int) -> RoleBackend:
        config = self.config.in_role(role)
        if role == "prefill" and self._side_port:
            config = attrs.evolve(config, disaggregation_side_channel_port=self._side_port)
        backend = make_backend(config, self._engine)
        backend.role_epoch = epoch
        return backend

    async def _start(self, backend: ServeBackend) -> None:
        """Start ``backend``'s serve task; returns once it serves (raises what its start
        raised)."""
        assert self._nursery is not None
        self._configure(backend)
        scope, ended = trio.CancelScope(), trio.Event()

        async def serve(*, task_status: trio.TaskStatus[None]) -> None:
            try:
                with scope:
                    await backend.serve(task_status=task_status)
            finally:
                ended.set()

        await self._nursery.start(serve)
        self.backend, self._serving = backend, (scope, ended)
        self._side_port = _side_port(backend) or self._side_port

    async def _until_ready(self) -> None:
        """A PD role serves once the registry acknowledged its record (``ready()``), as at
        start: routers find it there under its new epoch. No deadline of its own, as at start:
        a registry that never answers leaves the worker unready (and /health 503) either way."""
        while not self.backend.ready():
            await trio.sleep(DRAIN_POLL_S)

    async def _stop(self) -> None:
        """Stop the current backend: its serve task cancelled (it closes its scheduler)."""
        assert self._serving is not None
        scope, ended = self._serving
        scope.cancel()
        with trio.CancelScope(shield=True):
            await ended.wait()
        left = in_flight(self.backend.stats())
        if left:
            log.warning("role %s stopped holding %s", self.role, ", ".join(left))
        # The old scheduler's KV pool (the bulk of its memory) sits in reference cycles: free it
        # before the new role allocates its own, not at some later collection (measured with
        # SmolLM2, 256 pages: without this, resident memory grew by a pool per switch for the
        # first five switches).
        gc.collect()

    # -- a switch --------------------------------------------------------------------------------

    def request(self, role: str) -> SwitchAnswer:
        """``POST /switch_role``: answer at once; a switch runs on in the background."""
        if not self.started or self.machine.state == ROLE_SWITCH.S.FAILED:
            return SwitchAnswer(503, {}, "the worker is not serving yet (or cannot any more)")
        refusal = self.machine.refusal(role)
        if refusal is not None:
            return SwitchAnswer(400, {}, refusal)
        if self.machine.serving and role == self.role:
            return SwitchAnswer(200, {"role": role, "role_epoch": self.epoch, "switched": False})
        source, self._refused = self.role, None
        if self.machine.serving:
            self._switch_started = trio.current_time()
            self._drain_started = time.monotonic()
            self._failed_in_flight = 0
        self._feed(ev.SwitchRequested(role, self.config.drain_timeout))
        if self._refused is not None:
            return SwitchAnswer(409, {}, self._refused)
        assert self._nursery is not None
        self._nursery.start_soon(self._switch)
        log.info("switching role: %s -> %s (role epoch %d next)", source, role, self.epoch + 1)
        return SwitchAnswer(202, {"from": source, "to": role, "role_epoch": self.epoch + 1})

    def _feed(self, event: ev.RoleSwitchEvent) -> None:
        drive(self.machine.handle, event, trio.current_time(), self._carry_out)

    def _carry_out(self, effect: fx.RoleSwitchEffect) -> list[ev.RoleSwitchEvent]:
        match effect:
            case fx.WithdrawRecord():
                self._withdraw = True
            case fx.RefuseLegs():
                self.refusing = effect.reason
            case fx.FailInFlight():
                # Any backend the host built has it; one a test handed in may not.
                backend = self.backend
                n = (backend.fail_in_flight(effect.reason) if isinstance(backend, RoleBackend)
                     else 0)
                self._failed_in_flight += n
                log.warning("switch: the drain deadline passed: %d request(s) failed", n)
            case fx.StopRole() | fx.StartRole():
                self._work.append(effect)
            case fx.AcceptLegs():
                self.refusing = None
                self._accepted(effect)
            case fx.RefuseSwitch():
                self._refused = effect.reason
            case fx.ExitProcess():
                self._exit = effect.reason
        return []

    def _accepted(self, effect: fx.AcceptLegs) -> None:
        from pd_fsm.jax_engine.kv.tiered import total_compiles

        now = trio.current_time()
        self.last_switch = LastSwitch(
            "switched" if effect.role == self.machine.target else "restored",
            now - self._switch_started, now - self._stopped_at,
            sum(total_compiles()) - self._compiles_at_stop, self._failed_in_flight)
        log.info("serving as %s (role epoch %d) %.2f s after the request, %.2f s after the "
                 "old role stopped; %d executables compiled or loaded since it stopped",
                 effect.role, effect.epoch, self.last_switch.seconds,
                 self.last_switch.start_seconds, self.last_switch.compiles)

    def _in_flight(self) -> bool:
        return bool(self._live() or in_flight(self.backend.stats()))

    async def _switch(self) -> None:
        if self._withdraw:
            self._withdraw = False
            await self.backend.withdraw()
        # A D leaving its role hands its streams to other Ds, as on SIGTERM, when another can
        # take them (drain_gate.py): the drain then costs a pull each instead of waiting for
        # every stream to finish.
        self._drained(await drain_streams(self.backend, self.config, self._drain_started,
                                          "switch"))
        while self.machine.state == ROLE_SWITCH.S.DRAINING:
            deadline = self.machine.next_deadline()
            if not self._in_flight():
                self._feed(ev.RoleDrained())
            elif deadline is not None and trio.current_time() >= deadline:
                self._feed(ev.TimeAdvanced())
            else:
                await trio.sleep(DRAIN_POLL_S)
        while self._work:
            effect = self._work.popleft()
            if isinstance(effect, fx.StopRole):
                if self._failed_in_flight:
                    with trio.move_on_after(STOP_AFTER_FAIL_S):
                        while self._in_flight():
                            await trio.sleep(DRAIN_POLL_S)
                await self._stop()
                from pd_fsm.jax_engine.kv.tiered import total_compiles

                self._stopped_at, self._compiles_at_stop = (trio.current_time(),
                                                            sum(total_compiles()))
                continue
            try:
                # Before its backend starts: a D above P on shared cores that becomes P steps
                # back behind the Ds it shares them with.
                self.priority.move_to(self.config.nice_of(effect.role), f"role {effect.role}")
                await self._start(self._make(effect.role, effect.epoch))
                await self._until_ready()
            except Exception as exc:  # a failed build is a row of the table, not a crash
                log.exception("starting role %s failed", effect.role)
                self._feed(ev.RoleStartFailed(f"role {effect.role}: {exc!r}"))
            else:
                self._feed(ev.RoleStarted())
        if self._exit is not None:
            raise RoleSwitchFailed(self._exit)

    # -- what /metrics and /server_info show ------------------------------------------------------

    def snapshot(self) -> RoleSnapshot:
        return RoleSnapshot(self.role, self.epoch, self.machine.roles,
                            dict(self.machine.outcomes))

    def info(self) -> JsonObject:
        last = self.last_switch
        return {
            "disaggregation_mode": self.role,
            "role_epoch": self.epoch,
            "roles": list(self.machine.roles),
            "role_state": self.state,
            "nice": self.priority.nice,
            "cpus": sorted(self.cores.cpus),
            "cpu_pool_threads": self.pool_threads,
            "prefill_bootstrap_port": self.bootstrap_port(),
            "prefill_bootstrap_host": self.bootstrap_host(),
            "last_role_switch": None if last is None else attrs.asdict(last),
        }
