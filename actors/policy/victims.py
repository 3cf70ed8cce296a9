"""The victim choice (R-4.4): the least recently used model that may be evicted.

A heap of offers (last_used, seq, model), each valid while the model is evictable and its
`last_used` is unchanged; invalid offers are dropped when they reach the top, and the
whole heap is rebuilt whenever it holds more than twice the offers that can still be
valid, so it stays bounded by the number of models however many requests go by.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import overload

from .records import ModelRecord

SLACK = 8
"""Offers tolerated beyond two per model before a rebuild."""


class Victims:
    def __init__(self, evictable: Callable[[ModelRecord], bool]) -> None:
        self.evictable = evictable
        self.heap: list[tuple[float, int, str]] = []
        self.offered: dict[str, float] = {}
        """Model -> the last_used of its newest offer."""
        self._seq = itertools.count()

    def offer(self, rec: ModelRecord) -> None:
        """Offer `rec` if it is evictable now and not already offered as it is."""
        if not self.evictable(rec) or self.offered.get(rec.name) == rec.last_used:
            return
        self.offered[rec.name] = rec.last_used
        heapq.heappush(self.heap, (rec.last_used, next(self._seq), rec.name))
        if len(self.heap) > 2 * len(self.offered) + SLACK:
            self.heap = [o for o in self.heap if self.offered.get(o[2]) == o[0]]
            heapq.heapify(self.heap)

    def forget(self, name: str) -> None:
        """The model left the table (a reload removed it)."""
        self.offered.pop(name, None)

    def pick(self, models: dict[str, ModelRecord], now: float,
             resident_until: Callable[[ModelRecord], float],
             allowed: Callable[[ModelRecord], bool] | None = None,
             ) -> tuple[ModelRecord | None, float | None]:
        """The least recently used evictable model that has been resident long enough
        (min_resident_s) and is `allowed`, and, when only younger ones are left, when
        the first of them comes of age."""
        young: list[tuple[float, int, str]] = []
        passed: list[tuple[float, int, str]] = []
        found = None
        while self.heap:
            last_used, _, name = self.heap[0]
            rec = models.get(name)
            if rec is None or rec.last_used != last_used or not self.evictable(rec):
                heapq.heappop(self.heap)
                if rec is None or self.offered.get(name) == last_used:
                    self.offered.pop(name, None)
                continue
            if allowed is not None and not allowed(rec):
                passed.append(heapq.heappop(self.heap))
                continue
            if resident_until(rec) > now:
                young.append(heapq.heappop(self.heap))
                continue
            found = rec
            break
        for offer in young + passed:
            heapq.heappush(self.heap, offer)
        if found is not None or not young:
            return found, None
        return None, min(resident_until(models[o[2]]) for o in young)

    def ranked(self, models: dict[str, ModelRecord], now: float,
               resident_until: Callable[[ModelRecord], float]) -> list[ModelRecord]:
        """Every model `pick` could return, least recently used first (for a memory plan,
        which may need several)."""
        return [rec for last, _, name in sorted(self.heap)
                if (rec := models.get(name)) is not None and rec.last_used == last
                and self.evictable(rec) and resident_until(rec) <= now]

    def check(self, models: dict[str, ModelRecord]) -> None:
        assert len(self.heap) <= 2 * len(models) + SLACK + 1, "victim heap unbounded"
        offers = {(name, last) for last, _, name in self.heap}
        for rec in models.values():
            if self.evictable(rec):
                assert (rec.name, rec.last_used) in offers, f"{rec.name}: evictable, unoffered"


class Deferred(Sequence[ModelRecord]):
    """Victims listed when first read: a plan that fits as things are reads none, and
    listing them (every idle model, ranked) cost a busy cluster's plans a fifth of
    their time. Nothing a plan reads them for changes before it reads them."""

    __slots__ = ("_items", "_make")

    def __init__(self, make: Callable[[], list[ModelRecord]]) -> None:
        self._make = make
        self._items: list[ModelRecord] | None = None

    def _listed(self) -> list[ModelRecord]:
        if self._items is None:
            self._items = self._make()
        return self._items

    @overload
    def __getitem__(self, i: int) -> ModelRecord: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[ModelRecord]: ...

    def __getitem__(self, i: int | slice) -> ModelRecord | Sequence[ModelRecord]:
        return self._listed()[i]

    def __len__(self) -> int:
        return len(self._listed())

    def __iter__(self) -> Iterator[ModelRecord]:
        return iter(self._listed())
