"""How fast each model answers, and what it and each key used, as a front sees each
answer end (issue 40, part 3; GET /metrics, GET /keys).

Per model (the one that answered): the time to a stream's first token (from the
request's arrival: its queue wait and load included, what its client saw), the time
per output token after it (the stream's own timing: from its first event to its end,
over its tokens but the first), and tokens per second (llama-server's
`predicted_per_second` where it says, else the stream's); and counters of prompt,
completion and cached tokens, as the answers said them (figures.py; a stream that says
none counts its events as completion tokens). Per named key: requests, and the same
three counters. A front's are summed over the fronts (`merge`).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from ..histogram import BUCKETS_S, Histogram
from ..journal.record import Said
from ..messages import HistogramView

TPOT_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
          0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
"""Bounds of the time per output token, in seconds."""
TOKENS_PER_S = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 150.0,
                200.0, 300.0, 500.0, 1000.0, 2500.0, 5000.0)


class SpeedRow(msgspec.Struct, frozen=True, kw_only=True):
    """One model's, as a front hands them over (control.FrontCounts)."""

    model: str
    ttft: HistogramView
    tpot: HistogramView
    tps: HistogramView
    tokens: tuple[int, int, int]
    """Prompt, completion and cached tokens."""


class _Model:
    __slots__ = ("tokens", "tpot", "tps", "ttft")

    def __init__(self) -> None:
        self.ttft = Histogram(BUCKETS_S)
        self.tpot = Histogram(TPOT_S)
        self.tps = Histogram(TOKENS_PER_S)
        self.tokens = [0, 0, 0]


class Speeds:
    """One front's, per model."""

    def __init__(self) -> None:
        self.models: dict[str, _Model] = {}

    def observe(self, model: str, said: Said | None, events: int, stream: bool,
                arrived: float, first_body: float | None, end: float) -> None:
        """An answer that succeeded ended (`events`: a stream's JSON events)."""
        m = self.models.get(model)
        if m is None:
            m = self.models[model] = _Model()
        completion = said.completion if said is not None else None
        if completion is None and stream:
            completion = events
        if said is not None:
            m.tokens[0] += said.prompt or 0
            m.tokens[2] += said.cached or 0
        m.tokens[1] += completion or 0
        per_s = said.predicted_per_s if said is not None else None
        if stream and first_body is not None:
            m.ttft.observe(first_body - arrived)
            took = end - first_body
            if completion and completion > 1 and took > 0:
                m.tpot.observe(took / (completion - 1))
                if per_s is None:
                    per_s = (completion - 1) / took
        if per_s:
            m.tps.observe(per_s)

    def rows(self) -> list[SpeedRow]:
        return [SpeedRow(model=name, ttft=m.ttft.view(), tpot=m.tpot.view(), tps=m.tps.view(),
                         tokens=(m.tokens[0], m.tokens[1], m.tokens[2]))
                for name, m in self.models.items()]


def merge(fronts: Iterable[list[SpeedRow]]) -> list[SpeedRow]:
    """Several fronts' rows as one front's."""
    out: dict[str, SpeedRow] = {}
    for rows in fronts:
        for r in rows:
            o = out.get(r.model)
            out[r.model] = r if o is None else SpeedRow(
                model=r.model, ttft=_sum(o.ttft, r.ttft), tpot=_sum(o.tpot, r.tpot),
                tps=_sum(o.tps, r.tps),
                tokens=(o.tokens[0] + r.tokens[0], o.tokens[1] + r.tokens[1],
                        o.tokens[2] + r.tokens[2]))
    return list(out.values())


def _sum(a: HistogramView, b: HistogramView) -> HistogramView:
    return HistogramView(counts=[x + y for x, y in zip(a.counts, b.counts, strict=True)],
                         sum=a.sum + b.sum)


class KeyUses:
    """A front's count of what each named key used: requests, and prompt, completion and
    cached tokens (GET /metrics, GET /keys; summed over the fronts)."""

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int, int, int]] = {}

    def add(self, key: str, prompt: int, completion: int, cached: int = 0) -> None:
        n, p, c, k = self.counts.get(key, (0, 0, 0, 0))
        self.counts[key] = (n + 1, p + prompt, c + completion, k + cached)
