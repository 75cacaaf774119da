"""A ``stats()`` dict as Prometheus metrics, read at scrape time: a number becomes a gauge (a
counter when its key ends in ``_total``), a dict of numbers a metric with a ``key`` label. The
worker, the proxy and the bootstrap server each export theirs this way."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _name(key: str) -> str:
    return _BAD.sub("_", key)


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, int | float):
        return float(v)
    return None


class StatsCollector(Collector):
    """Exports a ``stats()`` dict on every scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], prefix: str) -> None:
        self._stats = stats
        self._prefix = prefix

    def collect(self) -> Iterator[Metric]:
        for key, value in sorted(self._stats().items()):
            name = f"{self._prefix}_{_name(key)}"
            is_counter = key.endswith("_total")
            base = name[: -len("_total")] if is_counter else name
            doc = f"backend stats()['{key}']"
            if isinstance(value, dict):
                family: Metric = (
                    CounterMetricFamily(base, doc, labels=["key"])
                    if is_counter
                    else GaugeMetricFamily(base, doc, labels=["key"])
                )
                for sub, v in sorted(value.items(), key=lambda kv: str(kv[0])):
                    n = _number(v)
                    if n is not None:
                        family.add_metric([str(sub)], n)  # type: ignore[attr-defined]
                yield family
                continue
            n = _number(value)
            if n is None:
                continue
            if is_counter:
                yield CounterMetricFamily(base, doc, value=n)
            else:
                yield GaugeMetricFamily(name, doc, value=n)
