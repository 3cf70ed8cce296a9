"""Copies added by demand (issue 24): a model with `replicas` gets another copy while it
has fewer than `min` up, or fewer than `max` and its copies are busy (more than
`target_in_flight` requests in flight each, for `scale_up_after_s`) or a request has
waited in its queue for `scale_up_wait_s`. Copies above `min` go after
`scale_down_idle_s` idle (state.ttl_after), and are the first victims of any model's need
(Choice.extra_victim).

The rule for what a copy may take: a free slot and free memory; else an idle spare copy
of another model (above its `min`); else another model only if it has been idle longer
than this model's demand has lasted (its oldest request's wait, or how long its copies
have been busy). A copy that `min` asks for takes only what is free or spare, and
waits while a request for a model that is down waits (it would take the room made for
that request). One copy
loads at a time per model; a request for a model that has none waits before any copy is
added (tick and claim run first).
"""

from __future__ import annotations

import math

from ..config.keys import BATCH
from ..config.rules import Replicas
from ..lifecycle import ModelState
from ..messages import Repump
from .bringup import BringUp
from .choice import Choice
from .moves import Moves
from .records import Later, ModelRecord
from .replicas import UP
from .state import State

S = ModelState
LOOK_AGAIN_S = 0.001
"""The least a copy's demand is looked at again after."""


class Scaling:
    """The scaling step of every decision (Rules.pump), on one `State`: it chooses with
    `choice`, brings copies up with `up` and evicts with `moves`."""

    def __init__(self, state: State, moves: Moves, choice: Choice, up: BringUp) -> None:
        self.state = state
        self.moves = moves
        self.choice = choice
        self.up = up

    def scale(self, now: float) -> None:
        """Look at the models that may want a copy (`Groups.wanting`: a copy of theirs
        moved or was granted since, or they wanted one and have not got it yet)."""
        groups = self.state.groups
        if self.state.shutting_down:
            return
        for name in list(groups.wanting):
            group = groups.active.get(name)
            if group is None or not self.scale_one(name, group, now):
                groups.wanting.pop(name, None)

    def scale_one(self, name: str, group: list[ModelRecord], now: float) -> bool:
        """Add a copy to `name` if it wants one and may have it; whether to look again
        at the next decision (it wants one, or its demand is being timed)."""
        state = self.state
        base, copies = group[0], group[0].rules.replicas
        up = [r for r in group if r.state in UP]
        if copies is None or base.removed or len(up) >= copies.most:
            state.groups.busy_since.pop(name, None)
            return False  # all up (or being removed)
        if any(r.state in (S.LOADING, S.WAKING) for r in up):
            return False  # one is on its way: its ready or exit looks again
        if state.teams.rivals and (any(r.retiring for r in up) or any(
                rival in state.queue.entries for rival in state.teams.rivals.get(name, {}))):
            return False  # an exclusive swap is due: no copy is added to what goes
        why, waited = ((f"replicas min {copies.min}", math.inf) if len(up) < copies.min
                       else self.demand(name, up, copies, now))
        if why is None:
            return name in state.groups.busy_since or name in state.queue.entries
        self.add_copy(group, why, waited, now)
        return True  # added (its transition looks again), or no room yet

    def demand(self, name: str, up: list[ModelRecord], copies: Replicas,
               now: float) -> tuple[str | None, float]:
        """Why `name` needs one more copy now (None: it does not), and how long that
        demand has lasted; sets a timer for when it would."""
        groups, serving = self.state.groups, [r for r in up if r.state.is_serving]
        busy = sum(r.in_flight for r in serving) / max(len(serving), 1)
        lasted = 0.0
        if busy > copies.target_in_flight:
            lasted = now - groups.busy_since.setdefault(name, now)
            if lasted >= copies.scale_up_after_s:
                return (f"{busy:.1f} requests in flight per copy for {lasted:.1f} s "
                        f"(target_in_flight {copies.target_in_flight})"), lasted
            self.look_again(name, now + copies.scale_up_after_s - lasted, now)
        else:
            groups.busy_since.pop(name, None)
        _, oldest = self.state.queue.view(name, now)
        if oldest is not None:
            if oldest >= copies.scale_up_wait_s:
                return (f"a request has waited {oldest:.1f} s "
                        f"(scale_up_wait_s {copies.scale_up_wait_s:g})"), max(oldest, lasted)
            self.look_again(name, now + copies.scale_up_wait_s - oldest, now)
        return None, lasted

    def look_again(self, name: str, at: float, now: float) -> None:
        due = self.state.groups.due
        if due.get(name, 0.0) > now and due[name] <= at:
            return  # one is pending, no later than that
        due[name] = at
        # (at least a millisecond on: `at` is a sum of floats, and a demand that rounds
        # to due-now-but-not-yet would repump at the same instant, without end on a
        # clock that only moves with events, as the cluster sim's)
        self.state.out.append(Later(max(at - now, LOOK_AGAIN_S), Repump()))

    def add_copy(self, group: list[ModelRecord], why: str, waited: float, now: float) -> None:
        """Load (or wake) one more copy of `group`'s model, if the rule allows a place."""
        state = self.state
        rec = next((r for r in group if r.state is S.SUSPENDED and not r.removed), None) \
            or next((r for r in group if r.state is S.UNLOADED and not r.removed), None)
        if rec is None or rec.breaker.is_open(now):
            return
        if waited == math.inf and any(state.needs_slot(e, now) and e.model != rec.group
                                      for e in state.queue.entries.values()):
            return  # a request for a model that is down goes first: `min` fills what is
            #         left, or it would take the room made for that request, again and again
        if not state.has_capacity():
            if any(state.needs_slot(e, now) for e in state.queue.entries.values()) \
                    or state.n_stopping or state.n_suspending:
                return  # a request for a model that is down goes first; or a slot is coming
            victim = next(iter(self.copy_victims(rec, waited, now)), None)
            if victim is not None:
                self.moves.evict(victim, "lru", rec.group, now)
            return  # the next decision after its exit adds the copy
        if rec.rules.nodes is not None and not state.memory_on:  # a node's slot
            allowed = self.copy_victims(rec, waited, now)
            choice = state.nodes.choose(rec, state.models, allowed,
                                        avoid={r.node for r in group if r.state in UP})
            if choice.verdict != "go":
                if choice.victim is not None:
                    self.moves.evict(choice.victim, "lru", rec.group, now)
                return
            rec.node = choice.node
        plan = None
        if state.memory_on:
            plan = self.up.plan(rec, self.copy_victims(rec, waited, now))
            self.up.make_room(plan, rec.group, now)
            if plan.measure:
                rec.measure_requested_first = True
            if plan.verdict != "go":
                return
        self.up.go(rec, plan, now, why=f"replica for {why}")

    def copy_victims(self, rec: ModelRecord, waited: float, now: float) -> list[ModelRecord]:
        """What a copy of `rec`'s model may evict, in order: idle spare copies of other
        models (above their `min`), then models idle longer than `waited` (least recently
        used first; `waited` is infinite for a copy that `min` asks for: it takes only
        what is free or spare, so models that fill their `min` never evict each other)."""
        victims = self.choice.memory_victims(now, rec.group)
        if max(r.asked_at for r in self.state.groups.of(rec)) + self.state.tenants.of(
                BATCH).idle_s <= now:  # only a batch's lines have used it: their window
            victims = self.choice.in_window(now, victims, self.choice.window(now))
        spare = self.choice.spares(victims)
        return [v for v in victims if v.group != rec.group and v.state.is_serving
                and (v in spare or now - v.idle_from > waited)]


