"""The moves of the model groups (teams.py says their rules): an exclusive group's rivals
stopped before a member loads, a together group's partners loaded, used and stopped with
a member. `Moves` calls `moved`, `granted` and `stopped` by name, last in its own
transition, grant and stop; this part moves through `Mover`, what it uses of them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

from ..lifecycle import ModelState
from ..messages import EvictionReason, Shortfall
from .teams import UNIT_STOPS

if TYPE_CHECKING:
    from ..config.rules import ModelGroup
    from .records import ModelRecord
    from .state import State

S = ModelState


class Mover(Protocol):
    """The moves a team's rule makes (Moves')."""

    def idle(self, rec: ModelRecord, now: float | None = None) -> None: ...

    def stop(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
             now: float, shortfalls: list[Shortfall] | None = None,
             why: str | None = None, note: str | None = None) -> None: ...

    def retire(self, rec: ModelRecord, now: float, reason: EvictionReason = "reload",
               for_model: str | None = None, note: str | None = None) -> None: ...


class Teamwork:
    """The exclusive and together rules, carried out on one `State` with its `Moves`
    (which call `moved`, `granted` and `stopped` after their own step, by name)."""

    def __init__(self, state: State, moves: Mover) -> None:
        self.state = state
        self.moves = moves

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
                    self.moves.stop(r, "warm", rec.group, now, note=f"{note}; it loaded for nobody")
                elif r.state is S.STOPPING or self.oldest(rival) < first:
                    continue  # going already, or its older waiters go first (FIFO)
                elif r.state is S.SUSPENDED or (r.state.is_serving and not r.in_flight
                                                and not state.partner_busy(r)):
                    self.moves.stop(r, "group", rec.group, now, note=note)
                elif r.state.is_serving:  # it, and partners of it that are busy, finish
                    for busy in [r, *self.partner_copies(r)]:
                        if busy.in_flight and not busy.retiring:
                            self.moves.retire(busy, now, "group", rec.group, note)
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

    def moved(self, rec: ModelRecord, now: float) -> None:
        """`rec` changed state: its together partners' evictability may have changed."""
        for r in self.partner_copies(rec):
            self.moves.idle(r, now)

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

    def granted(self, rec: ModelRecord, now: float) -> None:
        """A request of `rec` began: its partners were used too, and one of them that
        crashed (or a warm one's partner) comes back."""
        self.used_together(rec, now)
        self.bring_partners(rec, now)

    def used_together(self, rec: ModelRecord, now: float) -> None:
        """A request of `rec` began or ended: its partners were used too (LRU, TTL)."""
        state = self.state
        for partner in state.teams.partners.get(rec.group, {}):
            base = state.models.get(partner)
            for r in state.groups.all_of(base) if base is not None else []:
                if r.state.is_running:
                    r.last_used = max(r.last_used, rec.last_used)
                    r.ended_at = max(r.ended_at, rec.ended_at)
                    self.moves.idle(r, now)

    def stopped(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
                now: float) -> None:
        """`rec` was stopped: for a unit stop (UNIT_STOPS), so are its together partners,
        a busy one once its requests have ended."""
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
                        self.moves.retire(r, now, "group", None, note)
                else:
                    self.moves.stop(r, "group", None, now, note=note)

    def apply(self, groups: dict[str, ModelGroup], now: float) -> None:
        """The model groups now (Policy.set_groups): of an exclusive group's members
        running, all but the one used last go (once their requests have ended); a
        together group's running members bring the others."""
        state = self.state
        state.teams.replace(groups)
        state.memory.epoch += 1  # plans cached on the old groups are stale
        for name, group in groups.items():
            up = [state.models[m] for m in group.models if m in state.models
                  and not state.absent(state.models[m])]
            if group.exclusive and len(up) > 1:
                keep = max(up, key=lambda r: r.last_used)
                for rec in up:
                    for copy in state.groups.all_of(rec) if rec is not keep else ():
                        if copy.state.is_running and copy.state is not S.STOPPING:
                            self.moves.retire(copy, now, "group", keep.group, note=(
                                f"exclusive group '{name}' (a reload): one member runs "
                                "at a time"))
            if group.together:
                for rec in up:
                    self.bring_partners(rec, now)

    def drop_partner_loads(self) -> None:
        """Loads of together partners queued for nobody, their group stopped meanwhile."""
        queue, dropped = self.state.queue, self.state.teams.dropped
        for name in list(dropped):
            entry = queue.entry(name)
            if entry is not None and entry.claimed and not entry.waiters:
                continue  # its load runs, being stopped: looked at again once it ends
            if entry is not None and entry.explicit and not entry.waiters:
                entry.explicit = False
                queue.close_if_empty(name)
                self.moves.idle(self.state.models[name])
            dropped.discard(name)
