"""Decisions that leave the rules nothing to decide (issue 43): a request with no key
that joins a wait already under way, or leaves one from its middle; one granted at once
on a model that serves others; and one that ends on a model that stays busy.

The rules (rules.py `pump`) run after each decision. When their last run changed
nothing (no effect, the same turn) and nothing came after it, the state is *rested*: a
fixed point of theirs (`State.rested`, set by Moves.flush). A decision vouched for here
changes nothing they read, so a run after it would decide nothing either, unless a time
they wait for has come since (each is a `Later`: a backoff, a young victim, a turn's
cutoff, a warm retry) or a step of theirs is pending (grants to revoke, a group's
partners, a drain, copies to scale). Then their run is skipped: at 1,000 models and
10,000 waiters it was most of such a decision's cost (bench/README.md, issue 43).

A rule of its own, skip or no skip: a keyless grant made at once, while the rules rest
revoking the grants the fronts keep (a waiter needs what busy models hold:
`State.revoking`), is revoked as it is made, as their next run would (`granted`), so
that its release leaves them nothing to do.

`check` (the tests' policies) runs the rules anyway where they would be skipped, and
asserts that they changed nothing.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from ..messages import Revoke
from .records import ModelRecord
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
        """Before `ticket` leaves the queue: it is a keyless waiter, not its entry's last,
        nor its first where its arrival is read (a turn's start: its model's turn, or one
        spent; the oldest waiter of an exclusive group's member, teamwork.py), nothing was
        cut for it, and one class level waits."""
        state = self.state
        queue = state.queue
        waiter = queue.waiters.get(ticket)
        entry = queue.entries.get(waiter.model) if waiter is not None else None
        return (waiter is not None and entry is not None and not waiter.key
                and len(entry.lanes.get("", ())) > 1
                and (next(iter(entry.waiters)) != ticket or not self.starts_turn(entry.model))
                and not state.cuts.of and len(queue.levels) <= 1)  # (a last of its
        # level leaving would take the queue's order from ranks to arrival: queue.py)

    def starts_turn(self, model: str) -> bool:
        """`model`'s first waiter's arrival decides: it is a turn's start (turns.py
        `since`: the turn's or the spent one's, a new first waiter makes a new turn), or
        exclusive groups weigh their members' oldest waiters (teamwork.py `oldest`)."""
        state = self.state
        turn = state.turn
        return bool(state.teams.rivals) or (turn is not None and turn.model == model) or any(
            m == model for m, _ in state.spent_turns)

    def granted(self, rec: ModelRecord, key: str, now: float) -> bool:
        """After a request with `key` was granted `rec` at once: whether that left the
        rules nothing to decide (it had no key, and `rec` others in flight).

        Its grant, which the front may keep idle, is revoked at once where the rules,
        resting, revoke kept grants (a waiter needs what busy models hold), skipped or
        not: their next run would, were nothing to change meanwhile (if something does,
        a victim found first, say, the grant is given back sooner than it had to be,
        and a later request for `rec` asks the Scheduler again)."""
        state, rules, turn = self.state, rec.rules, self.state.turn
        if (key or rec.in_flight < 2 or rules.max_concurrency or rules.replicas is not None
                or state.teams.partners or (turn is not None and rec.name in turn.held)):
            return False
        return self.granted_quietly(rec, now)

    def granted_quietly(self, rec: ModelRecord, now: float) -> bool:
        """The rest of `granted`, for a grant its caller has found quiet (plain.py)."""
        state = self.state
        revocable = state.revocable
        if state.revoking and state.rested and len(revocable) == 1:
            grant = (rec.group, rec.generation)
            if grant in revocable and not self.due(now):
                del revocable[grant]
                state.out.append(Revoke(grants=(grant,)))
        return self.settled(now, skips=False)

    def ended(self, lease: tuple[str, int, str], moved: bool, now: float) -> bool:
        """After a lease (model, generation, key) was let go: whether the rules may be
        skipped. It had no key, did not move the model's last use (`moved`: shared, or
        kept idle), and the model still serves others, is not held by a turn nor
        retiring, and no waiter was served meanwhile."""
        state = self.state
        name, generation, key = lease
        rec, turn = state.models.get(name), state.turn
        return (not key and not moved and rec is not None
                and rec.generation == generation and rec.in_flight > 0 and not rec.retiring
                and not state.queue.changed and not state.teams.partners
                and (turn is None or name not in turn.held) and self.settled(now))

    def settled(self, now: float, skips: bool = True) -> bool:
        """Whether the rules may be skipped now, after a decision `joins`, `leaves`,
        `granted` or `ended` vouched for: they rested after the last event, one class
        level waits, and nothing they wait for is due or pending. Not `skips`: after a
        grant at once, which runs no rules with the skip on or off, the state stays
        rested in both (a policy that never skips revokes such a grant as it is made
        as well: tests/test_policy_twins.py)."""
        state = self.state
        if state.revocable or not self.may(now, skips):
            return False
        state.now = now
        self.skipped += skips
        if self.check:
            before, n = fingerprint(state), len(state.out)
            self.rules.pump(now)
            after = fingerprint(state)
            assert after == before and len(state.out) == n, (
                "the rules decided something after a decision that changed nothing they "
                f"read: {state.out[n:]}, "
                f"{[(b, a) for b, a in zip(before, after, strict=True) if b != a]}")
        state.clean, state.clean_at = True, len(state.out)
        return True

    def may(self, now: float, skips: bool = True) -> bool:
        """The rules rested after the last event, one class level waits, and nothing
        they wait for is due, nor a step of theirs pending (but for grants to revoke)."""
        state = self.state
        if not ((self.on or not skips) and state.rested):
            return False
        dues = state.dues
        while dues and dues[0] <= state.pumped_at:
            heapq.heappop(dues)
        return (not (dues and dues[0] <= now) and len(state.queue.levels) <= 1
                and not state.shutting_down and not state.teams.dropped and not state.teams.brought
                and not state.nodes.draining and not state.groups.wanting)

    def due(self, now: float) -> bool:
        """A time the rules wait for (a `Later`) has come since their last run."""
        dues, pumped_at = self.state.dues, self.state.pumped_at
        while dues and dues[0] <= pumped_at:
            heapq.heappop(dues)
        return bool(dues) and dues[0] <= now


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
            tuple(sorted(state.spent_turns)),
            state.wake_at, state.n_running, state.n_stopping, state.n_suspending,
            tuple(r.name for r in state.warming), state.warm_after, state.warm_due,
            state.revoking)
