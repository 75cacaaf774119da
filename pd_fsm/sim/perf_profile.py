"""A performance profile of the real engine (issue 30 §4): what a prefill, a decode step and a
KV move cost on one machine, as measured by ``pd-fsm profile`` (``pd_fsm/sim/profiler.py``),
and read back by the performance model (``pd_fsm/sim/perf.py``). Plain data and interpolation:
no JAX here, so the model runs anywhere.

A profile holds one ``CoreProfile`` per core count it was measured with (``pd-fsm profile
--cpus 0`` and ``--cpus 0-1`` merged into one file): a pinned P or D runs on one core, a
colocated worker on all of them.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path

import attrs

VERSION = 1


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x); beyond the ends, the nearest segment's
    line continued (a longer prompt than measured costs what the trend says, not the last
    point's)."""
    if not points:
        raise ValueError("no points to interpolate")
    if len(points) == 1:
        return points[0][1]
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y1
    return max(y, 0.0)


@attrs.frozen
class CoreProfile:
    """Costs on ``cores`` cores, in seconds: a one-row prefill by prompt tokens; a decode step
    by batch rows at two or more context lengths; a device copy (gather / scatter) and a
    loopback pull by bytes."""

    cores: int
    prefill: tuple[tuple[int, float], ...]  # (prompt tokens, seconds)
    decode: tuple[tuple[int, int, float], ...]  # (batch rows, context tokens, seconds)
    copy: tuple[tuple[int, float], ...]  # (bytes, seconds)
    pull: tuple[tuple[int, float], ...]  # (bytes, seconds)

    def prefill_s(self, tokens: int) -> float:
        return interpolate([(float(t), s) for t, s in self.prefill], tokens)

    def decode_s(self, rows: int, context: float) -> float:
        """Interpolated over rows at each measured context, then over context."""
        contexts = sorted({c for _, c, _ in self.decode})
        by_context = [(float(c), interpolate(
            [(float(b), s) for b, cc, s in sorted(self.decode) if cc == c], rows))
            for c in contexts]
        return interpolate(by_context, context)

    def copy_s(self, n_bytes: int) -> float:
        return interpolate([(float(b), s) for b, s in self.copy], n_bytes)

    def pull_s(self, n_bytes: int) -> float:
        return interpolate([(float(b), s) for b, s in self.pull], n_bytes)


@attrs.frozen
class Profile:
    model: str
    kv_bytes_per_token: int
    page_size: int
    max_batched_tokens: int
    max_running: int
    by_cores: tuple[CoreProfile, ...]

    def on(self, cores: int) -> CoreProfile:
        """The profile measured with ``cores`` cores (else the nearest measured below it, else
        the smallest): a pinned role on one core, a colocated worker on two."""
        ordered = sorted(self.by_cores, key=lambda c: c.cores)
        below = [c for c in ordered if c.cores <= cores]
        return below[-1] if below else ordered[0]

    def merged(self, other: Profile) -> Profile:
        """This profile with ``other``'s core counts added (same model and settings)."""
        if (self.model, self.kv_bytes_per_token) != (other.model, other.kv_bytes_per_token):
            raise ValueError(f"profiles of different models: {self.model} / {other.model}")
        keep = {c.cores: c for c in self.by_cores} | {c.cores: c for c in other.by_cores}
        return attrs.evolve(self, by_cores=tuple(keep[k] for k in sorted(keep)))

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({"version": VERSION, **attrs.asdict(self)}, indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        raw = json.loads(path.read_text())
        if raw.get("version") != VERSION:
            raise ValueError(f"{path}: profile version {raw.get('version')!r}, this reader "
                             f"reads {VERSION}")
        cores = tuple(CoreProfile(
            cores=int(c["cores"]),
            prefill=tuple((int(t), float(s)) for t, s in c["prefill"]),
            decode=tuple((int(b), int(x), float(s)) for b, x, s in c["decode"]),
            copy=tuple((int(b), float(s)) for b, s in c["copy"]),
            pull=tuple((int(b), float(s)) for b, s in c["pull"]),
        ) for c in raw["by_cores"])
        return cls(model=str(raw["model"]), kv_bytes_per_token=int(raw["kv_bytes_per_token"]),
                   page_size=int(raw["page_size"]),
                   max_batched_tokens=int(raw["max_batched_tokens"]),
                   max_running=int(raw["max_running"]), by_cores=cores)
