"""JAX's persistent compilation cache, on by default for workers.

A worker compiles ~100 executables before it says ready (``Scheduler.warm_up``); with this cache
a second start of the same configuration loads them from disk instead. The default directory is
``<PD_FSM_CACHE_DIR or ~/.cache/pd_fsm>/xla``; ``pd-fsm serve --compilation-cache-dir DIR``
moves it, ``--no-compilation-cache`` turns it off. JAX keys entries by the program, the JAX/XLA
versions and the device, so a stale entry is never used; writes are atomic, so workers may share
a directory.
"""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

from pd_fsm.jax_engine.model.weight_cache import cache_dir

# JAX's own events, counted for the worker's metrics: a hit is an executable loaded from disk.
_EVENTS = {
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "misses",
}
_counts: Counter[str] = Counter()
_counts_lock = threading.Lock()
_listening = False


def default_dir() -> Path:
    return cache_dir() / "xla"


def enable(directory: Path) -> Path:
    """Turn the cache on for this process (before the first compile); returns the directory."""
    import jax

    directory.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    # Every executable, however quick to compile: a start loads ~100 of them, most small.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    global _listening
    if not _listening:
        jax.monitoring.register_event_listener(_on_event)
        _listening = True
    return directory


def _on_event(event: str, **_: object) -> None:
    name = _EVENTS.get(event)
    if name is not None:
        with _counts_lock:
            _counts[name] += 1


def counts() -> dict[str, int]:
    """Persistent-cache hits and misses in this process so far (a snapshot)."""
    with _counts_lock:
        return {name: _counts[name] for name in _EVENTS.values()}
