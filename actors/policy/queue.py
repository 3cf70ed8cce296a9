"""The request queue: one entry per model (R-4.2), one `Waiter` per queued request.

Entries keep arrival order, so the first entry that still needs a slot is the head
(R-4.3). Every queued ticket is in exactly one entry and in `waiters`; the two change
together here and nowhere else.

With keys (issue 22) a waiter has a class level and a key, and the order is theirs: a
higher level goes first, a waiter's level rising by one for every `aging_s` it has waited
(so every request is served in the end); among the keys of the winning class, the key
served least goes next (round robin, by requests: one unit for all, so that keys with and
without a token budget can be weighed together); FIFO within a key. Each key's waiters
of an entry are its *lane*. Without keys there is one lane, and the order is arrival
order, at no extra cost. Within a lane, the requests that came with a session header
(their affinity is a session's) are served session by session, the least served first,
FIFO within each (`by_session`).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import msgspec

from ..config.keys import BATCH, BATCH_LEVEL
from ..config.rules import SESSION
from .order import ClassOrder

SCAN = 256
"""Waiters of a key's lane looked at for the session to serve next (`by_session`)."""
KILLS_OUTLIVED_MAX = 2
"""A queued request outlives this many loads killed by a signal (the OOM killer, an
operator, chaos) before one answers it: as many as a request whose child died under it
is sent on to next instances (the front's MAX_REPLAYS)."""


class Waiter(msgspec.Struct, eq=False, gc=False):
    """One queued request (a Struct: one is made for every request that waits, and
    msgspec makes it in a fifth of a dataclass's time; only numbers and strings in it,
    so no cycle for the collector to track)."""

    model: str
    queued_at: float
    deadline: float | None = None
    """When it gives up (queue_timeout_s), or None to wait as long as it takes."""
    key: str = ""
    level: int = 0
    """Its key's class level when it came."""
    kills_outlived: int = 0
    """Loads it waited on that were killed by a signal; past `KILLS_OUTLIVED_MAX` the next
    failure answers it."""
    cuttable: bool = False
    """Once granted, it may be cut for a higher class (cuts.py): a front's request, not
    cut before."""
    again: bool = False
    """It waits again, cut from its slot: first of its lane, its wait counted once."""
    affinity: int = 0
    """A hash of its prompt's start, for a model with copies routed by `prefix`."""


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
    lanes: dict[str, dict[Hashable, None]] = field(default_factory=dict)
    """Key -> its waiters here, in arrival order. Invariant: together, `waiters`."""
    served: dict[str, float] = field(default_factory=dict)
    """Key -> the requests granted to it here: the fair share's count. A key that comes
    back starts level with the least served key that waits, so it cannot claim a backlog
    of turns."""

    sessions: int = 0
    """Its waiters that came with a session (http.session_headers): while there are any,
    each key's lane is served session by session (`RequestQueue.by_session`)."""
    by_session: dict[tuple[str, int], float] = field(default_factory=dict)
    """(key, session) -> the requests granted to it here (0: none)."""

    def copy(self) -> QueueEntry:
        return QueueEntry(self.model, dict(self.waiters), self.explicit, self.claimed,
                          {k: dict(lane) for k, lane in self.lanes.items()}, dict(self.served),
                          self.sessions, dict(self.by_session))

    def batch_only(self) -> bool:
        """Only a batch's lines wait here (`batch:KEY`, issue 44): they take no turn, and
        make room only in the others' idle windows (turns.py, choice.py)."""
        return bool(self.lanes) and all(k.startswith(BATCH) for k in self.lanes)

    def put(self, ticket: Hashable, key: str, first: bool = False) -> None:
        """Add `ticket` at the back of its lane, or at its front (`first`)."""
        if first:
            self.waiters = {ticket: None, **self.waiters}
        else:
            self.waiters[ticket] = None
        lane = self.lanes.get(key)
        if lane is None:
            lane = self.lanes[key] = {}
            floor = min((self.served.get(k, 0.0) for k in self.lanes if k != key),
                        default=None)
            if floor is not None:
                self.served[key] = max(self.served.get(key, 0.0), floor)
        if first:
            self.lanes[key] = {ticket: None, **lane}
        else:
            lane[ticket] = None

    def pull(self, ticket: Hashable, key: str) -> None:
        del self.waiters[ticket]
        lane = self.lanes[key]
        del lane[ticket]
        if not lane:
            del self.lanes[key]


class RequestQueue:
    def __init__(self, aging_s: float = 0.0) -> None:
        self.entries: dict[str, QueueEntry] = {}
        """Model -> its entry, in arrival order."""
        self.waiters: dict[Hashable, Waiter] = {}
        self.changed: set[str] = set()
        """Models whose waiters changed since the policy last said so (a `queue` event)."""
        self.order: ClassOrder[QueueEntry] = ClassOrder(lambda: self.entries, self.best)
        """The entries' order while more than one class level waits (`ordered`)."""
        self._aging_s = aging_s
        self.levels: dict[int, int] = {}
        """Class level -> waiters of it: with one level, entries keep arrival order."""

    @property
    def aging_s(self) -> float:
        """A waiter's level rises by one for every this long it waits (0: never)."""
        return self._aging_s

    @aging_s.setter
    def aging_s(self, aging_s: float) -> None:
        self._aging_s = aging_s
        self.order.reset()

    def __len__(self) -> int:
        """Queued requests (not entries)."""
        return len(self.waiters)

    def __deepcopy__(self, memo: dict[int, object]) -> RequestQueue:
        """A copy for a plan (plans.py), made here in one pass: the generic deep copy
        of 10,000 waiters took a quarter of a second. The tickets are kept, not copied."""
        new = RequestQueue(self.aging_s)
        memo[id(self)] = new
        new.waiters = {t: Waiter(w.model, w.queued_at, w.deadline, w.key, w.level,
                                 w.kills_outlived, w.cuttable, w.again, w.affinity)
                       for t, w in self.waiters.items()}
        new.entries = {m: e.copy() for m, e in self.entries.items()}
        for model in new.entries:
            new.order.arrived(model)
        new.changed = set(self.changed)
        new.levels = dict(self.levels)
        return new

    def __contains__(self, ticket: Hashable) -> bool:
        return ticket in self.waiters

    def __iter__(self) -> Iterator[QueueEntry]:
        return iter(self.entries.values())

    def entry(self, model: str) -> QueueEntry | None:
        return self.entries.get(model)

    def behind(self, model: str) -> None:
        """`model`'s entry goes to the back: its waiters came after those of the entries
        it was ahead of (actors/policy/turns.py)."""
        self.entries[model] = self.entries.pop(model)
        self.order.arrived(model)

    def open(self, model: str) -> QueueEntry:
        """The model's entry, created at the back if it has none."""
        entry = self.entries.get(model)
        if entry is None:
            entry = self.entries[model] = QueueEntry(model)
            self.order.arrived(model)
        return entry

    def add(self, ticket: Hashable, model: str, now: float, deadline: float | None,
            key: str = "", level: int = 0, cuttable: bool = False,
            again: bool = False, affinity: int = 0) -> QueueEntry:
        """Queue `ticket`, come at `now`; a request cut from its slot waits `again`,
        first of its key's lane."""
        entry = self.open(model)
        entry.put(ticket, key, first=again)
        self.waiters[ticket] = Waiter(model, now, deadline, key, level, cuttable=cuttable,
                                      again=again, affinity=affinity)
        entry.sessions += affinity >= SESSION
        if entry.sessions:
            self.level(entry, key, affinity)
        self.levels[level] = self.levels.get(level, 0) + 1
        self.changed.add(model)
        if self.order.keys is not None:  # (order.changed, inline: every request's)
            self.order.stale.add(model)
        return entry

    def _forget(self, ticket: Hashable) -> Waiter:
        """Take `ticket` out of `waiters`, its entry and the level counts."""
        waiter = self.waiters.pop(ticket)
        entry = self.entries[waiter.model]
        entry.pull(ticket, waiter.key)
        entry.sessions -= waiter.affinity >= SESSION
        left = self.levels[waiter.level] - 1
        if left:
            self.levels[waiter.level] = left
        else:
            del self.levels[waiter.level]
        self.changed.add(waiter.model)
        if self.order.keys is not None:  # (order.changed, inline: every request's)
            self.order.stale.add(waiter.model)
        return waiter

    def rank(self, waiter: Waiter, now: float) -> float:
        """A waiter's level now, with what its wait has added (a batch's line: none)."""
        if not self._aging_s or waiter.level == BATCH_LEVEL:
            return waiter.level
        return waiter.level + (now - waiter.queued_at) / self._aging_s

    def best(self, entry: QueueEntry, now: float) -> float:
        """The rank of `entry`'s best lane head (-inf: it has none)."""
        return max((self.rank(self.waiters[next(iter(lane))], now)
                    for lane in entry.lanes.values()), default=float("-inf"))

    def next_of(self, entry: QueueEntry, now: float,
                skip: frozenset[str] | set[str] = frozenset()) -> Hashable | None:
        """The waiter of `entry` to serve next, leaving out the keys in `skip` (at their
        max_concurrency); None if there is none."""
        lanes = entry.lanes
        if len(lanes) == 1 and not skip:
            ticket = next(iter(entry.waiters), None)
            return ticket if not entry.sessions or ticket is None else \
                self.by_session(entry, ticket)
        best_rank: float | None = None
        best_level = 0
        heads: list[tuple[str, Hashable, Waiter]] = []
        for key, lane in lanes.items():
            if key in skip:
                continue
            head = next(iter(lane))
            waiter = self.waiters[head]
            heads.append((key, head, waiter))
            rank = self.rank(waiter, now)
            if best_rank is None or rank > best_rank:
                best_rank, best_level = rank, waiter.level
        if not heads:
            return None
        # the class that won; among its keys, the least served, then the longest waiting
        _, ticket, _ = min(((k, t, w) for k, t, w in heads if w.level == best_level),
                           key=lambda h: (entry.served.get(h[0], 0.0), h[2].queued_at))
        return ticket if not entry.sessions else self.by_session(entry, ticket)

    def level(self, entry: QueueEntry, key: str, affinity: int) -> None:
        """A session that comes to `key`'s lane with none of its requests there starts
        level with the most served of the sessions waiting in it: it goes after those
        served less, and a stream of new sessions (an id per request) cannot keep the
        lane's others waiting; one burst of a session still cannot starve another."""
        one = (key, affinity if affinity >= SESSION else 0)
        waiting = {(key, w.affinity if w.affinity >= SESSION else 0)
                   for w in map(self.waiters.__getitem__,
                                itertools.islice(entry.lanes[key], SCAN))}
        waiting.discard(one)
        floor = max((entry.by_session.get(s, 0.0) for s in waiting), default=None)
        if floor is not None and sum(  # (its first request here: the others' level)
                1 for t in itertools.islice(entry.lanes[key], SCAN)
                if (self.waiters[t].affinity if self.waiters[t].affinity >= SESSION
                    else 0) == one[1]) == 1:
            entry.by_session[one] = max(entry.by_session.get(one, 0.0), floor)

    def by_session(self, entry: QueueEntry, ticket: Hashable) -> Hashable:
        """Within the lane of `ticket`'s key: the first waiter of the session (or of the
        requests with none) granted least here, the earliest on a tie, among the first
        SCAN waiters; one cut from its slot (`again`) first. One agent's burst of
        parallel sub-tasks then cannot keep the same key's other conversation waiting."""
        head = self.waiters[ticket]
        if head.again:
            return ticket
        firsts: dict[int, Hashable] = {}  # session (0: none) -> its first waiter here
        for t in itertools.islice(entry.lanes[head.key], SCAN):
            affinity = self.waiters[t].affinity
            firsts.setdefault(affinity if affinity >= SESSION else 0, t)
        best, least = ticket, None
        for session, t in firsts.items():
            served = entry.by_session.get((head.key, session), 0.0)
            if least is None or served < least:
                best, least = t, served
        return best

    def served(self, model: str, key: str, amount: float) -> None:
        """Count `amount` (grants) as served to `key` in `model`'s entry."""
        entry = self.entries.get(model)
        if entry is not None:
            entry.served[key] = entry.served.get(key, 0.0) + amount

    def ordered(self, now: float) -> list[QueueEntry] | Iterator[QueueEntry]:
        """The entries in the order they claim slots: arrival order, unless waiters of
        more than one class level wait; then the entry whose best waiter ranks highest
        first (ties: arrival order)."""
        if len(self.levels) <= 1:
            if self.order.keys is not None:  # (kept only while it is used: order.py)
                self.order.reset()
            return iter(self.entries.values())
        return self.order.ordered(now)

    def remove(self, ticket: Hashable) -> tuple[Waiter, bool] | None:
        """Take `ticket` out; return its waiter and whether its entry went with it (it was
        the last waiter of an entry no load holds)."""
        if ticket not in self.waiters:
            return None
        waiter = self._forget(ticket)
        entry = self.entries[waiter.model]
        gone = not entry.waiters and not entry.explicit
        if gone:
            del self.entries[waiter.model]
        return waiter, gone

    def take(self, ticket: Hashable) -> Waiter:
        """Take `ticket` out of a non-empty entry that stays (it is being granted)."""
        waiter = self._forget(ticket)
        entry = self.entries[waiter.model]
        if entry.sessions or entry.by_session:  # (its session's turns within its key)
            served = entry.by_session
            one = (waiter.key, waiter.affinity if waiter.affinity >= SESSION else 0)
            served[one] = served.get(one, 0.0) + 1.0
            if len(served) > 4 * SCAN:  # (the sessions with no waiter left: forgotten)
                waiting = {(w.key, w.affinity if w.affinity >= SESSION else 0)
                           for w in map(self.waiters.__getitem__, entry.waiters)}
                entry.by_session = {k: n for k, n in served.items() if k in waiting}
        return waiter

    def drop(self, model: str) -> list[tuple[Hashable, Waiter]]:
        """Remove the model's entry; return its waiters, oldest first."""
        entry = self.entries.get(model)
        if entry is None:
            return []
        out = [(t, self._forget(t)) for t in list(entry.waiters)]
        del self.entries[model]
        self.order.changed(model)
        return out

    def keep_for_retries(self, model: str) -> list[tuple[Hashable, Waiter]]:
        """A load the entry waited on was killed by a signal: keep the waiters that have
        outlived fewer than `KILLS_OUTLIVED_MAX` kills (counted now); remove and return
        the others."""
        entry = self.entries.get(model)
        if entry is None:
            return []
        done = [(t, self._forget(t)) for t in list(entry.waiters)
                if self.waiters[t].kills_outlived >= KILLS_OUTLIVED_MAX]
        for t in entry.waiters:
            self.waiters[t].kills_outlived += 1
        self.close_if_empty(model)
        return done

    def close_if_empty(self, model: str) -> bool:
        """Drop the model's entry if nothing holds it any more; True if it is gone."""
        entry = self.entries.get(model)
        if entry is not None and not entry.waiters and not entry.explicit:
            del self.entries[model]
            self.order.changed(model)
        return model not in self.entries

    def clear(self) -> list[Hashable]:
        self.changed.update(w.model for w in self.waiters.values())
        tickets = list(self.waiters)
        self.entries.clear()
        self.waiters.clear()
        self.levels.clear()
        self.order.reset()
        return tickets

    def view(self, model: str, now: float) -> tuple[int, float | None]:
        """(requests waiting for `model`, how long the oldest of them has waited)."""
        entry = self.entries.get(model)
        if entry is None or not entry.waiters:
            return 0, None
        return len(entry.waiters), now - self.waiters[next(iter(entry.waiters))].queued_at

    def check(self) -> None:
        levels: dict[int, int] = {}
        for ticket, waiter in self.waiters.items():
            assert ticket in self.entries[waiter.model].waiters, (ticket, waiter.model)
            assert ticket in self.entries[waiter.model].lanes[waiter.key], (ticket, waiter.key)
            levels[waiter.level] = levels.get(waiter.level, 0) + 1
        assert levels == self.levels, (levels, self.levels)
        for entry in self.entries.values():
            assert sum(len(lane) for lane in entry.lanes.values()) == len(entry.waiters)
            assert all(entry.lanes.values()), f"{entry.model}: an empty lane"
        for name, entry in self.entries.items():
            assert entry.waiters or entry.explicit, f"{name}: empty entry"
            for ticket in entry.waiters:
                assert self.waiters[ticket].model == name
