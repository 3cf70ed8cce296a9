"""Who may be evicted for whom (R-4.4): the least recently used idle model; a spare copy
(above its model's `min`) first; for memory, suspended models that still hold a device
last; never a member of a persistent group for a model outside it (teams.py); for a batch's
lines alone, only a model no request of a class has used for `[batches] idle_s` (issue 44).

It only chooses (and sets a timer for when a model too young to go comes of age): the
caller evicts (Moves.evict).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config.keys import BATCH
from ..lifecycle import ModelState
from ..messages import Repump
from .records import Later, ModelRecord
from .replicas import UP
from .state import State
from .victims import Deferred

S = ModelState


class Choice:
    """The victim choice on one `State`."""

    def __init__(self, state: State) -> None:
        self.state = state

    def kept_from(self, rec: ModelRecord, for_model: str | None) -> bool:
        return self.state.kept_from(rec, for_model)

    def pick_victim(self, now: float, for_model: str | None = None) -> ModelRecord | None:
        """The least recently used model that is idle, serving, unpinned, not wanted and
        resident for its min_resident_s, and not kept from `for_model` by a persistent
        group; if only young ones are left, wake up when the first comes of age (R-4.4)."""
        extra = self.extra_victim(now, for_model)
        if extra is not None:
            return extra
        teams = self.state.teams
        kept = (lambda r: not self.kept_from(r, for_model)) \
            if teams.kept or teams.partners else None
        window = self.batch_window(now, for_model)
        allowed = kept if window is None else window if kept is None else \
            (lambda r: kept(r) and window(r))
        victim, wake = self.state.victims.pick(self.state.models, now,
                                               self.state.resident_until, allowed)
        if victim is None and window is not None:
            wake = min((r.asked_at + self.state.tenants.of(BATCH).idle_s
                        for r in self.state.models.values()
                        if self.state.evictable(r) and not window(r)), default=wake)
        if wake is not None:
            self.wake_at(wake, now)
        return victim

    def wake_at(self, wake: float, now: float) -> None:
        """Decide again at `wake` (a Repump), unless an earlier one is set."""
        if self.state.wake_at is None or wake < self.state.wake_at:
            self.state.wake_at = wake
            self.state.out.append(Later(wake - now, Repump()))

    def batch_window(self, now: float,
                     for_model: str | None) -> Callable[[ModelRecord], bool] | None:
        """Which models may go for `for_model` when only a batch's lines wait for it: those
        no request of a class has used for [batches] idle_s (None: any, it is not so)."""
        entry = self.state.queue.entries.get(for_model) if for_model is not None else None
        if entry is None or not entry.batch_only():
            return None
        return self.window(now)

    def window(self, now: float) -> Callable[[ModelRecord], bool]:
        """Whether a model's idle window is open: no request of a class has used it for
        [batches] idle_s (the same sum as the Repump set for its opening)."""
        idle_s = self.state.tenants.of(BATCH).idle_s
        return lambda r: r.asked_at + idle_s <= now

    def nodes_victims(self, now: float, rec: ModelRecord) -> list[ModelRecord]:
        """What a load of `rec` may stop on a node at its cap (no memory accounting): the
        LRU idle models, less a persistent group's, and for a batch's lines alone those in
        their idle window (a Repump for the first to open)."""
        victims = self.state.victims.ranked(self.state.models, now, self.state.resident_until)
        if self.state.teams.kept:
            victims = [v for v in victims if not self.kept_from(v, rec.group)]
        return self.in_window(now, victims, self.batch_window(now, rec.group))

    def in_window(self, now: float, victims: list[ModelRecord],
                  window: Callable[[ModelRecord], bool] | None) -> list[ModelRecord]:
        """`victims` in their idle window (all: `window` None); a Repump for when the
        first of the others' opens."""
        if window is None:
            return victims
        if (shut := [v for v in victims if not window(v)]):
            self.wake_at(min(v.asked_at for v in shut) + self.state.tenants.of(BATCH).idle_s,
                         now)
        return [v for v in victims if window(v)]

    def extra_victim(self, now: float, for_model: str | None = None) -> ModelRecord | None:
        """The least recently used idle copy above its model's `min` (a spare): the first
        victim for a slot or memory, before any model's last copy (issue 24)."""
        state = self.state
        if not state.groups.active:
            return None
        window = self.batch_window(now, for_model)
        return min((r for group in state.groups.active.values() for r in group
                    if state.evictable(r) and state.resident_until(r) <= now
                    and state.above_min(r) and not self.kept_from(r, for_model)
                    and (window is None or window(r))),
                   key=lambda r: r.last_used, default=None)

    def spares(self, victims: list[ModelRecord]) -> set[ModelRecord]:
        """The copies among `victims` (least recently used first) that their models can
        do without: of each model, as many as it has up above its `min`."""
        left = {name: sum(r.state in UP for r in group) - c.min
                for name, group in self.state.groups.active.items()
                if (c := group[0].rules.replicas) is not None}
        spare = set()
        for r in victims:
            if left.get(r.group, 0) > 0 and r.state in UP:
                spare.add(r)
                left[r.group] -= 1
        return spare

    def wake_when_of_age(self, now: float, nodes: list[str] | None = None) -> None:
        """Something waits for what an idle model too young to be evicted holds (its
        min_resident_s; on one of `nodes`, where given): the rules run again when the
        first comes of age, as `pick_victim` has them for a slot. Without it, a memory
        plan that left young models out waited for an unrelated event."""
        state, models = self.state, self.state.models
        # (every evictable model is offered on the victims' heap: its names, not all models)
        young = [until for name in {offer[2] for offer in state.victims.heap}
                 if (r := models.get(name)) is not None
                 and (until := state.resident_until(r)) > now
                 and (nodes is None or r.node in nodes) and state.evictable(r)]
        if young and (state.wake_at is None or min(young) < state.wake_at):
            state.wake_at = min(young)
            state.out.append(Later(state.wake_at - now, Repump()))

    def victims_later(self, now: float, for_model: str | None = None,
                      ) -> Sequence[ModelRecord]:
        """`memory_victims`, listed when a plan first reads them (most fit as things are);
        at once for a batch's lines alone, whose listing sets the timer for the first
        idle window to open whether or not the plan reads it."""
        if self.batch_window(now, for_model) is not None:
            return self.memory_victims(now, for_model)
        return Deferred(lambda: self.memory_victims(now, for_model))

    def memory_victims(self, now: float, for_model: str | None = None) -> list[ModelRecord]:
        """What may be evicted for memory (for `for_model`), in order: the idle models,
        least recently used first, then the suspended ones that still hold some of a
        device (a CUDA context left behind), least recently used first (issue 23: they
        are stopped)."""
        state = self.state
        victims = state.victims.ranked(state.models, now, state.resident_until)
        if state.groups.active:  # spare copies (above their min) go first (issue 24)
            spare = self.spares(victims)
            victims.sort(key=lambda r: r not in spare)
        if state.n_suspended:
            victims += sorted((r for r in state.models.values() if r.state is S.SUSPENDED
                               and not r.draining and state.ledger.held.get(r.name)),
                              key=lambda r: r.last_used)
        if state.teams.kept or state.teams.partners:
            victims = [v for v in victims if not self.kept_from(v, for_model)]
        return self.in_window(now, victims, self.batch_window(now, for_model))
