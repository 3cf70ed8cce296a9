"""Decisions that leave the rules nothing to decide (issue 43): a request with no key
that joins a wait already under way, or leaves one from its middle, and a request that
ends on a model that stays busy. After any decision the rules have run to a fixed point
(rules.py `pump`); such a decision changes nothing they read, so a run now would decide
what the last one did, unless a time they wait for has come since (each is a `Later`:
a backoff, a young victim, a turn's cutoff, a warm retry) or a step of theirs is pending
(grants to revoke, a group's partners, a drain, copies to scale). Then their run is
skipped: at 1,000 models and 10,000 waiters it was most of such a decision's cost.

`check` (tests) runs them anyway, and asserts that they changed nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from .rules import Rules
from .state import State


class Quiet:
    """The skipped runs of the rules on one `State`."""

    CHECK = False
    """`check` of every new one (the tests' own process: tests/conftest.py)."""

    def __init__(self, state: State, rules: Rules) -> None:
        self.state = state
        self.rules = rules
        self.on = True
        """False: the rules run after every decision, as they did."""
        self.check = Quiet.CHECK
        """Run the rules where they would be skipped, and assert they changed nothing."""
        self.skipped = 0

    def joins(self, model: str, key: str) -> bool:
        """Before a request for `model` with `key` is queued: it would join the keyless
        lane of a wait under way (its entry's claim and order stay as they are)."""
        entry = self.state.queue.entries.get(model)
        return not key and entry is not None and "" in entry.lanes and not entry.sessions

    def leaves(self, ticket: Hashable) -> bool:
        """Before `ticket` leaves the queue: it is a keyless waiter, neither its entry's
        first (a turn's start) nor its last, and nothing was cut for it."""
        queue = self.state.queue
        waiter = queue.waiters.get(ticket)
        entry = queue.entries.get(waiter.model) if waiter is not None else None
        return (waiter is not None and entry is not None and not waiter.key
                and len(entry.lanes.get("", ())) > 1 and next(iter(entry.waiters)) != ticket
                and not self.state.cuts.of)

    def ended(self, name: str, generation: int, key: str, shared: bool,
              idle_s: float) -> bool:
        """After a lease of `name` (its `generation`, `key`) was let go: it had no key,
        did not move the model's last use, and the model still serves others, is not
        held by a turn nor retiring, and no waiter was served meanwhile."""
        state = self.state
        rec, turn = state.models.get(name), state.turn
        return (not key and not shared and not idle_s and rec is not None
                and rec.generation == generation and rec.in_flight > 0 and not rec.retiring
                and not state.queue.changed and not state.teams.partners
                and (turn is None or name not in turn.held))

    def settled(self, now: float) -> bool:
        """Whether the rules may be skipped now, after a decision `joins`, `leaves` or
        `ended` vouched for (one class level waits; nothing the rules wait for is due)."""
        state = self.state
        dues = state.dues
        while dues and dues[0] <= state.pumped_at:
            heapq.heappop(dues)
        if (not self.on or (dues and dues[0] <= now) or len(state.queue.levels) > 1
                or state.revocable or state.shutting_down or state.teams.dropped
                or state.teams.brought or state.nodes.draining or state.groups.wanting):
            return False
        state.now = now
        self.skipped += 1
        if self.check:
            before, n = fingerprint(state), len(state.out)
            self.rules.pump(now)
            after = fingerprint(state)
            assert after == before and len(state.out) == n, (
                "the rules decided something after a decision that changed nothing they "
                f"read: {state.out[n:]}, "
                f"{[(b, a) for b, a in zip(before, after, strict=True) if b != a]}")
        return True


def fingerprint(state: State) -> tuple[object, ...]:
    """What the rules may change of `state` (tests: `Quiet.check`); not what a waiting
    model is said to wait for (`waiting_for`), which a second run may say in other words
    ("its least recently used idle model is being stopped", then "waiting for a child
    being stopped there")."""
    return (tuple((r.name, r.state, r.in_flight, r.generation, r.node, r.last_used,
                   r.ttl_armed, r.failed, r.retiring)
                  for r in state.models.values()),
            tuple((m, tuple(e.waiters), e.claimed, e.explicit)
                  for m, e in state.queue.entries.items()),
            tuple(state.leases.items()), tuple(state.revocable), state.turn, state.spent,
            state.wake_at, state.n_running, state.n_stopping, state.n_suspending,
            tuple(r.name for r in state.warming), state.warm_after)
