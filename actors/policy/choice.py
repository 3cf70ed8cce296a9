"""Who may be evicted for whom (R-4.4), and the moves of the model groups (teams.py).

Victims: the least recently used idle model; a spare copy (above its model's `min`)
first; for memory, suspended models that still hold a device last; never a member of a
persistent group for a model outside it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

from ..lifecycle import ModelState
from ..messages import EvictionReason, Repump, Shortfall
from .moves import Moves
from .queue import Waiter
from .records import Later, ModelRecord
from .replicas import UP
from .teams import UNIT_STOPS

S = ModelState


class Teamwork(Moves):
    """The victim choice, and the moves of the model groups, on one `State`."""

    # ------------------------------------------------------------ victims

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
        allowed = (lambda r: not self.kept_from(r, for_model)) \
            if teams.kept or teams.partners else None
        victim, wake = self.state.victims.pick(self.state.models, now,
                                               self.state.resident_until, allowed)
        if wake is not None and (self.state.wake_at is None or wake < self.state.wake_at):
            self.state.wake_at = wake
            self.state.out.append(Later(wake - now, Repump()))
        return victim

    def extra_victim(self, now: float, for_model: str | None = None) -> ModelRecord | None:
        """The least recently used idle copy above its model's `min` (a spare): the first
        victim for a slot or memory, before any model's last copy (issue 24)."""
        state = self.state
        if not state.groups.active:
            return None
        return min((r for group in state.groups.active.values() for r in group
                    if state.evictable(r) and state.resident_until(r) <= now
                    and state.above_min(r) and not self.kept_from(r, for_model)),
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
        return victims

    # ------------------------------------------------------------ exclusive

    def clear_rivals(self, rec: ModelRecord, now: float) -> bool:
        """Before `rec` loads: stop its exclusive rivals, busy ones (or ones whose
        together partner is busy) once their requests have ended, and not before they
        have served the requests that waited for them longer than `rec`'s have; whether
        any still runs, so that `rec` waits."""
        state, waits = self.state, []
        first = self.oldest(rec.group)
        for rival, group in state.teams.rivals.get(rec.group, {}).items():
            base = state.models.get(rival)
            note = f"exclusive group '{group}': one member runs at a time"
            for r in state.groups.all_of(base) if base is not None else []:
                if r.state is S.UNLOADED:
                    continue
                waits.append(rival)
                if r in state.warming and r.state is S.LOADING and rival not in state.queue.entries:
                    self.stop(r, "warm", rec.group, now, note=f"{note}; it loaded for nobody")
                elif r.state is S.STOPPING or self.oldest(rival) < first:
                    continue  # going already, or its older waiters go first (FIFO)
                elif r.state is S.SUSPENDED or (r.state.is_serving and not r.in_flight
                                                and not state.partner_busy(r)):
                    self.stop(r, "group", rec.group, now, note=note)
                elif r.state.is_serving:  # it, and partners of it that are busy, finish
                    for busy in [r, *self.partner_copies(r)]:
                        if busy.in_flight and not busy.retiring:
                            self.retire(busy, now, "group", rec.group, note)
        if waits:
            rec.waiting_for = (f"exclusive group: waiting for {', '.join(sorted(set(waits)))}"
                               " to stop (once its requests have ended)")
        elif (rec.waiting_for or "").startswith("exclusive group"):
            rec.waiting_for = None
        return bool(waits)

    def oldest(self, model: str) -> float:
        """When the longest waiter of `model` came (inf: none waits)."""
        entry = self.state.queue.entry(model)
        if entry is None or not entry.waiters:
            return math.inf
        return self.state.queue.waiters[next(iter(entry.waiters))].queued_at

    def partner_copies(self, rec: ModelRecord) -> list[ModelRecord]:
        state = self.state
        return [r for partner in state.teams.partners.get(rec.group, {})
                if partner in state.models for r in state.groups.all_of(state.models[partner])]

    def has_rival_up(self, name: str) -> bool:
        state = self.state
        return any(r.state is not S.UNLOADED for rival in state.teams.rivals.get(name, {})
                   if rival in state.models
                   for r in state.groups.all_of(state.models[rival]))

    # ------------------------------------------------------------ together

    def transition(self, rec: ModelRecord, new: ModelState, cause: str, now: float,
                   exit_code: int | None = None, info: dict[str, Any] | None = None) -> None:
        super().transition(rec, new, cause, now, exit_code, info)
        if self.state.teams.partners:  # its partners' evictability may have changed
            for r in self.partner_copies(rec):
                self.idle(r, now)

    def bring_partners(self, rec: ModelRecord, now: float) -> bool:
        """`rec` loads: so do its together partners that are not running (queued as a
        load of their own); whether the queue changed."""
        state, queued = self.state, False
        for partner in state.teams.partners.get(rec.group, {}):
            base = state.models.get(partner)
            if (base is None or base.removed or partner in state.queue.entries
                    or base.breaker.is_open(now) or not state.absent(base)
                    or self.has_rival_up(partner)):
                continue
            state.queue.open(partner).explicit = True
            queued = state.teams.brought = True
        return queued

    def grant(self, ticket: Hashable, rec: ModelRecord, now: float, key: str = "",
              waiter: Waiter | None = None, cuttable: bool = False) -> None:
        super().grant(ticket, rec, now, key, waiter, cuttable)
        if self.state.teams.partners:
            self.used_together(rec, now)
            self.bring_partners(rec, now)  # one that crashed, or a warm one's, comes back

    def used_together(self, rec: ModelRecord, now: float) -> None:
        """A request of `rec` began or ended: its partners were used too (LRU, TTL)."""
        state = self.state
        for partner in state.teams.partners.get(rec.group, {}):
            base = state.models.get(partner)
            for r in state.groups.all_of(base) if base is not None else []:
                if r.state.is_running:
                    r.last_used = max(r.last_used, rec.last_used)
                    r.ended_at = max(r.ended_at, rec.ended_at)
                    self.idle(r, now)

    def stop(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
             now: float, shortfalls: list[Shortfall] | None = None,
             why: str | None = None, note: str | None = None) -> None:
        super().stop(rec, reason, for_model, now, shortfalls, why, note)
        partners = self.state.teams.partners.get(rec.group)
        if not partners or reason not in UNIT_STOPS:
            return
        why = reason + (f" for {for_model}" if for_model else "")
        for partner, group in partners.items():
            base = self.state.models.get(partner)
            self.state.teams.dropped.add(partner)  # its load, if queued, goes too
            for r in self.state.groups.all_of(base) if base is not None else []:
                if not r.state.is_running or r.state is S.STOPPING:
                    continue
                note = f"together group '{group}': {rec.group} stopped ({why})"
                if r.in_flight:
                    if not r.retiring:
                        self.retire(r, now, "group", None, note)
                else:
                    self.stop(r, "group", None, now, note=note)
