"""The request queue: one entry per model (R-4.2), one `Waiter` per queued request.

Entries keep arrival order, so the first entry that still needs a slot is the head
(R-4.3). Every queued ticket is in exactly one entry and in `waiters`; the two change
together here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

KILLS_OUTLIVED_MAX = 2
"""A queued request outlives this many loads killed by a signal (the OOM killer, an
operator, chaos) before one answers it: as many as a request whose child died under it
is sent on to next instances (the front's MAX_REPLAYS)."""


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request."""

    model: str
    queued_at: float
    deadline: float | None = None
    """When it gives up (queue_timeout_s), or None to wait as long as it takes."""
    kills_outlived: int = 0
    """Loads it waited on that were killed by a signal; past `KILLS_OUTLIVED_MAX` the next
    failure answers it."""


@dataclass(eq=False)
class QueueEntry:
    """Requests waiting for one model; N requests for one model share one entry (R-4.2)."""

    model: str
    waiters: dict[Hashable, None] = field(default_factory=dict)
    """Tickets in arrival order (a dict as an ordered set)."""
    explicit: bool = False
    """Held by POST /models/load (or a permanent restart): it stays even with no waiter."""
    claimed: bool = False
    """A spawn was made for it (R-4.5: claimed-not-yet-ready)."""


class RequestQueue:
    def __init__(self) -> None:
        self.entries: dict[str, QueueEntry] = {}
        """Model -> its entry, in arrival order."""
        self.waiters: dict[Hashable, Waiter] = {}
        self.changed: set[str] = set()
        """Models whose waiters changed since the policy last said so (a `queue` event)."""

    def __len__(self) -> int:
        """Queued requests (not entries)."""
        return len(self.waiters)

    def __contains__(self, ticket: Hashable) -> bool:
        return ticket in self.waiters

    def __iter__(self) -> Iterator[QueueEntry]:
        return iter(self.entries.values())

    def entry(self, model: str) -> QueueEntry | None:
        return self.entries.get(model)

    def open(self, model: str) -> QueueEntry:
        """The model's entry, created at the back if it has none."""
        entry = self.entries.get(model)
        if entry is None:
            entry = self.entries[model] = QueueEntry(model)
        return entry

    def add(self, ticket: Hashable, model: str, now: float,
            deadline: float | None) -> QueueEntry:
        entry = self.open(model)
        entry.waiters[ticket] = None
        self.waiters[ticket] = Waiter(model, now, deadline)
        self.changed.add(model)
        return entry

    def remove(self, ticket: Hashable) -> tuple[Waiter, bool] | None:
        """Take `ticket` out; return its waiter and whether its entry went with it (it was
        the last waiter of an entry no load holds)."""
        waiter = self.waiters.pop(ticket, None)
        if waiter is None:
            return None
        entry = self.entries[waiter.model]
        del entry.waiters[ticket]
        self.changed.add(waiter.model)
        gone = not entry.waiters and not entry.explicit
        if gone:
            del self.entries[waiter.model]
        return waiter, gone

    def take(self, ticket: Hashable) -> Waiter:
        """Take `ticket` out of a non-empty entry that stays (it is being granted)."""
        waiter = self.waiters.pop(ticket)
        del self.entries[waiter.model].waiters[ticket]
        self.changed.add(waiter.model)
        return waiter

    def drop(self, model: str) -> list[tuple[Hashable, Waiter]]:
        """Remove the model's entry; return its waiters, oldest first."""
        entry = self.entries.pop(model, None)
        if entry is None:
            return []
        if entry.waiters:
            self.changed.add(model)
        return [(t, self.waiters.pop(t)) for t in entry.waiters]

    def keep_for_retries(self, model: str) -> list[tuple[Hashable, Waiter]]:
        """A load the entry waited on was killed by a signal: keep the waiters that have
        outlived fewer than `KILLS_OUTLIVED_MAX` kills (counted now); remove and return
        the others."""
        entry = self.entries.get(model)
        if entry is None:
            return []
        done = [(t, self.waiters[t]) for t in entry.waiters
                if self.waiters[t].kills_outlived >= KILLS_OUTLIVED_MAX]
        for t, _ in done:
            del self.waiters[t]
            del entry.waiters[t]
            self.changed.add(model)
        for t in entry.waiters:
            self.waiters[t].kills_outlived += 1
        self.close_if_empty(model)
        return done

    def close_if_empty(self, model: str) -> bool:
        """Drop the model's entry if nothing holds it any more; True if it is gone."""
        entry = self.entries.get(model)
        if entry is not None and not entry.waiters and not entry.explicit:
            del self.entries[model]
        return model not in self.entries

    def clear(self) -> list[Hashable]:
        self.changed.update(w.model for w in self.waiters.values())
        tickets = list(self.waiters)
        self.entries.clear()
        self.waiters.clear()
        return tickets

    def view(self, model: str, now: float) -> tuple[int, float | None]:
        """(requests waiting for `model`, how long the oldest of them has waited)."""
        entry = self.entries.get(model)
        if entry is None or not entry.waiters:
            return 0, None
        return len(entry.waiters), now - self.waiters[next(iter(entry.waiters))].queued_at

    def check(self) -> None:
        for ticket, waiter in self.waiters.items():
            assert ticket in self.entries[waiter.model].waiters, (ticket, waiter.model)
        for name, entry in self.entries.items():
            assert entry.waiters or entry.explicit, f"{name}: empty entry"
            for ticket in entry.waiters:
                assert self.waiters[ticket].model == name
