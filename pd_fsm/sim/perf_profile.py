"""A performance profile of the real engine: what a prefill, a decode step and a
KV move cost on one machine, as measured by ``pd-fsm profile`` (``pd_fsm/sim/profiler.py``),
and read back by the performance model (``pd_fsm/sim/perf.py``). Plain data and interpolation:
no JAX here, so the model runs anywhere.

A profile holds one ``CoreProfile`` per core count it was measured with (``pd-fsm profile
--cpus 0`` and ``--cpus 0-1`` merged into one file): a pinned P or D runs on one core, a
colocated worker on all of them.

Since 2026-12-04 a profile also records how many cores each prefill and decode step kept busy
(the process's CPU seconds over the step's wall seconds). It is not the step's speed-up: XLA's
pool threads spin while they wait for work, so a batch-1 decode step on two cores ran no faster
than on one (27 vs 25 ms) yet kept 1.42 cores busy, and a worker sharing those cores gets only
what is left. Profiles measured before hold no such figures; the model then takes the speed-up.

Optional fields, all with defaults, so files written before them load unchanged and a reader
that predates them skips them (``load`` reads named keys only; ``VERSION`` stays 1):

- ``Profile.platform``: the JAX backend measured on, ``cpu`` or ``tpu`` (``cpu`` where absent:
  every profile before these fields was measured on a CPU); ``device_kind``: the device as JAX
  names it (``TPU v5 lite``; ``""`` where unknown); ``step``: the step the engine ran there,
  ``fused`` (one jitted program: an accelerator) or ``chain`` (the jitted calls: a CPU), ``""``
  where unknown; ``kv_dtype``: the KV's dtype (``""`` where unknown).
- ``Profile.prefill_grid`` / ``decode_grid``: the grid asked for (prompt tokens; (rows,
  context) pairs); a point of the grid absent from ``prefill`` / ``decode`` was not measured,
  and ``skipped`` says why (one line per point or leg, e.g. the pool it needed did not fit the
  chip's memory, or the TCP-only loopback pull on a machine that refuses TCP sockets).
- ``CoreProfile``'s KV legs, each (bytes of one room, seconds), best of N on fresh arrays:
  ``gather`` (P's gather of a room from the pool, this backend's method), ``d2h`` (the gathered
  room device -> numpy, the faster of the two ways measured: one array, or one array per layer
  with ``copy_to_host_async`` on all first), ``d2h_pinned`` (device -> ``pinned_host`` memory),
  ``h2d`` (numpy -> device),
  ``scatter`` (D's scatter of a room into the pool, this backend's method). Empty where not
  measured (every CPU profile before them; ``d2h_pinned`` where the backend has no
  ``pinned_host`` memory). ``has_leg(name)`` says whether one was measured.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path

import attrs

VERSION = 1
LEGS = ("gather", "d2h", "d2h_pinned", "h2d", "scatter")


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


def _by_rows_then_context(points: Sequence[tuple[int, int, float]], rows: int,
                          context: float) -> float:
    """``points`` of (rows, context, value) interpolated over rows at each measured context,
    then over context."""
    contexts = sorted({c for _, c, _ in points})
    by_context = [(float(c), interpolate(
        [(float(b), v) for b, cc, v in sorted(points) if cc == c], rows)) for c in contexts]
    return interpolate(by_context, context)


@attrs.frozen
class CoreProfile:
    """Costs on ``cores`` cores, in seconds: a one-row prefill by prompt tokens; a decode step
    by batch rows at two or more context lengths; a device copy (gather / scatter) and a
    loopback pull by bytes. ``prefill_busy`` and ``decode_busy`` are the cores those steps kept
    busy, by the same keys (empty in profiles measured before they were recorded)."""

    cores: int
    prefill: tuple[tuple[int, float], ...]  # (prompt tokens, seconds)
    decode: tuple[tuple[int, int, float], ...]  # (batch rows, context tokens, seconds)
    copy: tuple[tuple[int, float], ...]  # (bytes, seconds)
    pull: tuple[tuple[int, float], ...]  # (bytes, seconds)
    prefill_busy: tuple[tuple[int, float], ...] = ()  # (prompt tokens, cores busy)
    decode_busy: tuple[tuple[int, int, float], ...] = ()  # (batch rows, context, cores busy)
    # The KV path's legs by the bytes of one room (module docstring): (bytes, seconds).
    gather: tuple[tuple[int, float], ...] = ()
    d2h: tuple[tuple[int, float], ...] = ()
    d2h_pinned: tuple[tuple[int, float], ...] = ()
    h2d: tuple[tuple[int, float], ...] = ()
    scatter: tuple[tuple[int, float], ...] = ()

    @property
    def measured_busy(self) -> bool:
        return bool(self.prefill_busy and self.decode_busy)

    def prefill_s(self, tokens: int) -> float:
        return interpolate([(float(t), s) for t, s in self.prefill], tokens)

    def decode_s(self, rows: int, context: float) -> float:
        """Interpolated over rows at each measured context, then over context."""
        return _by_rows_then_context(self.decode, rows, context)

    def prefill_busy_cores(self, tokens: int) -> float:
        return interpolate([(float(t), c) for t, c in self.prefill_busy], tokens)

    def decode_busy_cores(self, rows: int, context: float) -> float:
        return _by_rows_then_context(self.decode_busy, rows, context)

    def copy_s(self, n_bytes: int) -> float:
        return interpolate([(float(b), s) for b, s in self.copy], n_bytes)

    def pull_s(self, n_bytes: int) -> float:
        return interpolate([(float(b), s) for b, s in self.pull], n_bytes)

    def has_leg(self, name: str) -> bool:
        """Whether the leg ``name`` (``copy``, ``pull``, or one in ``LEGS``) was measured."""
        return bool(getattr(self, name))

    def leg_s(self, name: str, n_bytes: int) -> float:
        """Seconds of the leg ``name`` for ``n_bytes``, interpolated (refuses one not
        measured: ``has_leg``)."""
        points = getattr(self, name)
        if not points:
            raise ValueError(f"the profile measured no {name} leg")
        return interpolate([(float(b), s) for b, s in points], n_bytes)


@attrs.frozen
class Profile:
    model: str
    kv_bytes_per_token: int
    page_size: int
    max_batched_tokens: int
    max_running: int
    by_cores: tuple[CoreProfile, ...]
    platform: str = "cpu"
    device_kind: str = ""
    step: str = ""  # "fused" or "chain"
    kv_dtype: str = ""
    prefill_grid: tuple[int, ...] = ()  # prompt tokens asked for
    decode_grid: tuple[tuple[int, int], ...] = ()  # (rows, context) asked for
    skipped: tuple[str, ...] = ()  # what was not measured, and why

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
        if self.platform != other.platform:
            raise ValueError(f"profiles of different platforms: {self.platform} / "
                             f"{other.platform}")
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
            prefill_busy=tuple((int(t), float(n)) for t, n in c.get("prefill_busy", ())),
            decode_busy=tuple((int(b), int(x), float(n)) for b, x, n in c.get("decode_busy", ())),
            **{leg: _pairs(c.get(leg, ())) for leg in LEGS},
        ) for c in raw["by_cores"])
        return cls(model=str(raw["model"]), kv_bytes_per_token=int(raw["kv_bytes_per_token"]),
                   page_size=int(raw["page_size"]),
                   max_batched_tokens=int(raw["max_batched_tokens"]),
                   max_running=int(raw["max_running"]), by_cores=cores,
                   platform=str(raw.get("platform", "cpu")),
                   device_kind=str(raw.get("device_kind", "")), step=str(raw.get("step", "")),
                   kv_dtype=str(raw.get("kv_dtype", "")),
                   prefill_grid=tuple(int(t) for t in raw.get("prefill_grid", ())),
                   decode_grid=tuple((int(b), int(x)) for b, x in raw.get("decode_grid", ())),
                   skipped=tuple(str(line) for line in raw.get("skipped", ())))


def _pairs(raw: Sequence[Sequence[float]]) -> tuple[tuple[int, float], ...]:
    """(bytes, seconds) pairs as JSON holds them."""
    return tuple((int(b), float(s)) for b, s in raw)
