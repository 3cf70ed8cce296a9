"""Whose turn a slot is (issue 41, `swap_order`): a model that waits for a slot, or for
room, that busy models hold gets it in the end, however busy they stay.

llama.cpp's rule (R-4.2) proxies a request for a loaded model at once. Under a steady
stream of requests for A, a request for B that needs A's place waited until A had no
request at all, which might be never (llama-swap#612; `queue_timeout_s` was the only
bound). Now the first entry in the queue's order that waits for a slot has the *turn*,
from `since`, its oldest request's arrival. Each model whose place it could take
(`State.held`: serving, unpinned, on its devices or nodes, not kept from it by a group)
takes only the requests that came before `since` plus its `swap_delay_s`; later ones
queue behind. The model drains, is the LRU victim, and the waiter's load goes.

- `swap_order = "arrival"` (the default, delay 0): models are served in the order they
  were asked for, ABAB, each swap serving what had queued.
- `swap_order = "batch"`: the loaded model goes on serving its own for
  `max_swap_delay_s` more, AABB (llama-swap PR #790), with that as the bound on the
  waiter's extra wait.

The fronts are told too: a held model's grants are withdrawn once its cutoff has passed
(`Withdraw`), so no request joins them on a front without asking.

A turn that cannot help is *spent*: once every model it holds is idle and old enough to
be evicted and the waiter still cannot go (it waits for something no eviction gives),
those models take requests again, and the next entry in line may have its turn.
"""

from __future__ import annotations

import logging

from ..lifecycle import ModelState
from ..messages import Repump, Withdraw
from .queue import QueueEntry
from .records import Later, ModelRecord, Turn
from .state import State

log = logging.getLogger("corral.scheduler")

S = ModelState


class Turns:
    """The turn on one `State`: found after each decision (`update`), read by the rules
    through `State.held` and `State.takes`."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.held: list[ModelRecord] = []
        """The models the turn held when it began (those serving then)."""
        self.pending: list[ModelRecord] = []
        """Of those, the ones whose grants the fronts have not been told to withdraw yet
        (their cutoff is still to come; grants made while held are not shared at all)."""
        self.due: float | None = None
        """A Repump is due then: a held model's cutoff (a batch's delay) comes."""

    def update(self, now: float) -> bool:
        """Find the turn as things are now; whether it changed (its held models may take
        their waiters, or become victims: the rules run again)."""
        state = self.state
        turn = self.find(now) if state.queue.entries else None
        if turn is not None and turn == state.turn and self.spent(turn, now):
            state.spent = turn
            log.info("model %s: its turn is spent (the models it waits for are idle, and "
                     "it still cannot load); they take requests again", turn.model)
            turn = self.find(now)
        changed = turn != state.turn
        if changed:
            state.turn = turn
            self.held = [r for r in state.models.values() if state.held(r)] if turn else []
            self.pending = list(self.held)
            if turn is not None:
                log.debug("model %s has the turn (waiting since %.3f)", turn.model, turn.since)
        if turn is not None and self.pending and (changed or self.due is None
                                                  or now >= self.due):
            self.withdraw(turn, now)
        return changed

    def find(self, now: float) -> Turn | None:
        """The turn: the first entry, in the queue's order, with requests waiting for a
        slot for a model none of whose copies serves (other than the turn last spent)."""
        state = self.state
        if not state.memory_on and state.has_capacity():
            return None  # (a slot is free: whatever it waits for, no eviction gives it)
        for entry in state.queue.ordered(now):
            turn = self.of(entry, now)
            if turn is not None and turn != state.spent:
                return turn
        return None

    def of(self, entry: QueueEntry, now: float) -> Turn | None:
        """The turn `entry` would have, if it may have one."""
        state = self.state
        if not entry.waiters or not state.needs_slot(entry, now):
            return None
        rec = state.models[entry.model]
        if any(r.state.is_serving for r in state.groups.of(rec)):
            return None  # (a copy serves: more copies are not worth another's wait)
        memory = state.memory_on
        return Turn(entry.model, state.queue.waiters[next(iter(entry.waiters))].queued_at,
                    frozenset(state.memory.devices_of(rec)) if memory else None,
                    frozenset(rec.rules.nodes) if rec.rules.nodes is not None
                    and not memory else None)

    def spent(self, turn: Turn, now: float) -> bool:
        """Every model `turn` holds is idle and old enough to go, and its waiter still
        cannot: holding them longer would only make their own requests wait."""
        state = self.state
        held = [r for r in self.held if state.held(r)]  # (not those stopped meanwhile)
        return bool(held) and all(not r.in_flight and state.resident_until(r) <= now
                                  for r in held)

    def withdraw(self, turn: Turn, now: float) -> None:
        """Tell the fronts to let no request join a held model's grants once its cutoff
        has passed; a Repump for the first cutoff still to come."""
        state = self.state
        due, pending = None, []
        for rec in self.pending:
            if not state.held(rec):
                continue  # (it stopped meanwhile)
            cutoff = turn.since + rec.rules.swap_delay_s
            if cutoff > now:
                due = cutoff if due is None else min(due, cutoff)
                pending.append(rec)
                continue
            state.victims.offer(rec)  # (idle with its own waiters: a victim now)
            state.out.append(Withdraw(model=rec.group, generation=rec.generation,
                                      epoch=rec.wakes, instance=rec.copy_name))
        self.pending = pending
        if due is not None and (self.due is None or self.due <= now or due < self.due):
            self.due = due
            state.out.append(Later(due - now, Repump()))

