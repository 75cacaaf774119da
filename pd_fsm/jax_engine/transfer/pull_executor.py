"""D's pull executor: a bounded thread pool running pull -> readiness wait, then the scatter and
the report on the thread that runs the forward steps.

A pull thread only pulls: once the KV has arrived it queues the pulled arrays and is free for the
next pull. :meth:`PullExecutor.poll` / :meth:`PullExecutor.get`, called by the scheduler between
two steps (on the thread that dispatches them), scatter everything queued with one hold of the
holder's lock, dispatching the copies without waiting for them: the next step runs on the pool
they return, so JAX orders it after them. Each job ends in exactly one :class:`PullResult` (a
plain frozen value the scheduler turns into a core event). ``on_result(room)`` is called on the
pull thread when a job is ready to collect, to wake the scheduler.

Why not scatter on the pull thread: measured under 6 and 16 concurrent requests
(``bench/RESULTS_pulls.md``), a scatter dispatched from a pull thread while a step ran was
ordered after the whole step and blocked its thread (and the lock) until its copy had run:
scatter p99 ~470 ms against a 177 ms step, and pulls queued for a free thread behind scatters.

With READY's checksums (``PullRequest.kv_checksums``, ``--disaggregation-kv-checksum``) the pull
thread checks every pulled array against P's checksum of what it registered before the KV is
queued for its scatter (:mod:`~pd_fsm.jax_engine.kv.checksum`): KV corrupted in flight is
reported (``PullResult.checksum_mismatch``) and never written into the room's pages, which stay as
they were, so the room can be pulled again into them.

Nothing waits without a deadline: the layout hash is compared before anything is pulled; the pull
and readiness wait are bounded by the engine (which polls ``is_ready()`` against the deadline and,
on a timeout or failure, retires the peer's connection so the next pull connects afresh); the
scatter waits for the holder's lock at most ``SCATTER_LOCK_S``. The scatter goes through
:class:`~pd_fsm.jax_engine.kv.holder.KVCacheHolder`, so it never races a forward step (DESIGN §6).

A room that fails while its pull is in flight (P lost, the client gone) gets its pages back at
once: :meth:`PullExecutor.cancel` marks the room's jobs under the holder's lock, and the scatter
asks for that mark under the same lock just before it copies, so once ``cancel`` has returned no
copy into the room's pages can start (one under way has been dispatched first, and JAX orders a
later owner's writes after it). The pulled arrays are a buffer of the job's own until then, so
the pages are free to go. A cancelled job not started yet never starts (no connection is opened
to a P that is gone); one under way runs to its own end, bounded by its deadline, or sooner when
the engine drops the dead P's connection; either way it reports once, ``cancelled``, with
nothing scattered (KV that arrived is ``dropped``).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import jax

from pd_fsm.jax_engine.kv.checksum import kv_checksum
from pd_fsm.jax_engine.kv.gather_scatter import ScatterMethod, validate_pages
from pd_fsm.jax_engine.kv.holder import KVCacheHolder
from pd_fsm.jax_engine.kv.pool_spec import KVArgs
from pd_fsm.jax_engine.kv.room import RoomPages, ScatterSkipped, pages_by_pool, scatter_rooms
from pd_fsm.jax_engine.parallel.tensor_parallel import (
    TensorParallelError,
    packed_sharding,
    process_shards,
    regroup,
    shard_structs,
)
from pd_fsm.jax_engine.transfer.base import KVTransferEngine, PullError, PullTimeout
from pd_fsm.jax_engine.transfer.thread_priority import raise_this_thread

log = logging.getLogger(__name__)

_MIN_PULL_S = 0.05  # the least time left worth starting a pull with
# The scatter runs between two steps on the thread that runs them, so the lock is free then; the
# bound only guards against a caller on another thread holding it.
SCATTER_LOCK_S = 5.0


def _frozen_pages(value: Mapping[str, Sequence[int]] | Sequence[int]) -> object:
    if isinstance(value, Mapping):
        return tuple(sorted((k, tuple(int(i) for i in v)) for k, v in value.items()))
    return tuple(int(i) for i in value)


@attrs.frozen
class PullRequest:
    """Pull ``uuid`` from ``peer`` (P's transfer address) into ``pages`` (one sequence for every
    pool, or pool name -> pages as pairs), after checking P's ``remote_layout_hash``."""

    room: int
    uuid: int
    peer: str
    pages: tuple[int, ...] | tuple[tuple[str, tuple[int, ...]], ...] = attrs.field(
        converter=_frozen_pages
    )
    remote_layout_hash: str
    deadline_s: float | None = None  # None: the executor's default
    kv_shards: int = 1  # arrays per pool P registered (READY's kv_shards), regrouped here
    # P's checksum of each array it registered, pools in wire order, shards within each (READY's
    # kv_checksums); () verifies nothing.
    kv_checksums: tuple[int, ...] = ()

    def page_map(self) -> Mapping[str, Sequence[int]] | Sequence[int]:
        if self.pages and isinstance(self.pages[0], tuple):
            return dict(self.pages)
        return self.pages  # type: ignore[return-value]


@attrs.frozen
class PullResult:
    room: int
    uuid: int
    ok: bool
    reason: str
    bytes: int
    seconds: float  # submit -> this result (everything the job took)
    peer: str = ""
    # Where the time went (0 for a step not reached): submit -> KV ready (a wait for a free
    # thread included; with checksums, ready means verified), start_pull -> KV arrived (the
    # transfer alone), the scatter.
    pull_seconds: float = 0.0
    transfer_seconds: float = 0.0
    scatter_seconds: float = 0.0
    # Iterations of D's loop that ended between the KV's arrival and its scatter: 1 = it waited
    # for the step in flight, 0 = it arrived between two steps (-1: no scatter, or not counted).
    scatter_iterations: int = -1
    # The KV arrived but failed P's checksums (``reason`` says which array): nothing scattered.
    checksum_mismatch: bool = False
    # The room failed while this job was in flight (PullExecutor.cancel): nothing was
    # scattered; ``reason`` says what became of the pull, and ``dropped`` whether its KV had
    # arrived, and was thrown away.
    cancelled: bool = False
    dropped: bool = False


class _NotPulled(Exception):
    """A step of a pull job that cannot go on: ``reason`` is the failed PullResult's."""

    def __init__(self, reason: str, checksum_mismatch: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.checksum_mismatch = checksum_mismatch


@attrs.frozen
class _Pulled:
    """A pull whose KV has arrived, waiting for the forward thread to scatter it."""

    req: PullRequest
    start: float  # submit
    ready: float  # KV ready
    ready_iteration: int  # loop iterations ended when the KV was ready
    transfer_seconds: float
    arrays: tuple[Any, ...]  # the pulled jax.Arrays, one per pool
    pages: RoomPages
    nbytes: int


# A finished job: its ticket, and a result (a refusal or a failed pull) or KV still to scatter.
_Done = tuple[int, PullResult | _Pulled]


def _room(done: _Done) -> int:
    item = done[1]
    return item.req.room if isinstance(item, _Pulled) else item.room


class PullExecutor:
    """Runs pulls for D on at most ``max_workers`` threads."""

    def __init__(
        self,
        engine: KVTransferEngine,
        holder: KVCacheHolder,
        kv_args: KVArgs,
        *,
        max_workers: int = 2,
        deadline_s: float = 30.0,
        on_result: Callable[[int], None] | None = None,
        scatter_method: ScatterMethod | None = None,
        clock: Callable[[], float] = time.monotonic,
        iterations: Callable[[], int] = lambda: -1,
        thread_nice: int = 0,
        peer_for: Callable[[str], str] | None = None,
    ) -> None:
        """``iterations``: how many iterations of the forward thread's loop have ended; read on
        the pull threads, so it must return a value the loop publishes (an int it rebinds).
        ``thread_nice``: the pull threads' nice value (< 0 raises them above compute, where
        allowed; thread_priority.py). ``peer_for(transfer_addr)``: where this process pulls
        what READY says is at ``transfer_addr`` (a rank > 0 of an instance spanning processes:
        the P rank it pairs with, RFC-2 §6.2); called on the pull thread, raises
        ``PullError``."""
        self._engine = engine
        self._holder = holder
        self._kv_args = kv_args
        self._deadline_s = deadline_s
        self._on_result = on_result
        # None: scatter_rooms takes this backend's (Pallas on a TPU), as D's warm-up did.
        self._method = scatter_method
        self._clock = clock
        self._iterations = iterations
        self._peer_for = peer_for
        # Finished jobs taken off ``_done`` by ready() and not yet collected (forward thread).
        self._held: list[_Done] = []
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="kv-pull",
            initializer=raise_this_thread, initargs=(thread_nice,),
        )
        self._closed = False
        self._lock = threading.Lock()
        self._tickets = itertools.count()
        self._jobs: dict[int, int] = {}  # ticket -> room: every job from submit to collection
        # Tickets of cancelled jobs not collected yet; added to with the holder's lock held
        # too, so the scatter's check under that lock sees every cancel that returned.
        self._cancelled: set[int] = set()
        with holder.locked() as kv:
            # Pulled arrays land where the pool lives.
            self._sharding = {
                p.name: packed_sharding(kv[p.name][0].sharding) for p in kv_args.pools
            }
            self._num_pages = {p.name: kv[p.name][0].shape[0] for p in kv_args.pools}

    @property
    def inflight(self) -> int:
        """Jobs submitted and not collected yet (cancelled ones included)."""
        with self._lock:
            return len(self._jobs)

    @property
    def cancelled_inflight(self) -> int:
        """Of ``inflight``, the jobs of rooms that failed meanwhile (``cancel``)."""
        with self._lock:
            return len(self._cancelled)

    def submit(self, req: PullRequest) -> None:
        ticket, start = self._accept(req.room)
        self._pool.submit(self._run, ticket, req, start)

    def _accept(self, room: int) -> tuple[int, float]:
        """Count a job in: its ticket, and when its deadline starts. It runs from here, not from
        when a worker thread takes the job, so that a job queued behind slow pulls still ends
        within the core's transfer backstop (transfer_timeout > pull_deadline)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("pull executor closed")
            ticket = next(self._tickets)
            self._jobs[ticket] = room
        return ticket, self._clock()

    def cancel(self, room: int) -> int:
        """``room`` failed while its pull is in flight: from now on none of its jobs' KV is
        scattered, nor is a job of it not started yet started; each still reports once, with
        ``cancelled`` set. Takes the holder's lock (at most ``SCATTER_LOCK_S``: TimeoutError),
        so that a scatter under way has been dispatched when this returns, and none starts
        after. How many jobs of the room were in flight."""
        with self._holder.locked(timeout=SCATTER_LOCK_S), self._lock:
            tickets = [t for t, r in self._jobs.items() if r == room]
            self._cancelled.update(tickets)
        return len(tickets)

    def _take_done(self) -> None:
        while True:
            try:
                self._held.append(self._done.get_nowait())
            except queue.Empty:
                return

    def ready(self) -> dict[int, str]:
        """Rooms whose job has finished and waits to be collected: "" if its KV arrived, else
        why it failed (non-blocking; the forward thread's, like :meth:`poll`)."""
        self._take_done()
        return {_room(d): "" if isinstance(d[1], _Pulled) else d[1].reason for d in self._held}

    def poll(self, only: Mapping[int, str] | None = None) -> list[PullResult]:
        """Every job finished so far (non-blocking), pulled KV scattered first. Call between two
        forward steps, on the thread that runs them.

        ``only``: collect just these rooms (room -> "" or why the room failed elsewhere: its
        pulled KV is then dropped, not scattered, and the room fails with that reason). Every
        rank of an instance spanning processes collects the same rooms in the same tick, since
        the scatter is one computation over all of them."""
        self._take_done()
        if only is None:
            items, self._held = self._held, []
            return self._finish(items)
        items = [i for i in self._held if _room(i) in only]
        self._held = [i for i in self._held if _room(i) not in only]
        for n, (ticket, item) in enumerate(items):
            if isinstance(item, _Pulled) and only[item.req.room]:
                items[n] = ticket, self._failed(item.req, item.start, only[item.req.room])
        return self._finish(items)

    def get(self, timeout: float) -> PullResult | None:
        """The next finished job (scattered, if it pulled), or None after ``timeout`` seconds;
        same thread rule as :meth:`poll`."""
        if self._held:
            return self._finish([self._held.pop(0)])[0]
        try:
            item = self._done.get(timeout=timeout)
        except queue.Empty:
            return None
        return self._finish([item])[0]

    def _finish(self, items: list[_Done]) -> list[PullResult]:
        pulled = [(t, item) for t, item in items if isinstance(item, _Pulled)]
        found: list[Exception | None] = []
        if pulled:
            # Asked under the holder's lock, as cancel() marks: a cancelled room's KV is
            # dropped here, never copied into pages that may be another room's by now.
            cancelled = self._cancelled
            try:
                found = scatter_rooms(
                    self._holder, self._kv_args, [(p.arrays, p.pages) for _, p in pulled],
                    method=self._method, lock_timeout_s=SCATTER_LOCK_S,
                    keep=lambda i: pulled[i][0] not in cancelled,
                )
            except TimeoutError as exc:
                found = [exc] * len(pulled)
        errors = iter(found)  # one per pulled item, in the order of ``items``
        scattered = self._clock()
        iteration = self._iterations()
        with self._lock:
            late = {t for t, _ in items if t in self._cancelled}
            for t, _ in items:
                self._jobs.pop(t, None)
                self._cancelled.discard(t)
        results = []
        for ticket, item in items:
            if isinstance(item, PullResult):
                results.append(attrs.evolve(item, cancelled=True) if ticket in late else item)
                continue
            error = next(errors)
            if isinstance(error, ScatterSkipped):
                results.append(attrs.evolve(
                    self._failed(item.req, item.start, "cancelled: the room failed while its KV "
                                 "was pulled; the KV was dropped, not scattered"),
                    cancelled=True, dropped=True))
                continue
            if error is not None:
                log.warning("scatter for room %d failed: %r", item.req.room, error)
            results.append(PullResult(
                item.req.room, item.req.uuid, error is None,
                "ok" if error is None else f"scatter: {error}",
                item.nbytes if error is None else 0, scattered - item.start, item.req.peer,
                pull_seconds=item.ready - item.start,
                transfer_seconds=item.transfer_seconds,
                scatter_seconds=scattered - item.ready,
                scatter_iterations=(
                    iteration - item.ready_iteration if item.ready_iteration >= 0 else -1
                ),
                cancelled=ticket in late,
            ))
        return results

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _run(self, ticket: int, req: PullRequest, start: float) -> None:
        try:
            done = self._pull(ticket, req, start)
        except Exception as e:  # a job must always report, whatever broke
            log.exception("pull job for room %d", req.room)
            done = self._failed(req, start, f"internal error: {type(e).__name__}: {e}")
        self._done.put((ticket, done))
        if self._on_result is not None:
            try:
                self._on_result(req.room)
            except Exception:
                log.exception("pull result callback")

    def _failed(
        self, req: PullRequest, start: float, reason: str, checksum_mismatch: bool = False
    ) -> PullResult:
        return PullResult(req.room, req.uuid, False, reason, 0, self._clock() - start, req.peer,
                          checksum_mismatch=checksum_mismatch)

    def _pull(self, ticket: int, req: PullRequest, start: float) -> PullResult | _Pulled:
        """One job, on a pull thread: check, pull, verify and regroup; or why not."""
        try:
            with self._lock:
                cancelled = ticket in self._cancelled
            if cancelled:  # the room failed while the job was queued
                raise _NotPulled("cancelled before it started (the room failed); not pulled")
            pages, deadline_s = self._checked(req, start)
            mine, specs, peer = self._what_to_pull(req, pages)
            nbytes = sum(p.packed_nbytes(len(pages[p.name])) for p in self._kv_args.pools)
            pulled, started, arrived = self._transfer(req, start, peer, specs, deadline_s)
            if req.kv_checksums:
                # Here, on the pull thread, before anything reaches the scatter: corrupted KV
                # is never written into the room's pages.
                wrong = self._checksum_mismatch(req.kv_checksums, pulled, mine, req.kv_shards)
                if wrong:
                    raise _NotPulled(wrong, checksum_mismatch=True)
        except _NotPulled as no:
            return self._failed(req, start, no.reason, no.checksum_mismatch)
        # Ready to scatter (verified, when checked): the pull phase ends here.
        ready, ready_iteration = self._clock(), self._iterations()
        return _Pulled(
            req, start, ready, ready_iteration, arrived - started,
            self._regrouped(pulled, len(mine), req.kv_shards), pages, nbytes,
        )

    def _checked(self, req: PullRequest, start: float) -> tuple[dict[str, tuple[int, ...]], float]:
        """The room's pages by pool and the pull's deadline, once the request can be pulled:
        the same layout as P's, pages in range, time left and a checksum per array."""
        if req.remote_layout_hash != self._kv_args.layout_hash:
            raise _NotPulled(f"layout mismatch: local {self._kv_args.layout_hash}, "
                             f"peer {req.remote_layout_hash}; not pulled")
        pages = pages_by_pool(self._kv_args, req.page_map())
        try:
            for name, ids in pages.items():
                validate_pages(ids, self._num_pages[name])
        except ValueError as e:
            raise _NotPulled(f"bad destination pages: {e}; not pulled") from None
        deadline_s = self._deadline_s if req.deadline_s is None else req.deadline_s
        left = deadline_s - (self._clock() - start)
        # A pull left with a sliver of its deadline (queued behind hung ones) cannot finish: do
        # not start it (and do not open a connection) only to time it out.
        if left <= min(_MIN_PULL_S, deadline_s / 10):
            raise _NotPulled(
                f"not started within the {deadline_s:g}s deadline (queued); not pulled")
        registered = len(self._kv_args.pools) * req.kv_shards
        if req.kv_checksums and len(req.kv_checksums) != registered:
            raise _NotPulled(f"READY carries {len(req.kv_checksums)} KV checksums for "
                             f"{registered} registered arrays; not pulled")
        return pages, deadline_s

    def _what_to_pull(
        self, req: PullRequest, pages: Mapping[str, Sequence[int]]
    ) -> tuple[list[int], list[jax.ShapeDtypeStruct], str]:
        """Which of P's shards this process pulls, their shapes, and the P rank to pull from."""
        shards = req.kv_shards
        try:
            # All of P's shards, or in an instance spanning processes those on our devices
            # (what the P rank we pair with registered).
            mine = process_shards(shards, next(iter(self._sharding.values())))
            specs = [
                struct
                for p in self._kv_args.pools
                for j, struct in enumerate(shard_structs(
                    p.packed_shape(len(pages[p.name])), jax.numpy.dtype(p.dtype), shards,
                    self._sharding[p.name],
                ))
                if j in mine
            ]
            peer = req.peer if self._peer_for is None else self._peer_for(req.peer)
        except TensorParallelError as e:
            raise _NotPulled(f"cannot regroup P's KV: {e}; not pulled") from None
        except PullError as e:
            raise _NotPulled(f"no P rank to pair with: {e}; not pulled") from None
        return mine, specs, peer

    def _transfer(self, req: PullRequest, start: float, peer: str,
                  specs: list[jax.ShapeDtypeStruct],
                  deadline_s: float) -> tuple[list[jax.Array], float, float]:
        """The pulled arrays, when the pull started and when it arrived."""
        left = deadline_s - (self._clock() - start)  # the pairing lookup may have taken some
        try:
            started = self._clock()
            pending = self._engine.start_pull(peer, req.uuid, specs, left)
            pending.wait()
        except PullTimeout as e:
            raise _NotPulled(f"timeout after {deadline_s:g}s: {e}") from None
        except PullError as e:
            raise _NotPulled(str(e)) from None
        arrived = self._clock()
        return list(pending.arrays), started, arrived

    def _regrouped(self, pulled: list[jax.Array], n: int, shards: int) -> tuple[jax.Array, ...]:
        """P's shards onto our own devices, ``n`` pulled arrays per pool: dispatched here, on
        the pull thread (no copy at all when P's tp equals ours)."""
        return tuple(
            regroup(pulled[i * n : (i + 1) * n], self._sharding[p.name], shards)
            for i, p in enumerate(self._kv_args.pools)
        )

    def _checksum_mismatch(
        self, expected: tuple[int, ...], pulled: list[Any], mine: list[int], shards: int
    ) -> str:
        """"" when every pulled array sums to what P registered, else what differs. ``pulled``
        holds this process's shards (``mine``) of each pool, pools in wire order, as P
        registered them (pool-major)."""
        pools = self._kv_args.pools
        for k, array in enumerate(pulled):
            pool, shard = divmod(k, len(mine))
            index = pool * shards + mine[shard]
            got = kv_checksum(array)
            if got != expected[index]:
                return (f"KV checksum mismatch: array {index} ({pools[pool].name}, shard "
                        f"{mine[shard]}) sums to {got:#010x} here, {expected[index]:#010x} on P")
        return ""
