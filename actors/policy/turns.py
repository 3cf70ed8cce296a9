"""Whose turn a slot is (issue 41, `swap_order`): a model that waits for a slot, or for
room, that busy models hold gets it in the end, however busy they stay.

llama.cpp's rule (R-4.2) proxies a request for a loaded model at once. Under a steady
stream of requests for A, a request for B that needs A's place waited until A had no
request at all, which might be never (llama-swap#612; `queue_timeout_s` was the only
bound). Now the first entry in the queue's order that waits for a slot has the *turn*,
from `since`, its oldest request's arrival, and the models it needs gone are *held*:
the least recently used busy model that may be evicted for it, or, with memory
accounting, those the memory plan would evict were the busy ones idle (`Turn.held`).
A held model takes only the requests that came before `since` (or before it became
ready, if later: what it was loaded for) plus its `swap_delay_s`; later ones queue
behind. It drains, is the victim, and the waiter's load goes; the other models serve on
as before.

- `swap_order = "arrival"` (the default, delay 0): models are served in the order they
  were asked for, ABAB, each swap serving what had queued.
- `swap_order = "batch"`: the loaded model goes on serving its own for
  `max_swap_delay_s` more, AABB (llama-swap PR #790), with that as the bound on the
  waiter's extra wait.

The fronts are told too: a held model's grants are withdrawn once its cutoff has passed
(`Withdraw`), and those it makes meanwhile are not shared, so no request joins them on
a front without asking.

A turn that cannot help is *spent*: once every model it holds is idle and old enough to
be evicted and the waiter still cannot go (it waits for something no eviction gives),
those models take requests again, and the next entry in line may have its turn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..lifecycle import ModelState
from ..messages import Repump, Withdraw
from .queue import QueueEntry
from .records import Later, ModelRecord, Turn
from .state import State
from .weigh import Plan

log = logging.getLogger("corral.scheduler")
REVOKED_S = 0.05
"""How long after a Revoke a held model's grants are withdrawn: the fronts answer one in
a loop turn, and what they give back together then says which model was used last."""


UP = frozenset({ModelState.LOADED, ModelState.SLEEPING, ModelState.REMOTE,
                ModelState.LOADING, ModelState.WAKING})
"""Serving (ModelState.is_serving), or on the way to (a load, a wake)."""


def up(rec: ModelRecord) -> bool:
    """`rec` serves, or is on its way to (a load, a wake)."""
    return rec.state in UP



class Turns:
    """The turn on one `State`: found after each decision (`update`), read by the rules
    through `State.held` and `State.cutoff`. `plan`: the memory plan of a model's load,
    evicting only the victims given (BringUp.plan)."""

    def __init__(self, state: State,
                 plan: Callable[[ModelRecord, list[ModelRecord]], Plan]) -> None:
        self.state = state
        self.plan = plan
        self.pending: list[ModelRecord] = []
        """Held models whose grants the fronts have not been told to withdraw yet (their
        cutoff is still to come)."""
        self.due: float | None = None
        """A Repump is due then: a held model's cutoff (a batch's delay) comes."""
        self.revoking = False
        """Grants the fronts keep were revoked in this decision: the held models' grants
        are withdrawn REVOKED_S later, once the fronts have given back what they kept
        idle (together, so that the least recently used of them goes: a withdrawal first
        would give back the held model's alone, and make it the victim whatever its last
        use)."""
        self.noted = False
        """The turn changed in a tick (before its revocations), not yet acted on."""
        self.seen: tuple[object, ...] = ()
        """What the turn was last found by (`unchanged`)."""
        self.memo: tuple[tuple[str, float], tuple[int, ...], frozenset[str]] | None = None
        """The last `victims`: for which turn, the memory's state then, and them."""

    def update(self, now: float) -> bool:
        """Find the turn as things are now; whether it changed (its held models may take
        their waiters, or become victims: the rules run again)."""
        state = self.state
        if self.unchanged(now):
            return False
        turn = self.find(now) if state.queue.entries else None
        if turn is not None and turn == state.turn and self.spent(turn, now):
            self.was_spent(turn.model, turn.since)  # (the set of this epoch's, first)
            state.spent = turn
            state.spent_turns.add((turn.model, turn.since))
            log.info("model %s: its turn is spent (%s idle and it still cannot load); they "
                     "take requests again", turn.model, ", ".join(sorted(turn.held)))
            turn = self.find(now)
        changed = turn != state.turn
        if changed:
            state.turn, self.due = turn, None
            self.pending = [r for n in sorted(turn.held) if (r := state.models.get(n))] if turn \
                else []
            for rec in self.pending:  # (idle with waiters of its own: a victim now)
                state.victims.offer(rec)
            if turn is not None and turn.held:
                log.info("model %s waits for %s (its turn: what comes for %s now waits "
                         "behind it)", turn.model, ", ".join(sorted(turn.held)),
                         "them" if len(turn.held) > 1 else "it")
        if turn is not None and self.pending and (changed or self.due is None
                                                  or now >= self.due):
            self.withdraw(turn, now)
        return changed

    def unchanged(self, now: float) -> bool:
        """There is a turn, and nothing it is found by has changed since it last was: no
        model changed state (the memory's epoch), nor the device figures, the entries,
        the turn's first request, or what its held models have in flight; nor has a
        cutoff come. (The turn is looked for after each decision: this keeps that O(1)
        while one is had. With none, a waiter may come to wait by the time, a breaker's,
        or by a key's limit: it is looked for each time.)"""
        state = self.state
        turn = state.turn
        if turn is None:
            self.seen = ()
            return False
        entry = state.queue.entries.get(turn.model)
        seen = (state.memory.epoch, state.ledger.version, len(state.queue.entries),
                next(iter(entry.waiters), None) if entry else None,
                *[r.in_flight if (r := state.models.get(n)) else -1 for n in turn.held])
        if seen == self.seen and (self.due is None or now < self.due):
            return True
        self.seen = seen
        return False

    def find(self, now: float) -> Turn | None:
        """The turn: the one it is while its model still waits and a model it holds still
        serves; else the first entry, in the queue's order, with requests waiting for a
        slot for a model none of whose copies serves (none spent: `was_spent`)."""
        state = self.state
        if not state.memory_on and state.has_capacity():
            return None  # (a slot is free: whatever it waits for, no eviction gives it)
        turn = state.turn
        if turn is not None and (entry := state.queue.entry(turn.model)) is not None \
                and self.waits(entry, now) \
                and not self.was_spent(turn.model, since := self.since(entry)):
            held = self.victims(turn.model, since)
            return turn if held == turn.held and since == turn.since else \
                Turn(turn.model, since, held)
        for entry in state.queue.ordered(now):
            if not entry.claimed and self.waits(entry, now):  # (claimed: it waits for none)
                since = self.since(entry)
                if not self.was_spent(entry.model, since):
                    return Turn(entry.model, since, self.victims(entry.model, since))
        return None

    def was_spent(self, model: str, since: float) -> bool:
        """`model`'s turn from `since` was spent, and no model has changed state since
        (what it waited for cannot have come free: it is not had again, nor spent again
        at every run); once one has, every spent turn may come back."""
        state = self.state
        if state.spent_epoch != state.memory.epoch:
            state.spent_turns.clear()
            state.spent_epoch = state.memory.epoch
        return (model, since) in state.spent_turns

    def waits(self, entry: QueueEntry, now: float) -> bool:
        """`entry` has requests that wait for a slot for a model none of whose copies
        serves, not a batch's lines alone (they hold no model: they wait for idle ones)."""
        state = self.state
        return bool(entry.waiters) and state.needs_slot(entry, now) \
            and not entry.batch_only() and not any(  # (claimed: most, at once)
                r.state.is_serving for r in state.groups.of(state.models[entry.model]))

    def since(self, entry: QueueEntry) -> float:
        return self.state.queue.waiters[next(iter(entry.waiters))].queued_at

    def victims(self, model: str, since: float) -> frozenset[str]:
        """The models up (or coming up) that `model` needs gone: the least recently used
        that may go for it; with memory accounting, those its plan would evict were they
        all idle (and the least recently used, if it needs a slot too). One coming up is
        held once it serves: it serves what it was loaded for first. Chosen once a turn,
        while they are up (with memory accounting, again when the memory has changed)."""
        state = self.state
        rec = state.groups.target(state.models[model])
        assert rec is not None
        memory = (state.memory.epoch, state.ledger.version, state.n_running,
                  state.n_stopping) if state.memory_on else ()
        if (memo := self.memo) is not None and memo[0] == (model, since) and (
                (memo[1] == memory and state.memory_on) or memo[2]) and all(
                (r := state.models.get(n)) is not None and up(r) for n in memo[2]):
            return memo[2]  # (nothing it was chosen by has changed: a plan is dear)
        held = self.choose(rec, model)
        self.memo = ((model, since), memory, held)
        return held

    def choose(self, rec: ModelRecord, model: str) -> frozenset[str]:
        state = self.state
        may = [r for r in state.models.values()
               if r.state in UP and not r.pinned and not r.removed and r.group != rec.group
               and not state.kept_from(r, model)
               and (rec.rules.nodes is None or state.memory_on or r.node in rec.rules.nodes)]
        if not may:
            return frozenset()
        if not state.memory_on:
            return frozenset((min(may, key=lambda r: r.last_used).name,))
        may.sort(key=lambda r: r.last_used)
        plan = self.plan(rec, may)  # (a plan that evicts waits for its victims' exits)
        held = {victim.name for victim, _ in plan.evict} if plan.verdict != "refuse" else set()
        if not state.has_capacity() and not held:
            held.add(may[0].name)
        return frozenset(held)

    def spent(self, turn: Turn, now: float) -> bool:
        """Every model `turn` holds is idle and old enough to go, and its waiter still
        cannot: holding them longer would only make their own requests wait."""
        state = self.state
        held = [r for n in turn.held if (r := state.models.get(n)) and state.held(r)]
        return bool(held) and all(not r.in_flight and state.resident_until(r) <= now
                                  for r in held)

    def withdraw(self, turn: Turn, now: float) -> None:
        """Tell the fronts to let no request join a held model's grants once its cutoff
        has passed; a Repump for the first cutoff still to come."""
        state = self.state
        due, pending = None, []
        for rec in self.pending:
            cutoff = state.cutoff(rec)
            if cutoff is None:
                continue  # (it stopped meanwhile)
            if self.revoking:  # (once the fronts have given back what they kept idle)
                cutoff = max(cutoff, now + REVOKED_S)
            if cutoff > now:
                due = cutoff if due is None else min(due, cutoff)
                pending.append(rec)
                continue
            state.victims.offer(rec)  # (idle with its own waiters: a victim now)
            state.out.append(Withdraw(model=rec.group, generation=rec.generation,
                                      epoch=rec.wakes, instance=rec.copy_name))
        self.pending = pending
        if due is None:
            self.due = None
        elif self.due is None or self.due <= now or due < self.due:
            self.due = due
            state.out.append(Later(due - now, Repump()))
