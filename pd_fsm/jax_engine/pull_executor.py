"""D's pull executor: a bounded thread pool running pull -> readiness wait -> scatter -> report.

Each job ends in exactly one :class:`PullResult` (a plain frozen value the scheduler turns into a
core event), delivered to ``on_result`` (called on the worker thread) and to a thread-safe queue the
scheduler drains with :meth:`PullExecutor.poll` / :meth:`PullExecutor.get`.

Nothing waits without a deadline: the layout hash is compared before anything is pulled; the pull
and readiness wait are bounded by the engine (which polls ``is_ready()`` against the deadline and,
on a timeout or failure, retires the peer's connection so the next pull connects afresh); the
scatter waits for the holder's lock at most for what is left of the deadline (1 s at least).
The scatter goes through :class:`~pd_fsm.jax_engine.kv_holder.KVCacheHolder`, so it never races a
forward step (DESIGN §6).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import attrs

from pd_fsm.jax_engine.gather_scatter import ScatterMethod, validate_pages
from pd_fsm.jax_engine.kv_holder import KVCacheHolder
from pd_fsm.jax_engine.pool_spec import KVArgs
from pd_fsm.jax_engine.room_kv import pages_by_pool, scatter_room
from pd_fsm.jax_engine.transfer.base import KVTransferEngine, PullError, PullTimeout

log = logging.getLogger(__name__)

_MIN_PULL_S = 0.05  # the least time left worth starting a pull with


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

    def page_map(self) -> Mapping[str, Sequence[int]] | Sequence[int]:
        if self.pages and isinstance(self.pages[0], tuple):
            return dict(self.pages)  # type: ignore[arg-type]
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
    # thread included), start_pull -> KV ready (the transfer alone), the scatter.
    pull_seconds: float = 0.0
    transfer_seconds: float = 0.0
    scatter_seconds: float = 0.0


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
        on_result: Callable[[PullResult], None] | None = None,
        scatter_method: ScatterMethod = "xla",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._holder = holder
        self._kv_args = kv_args
        self._deadline_s = deadline_s
        self._on_result = on_result
        self._method: ScatterMethod = scatter_method
        self._clock = clock
        self._results: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kv-pull")
        self._closed = False
        self._lock = threading.Lock()
        self._inflight = 0
        with holder.locked() as kv:
            # Pulled arrays land where the pool lives.
            self._sharding = {p.name: kv[p.name][0].sharding for p in kv_args.pools}
            self._num_pages = {p.name: kv[p.name][0].shape[0] for p in kv_args.pools}

    @property
    def inflight(self) -> int:
        with self._lock:
            return self._inflight

    def submit(self, req: PullRequest) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("pull executor closed")
            self._inflight += 1
        # The deadline runs from here, not from when a worker thread takes the job: the core
        # frees the pages by its own backstop (transfer_timeout > pull_deadline) counted from
        # the submit, so a job queued behind hung pulls must not write into them later.
        self._pool.submit(self._run, req, self._clock())

    def poll(self) -> list[PullResult]:
        """Every result delivered so far (non-blocking)."""
        out: list[PullResult] = []
        while True:
            try:
                out.append(self._results.get_nowait())
            except queue.Empty:
                return out

    def get(self, timeout: float) -> PullResult | None:
        """The next result, or None after ``timeout`` seconds."""
        try:
            return self._results.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self, wait: bool = True) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def _run(self, req: PullRequest, start: float) -> None:
        timing: dict[str, float] = {}  # filled by _pull as it goes (this thread only)
        try:
            ok, reason, nbytes = self._pull(req, start, timing)
        except Exception as e:  # a job must always report, whatever broke
            log.exception("pull job for room %d", req.room)
            ok, reason, nbytes = False, f"internal error: {type(e).__name__}: {e}", 0
        result = PullResult(
            req.room, req.uuid, ok, reason, nbytes, self._clock() - start, req.peer,
            pull_seconds=timing.get("pull", 0.0),
            transfer_seconds=timing.get("transfer", 0.0),
            scatter_seconds=timing.get("scatter", 0.0),
        )
        with self._lock:
            self._inflight -= 1
        self._results.put(result)
        if self._on_result is not None:
            try:
                self._on_result(result)
            except Exception:
                log.exception("pull result callback")

    def _pull(
        self, req: PullRequest, start: float, timing: dict[str, float]
    ) -> tuple[bool, str, int]:
        if req.remote_layout_hash != self._kv_args.layout_hash:
            return False, (
                f"layout mismatch: local {self._kv_args.layout_hash}, "
                f"peer {req.remote_layout_hash}; not pulled"
            ), 0
        pages = pages_by_pool(self._kv_args, req.page_map())
        try:
            for name, ids in pages.items():
                validate_pages(ids, self._num_pages[name])
        except ValueError as e:
            return False, f"bad destination pages: {e}; not pulled", 0
        deadline_s = self._deadline_s if req.deadline_s is None else req.deadline_s
        left = deadline_s - (self._clock() - start)
        # A pull left with a sliver of its deadline (queued behind hung ones) cannot finish: do
        # not start it (and do not open a connection) only to time it out.
        if left <= min(_MIN_PULL_S, deadline_s / 10):
            return False, f"not started within the {deadline_s:g}s deadline (queued); not pulled", 0
        specs = [
            p.pull_struct(len(pages[p.name]), self._sharding[p.name]) for p in self._kv_args.pools
        ]
        nbytes = sum(p.packed_nbytes(len(pages[p.name])) for p in self._kv_args.pools)
        try:
            started = self._clock()
            pending = self._engine.start_pull(req.peer, req.uuid, specs, left)
            pending.wait()
        except PullTimeout as e:
            return False, f"timeout after {deadline_s:g}s: {e}", 0
        except PullError as e:
            return False, str(e), 0
        ready = self._clock()
        timing.update(pull=ready - start, transfer=ready - started)
        left = deadline_s - (ready - start)
        try:
            scatter_room(
                self._holder, self._kv_args, pending.arrays, pages,
                method=self._method, lock_timeout_s=max(left, 1.0),
            )
        except TimeoutError:
            return False, "scatter: KV holder lock not acquired before the deadline", 0
        timing["scatter"] = self._clock() - ready
        return True, "ok", nbytes
