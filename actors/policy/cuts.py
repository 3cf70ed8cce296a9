"""Cutting a lower class's request for a higher class's waiter (`priority_preempt`).

A model at its max_concurrency serves its queue only as its requests end, so a waiter of
a higher class, first in line, still waits for the first running request to end: beside a
flood of long batch requests, most of one. With `priority_preempt` the policy takes a slot
back instead. For each waiter of a class above the lowest running one (beyond the cuts
already asked for), it asks the front to cut one running request (`Preempt`, a `Cut` on
its ticket):

- of the lowest class below the waiter's, the most recently granted (the least work lost);
- never one cut before: a request is cut at most once, so every request still ends;
- never one whose client has had a byte of its answer: only the front knows, and it says
  so (`NotCut`); the policy then asks for another.

Only a front's request may be cut (`Acquire.cuttable`: not one cut before, nor an
embedding's lease, which nothing could cut), and only for a waiter the freed slot would go
to (with `priority_aging_s`, an aged waiter of a lower class may rank first: then no cut).
The front drops the child's connection (the child drops the work) and gives the slot
back (`Requeue`): the request waits again, first in its key's lane, aged from when it
first came (so a request that has run long is the less likely to be cut) and with a fresh
queue_timeout_s.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from .queue import QueueEntry, RequestQueue


@dataclass(eq=False, slots=True)
class Slot:
    """A granted request of a max_concurrency model, as a victim."""

    model: str
    generation: int
    key: str
    level: int
    granted_at: float
    came_at: float
    """When it first came (its place when it waits again)."""
    cut: bool = False
    """It was cut before, or its answer had begun when asked: never asked again."""
    asked: bool = False
    """A Cut is out for it, not answered yet."""


class Cuts:
    """The granted requests that may be cut, by model, while `priority_preempt` is on."""

    def __init__(self) -> None:
        self.on = False
        self.slots: dict[str, dict[Hashable, Slot]] = {}
        self.of: dict[Hashable, Slot] = {}

    def granted(self, ticket: Hashable, slot: Slot) -> None:
        self.slots.setdefault(slot.model, {})[ticket] = slot
        self.of[ticket] = slot

    def forget(self, ticket: Hashable) -> Slot | None:
        """The request of `ticket` ended, or gave its slot back."""
        slot = self.of.pop(ticket, None)
        if slot is not None:
            running = self.slots[slot.model]
            del running[ticket]
            if not running:
                del self.slots[slot.model]
        return slot

    def asked(self, model: str, generation: int) -> int:
        """How many cuts are out for requests of `model`'s `generation`."""
        return sum(s.asked and s.generation == generation
                   for s in self.slots.get(model, {}).values())

    def wanted(self, model: str, generation: int, entry: QueueEntry, queue: RequestQueue,
               skip: Iterable[str], now: float, elsewhere: int = 0) -> list[Hashable]:
        """The requests of `model` to cut now for the waiters of `entry` (leaving out the
        keys in `skip`, at their max_concurrency); each is marked asked. `elsewhere`:
        the cuts out for the same waiters on the model's other copies (issue 24).

        A freed slot goes to the waiter that ranks highest (queue.next_of: its level and
        what its wait has added), so a cut is asked only for a waiter of a higher class
        that would get it: one that outranks every waiter no cut is for, and the request
        cut, waiting again aged from when it first came. Every rank grows at one pace, so
        what is wanted changes only with events, never with the time alone."""
        running = [(t, s) for t, s in self.slots.get(model, {}).items()
                   if s.generation == generation]
        asked = sum(s.asked for _, s in running) + elsewhere
        # the lowest class first, and in it the most recently granted
        open_ = sorted(((t, s) for t, s in running if not (s.cut or s.asked)),
                       key=lambda ts: (ts[1].level, -ts[1].granted_at))
        if not open_:
            return []
        floor = open_[0][1].level
        skipped = set(skip)
        cutters: list[tuple[float, int]] = []  # (rank, level) of the waiters cuts are for
        first = float("-inf")  # the best rank of the others: served before any cut's
        for key, lane in entry.lanes.items():  # a lane's waiters are of one key
            if key in skipped:
                continue
            head = queue.waiters[next(iter(lane))]
            if head.level <= floor:
                first = max(first, queue.rank(head, now))  # a lane's head ranks highest
                continue
            cutters.extend((queue.rank(w, now), w.level)
                           for w in (queue.waiters[t] for t in lane))
        cutters.sort(reverse=True)
        out: list[Hashable] = []
        aging_s = queue.aging_s

        def back(slot: Slot) -> float:  # (its rank once cut, waiting again)
            return slot.level + ((now - slot.came_at) / aging_s if aging_s else 0)
        for _, slot in running:  # the cuts out: each comes back to wait, ranked so
            if slot.asked and not slot.cut:
                first = max(first, back(slot))
        for (rank, level), (ticket, slot) in zip(cutters[asked:], open_, strict=False):
            first = max(first, back(slot))
            if slot.level >= level or rank <= first:
                break
            slot.asked = True
            out.append(ticket)
        return out

    def refused(self, ticket: Hashable) -> Slot | None:
        """The front could not cut `ticket` (its answer had begun): never asked again."""
        slot = self.of.get(ticket)
        if slot is None or not slot.asked:
            return None
        slot.asked, slot.cut = False, True
        return slot
