"""The compilation cache: on by default for workers.

A worker builds ~100 executables before it says ready (``schedulers.warm_up``, and the PD roles'
KV copies); with this cache a second start of the same configuration loads them from disk instead
of compiling them. The cache is pd_fsm's executable store (``executable_store``): it keys an
executable by the function, its static arguments, the argument shapes and a fingerprint of the
code, JAX and the machine, so loading one needs no tracing or lowering (SmolLM2's 109: 1.3 s,
where JAX's own persistent cache took 11.6 s, most of it lowering to compute its key). JAX's
persistent cache stays off: an executable it loads cannot be stored again (``fresh_compile``).
The default directory is ``<PD_FSM_CACHE_DIR or ~/.cache/pd_fsm>/xla``; ``pd-fsm serve
--compilation-cache-dir DIR`` moves it, ``--no-compilation-cache`` turns it off. A stale entry
is never used; writes are atomic, so workers may share a directory.
"""

from __future__ import annotations

from pathlib import Path

from pd_fsm.jax_engine.paths import cache_dir


def default_dir() -> Path:
    return cache_dir() / "xla"


def enable(directory: Path) -> Path:
    """Turn the cache on for this process (before the first compile); returns the directory."""
    from pd_fsm.jax_engine.compilation.executable_store import ExecutableStore
    from pd_fsm.jax_engine.compilation.executables import EXECUTABLES

    EXECUTABLES.use_store(ExecutableStore(directory))
    return directory


def counts() -> dict[str, int]:
    """Executables loaded from the cache (hits) and compiled because it had none (misses) in this
    process so far, with the store's other counters (a snapshot)."""
    from pd_fsm.jax_engine.compilation.executables import EXECUTABLES

    store = EXECUTABLES.store_counts()
    return {"hits": store["loads"], "misses": store["misses"], "writes": store["writes"],
            "corrupt": store["corrupt"], "write_errors": store["write_errors"]}
