"""The next model, woken before it is asked (issue 44, part 2; `prefetch = true`).

Each asker (its key's name, "" for requests without a key; and within it each session,
http.session_headers: two agents under one key, their turns interleaved, are followed
each on its own) is followed from model to model: when it asks for B within
FOLLOW_S of its request for A (or of that answer's end), "B after A" is counted (A after
A too: staying is a choice; a request that joins a grant the front kept is not seen, so
staying counts less than it happens), and how long after: B's expected wait is the
median of the last GAPS_KEPT. When an answer from A ends (the front's grant let go), the
model most often asked next after A is prefetched if it was that at least ODDS of the
times seen, over at least SEEN of them, and it is not up. It is loaded (or woken) where
it fits, evicting only models no request waits for that have been idle longer than B's
expected wait (B is likely asked before them: Belady's rule, with each one's time since
its last answer ended standing for the time to its next), never the model that just
answered. A
slot its victim frees is taken once the victim is gone, unless a request came first
(`due`). As a warm model's load is (rules.py `warm_up`), it gives way to any request
that needs its place, and once ready, unasked, it is the first LRU victim: a wrong guess
costs what had gone unused longest.

Each prefetch is a `prefetch` event with its odds, its expected wait and what it evicted
(each an eviction with reason `prefetch`); `GET /models` shows a prefetched child that
has served nothing yet, and /metrics counts the prefetches used (a request came while it
was up) and wasted (it went first: counted as it goes, in `Moves.transition`). Never
prefetched: copies of a model with replicas, remote models, a model with an exclusive
rival up or with together partners, anything while corral shuts down.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter, deque
from collections.abc import Collection, Hashable

from ..config.rules import SESSION
from ..lifecycle import ModelState
from ..messages import Prefetched
from .records import ModelRecord, Publish
from .rules import Rules
from .state import State
from .weigh import Plan

log = logging.getLogger("corral.scheduler")

S = ModelState
FOLLOW_S = 600.0
"""A request this long after the asker's last answer follows nothing."""
ODDS = 0.5
SEEN = 3
GAPS_KEPT = 16
DUE_S = 30.0
"""A prefetch waits at least this long for what its victims give back (or its wait)."""
"""How many of the last waits from A's answer to B's request give B's expected wait."""
TICKETS_MAX = 10_000
"""Askers followed, and requests of a session whose asker is kept until their answer
ends: the oldest go first past this (a request cancelled while queued has no end)."""


class Prefetch:
    """Which model follows which, per asker, and the prefetches it makes."""

    def __init__(self, state: State, rules: Rules) -> None:
        self.state = state
        self.rules = rules
        self._on = False
        self.follows: dict[str, Counter[str]] = {}
        """Model A -> how often each model was asked next after an answer from A."""
        self.last: dict[str, tuple[str, float, bool]] = {}
        """Asker -> the model of its last request, and when that came, or when its answer
        ended (True)."""
        self.open: dict[str, tuple[str, str, float]] = {}
        """Asker -> (A, B, when B was asked) while A's answer's end is not known."""
        self.pending: list[tuple[str, str, float]] = []
        self.tickets: dict[Hashable, str] = {}
        """A session's request -> its asker, until its answer ends."""
        self.gaps: dict[tuple[str, str], deque[float]] = {}
        """(A, B) -> the last waits from an answer from A to a request for B."""
        self.due: dict[str, tuple[Prefetched, float]] = {}
        """A prefetch waiting for the slot its victim frees -> until when it may go."""

    @property
    def on(self) -> bool:
        return self._on

    @on.setter
    def on(self, on: bool) -> None:
        """Prefetch on or off; off, the rules call nothing of it (no cost unused)."""
        self._on = on
        self.rules.prefetches = self.due_step if on else None
        if not on:
            self.due.clear()

    def asked(self, key: str, model: str, now: float, ticket: Hashable = None,
              affinity: int = 0) -> None:
        """A request for `model` (a model's own name, not a copy's) came with `key`, in
        a session if its `affinity` is one's."""
        if not self.on:
            return
        asker = key
        if affinity >= SESSION:
            asker = self.tickets[ticket] = f"{key}\x00{affinity:x}"
            if len(self.tickets) > TICKETS_MAX:
                del self.tickets[next(iter(self.tickets))]
        prefetched = self.state.prefetched
        for name in [n for n, e in prefetched.items() if e.model == model] if prefetched else ():
            del prefetched[name]  # (one that went first was counted: Moves)
            self.state.stats.prefetches["used"] += 1
        self.due.pop(model, None)  # (asked: it comes up as any load)
        last = self.last.pop(asker, None)  # (and back at the end: the oldest go first)
        if last is not None and now - last[1] <= FOLLOW_S:
            follows = self.follows.get(last[0])
            if follows is None:
                follows = self.follows[last[0]] = Counter()
            follows[model] += 1
            if last[2]:
                self.waited(last[0], model, now - last[1])
            else:  # (its answer's end is not known yet: the front keeps its grant a while)
                self.open[asker] = (last[0], model, now)
                if len(self.open) > TICKETS_MAX:
                    del self.open[next(iter(self.open))]
        self.last[asker] = (model, now, False)
        if len(self.last) > TICKETS_MAX:
            del self.last[next(iter(self.last))]

    def waited(self, model: str, after: str, wait: float) -> None:
        gaps = self.gaps.get((model, after))
        if gaps is None:
            gaps = self.gaps[(model, after)] = deque(maxlen=GAPS_KEPT)
        gaps.append(max(0.0, wait))

    def ended(self, key: str, model: str, ticket: Hashable = None, at: float = 0.0) -> None:
        """An answer from `model` to a request with `key` ended `at` (before its release,
        by the time the front kept its grant; looked at in `step`, once the rules have run
        for what waits: a prefetch takes only what they left)."""
        if self.on:
            self.pending.append((self.tickets.pop(ticket, key), model, at))

    def step(self, now: float) -> None:
        pending, self.pending = self.pending, []
        for asker, model, at in pending:
            self.answered(asker, model, min(at, now) or now, now)

    def answered(self, asker: str, model: str, at: float, now: float) -> None:
        """Its likely next model is prefetched, if it has room (`room`): the answer ended
        `at`, so what is asked `wait` after it is asked `wait - (now - at)` from now."""
        if self.last.get(asker, ("",))[0] == model:
            self.last[asker] = (model, at, True)  # (what follows counts from its end)
        if (opened := self.open.get(asker)) is not None and opened[0] == model:
            del self.open[asker]
            self.waited(model, opened[1], opened[2] - at)
        likely = self.likely(model)
        if likely is None:
            return
        after, n, total = likely
        rec = self.down(after)
        wait = self.expected(model, after)
        room = None if rec is None or rec.name in self.due else \
            self.room(rec, model, max(0.0, wait - (now - at)), now)
        if rec is None or room is None:
            return
        plan, victims = room
        event = Prefetched(model=after, after=model, odds=round(n / total, 3), seen=total,
                           action="wake" if rec.state is S.SUSPENDED else "load",
                           expected_s=round(wait, 1), evicts=[v.name for v in victims])
        log.info("prefetch: %s of %s after %s (asked next %d of %d times, %.1f s after)%s",
                 event.action, after, model, n, total, wait, "".join(
                     f"; evicts {v.name}, idle {now - max(v.last_used, v.ended_at):.0f} s"
                     for v in victims))
        for victim in victims:
            self.rules.moves.evict(victim, "prefetch", rec.name, now)
        if self.state.has_capacity() and (plan is None or plan.verdict == "go"):
            self.go(rec, event, plan, now)
        else:  # (its victims' slot or memory: once they are gone)
            self.due[rec.name] = (event, now + max(wait, DUE_S))

    def go(self, rec: ModelRecord, event: Prefetched, plan: Plan | None, now: float) -> None:
        self.state.stats.prefetches["loaded"] += 1
        self.state.out.append(Publish(event))
        self.state.prefetched[rec.name] = event
        self.state.warming.add(rec)
        self.rules.up.go(rec, plan, now, why=f"prefetch after {event.after}")

    def due_step(self, now: float) -> None:
        """The prefetches waiting for their victims go once they fit evicting nothing
        more, unless a request came first (its rules ran first), or they waited too long."""
        if not self.due:
            return
        for name, (event, until) in list(self.due.items()):
            rec = self.state.models.get(name)
            if rec is None or now > until or self.barred(rec, now) \
                    or rec.state not in (S.UNLOADED, S.SUSPENDED):
                del self.due[name]
            elif self.state.has_capacity():
                plan = self.rules.up.plan(rec, []) if self.state.memory_on else None
                if plan is None or (plan.verdict == "go" and not plan.note and not plan.evict):
                    del self.due[name]
                    self.go(rec, event, plan, now)

    def expected(self, model: str, after: str) -> float:
        """How long after an answer from `model` `after` is asked, as a rule (its median)."""
        gaps = self.gaps.get((model, after))
        return statistics.median(gaps) if gaps else FOLLOW_S

    def likely(self, model: str) -> tuple[str, int, int] | None:
        """The model most often asked next after `model`, how often, and of how many, if
        that is the odds a prefetch needs."""
        seen = self.follows.get(model)
        if not seen:
            return None
        (after, n), total = seen.most_common(1)[0], sum(seen.values())
        return None if after == model or n < SEEN or n / total < ODDS else (after, n, total)

    def down(self, model: str) -> ModelRecord | None:
        """The record a load of `model` would bring up, if it is down (a reload's
        alternate, where it is the current one); None if it is up, or not there."""
        rec = self.state.models.get(model)
        if rec is None or rec.rules.replicas is not None or rec.rules.remote:
            return None  # (copies and remote models: never prefetched)
        rec = self.state.groups.target(rec)
        return rec if rec is not None and rec.state in (S.UNLOADED, S.SUSPENDED) else None

    def after(self, model: str, shown: Collection[str] | None) -> str | None:
        """What an answer from `model` would prefetch as things are (GET /models/plan),
        said only of a model the asker may see (`shown`, None: any)."""
        likely = self.likely(model) if self.on else None
        if likely is None or (shown is not None and likely[0] not in shown) \
                or self.down(likely[0]) is None:
            return None
        return (f"{likely[0]}, where it fits evicting only models idle over "
                f"{self.expected(model, likely[0]):.0f} s (asked next {likely[1]} of "
                f"{likely[2]} times)")

    def barred(self, rec: ModelRecord, now: float) -> bool:
        """`rec` may not be prefetched now: a request waits, it is broken or removed,
        corral shuts down, an exclusive rival is up, or it has together partners."""
        state = self.state
        return (state.shutting_down or rec.breaker.is_open(now) or rec.failed or rec.removed
                or bool(state.queue.entries) or rec.group in state.teams.partners
                or self.rules.teams.has_rival_up(rec.group))

    def room(self, rec: ModelRecord, model: str, wait: float,
             now: float) -> tuple[Plan | None, list[ModelRecord]] | None:
        """How `rec` may come up: its memory plan (None without memory accounting; one
        that waits for its victims to be gone) and what it evicts, only idle models idle
        longer than `wait` (not `model`, which just answered); None if it may not: a
        request waits, it is broken or shutting down, an exclusive rival is up, it has
        together partners, or it has no room."""
        state = self.state
        if self.barred(rec, now):
            return None

        def may_go(r: ModelRecord) -> bool:
            return r.group != model and now - max(r.last_used, r.ended_at) > wait \
                and not state.kept_from(r, rec.group)
        plan, victims = None, []
        if state.memory_on:
            plan = self.rules.up.plan(rec, [v for v in self.rules.choice.memory_victims(
                now, rec.group) if may_go(v)])
            if plan.note or not (plan.verdict == "go" or (  # (or once its victims are gone)
                    plan.verdict == "wait" and plan.evict and plan.fits_once_freed)):
                return None
            victims = [v for v, _ in plan.evict]
        elif rec.rules.nodes is not None:  # (a node's slot: warm_up's way, not taken here)
            return None if not state.has_capacity() else (None, [])
        if not state.has_capacity() and not any(v.holds_slot for v in victims):
            slot, _ = state.victims.pick(state.models, now, state.resident_until, may_go)
            if slot is None:
                return None
            victims.append(slot)
        return plan, victims
