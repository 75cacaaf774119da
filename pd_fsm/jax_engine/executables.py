"""Compiled executables kept by shape, so a worker can compile before it serves and count after.

``jax.jit`` compiles on first call, and an ahead-of-time ``f.lower(...).compile()`` does not
fill the cache a later ``f(...)`` looks in (measured with jax 0.10.2: a SmolLM2 decode step took
as long after an AOT compile of its shape as without one). So the model's hot functions run
through an :class:`Executables` table instead: ``call`` looks the executable up by the function,
its static arguments and the shapes and dtypes of the others, compiles it on a miss, and runs it;
``compile`` fills an entry from ``jax.ShapeDtypeStruct`` s without running anything. A warm-up can
therefore compile every shape a scheduler will use before ``/health`` says ready, and
``stats().compiles`` says whether any request paid for one since.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Mapping
from typing import Any

import attrs
import jax


@attrs.frozen
class CompileStats:
    """A snapshot: executables compiled since start and the seconds spent compiling them."""

    compiles: int
    seconds: float


@attrs.frozen
class _Entry:
    executable: Any  # jax.stages.Compiled
    out_info: Any  # the outputs' ShapeDtypeStructs


class Executables:
    """Compiled executables of jitted functions, keyed by (function, static args, arg shapes)."""

    def __init__(self) -> None:
        self._table: dict[Hashable, _Entry] = {}
        self._lock = threading.Lock()  # guards the dicts and counters, never held to compile
        self._compiling: dict[Hashable, threading.Event] = {}
        self._compiles = 0
        self._seconds = 0.0

    def _get(self, fn: Any, static: Mapping[str, Hashable], args: tuple[Any, ...]) -> _Entry:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        # Arrays and ShapeDtypeStructs alike: a warm-up and a real call share the key.
        key = (fn, *static.items(), treedef, *[(x.shape, x.dtype) for x in leaves])
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
            start = time.perf_counter()
            lowered = fn.lower(*args, **static)
            entry = _Entry(lowered.compile(), lowered.out_info)
            with self._lock:
                self._seconds += time.perf_counter() - start
                self._compiles += 1
                self._table[key] = entry
            return entry
        finally:
            with self._lock:
                self._compiling.pop(key).set()

    def call(self, fn: Any, static: Mapping[str, Hashable], *args: Any) -> Any:
        """``fn(*args, **static)`` through the table (``fn`` is a ``jax.jit`` function)."""
        return self._get(fn, static, args).executable(*args)

    def compile(self, fn: Any, static: Mapping[str, Hashable], *args: Any) -> Any:
        """Compile ``fn`` for these argument shapes (arrays or ``ShapeDtypeStruct`` s); returns
        the output's ``ShapeDtypeStruct`` s, to chain the next function's warm-up."""
        return self._get(fn, static, args).out_info

    def stats(self) -> CompileStats:
        return CompileStats(self._compiles, self._seconds)


# The process's table: the model's forward and the samplers run through it; warm-ups fill it and
# workers report its compiles.
EXECUTABLES = Executables()
