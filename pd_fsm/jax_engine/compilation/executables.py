"""Compiled executables kept by shape, so a worker can compile before it serves and count after.

``jax.jit`` compiles on first call, and an ahead-of-time ``f.lower(...).compile()`` does not
fill the cache a later ``f(...)`` looks in (measured with jax 0.10.2: a SmolLM2 decode step took
as long after an AOT compile of its shape as without one). So the model's hot functions run
through an :class:`Executables` table instead: ``call`` looks the executable up by the function,
its static arguments and the shapes and dtypes of the others, compiles it on a miss, and runs it;
``compile`` fills an entry from ``jax.ShapeDtypeStruct`` s without running anything. A warm-up can
therefore compile every shape a scheduler will use before ``/health`` says ready, and
``stats()`` says whether any request paid for one since. With a store (``use_store``, set by
``cache.enable``), a miss first looks on disk, where the table keeps every executable
it compiles: a second start loads them without tracing or lowering (``executable_store``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Mapping
from typing import Any

import attrs
import jax

from pd_fsm.jax_engine.compilation.executable_store import ExecutableStore, fresh_compile, key_text

log = logging.getLogger(__name__)


def describe(fn: Any, static: Mapping[str, Hashable], args: tuple[Any, ...]) -> str:
    """``fn``'s name, static arguments and argument shapes: which executable, in a log line."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    shapes = " ".join(
        f"{x.dtype}{list(x.shape)}" for x in jax.tree_util.tree_leaves(args) if hasattr(x, "shape")
    )
    # A model's config is a long repr the shapes already identify: named by its type.
    statics = "".join(
        f" {k}={v!r}" if len(repr(v)) <= 40 else f" {k}=<{type(v).__name__}>"
        for k, v in static.items()
    )
    return f"{name}({shapes}){statics}"


@attrs.frozen
class CompileStats:
    """A snapshot: executables compiled since start and the seconds spent compiling them; and
    those loaded from the store instead, and the seconds that took."""

    compiles: int
    seconds: float
    loads: int = 0
    load_seconds: float = 0.0

    @property
    def built(self) -> int:
        """Executables added to the table either way: each one after ready made a request wait."""
        return self.compiles + self.loads


@attrs.frozen
class _Entry:
    executable: Any  # jax.stages.Compiled
    out_info: Any  # the outputs' ShapeDtypeStructs


@attrs.frozen
class Built:
    """An executable from ``Executables.build``, and whether it came from the store."""

    entry: _Entry
    loaded: bool

    @property
    def executable(self) -> Any:  # jax.stages.Compiled
        return self.entry.executable


def _on_mesh(leaf: Any) -> jax.sharding.NamedSharding | None:
    """``leaf``'s sharding if it is placed on a mesh; None for one device or unplaced (a batch
    input made from numpy goes wherever the executable wants it)."""
    sharding = getattr(leaf, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.NamedSharding) else None


class Executables:
    """Compiled executables of jitted functions, keyed by (function, static args, arg shapes)."""

    def __init__(self) -> None:
        self._table: dict[Hashable, _Entry] = {}
        self._lock = threading.Lock()  # guards the dicts and counters, never held to compile
        self._compiling: dict[Hashable, threading.Event] = {}
        self._compiles = 0
        self._seconds = 0.0
        self._loads = 0
        self._load_seconds = 0.0
        self._store: ExecutableStore | None = None
        # Set when a worker says it is ready: every counted build after that made a request
        # wait, and is logged by name so an operator can see which shape the warm-up missed.
        self._ready = False

    def mark_ready(self) -> None:
        """From now on, log each counted build as one a request waited for."""
        self._ready = True

    def use_store(self, store: ExecutableStore | None) -> None:
        """Load misses from, and save compiles to, ``store`` (None: compile only)."""
        self._store = store

    def _get(self, fn: Any, static: Mapping[str, Hashable], args: tuple[Any, ...]) -> _Entry:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        # Arrays and ShapeDtypeStructs alike: a warm-up and a real call share the key. A leaf
        # placed on a mesh (tensor parallelism) keys by its sharding too: a program is compiled
        # for it, and instances of different tp sizes share this table.
        key = (fn, *static.items(), treedef, *[(x.shape, x.dtype, _on_mesh(x)) for x in leaves])
        while True:
            entry = self._table.get(key)
            if entry is not None:
                return entry
            # One compile per key; different keys compile at once (XLA releases the GIL while it
            # compiles, so a warm-up on two threads uses two cores).
            with self._lock:
                entry = self._table.get(key)
                if entry is not None:
                    return entry
                busy = self._compiling.get(key)
                if busy is None:
                    self._compiling[key] = threading.Event()
            if busy is None:
                break
            busy.wait()  # then look again: the other thread's compile may have failed
        try:
            built = self.build(fn, static, *args)
            with self._lock:
                self._table[key] = built.entry
            return built.entry
        finally:
            with self._lock:
                self._compiling.pop(key).set()

    def _lookup(
        self, fn: Any, static: Mapping[str, Hashable], args: tuple[Any, ...], *, count_miss: bool
    ) -> tuple[str | None, Built | None]:
        """The store key of ``fn`` for these arguments (None: not storable, or no store) and
        the executable stored under it, if any."""
        store = self._store
        if store is None:
            return None, None
        leaves, treedef = jax.tree_util.tree_flatten(args)
        text = key_text(fn, static, treedef, leaves)
        loaded = None if text is None else store.load(text, count_miss=count_miss)
        return text, None if loaded is None else Built(_Entry(*loaded), loaded=True)

    def load_only(self, fn: Any, static: Mapping[str, Hashable], *args: Any) -> Built | None:
        """``fn``'s executable for these arguments if the store has it, else None (nothing
        compiles; not in ``stats()``, and a miss is not counted by the store)."""
        return self._lookup(fn, static, args, count_miss=False)[1]

    def build(
        self, fn: Any, static: Mapping[str, Hashable], *args: Any, counted: bool = True
    ) -> Built:
        """Load ``fn``'s executable for these arguments from the store, or lower and compile it
        (and store it); not put in the table (the KV copies keep their own). ``counted=False``
        leaves it out of ``stats()``: a background compile no request waits for."""
        start = time.perf_counter()
        text, loaded = self._lookup(fn, static, args, count_miss=True)
        if loaded is not None:
            if counted:
                self._count(time.perf_counter() - start, fn, static, args, loaded=True)
            return loaded
        with fresh_compile() as fresh:
            lowered = fn.lower(*args, **static)
            entry = _Entry(lowered.compile(), lowered.out_info)
        if counted:
            self._count(time.perf_counter() - start, fn, static, args, loaded=False)
        if self._store is not None and text is not None and fresh.fresh:
            self._store.save(text, entry.executable, entry.out_info)
        return Built(entry, loaded=False)

    def _count(self, took: float, fn: Any, static: Mapping[str, Hashable],
               args: tuple[Any, ...], *, loaded: bool) -> None:
        """Add a build to ``stats()``; after ready, log it as a request's wait."""
        with self._lock:
            if loaded:
                self._load_seconds += took
                self._loads += 1
            else:
                self._seconds += took
                self._compiles += 1
        if self._ready:
            how = "loaded from the compilation cache" if loaded else "compiled"
            log.warning("%s after ready (a request waited %.2f s): %s",
                        how, took, describe(fn, static, args))

    def executable(self, fn: Any, static: Mapping[str, Hashable], *args: Any) -> Any:
        """The compiled ``fn`` for these arguments, built (and counted) on a miss: a caller
        that calls one shape often keeps it and skips the lookup, whose key walks every
        argument (a fused step's ~340 arrays)."""
        return self._get(fn, static, args).executable

    def call(self, fn: Any, static: Mapping[str, Hashable], *args: Any) -> Any:
        """``fn(*args, **static)`` through the table (``fn`` is a ``jax.jit`` function)."""
        return self._get(fn, static, args).executable(*args)

    def compile(self, fn: Any, static: Mapping[str, Hashable], *args: Any) -> Any:
        """Compile ``fn`` for these argument shapes (arrays or ``ShapeDtypeStruct`` s); returns
        the output's ``ShapeDtypeStruct`` s, to chain the next function's warm-up. They carry
        the executable's output shardings (``out_info`` has none): on a mesh, the next
        function is then compiled for, and keyed by, what a real call will pass it."""
        entry = self._get(fn, static, args)
        return jax.tree.map(
            lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
            entry.out_info, entry.executable.output_shardings,
        )

    def stats(self) -> CompileStats:
        with self._lock:
            return CompileStats(self._compiles, self._seconds, self._loads, self._load_seconds)

    def store_counts(self) -> dict[str, int]:
        """The store's counters (all zero without one)."""
        if self._store is None:
            return {"loads": 0, "misses": 0, "writes": 0, "corrupt": 0, "write_errors": 0}
        return self._store.counts()


# The process's table: the model's forward and the samplers run through it; warm-ups fill it and
# workers report its compiles.
EXECUTABLES = Executables()
