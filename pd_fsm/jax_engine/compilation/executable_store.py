"""Compiled executables on disk, found without tracing or lowering anything.

JAX's persistent compilation cache keys an entry by the lowered program, so a start that finds
every executable there still traces and lowers each function first: measured for SmolLM2's 109
start-up executables (jax 0.10.2, this 2-core machine), 8.9 s of lowering and 2.0 s of loading
per start, against 1.6 s to deserialise the same executables directly. This store keys an
executable by what determines it before lowering instead:

- the function (module and qualified name; only ``pd_fsm.jax_engine``'s module-level functions),
  its static arguments' ``repr``, the argument tree and every leaf's shape and dtype;
- a fingerprint of everything else the program depends on: the source of every module under
  ``pd_fsm/jax_engine`` (the functions and the constants they close over), the JAX and jaxlib
  versions, the backend (platform, device kind, device count, platform version), the CPU's feature
  flags on a CPU backend, ``XLA_FLAGS`` and the JAX options that change lowering.

Any change to one of those gives new keys, so a stale executable is never loaded; old files stay
until the directory is cleared. Writes are atomic (a temporary file renamed into place), so
workers may share a directory. A file that fails to load is counted, removed and compiled afresh.
Entries are pickles (``jax.experimental.serialize_executable`` is pickle-based too): the
directory is created private to the user and must stay so, like JAX's own cache.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

log = logging.getLogger("pd_fsm.jax_engine.compilation.executable_store")

FORMAT = 1  # bump when the file layout changes
_PACKAGE = "pd_fsm.jax_engine"


class _FreshCompile(threading.local):
    """Per thread: did the compile running in this thread come from JAX's persistent cache?"""

    fresh = True


_compile_state = _FreshCompile()


def _on_jax_event(event: str, **_: object) -> None:
    # JAX records the event in the thread that compiles.
    if event == "/jax/compilation_cache/cache_hits":
        _compile_state.fresh = False


jax.monitoring.register_event_listener(_on_jax_event)


@contextmanager
def fresh_compile() -> Iterator[_FreshCompile]:
    """Around one compile: afterwards ``.fresh`` is False if JAX loaded the executable from its
    persistent cache instead. Such an executable must not be stored: measured with jax 0.10.2 on
    CPU, serialising an executable that JAX itself deserialised gives a file whose executable
    fails when run ("NOT_FOUND: Function iota_add_fusion not found"). pd_fsm therefore leaves
    JAX's cache off (``cache``); this guards against one a user turned on."""
    _compile_state.fresh = True
    yield _compile_state


@functools.cache
def fingerprint() -> str:
    """What every stored executable depends on besides its own key (computed once)."""
    import jaxlib

    h = hashlib.sha256()
    root = Path(__file__).parents[1]  # all of pd_fsm/jax_engine, not only this folder
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    devices = jax.devices()
    first = devices[0]
    parts = [
        f"format={FORMAT}",
        f"jax={jax.__version__}",
        f"jaxlib={jaxlib.__version__}",
        f"platform={first.platform}",
        f"kind={first.device_kind}",
        f"devices={len(devices)}",
        f"platform_version={first.client.platform_version}",
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')}",
        # jax adds its options to Config as properties at import time (setattr): no stub has them.
        f"x64={jax.config.jax_enable_x64}",  # type: ignore[attr-defined]
        f"precision={jax.config.jax_default_matmul_precision}",  # type: ignore[attr-defined]
    ]
    if first.platform == "cpu":
        parts.append(f"cpu_flags={_cpu_flags()}")
    h.update("\n".join(parts).encode())
    return h.hexdigest()


def _cpu_flags() -> str:
    """The host CPU's feature flags: XLA:CPU compiles for the features it finds."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def key_text(
    fn: Any, static: Mapping[str, Hashable], treedef: Any, leaves: Sequence[Any]
) -> str | None:
    """The stable text an executable is stored under, or None when it has none (a function
    outside ``pd_fsm.jax_engine``, a local one, or a static argument without a stable repr)."""
    module = getattr(fn, "__module__", "") or ""
    qualname = getattr(fn, "__qualname__", "") or ""
    if not module.startswith(_PACKAGE) or not qualname or "<" in qualname:
        return None
    statics = repr(sorted(static.items()))
    if " at 0x" in statics:  # an object's identity: not the same in the next process
        return None
    # The sharding too (None for a ShapeDtypeStruct without one): a program is compiled for it.
    shapes = ";".join(f"{tuple(x.shape)}:{x.dtype}:{getattr(x, 'sharding', None)}" for x in leaves)
    return f"{module}.{qualname}|{statics}|{treedef}|{shapes}"


class ExecutableStore:
    """Serialised executables in one directory; thread-safe, shared safely between processes."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.directory = directory
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()  # loads, misses, writes, corrupt, write_errors

    def _path(self, text: str) -> Path:
        digest = hashlib.sha256(f"{fingerprint()}\n{text}".encode()).hexdigest()
        return self.directory / f"{digest}.exe"

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def load(self, text: str, *, count_miss: bool = True) -> tuple[Any, Any] | None:
        """``(compiled, out_info)`` stored under ``text``, or None (a miss, or a bad file).
        ``count_miss=False``: a lookup that compiles nothing when it misses (a warm-up looking
        for the KV copies' background tier), so ``misses`` keeps meaning "compiled for want of
        an entry"."""
        path = self._path(text)
        try:
            blob = path.read_bytes()
        except OSError as exc:
            if not isinstance(exc, FileNotFoundError):
                log.warning("executable store: cannot read %s: %s", path, exc)
            if count_miss:
                self._count("misses")
            return None
        try:
            fmt, stored_text, serialized, out_info = pickle.loads(blob)
            if fmt != FORMAT or stored_text != text:
                raise ValueError("written for another key")
            compiled = serialize_executable.deserialize_and_load(*serialized)
        except Exception as exc:  # any bad file is a miss, never a failed start
            log.warning("executable store: dropping unreadable %s: %r", path.name, exc)
            self._count("corrupt")
            path.unlink(missing_ok=True)
            return None
        self._count("loads")
        return compiled, out_info

    def save(self, text: str, compiled: Any, out_info: Any) -> None:
        """Store an executable (best effort: a full disk costs the next start a compile)."""
        path = self._path(text)
        try:
            blob = pickle.dumps((FORMAT, text, serialize_executable.serialize(compiled), out_info))
            fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as exc:  # best effort, see the docstring
            log.warning("executable store: cannot write %s: %r", path.name, exc)
            self._count("write_errors")
            return
        self._count("writes")

    def counts(self) -> dict[str, int]:
        """A snapshot of the store's counters."""
        with self._lock:
            return {k: self._counts[k] for k in ("loads", "misses", "writes", "corrupt",
                                                 "write_errors")}
