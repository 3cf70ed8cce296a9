"""The events of cuts (`priority_preempt`; the rule is cuts.py's): asking for them when
a waiter of a higher class comes, and what the front answers, a request cut and waiting
again (`Requeue`) or one whose answer had begun (`NotCut`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

from ..messages import WaitDue
from .queue import QueueEntry
from .records import Effect, Later, ModelRecord, Preempt
from .rules import Rules
from .state import State

log = logging.getLogger("corral.scheduler")


class Preemption:
    """Cuts, on one `State`; `let_go` frees a request's slot in its model (core.py)."""

    def __init__(self, state: State, rules: Rules,
                 let_go: Callable[[str, int, float, bool, float], None]) -> None:
        self.state = state
        self.rules = rules
        self.moves = self.rules.moves
        self.let_go = let_go
        rules.ask_cuts = self.ask  # (a child that comes up serves its waiters: cuts too)

    def ask(self, model: ModelRecord, now: float) -> None:
        """Ask for the cuts that the waiters of a higher class need from `model`'s copies,
        serving and at their max_concurrency (one draining for a reload has no room
        either, but a slot it frees goes to nobody); a waiter gets one cut, whichever
        copy it is on."""
        state = self.state
        entry = state.queue.entry(model.group)
        if not state.cuts.on or entry is None:
            return
        copies = state.groups.of(model)
        for rec in copies:
            if (rec.state.is_serving and not rec.retiring and rec.rules.max_concurrency
                    and rec.in_flight >= rec.rules.max_concurrency):
                elsewhere = sum(state.cuts.asked(r.name, r.generation)
                                for r in copies if r is not rec)
                self._ask(rec, entry, elsewhere, now)

    def _ask(self, rec: ModelRecord, entry: QueueEntry, elsewhere: int, now: float) -> None:
        state = self.state
        skip = [key for key in entry.lanes if key and state.tenants.at_limit(key)]
        for ticket in state.cuts.wanted(rec.name, rec.generation, entry, state.queue, skip,
                                        now, elsewhere):
            slot = state.cuts.of[ticket]
            log.info("asking the front to cut a request of %s (class %s) on %s for a "
                     "waiter of a higher class (priority_preempt)", slot.key or "no key",
                     state.tenants.of(slot.key).priority, rec.name)
            state.out.append(Preempt(ticket))

    def where(self, now: float, key: str | None = None) -> None:
        """`ask` for every model `key` waits for (None: every model): its waiters
        may want cuts now (its max_concurrency let them go, or a reload's classes)."""
        if self.state.cuts.on:
            for entry in list(self.state.queue):
                if key is None or key in entry.lanes:
                    self.ask(self.state.models[entry.model], now)

    def requeue(self, ticket: Hashable, now: float) -> list[Effect]:
        """The front cut the request of `ticket` (nothing was sent to its client): its
        slot goes to the queue's next, and it waits again, first of its key's lane, aged
        from when it first came."""
        slot = self.state.cuts.forget(ticket)
        if slot is None or ticket not in self.state.leases:
            return []
        name, generation, key = self.state.leases.pop(ticket)
        rec = self.state.find(name)
        if rec is None or self.state.shutting_down:
            why = ("corral is shutting down" if rec is not None else
                   f"model '{name}' was removed")
            self.moves.refuse(ticket, 503, f"{why} while a request was cut to be sent again",
                              retry_after_s=1.0)
        else:
            stats = self.state.stats
            stats.cuts[(rec.group, key)] = stats.cuts.get((rec.group, key), 0) + 1
            timeout_s = rec.rules.queue_timeout_s
            self.state.queue.add(ticket, rec.group, slot.came_at,
                                 now + timeout_s if timeout_s else None, key, slot.level,
                                 again=True)
            if timeout_s:
                self.state.out.append(Later(timeout_s, WaitDue(ticket=ticket)))
        freed = bool(key) and self.state.tenants.released(key, 0, now)
        self.let_go(name, generation, now, False, 0.0)
        if rec is not None:  # an instance since the cut request's may serve or cut
            if self.state.has_room(rec):
                self.rules.serve_waiters(rec, now)
            self.ask(rec, now)
        if freed:
            self.rules.serve_queued(now, key)
            self.where(now, key)
        self.rules.pump(now)
        return self.moves.flush()

    def not_cut(self, ticket: Hashable, now: float) -> list[Effect]:
        """The front could not cut `ticket` (its answer had begun): cut another."""
        slot = self.state.cuts.refused(ticket)
        if slot is not None and (rec := self.state.find(slot.model)) is not None:
            self.ask(rec, now)
        return self.moves.flush()
