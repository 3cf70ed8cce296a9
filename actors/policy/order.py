"""The queue's entries in the order they claim slots while more than one class level
waits (queue.py's `ordered`), kept sorted as the queue changes instead of sorted again
at every run of the rules.

An entry ranks by its best lane head: its level, plus what its wait has added
(`RequestQueue.rank`: one level for every `aging_s`). The wait adds the same to every
waiter as time passes, so the order of the entries does not change with time, only with
the queue: an entry's key is its rank at one moment, `at` (the last full sort), and only
the entries whose lanes changed since are placed again. A batch's line does not age, but
ranks below every class (BATCH_LEVEL), so it stays last. Ties keep arrival order, as the
stable sort did: the key carries the entry's place in arrival order. One difference, by
the last bit: ranks that tie exactly (a level higher, one `aging_s` later) may round
apart at one moment and not at another, so the sort at each moment ordered such entries
either way; here they keep the order of the moment `at`.

At 1,000 models and 10,000 waiters of two classes, sorting every entry at each run was
nearly all of a decision's cost (`python -m bench scheduler --configured`).
"""

from __future__ import annotations

import itertools
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, Protocol, TypeVar

Key = tuple[float, int]
"""(minus the entry's best rank at `at`, its place in arrival order): ascending."""


class Entry(Protocol):
    """What it orders: a queue entry (queue.py's `QueueEntry`), known by its model."""

    model: str


E = TypeVar("E", bound=Entry)


class ClassOrder(Generic[E]):
    """The entries sorted by `Key`, for one queue: its entries by model, in arrival order,
    and the best rank of an entry's lane heads at a time (queue.py's)."""

    def __init__(self, entries: Callable[[], Mapping[str, E]],
                 best: Callable[[E, float], float]) -> None:
        self.entries_of = entries
        self.best = best
        self.keys: list[Key] | None = None
        """Sorted; None: sort all again at the next `ordered`."""
        self.entries: list[E] = []
        self.key_of: dict[str, Key] = {}
        self.stale: set[str] = set()
        """Models whose lane heads changed since the last `ordered`."""
        self.at = 0.0
        self.place: dict[str, int] = {}
        """Model -> its entry's place in arrival order (the queue's dict order)."""
        self.count = itertools.count()

    def arrived(self, model: str) -> None:
        """`model`'s entry went to the back of arrival order (new, or `behind`)."""
        self.place[model] = next(self.count)
        self.changed(model)

    def changed(self, model: str) -> None:
        if self.keys is not None:
            self.stale.add(model)

    def reset(self) -> None:
        """What every key depends on changed (aging_s, or the queue cleared)."""
        self.keys = None
        self.stale.clear()

    def ordered(self, now: float) -> list[E]:
        """The queue's entries in claim order: a new list."""
        entries = self.entries_of()
        if self.keys is None:
            self.at = now
            self.stale.clear()
            pairs = sorted(((self.key(e), e) for e in entries.values()), key=lambda p: p[0])
            self.keys = [k for k, _ in pairs]
            self.entries = [e for _, e in pairs]
            self.key_of = {e.model: k for k, e in pairs}
        elif self.stale:
            self.place_again(entries, self.stale)
            self.stale.clear()
        return list(self.entries)

    def place_again(self, entries: Mapping[str, E], models: Iterable[str]) -> None:
        keys = self.keys
        assert keys is not None
        for model in models:
            old = self.key_of.pop(model, None)
            if old is not None:
                i = bisect_left(keys, old)
                del keys[i], self.entries[i]
            entry = entries.get(model)
            if entry is not None:
                self.key_of[model] = key = self.key(entry)
                i = bisect_left(keys, key)
                keys.insert(i, key)
                self.entries.insert(i, entry)

    def key(self, entry: E) -> Key:
        return (-self.best(entry, self.at), self.place[entry.model])
