"""Gather and scatter executables in two tiers, so a new page bucket never waits on a slow compile.

The run-based kernels (``gather_scatter``) are the fast ones at run time, but XLA:CPU takes long
to compile them for a real model: measured for SmolLM2's 30 layers, 10-27 s per page bucket
(gather and scatter each), against ~0.6 s (gather) and ~2.5 s (scatter) for plain XLA
``take`` / ``.at[].set`` versions, which run 2-10x slower (e.g. 16 pages: 37 ms vs 6 ms gather).
So the first use of a bucket runs the quick tier while the run-based executable compiles on one
background thread; every later use of that bucket runs the run-based tier. Both tiers write
exactly the same bytes into the pages that matter (tests check it).

Every executable is compiled ahead of time (``jit(...).lower(...).compile()``) and called
directly, never under the pool lock: only the copy itself runs under it (DESIGN §6).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pd_fsm.jax_engine.compilation.executables import EXECUTABLES as FORWARD_EXECUTABLES
from pd_fsm.jax_engine.compilation.upload import upload
from pd_fsm.jax_engine.kv.counters import SharedCounter
from pd_fsm.jax_engine.kv.gather_scatter import (
    _gather_into,
    _packed_zeros,
    as_struct,
    contiguous_runs,
    multi_layer_copy,
    page_bucket,
    scatter_runs,
)
from pd_fsm.jax_engine.kv.pool import NULL_PAGE
from pd_fsm.jax_engine.parallel.tensor_parallel import packed_sharding

log = logging.getLogger("pd_fsm.jax_engine.kv.tiered")

# Which tier served each call ("gather_quick", "gather_runs", "scatter_quick", "scatter_runs").
TIER_COUNTS = SharedCounter()

Key = tuple[object, ...]


@jax.jit
def _take_gather(kv: list[jax.Array], ids: jax.Array) -> jax.Array:
    return jnp.stack([jnp.take(c, ids, axis=0) for c in kv])


@functools.partial(jax.jit, donate_argnums=(0,))
def _take_scatter(kv: list[jax.Array], packed: jax.Array, ids: jax.Array) -> list[jax.Array]:
    # Padding rows carry an out-of-range id and are dropped: no page but the room's is touched.
    return [c.at[ids].set(packed[i], mode="drop") for i, c in enumerate(kv)]


def _packed_sharding(layer: jax.ShapeDtypeStruct | jax.Array) -> jax.sharding.Sharding | None:
    """The packed array's sharding for a pool whose layers are placed like ``layer``."""
    sharding = getattr(layer, "sharding", None)
    return None if sharding is None else packed_sharding(sharding)


def _key(pool: Sequence[jax.ShapeDtypeStruct], bucket: int, what: str) -> Key:
    return (what, bucket, tuple((s.shape, str(s.dtype), s.sharding) for s in pool))


_STOP = object()  # the compile thread's signal to end


class _Executables:
    """Compiled executables by key; the slow tier compiles on one background thread."""

    def __init__(self) -> None:
        self._ready: dict[Key, jax.stages.Compiled] = {}
        self._pending: set[Key] = set()
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()  # jobs, or _STOP
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.quick_compiles = 0  # quick-tier executables built (a request waited for each)

    def get(self, key: Key) -> jax.stages.Compiled | None:
        with self._lock:
            return self._ready.get(key)

    def now(self, key: Key, build: Callable[[], jax.stages.Compiled]) -> jax.stages.Compiled:
        """The executable for ``key``, compiled here and now if need be (the quick tier)."""
        exe = self.get(key)
        if exe is None:
            exe = build()
            with self._lock:
                self.quick_compiles += 1
                exe = self._ready.setdefault(key, exe)
        return exe

    def put(self, key: Key, exe: jax.stages.Compiled) -> None:
        """An executable built elsewhere (loaded from the compilation cache at warm-up)."""
        with self._lock:
            self._ready.setdefault(key, exe)

    def later(self, key: Key, build: Callable[[], jax.stages.Compiled]) -> None:
        """Compile ``key`` on the background thread (once)."""
        with self._lock:
            if key in self._ready or key in self._pending or self._stopping:
                return
            self._pending.add(key)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._compile_loop, name="kv-compile", daemon=True
                )
                self._thread.start()
        self._jobs.put((key, build))

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is pending (tests, warm-ups)."""
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.01)
        return False

    def stop(self, timeout: float) -> None:
        """Let the compile in progress finish (at most ``timeout`` s) and start no other. Run
        at interpreter exit: a daemon thread killed inside an XLA compile aborts the whole
        process ("terminate called after throwing an instance of ''", exit status 134)."""
        with self._lock:
            thread, self._stopping = self._thread, True
        if thread is not None:
            self._jobs.put(_STOP)
            thread.join(timeout)

    def _compile_loop(self) -> None:
        _lower_own_priority()
        while True:
            job = self._jobs.get()
            if job is _STOP or self._stopping:
                return
            key, build = job
            try:
                exe = build()
            except Exception:  # the quick tier keeps serving this bucket
                log.exception("background compile of %s failed", key[:2])
                with self._lock:
                    self._pending.discard(key)
                continue
            with self._lock:
                self._ready[key] = exe
                self._pending.discard(key)


def _lower_own_priority() -> None:
    """Run this thread at the lowest CPU priority (Linux: nice is per thread). A run-based
    compile takes 10-27 s of a core for SmolLM2, queued at each page bucket's first use; on a
    worker pinned to one core they compete with serving for minutes after start (a goodput run
    saw P's prefill p50 at 9 s, bench/RESULTS_goodput.md). At nice 19 a compile gets the core
    when serving leaves it idle."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed: compile anyway
        log.info("background compiles keep normal priority: %s", exc)


KV_COPIES = _Executables()
atexit.register(KV_COPIES.stop, 120.0)


def _build(fn: Callable[..., object], *args: object, counted: bool = True) -> jax.stages.Compiled:
    """``fn.lower(*args).compile()``, through the compilation cache when it is on."""
    built = FORWARD_EXECUTABLES.build(fn, {}, *args, counted=counted)
    return built.executable  # type: ignore[no-any-return]


def _quick_gather(pool: Sequence[jax.ShapeDtypeStruct], bucket: int) -> jax.stages.Compiled:
    return KV_COPIES.now(
        _key(pool, bucket, "gather_take"),
        lambda: _build(_take_gather, pool, jax.ShapeDtypeStruct((bucket,), jnp.int32)),
    )


def _quick_scatter(
    pool: Sequence[jax.ShapeDtypeStruct], packed: jax.ShapeDtypeStruct
) -> jax.stages.Compiled:
    bucket = packed.shape[1]
    return KV_COPIES.now(
        _key(pool, bucket, "scatter_take"),
        lambda: _build(
            _take_scatter, list(pool), packed, jax.ShapeDtypeStruct((bucket,), jnp.int32)
        ),
    )


def _runs_build(
    pool: Sequence[jax.ShapeDtypeStruct],
    bucket: int,
    what: str,
    packed: jax.ShapeDtypeStruct | None = None,
) -> tuple[Callable[..., object], tuple[object, ...]]:
    """The run-based kernel of ``what`` ("gather" or "scatter") for ``bucket`` and the abstract
    arguments it is compiled for (the packed array as the pool's unless given): one place, so
    a warm-up's lookup and a first use's compile share their key in the compilation cache."""
    first = pool[0]
    if packed is None:
        packed = jax.ShapeDtypeStruct((len(pool), bucket, *first.shape[1:]), first.dtype,
                                      sharding=_packed_sharding(first))
    table = jax.ShapeDtypeStruct((3, bucket), jnp.int32)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    if what == "gather":
        return _gather_into, (packed, list(pool), table, n)
    return multi_layer_copy, (list(pool), packed, table, n)


def warm(pool: Sequence[jax.ShapeDtypeStruct], buckets: Sequence[int], what: str) -> int:
    """Compile the quick tier of ``what`` ("gather" or "scatter") for every page bucket now;
    returns how many were compiled. The run-based tier still compiles in the background at a
    bucket's first use: all of them at start would take minutes of both cores for SmolLM2."""
    before = KV_COPIES.quick_compiles
    first = pool[0]
    sharding = _packed_sharding(first)
    for bucket in buckets:
        if what == "gather":
            _quick_gather(pool, bucket)
        else:
            shape = (len(pool), bucket, *first.shape[1:])
            packed = jax.ShapeDtypeStruct(shape, first.dtype, sharding=sharding)
            _quick_scatter(pool, packed)
        # The run-based tier too, when the compilation cache holds it (a second start): then
        # nothing compiles in the background, whose tracing holds the GIL against serving.
        runs_key = _key(pool, bucket, f"{what}_runs")
        if KV_COPIES.get(runs_key) is None:
            fn, args = _runs_build(pool, bucket, what)
            built = FORWARD_EXECUTABLES.load_only(fn, {}, *args)
            if built is not None:
                KV_COPIES.put(runs_key, built.executable)
    return KV_COPIES.quick_compiles - before


def gather(kv: Sequence[jax.Array], pages: Sequence[int], *, run_tier: bool = True
           ) -> jax.Array:
    """``select_from_kv_caches`` semantics for rows ``0..len(pages)-1``; call under the lock
    (it only dispatches). Rows past ``len(pages)`` are padding (their content is unspecified).
    ``run_tier`` False: the quick tier always, the run-based one never compiled (on a TPU ``take``
    is the faster: ``gather_scatter.default_gather_method``)."""
    kv = list(kv)
    bucket = page_bucket(len(pages))
    pool = [as_struct(a) for a in kv]
    first = kv[0]
    out_shape = (len(kv), bucket, *first.shape[1:])
    runs_key = _key(pool, bucket, "gather_runs")
    exe = KV_COPIES.get(runs_key) if run_tier else None
    if exe is not None:
        TIER_COUNTS.bump("gather_runs")
        runs = contiguous_runs(pages, range(len(pages)), bucket)
        out = _packed_zeros(out_shape, first.dtype, packed_sharding(first.sharding))
        return exe(out, kv, upload(runs.table), jnp.int32(runs.n_runs))  # type: ignore[no-any-return]

    def build_runs() -> jax.stages.Compiled:
        fn, args = _runs_build(pool, bucket, "gather")
        return _build(fn, *args, counted=False)

    if run_tier:
        KV_COPIES.later(runs_key, build_runs)
    ids = np.full(bucket, NULL_PAGE, np.int32)
    ids[: len(pages)] = pages
    quick = _quick_gather(pool, bucket)
    TIER_COUNTS.bump("gather_quick")
    return quick(kv, upload(ids))  # type: ignore[no-any-return]


def scatter_plan(
    pool: Sequence[jax.ShapeDtypeStruct], packed: jax.Array, pages: Sequence[int]
) -> Callable[[list[jax.Array]], list[jax.Array]]:
    """Outside the lock: pick (and if need be compile) the scatter for ``packed`` into
    ``pages``; returns ``run(kv) -> new kv`` to call under the lock (it donates ``kv``)."""
    bucket = packed.shape[1]
    runs_key = _key(pool, bucket, "scatter_runs")
    exe = KV_COPIES.get(runs_key)
    if exe is not None:
        runs = scatter_runs(pages, bucket)
        table, n_runs = upload(runs.table), jnp.int32(runs.n_runs)

        def run_runs(kv: list[jax.Array]) -> list[jax.Array]:
            TIER_COUNTS.bump("scatter_runs")
            return exe(kv, packed, table, n_runs)  # type: ignore[no-any-return]

        return run_runs

    def build_runs() -> jax.stages.Compiled:
        fn, args = _runs_build(pool, bucket, "scatter", as_struct(packed))
        return _build(fn, *args, counted=False)

    KV_COPIES.later(runs_key, build_runs)
    quick = _quick_scatter(pool, as_struct(packed))
    ids = np.full(bucket, np.iinfo(np.int32).max, np.int32)  # out of range: dropped
    ids[: len(pages)] = pages
    ids_dev = upload(ids)

    def run_quick(kv: list[jax.Array]) -> list[jax.Array]:
        TIER_COUNTS.bump("scatter_quick")
        return quick(kv, packed, ids_dev)  # type: ignore[no-any-return]

    return run_quick


def total_compiles() -> tuple[int, int]:
    """Executables this process has (compiled, loaded from the compilation cache) so far: the
    forward and samplers and the quick-tier KV copies, all counted by ``executables.EXECUTABLES``
    (the run-based tier is built in the background and makes no request wait)."""
    stats = FORWARD_EXECUTABLES.stats()
    return stats.compiles, stats.loads
