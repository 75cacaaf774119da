"""`make bench`'s table reads each bench's figure from its output (bench/headline.py): the
readers against lines those benches printed in a real run, and a failed bench or a changed output
reported as FAILED instead of a figure."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _headline() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_headline", ROOT / "bench" / "headline.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


headline = _headline()
BY_NAME = {h.name: h for h in headline.HEADLINES}

SAMPLES = {
    "core": ("core, 1,000 live rooms              6.401 us/event       156,230 events/s\n",
             "156,230 events/s (6.401 µs/event)"),
    "sim": ("1000 seeds, 0 failing, 95 seeds/s (339 steps a seed); answers {'200': 8004}\n",
            "1000 seeds, 0 failing, 95 seeds/s"),
    "transfer": ("| 16 MiB | 1.50 | 0.68 | 1.03 | 2.30 | 2.20x | 1.45x | 0.65x |\n",
                 "1.50 GB/s, 2.20x the defaults, 0.65x a raw socket"),
    "io": ("  heartbeats/s ( 1 connection(s))             636\n"
           "  heartbeats/s ( 4 connection(s))            1310\n"
           "  GET /health (baseline)             p50  1.849 ms   p99  3.118 ms\n"
           "  GET /route by key                  p50  1.122 ms   p99  1.659 ms\n",
           "1310 heartbeats/s; GET /route p50 1.122 ms"),
    "model": ("prefill: 512 tokens in 915.1 ms -> 559 tokens/s (first call incl. compile 2.3s)\n"
              "decode batch 1: 53.7 ms/step, 53.69 ms/token, 19 tokens/s (context 512)\n",
              "prefill 559 tokens/s; decode 53.7 ms/token"),
    "pd": ("p99 ratio (arriving / baseline): 1.17   p50 ratio: 1.12\n",
           "p99 1.17x, p50 1.12x the baseline"),
    "tax": ("TTFT p50 ms               112.12         84.03            1.33\n"
            "TTFT p50 PD - colocated: +28.1 ms\n",
            "+28.1 ms p50 (PD 112.12 vs colocated 84.03 ms)"),
}


def test_every_headline_has_a_sample_and_a_page() -> None:
    assert set(BY_NAME) == set(SAMPLES)
    for h in headline.HEADLINES:
        page = h.page.split(" ")[0]
        assert (ROOT / page).exists(), page


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_each_reader_finds_its_figure(name: str) -> None:
    output, figure = SAMPLES[name]
    assert BY_NAME[name].read(output) == figure
    assert BY_NAME[name].read("an output of another shape\n") is None


def test_a_failed_bench_is_reported_not_read(tmp_path: Path) -> None:
    failing = headline.Headline("boom", "a bench that fails", (sys.executable, "-c",
                                "print('p99 ratio (arriving / baseline): 1.0   p50 ratio: 1.0');"
                                " raise SystemExit(3)"), BY_NAME["pd"].read, "bench/README.md")
    figure, _, ok = headline.run(failing, tmp_path)
    assert not ok and figure.startswith("FAILED (exit 3")
    silent = headline.Headline("mute", "a bench that prints nothing", (sys.executable, "-c", ""),
                               BY_NAME["pd"].read, "bench/README.md")
    figure, _, ok = headline.run(silent, tmp_path)
    assert not ok and "figure not found" in figure
