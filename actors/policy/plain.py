"""The decisions most requests make, written once for when no feature applies (issue
43: features cost nothing when unused): a request with no key granted at once by a model
that serves, or queued behind others waiting for a model on its way, and the release of
a grant.

`Policy.acquire` and `Policy.release` read top-down through every feature: keys and
their limits, virtual models, copies and their routing, groups, a turn's cutoff, cuts,
prefetch. For a keyless request to a model with no `max_concurrency`, no copies, not
held by a turn and in no `together` group, all of that decides nothing, yet its checks
were most of the decision's cost (`python -m bench scheduler`). Here the same decision
is made in one step, with the same effects and the same state after it; where any
feature applies, `None` says so before anything is changed, and the general path
decides.

The rules' own skip (quiet.py) is called as it is from the general path, so what it
vouches for, and what its `check` asserts in the tests, is the same. With `Quiet.on`
off, these are off too: tests/test_policy_twins.py drives a policy with both on and one
with both off through random worlds, and they must decide the same, effect for effect.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from ..config.rules import SESSION
from ..lifecycle import ModelState
from ..messages import Grant, WaitDue
from .prefetch import Prefetch
from .quiet import Quiet
from .records import Answer, Effect, Later
from .rules import Rules
from .state import State

log = logging.getLogger("corral.scheduler")
_SERVING = frozenset(s for s in ModelState if s.is_serving)


class Plain:
    """The keyless grant at once and its release, on one `State`."""

    def __init__(self, state: State, rules: Rules, quiet: Quiet, prefetch: Prefetch) -> None:
        self.state = state
        self.rules = rules
        self.quiet = quiet
        self.prefetch = prefetch

    def acquire(self, ticket: Hashable, model: str, now: float, autoload: bool,
                cuttable: bool, affinity: int) -> list[Effect] | None:
        """`Policy.acquire` of a keyless request for `model`, where no feature applies:
        granted at once, or queued behind a wait under way; None: neither applies."""
        done = self.grant(ticket, model, now)
        return done if done is not None else self.queue(ticket, model, now, autoload,
                                                        cuttable, affinity)

    def grant(self, ticket: Hashable, model: str, now: float) -> list[Effect] | None:
        """`Policy.acquire` of a keyless request, where `model` takes it at once and none
        of the features applies: its effects; None where that is not so (nothing changed)."""
        state, quiet = self.state, self.quiet
        rec = state.models.get(model)
        if rec is None or not quiet.on or self.prefetch.on:
            return None
        rules, turn, teams = rec.rules, state.turn, state.teams
        if (rec.state not in _SERVING or rec.retiring or rec.removed or rules.max_concurrency
                or rules.replicas is not None or rules.group or model in state.queue.entries
                or state.shutting_down or state.groups.alternates or teams.partners
                or (turn is not None and model in turn.held)):
            return None
        # moves.grant, of a request with no key and no waiter on a model that is none
        # of a turn's held: shareable, not solo, never cut, no class to count.
        rec.in_flight += 1
        rec.last_used = rec.asked_at = now
        state.stats.granted += 1
        generation = rec.generation
        state.leases[ticket] = (model, generation, "")
        if not rules.pinned:
            state.revocable[(model, generation)] = None
        assert rec.host is not None and rec.port is not None
        state.out.append(Answer(ticket, Grant(
            model=model, generation=generation, host=rec.host, port=rec.port,
            upstream_key=rec.upstream_key, epoch=rec.wakes)))
        if rec.in_flight > 1:  # (Quiet.granted, whose other terms the guards above hold)
            quiet.granted_quietly(rec, now)  # (its grant revoked, where the rules do)
        if teams.brought:  # a together partner to bring back
            self.rules.pump(now)
        return state.flush()

    def queue(self, ticket: Hashable, model: str, now: float, autoload: bool,
              cuttable: bool, affinity: int) -> list[Effect] | None:
        """`Policy.acquire` of a keyless request that joins the keyless lane of a wait under
        way for a model that does not serve (core._queue, which Quiet.joins vouches for),
        where none of the features applies: its effects; None where that is not so
        (nothing changed)."""
        state, quiet = self.state, self.quiet
        entry = state.queue.entries.get(model)
        rec = state.models.get(model)
        if (entry is None or rec is None or not autoload or not quiet.on or self.prefetch.on
                or rec.state in _SERVING or rec.removed or "" not in entry.lanes
                or entry.sessions or affinity >= SESSION or state.shutting_down
                or state.cuts.on or state.groups.alternates):
            return None
        rules = rec.rules
        if (rules.replicas is not None or rules.group or rec.breaker.is_open(now)
                or (rules.queue_max and len(entry.waiters) >= rules.queue_max)):
            return None
        timeout_s = rules.queue_timeout_s
        state.queue.add(ticket, model, now, now + timeout_s if timeout_s else None, "",
                        state.tenants.level, cuttable, affinity=affinity)
        if timeout_s:
            state.out.append(Later(timeout_s, WaitDue(ticket=ticket)))
        log.debug("request for %s queued (%d waiting for it, %d entries)",
                  model, len(entry.waiters), len(state.queue.entries))
        if not quiet.settled(now):  # (it does not serve: no room to route it to)
            self.rules.pump(now)
        return state.flush()

    def release(self, ticket: Hashable, now: float, shared: bool,
                idle_s: float) -> list[Effect] | None:
        """`Policy.release` of a keyless lease whose model stays busy and has no waiters,
        where none of the features applies: its effects; None where that is not so
        (nothing changed)."""
        state, quiet = self.state, self.quiet
        lease = state.leases.get(ticket)
        if lease is None or lease[2] or not quiet.on:
            return None
        name, generation, _ = lease
        rec = state.models.get(name)
        if (rec is None or rec.generation != generation or rec.state not in _SERVING
                or rec.in_flight < 2 or rec.retiring or state.teams.partners
                or self.prefetch.on or self.prefetch.pending or state.cuts.of
                or rec.rules.group or rec.group in state.queue.entries):
            return None
        # core._let_go and _model_let_go, of a keyless lease on a model with others in
        # flight and nobody waiting for it: no waiter to serve, not idle (moves.idle
        # offers no victim and arms no TTL while in_flight is above 0).
        del state.leases[ticket]
        rec.in_flight -= 1
        rec.ended_at = max(rec.ended_at, now - idle_s)
        if shared or idle_s:
            rec.last_used = max(rec.last_used, now - idle_s)
            rec.asked_at = max(rec.asked_at, now - idle_s)
        turn = state.turn  # (Quiet.ended, whose other terms the guards above hold)
        if (shared or idle_s or state.queue.changed or (turn is not None and name in turn.held)
                or not quiet.settled(now)):
            self.rules.pump(now)
        return state.flush()
