"""How a model comes up, whichever way it comes: a request's load or wake (Rules.claim_one,
Rules.claim_wake), a `warm` model's (Rules.warm_up), a copy that demand or `min` adds
(Scaling.add_copy). Each is the same three steps; what a caller does with a plan that
does not go (wait, refuse, try later) is its own.

1. `plan`: with memory accounting, where it may go: where it sleeps (a wake) or any
   place it may (a load), among the victims the caller allows.
2. `make_room`: evict what the plan names (for memory where it names a shortfall, else
   as the least recently used).
3. `go`: an unloaded model takes the plan's devices (and their node); then it is woken,
   or its child is spawned.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ledger import node_of
from ..lifecycle import ModelState
from ..messages import EvictionReason
from .context import choose
from .moves import Moves
from .queue import QueueEntry
from .records import ModelRecord
from .state import State
from .weigh import Plan

S = ModelState


class BringUp:
    """The one way a model comes up, on one `State` with its `Moves`."""

    def __init__(self, state: State, moves: Moves) -> None:
        self.state = state
        self.moves = moves

    def plan(self, rec: ModelRecord, victims: Sequence[ModelRecord],
             busy: set[str] | None = None) -> Plan:
        """Step 1: the memory plan that brings `rec` up, evicting only `victims`: a wake
        where it sleeps, or a load (`busy`: the devices with a load under way, if the
        caller has them already)."""
        state = self.state
        busy = self.moves.loading_devices(rec) if busy is None else busy
        if rec.state is S.SUSPENDED:
            return state.memory.plan_wake(rec, state.models, victims, busy)
        if rec.rules.ctx_fit is not None:  # its context: the most that fits (context.py)
            return choose(rec, lambda v: state.memory.plan(rec, state.models, v, busy), victims,
                          (state.memory.epoch, state.ledger.version, frozenset(busy),
                           state.nodes.version))
        return state.memory.plan(rec, state.models, victims, busy)

    def make_room(self, plan: Plan, for_model: str, now: float,
                  reason: EvictionReason | None = None) -> None:
        """Step 2: evict what `plan` names for `for_model` (`reason`: for all of them;
        else `memory` where the plan names a shortfall, `lru` where it does not)."""
        for victim, shortfalls in plan.evict:
            self.moves.evict(victim, reason or ("memory" if shortfalls else "lru"),
                             for_model, now, shortfalls)

    def go(self, rec: ModelRecord, plan: Plan | None, now: float, *,
           entry: QueueEntry | None = None, n_waiting: int = 0, why: str | None = None) -> None:
        """Step 3: `rec` comes up where `plan` puts it (None: no memory accounting, its
        place is chosen): woken for `entry`, or spawned for `n_waiting` requests (or
        `why`)."""
        if plan is not None and rec.state is S.UNLOADED:
            rec.placement = plan.devices
            rec.node = node_of(plan.devices[0]) if plan.devices else None
        if rec.state is S.SUSPENDED:
            self.moves.wake(rec, entry, now)
        else:
            self.moves.spawn(rec, n_waiting, now, why=why)
