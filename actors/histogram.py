"""Latency histograms with fixed buckets: the Scheduler's queue waits and load times, the
front's request times. Counted where they happen, shown as `messages.HistogramView`."""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TypeVar

from .messages import HistogramView

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
             120.0, 300.0, 600.0)
"""Histogram bucket bounds in seconds (queue waits, loads, request times)."""


@dataclass
class Histogram:
    """Observations in buckets bounded by `bounds` (BUCKETS_S unless told; the last
    bucket is +Inf)."""

    bounds: tuple[float, ...] = BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def view(self) -> HistogramView:
        return HistogramView(counts=list(self.counts), sum=self.total)


K = TypeVar("K", bound=Hashable)


def observe(table: dict[K, Histogram], key: K, value: float,
            bounds: tuple[float, ...] = BUCKETS_S) -> None:
    """Count `value` in `table[key]`, made on first use."""
    hist = table.get(key)
    if hist is None:
        hist = table[key] = Histogram(bounds)
    hist.observe(value)
