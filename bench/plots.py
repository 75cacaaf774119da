"""Every benchmark's pictures, drawn in one place (matplotlib, headless): goodput against request
rate, latency CDFs, phases as stacked bars, transfer rate against size. Each function takes the
figures a bench measured and writes one PNG beside its results (``bench/plots/NAME.png``); the
``RESULTS_*.md`` files and the README embed them.

matplotlib is the ``bench`` extra (``pip install -e '.[bench]'``): without it a bench prints its
tables as before and says that it drew nothing. ``PD_FSM_PLOTS_DIR`` sends the pictures elsewhere
(``make bench`` does, so a quick run never draws over the pictures the RESULTS pages show).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PLOTS = Path(os.environ.get("PD_FSM_PLOTS_DIR") or Path(__file__).resolve().parent / "plots")


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), or None when it is not installed."""
    try:
        import matplotlib
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install -e '.[bench]')", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, name: str) -> Path:
    PLOTS.mkdir(exist_ok=True)
    path = PLOTS / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    print(f"(plot: {shown})", flush=True)
    return path


def goodput_vs_rate(name: str, title: str, curves: Mapping[str, Sequence[tuple[float, float]]],
                    slo: str) -> Path | None:
    """Goodput (req/s within the SLO) against the rate the requests really arrived at (a few
    Poisson arrivals stray from the nominal rate: ``Summary.arrival_rate``), one line per
    configuration, with that rate itself as the ceiling (every request within the SLO)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    rates = sorted({r for points in curves.values() for r, _ in points})
    ax.plot(rates, rates, ls=":", color="grey", label="arrival rate (all within the SLO)")
    for label, points in curves.items():
        xs, ys = zip(*sorted(points), strict=True)
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xlabel="arrival rate (req/s, as the Poisson arrivals came)",
           ylabel=f"goodput (req/s with {slo})", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(plt, fig, name)


def latency_cdf(name: str, title: str, samples: Mapping[str, Sequence[float]], xlabel: str,
                target: float | None = None) -> Path | None:
    """The empirical CDF of each sample set (seconds, drawn in ms), with the SLO target as a
    vertical line."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, values in samples.items():
        xs = sorted(v * 1000 for v in values if math.isfinite(v))
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{label} (n={len(xs)})")
    if target is not None:
        ax.axvline(target * 1000, ls="--", color="grey", label=f"target {target * 1000:g} ms")
    ax.set(xlabel=f"{xlabel} (ms)", ylabel="fraction of samples ≤ x", title=title, ylim=(0, 1.02))
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, name)


def phase_bars(name: str, title: str, phases: Mapping[str, Sequence[tuple[str, float, float]]]
               ) -> Path | None:
    """Where a PD request's time went: per side (P, D, proxy), its phases stacked, p50 and p99
    side by side. ``phases[side]`` lists (phase, p50 s, p99 s) in the order a request meets
    them."""
    plt = _pyplot()
    if plt is None:
        return None
    sides = [s for s, rows in phases.items() if rows]
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    palette = plt.get_cmap("tab20").colors
    every = [f"{side}: {phase}" for side in sides for phase, _, _ in phases[side]]
    color = {name: palette[i % len(palette)] for i, name in enumerate(every)}
    seen: dict[str, Any] = {}
    for i, side in enumerate(sides):
        for j, q in enumerate(("p50", "p99")):
            x = i * 3 + j
            bottom = 0.0
            for phase, p50, p99 in phases[side]:
                value = (p50 if q == "p50" else p99) * 1000
                if not math.isfinite(value) or value <= 0:
                    continue
                bar = ax.bar(x, value, bottom=bottom, color=color[f"{side}: {phase}"],
                             edgecolor="white", linewidth=0.5)
                seen.setdefault(f"{side}: {phase}", bar)
                bottom += value
            ax.text(x, bottom, f"{bottom:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i * 3 + j for i in range(len(sides)) for j in (0, 1)],
                  [f"{s}\n{q}" for s in sides for q in ("p50", "p99")])
    ax.set(ylabel="ms (phases stacked; each quantile taken per phase)", title=title)
    ax.legend(seen.values(), seen.keys(), fontsize=7, bbox_to_anchor=(1.01, 1), loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    return _save(plt, fig, name)


def rate_vs_size(name: str, title: str, sizes_mib: Sequence[float],
                 lines: Mapping[str, Sequence[float]], reference: str) -> Path | None:
    """Transfer rate (GB/s) against size, one line per method; ``reference`` (the raw socket)
    dashed."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, gbps in lines.items():
        ax.plot(sizes_mib, gbps, marker="o", label=label,
                ls="--" if label == reference else "-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes_mib), [f"{m:g}" for m in sizes_mib])
    ax.set(xlabel="size (MiB)", ylabel="GB/s", title=title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(plt, fig, name)


def ratio_bars(name: str, title: str, rows: Mapping[str, tuple[float, float]],
               labels: tuple[str, str], unit: str) -> Path | None:
    """Two measures per row side by side (a baseline and the thing measured)."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    names = list(rows)
    for j, label in enumerate(labels):
        ax.bar([i * 3 + j for i in range(len(names))], [rows[n][j] for n in names], label=label)
    ax.set_xticks([i * 3 + 0.5 for i in range(len(names))], names, fontsize=8)
    ax.set(ylabel=unit, title=title)
    ax.set_yscale("log")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(plt, fig, name)


def phases_by_side(rows: Sequence[Any]) -> dict[str, list[tuple[str, float, float]]]:
    """``bench_client.phase_rows`` as :func:`phase_bars` takes them: the time phases of P and D,
    one after another on each side (not the sizes, rates or step counts, nor D's TTFT, which is
    their sum, nor the proxy's legs, which overlap each other and these)."""
    out: dict[str, list[tuple[str, float, float]]] = {"P": [], "D": []}
    for r in rows:
        if r.side in out and r.name.endswith("_seconds") and r.label != "time_to_first_token":
            out[r.side].append((r.label, r.p50, r.p99))
    return out
