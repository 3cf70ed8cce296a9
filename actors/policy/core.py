"""The policy's core: what each event means, in the order the rules are applied.

The rules are those of llama.cpp's router (shared/reference/server-models-sched.cpp), with
its mutex and condition variables replaced by one owner: the Scheduler actor calls these
methods one message at a time and executes the effects they return. Nothing here does
I/O, reads a clock or sleeps; the time comes in as an argument, and a timer is an effect
(`Later`) whose message comes back as an event, so tests drive it all synchronously.

Requests are named by their *ticket*, any hashable the caller chose (the front uses the reply
object itself); the policy never looks inside one. Its parts: `actors/policy/__init__.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Hashable, Iterable, Mapping

import msgspec

from ..config.keys import BATCH, Tenant
from ..config.rules import ModelGroup, ModelRules
from ..lifecycle import ModelState
from ..messages import ModelsSnapshot, WaitDue
from . import plans, views
from .children import Children
from .commands import Commands
from .drains import Drains
from .plain import Plain
from .plans import RequestPlan
from .preempt import Preemption
from .prefetch import Prefetch
from .queue import Waiter
from .quiet import Quiet
from .records import Answer, Effect, Later, ModelRecord
from .rules import Rules
from .state import State
from .tiers import Tiers

log = logging.getLogger("corral.scheduler")

S = ModelState


class Policy:
    """The scheduling state of one corral and the rules that change it: what a request, a
    person and a timer cause, each event method reading top-down. What children, the memory
    actors and a reload report goes to `children`; suspends, wakes, TTLs to `tiers`."""

    def __init__(self, models_max: int, restart_intensity: int = 3,
                 restart_period_s: float = 60.0, memory_margin: int = 0,
                 account_host: bool = False, restart_backoff_max_s: float = 60.0,
                 restart_healthy_s: float = 30.0, models_max_per_node: int = 0,
                 tenants: dict[str, Tenant] | None = None, aging_s: float = 0.0,
                 preempt: bool = False, host_margin: int = 0,
                 suspended_max: int = 0, prefetch: bool = False) -> None:
        self.state = State(models_max, restart_intensity, restart_period_s, memory_margin,
                           account_host, restart_backoff_max_s, restart_healthy_s,
                           models_max_per_node, tenants, aging_s, host_margin, suspended_max)
        self.state.cuts.on = preempt
        self.rules = Rules(self.state)
        self.moves = self.rules.moves
        self.children = Children(self.state, self.rules)
        self.cuts = Preemption(self.state, self.rules, self._model_let_go)
        self.tiers = Tiers(self.state, self.rules)
        self.commands = Commands(self.state, self.rules)
        self.quiet = Quiet(self.state, self.rules)
        self.drains = Drains(self.state, self.children.handovers)
        self.rules.drains = self.drains.step
        self.prefetch = Prefetch(self.state, self.rules)
        self.prefetch.on = prefetch
        self.plain = Plain(self.state, self.rules, self.quiet, self.prefetch)

    def add_model(self, name: str, now: float, *, pinned: bool = False,
                  rules: ModelRules | None = None) -> None:
        self.state.add_model(name, now, pinned=pinned, rules=rules)

    def snapshot(self, now: float = 0.0) -> ModelsSnapshot:
        """GET /models."""
        return views.snapshot(self.state, now)

    def warmest(self, among: tuple[str, ...]) -> str:
        """The first of `among` with a child that serves, else on its way (issue 25)."""
        def warmth(name: str) -> int:
            rec = self.state.find(name)
            return 0 if rec is None else max(
                2 if r.state.is_serving and not r.retiring
                else 1 if r.state.is_running and r.state is not S.STOPPING else 0
                for r in self.state.groups.all_of(rec))
        scores = [warmth(name) for name in among]
        return among[scores.index(max(scores))]

    def plan(self, model: str, now: float, key: str = "", autoload: bool = True,
             kept: Mapping[str, tuple[int, float]] | None = None,
             shown: Collection[str] | None = None, affinity: int = 0) -> RequestPlan:
        """GET /models/plan: what `acquire` would do with one more request now, decided
        on a copy of this policy (plans.py)."""
        plan = plans.plan(self, model, now, key, autoload, kept, shown, affinity)
        after = self.prefetch.after(plan.model, shown)
        return plan if after is None else msgspec.structs.replace(plan, prefetch=after)

    def running_count(self) -> int:
        return self.state.n_running

    def check_invariants(self) -> None:
        """Raise AssertionError if the state is inconsistent (tests run it after each step)."""
        views.check(self.state)

    # ------------------------------------------------------------ requests

    def acquire(self, ticket: Hashable, model: str, now: float, autoload: bool = True,
                key: str = "", retry: bool = False, cuttable: bool = False,
                affinity: int = 0, among: tuple[str, ...] = (), spill: bool = False,
                ) -> list[Effect]:
        """A request for `model` (`key`: "" for none): granted now, queued, or refused.
        `retry`: it came before (its child went away with it; its key's quota counted it);
        `cuttable`: a front may cut it (cuts.py); `affinity`: its prompt's hash (copies);
        `among`: a virtual model's members (`warm`); `spill`: a remote one takes a wait."""
        if not (key or among or spill) and (done := self.plain.acquire(
                ticket, model, now, autoload, cuttable, affinity)):
            return done  # (no feature applies: plain.py)
        model = self.warmest(among) if among else model
        counted, rec, tenants = bool(key) and not retry, self.state.find(model), self.state.tenants
        # 1. Nothing is served while shutting down, nor for a model that is not there.
        if self.state.shutting_down:
            self.moves.refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0,
                         model=model, reason="shutdown")
            return self.moves.flush()
        if rec is None:
            self.moves.refuse(ticket, 400, f"model '{model}' not found", "invalid_request_error")
            return self.moves.flush()
        rules, breaker, entry = rec.rules, rec.breaker, self.state.queue.entry(model)
        over = tenants.over_quota(key, now) if counted else None
        # 2. A key over its rate or token budget is told when to come back; not queued.
        if over is not None:
            self.moves.refuse(ticket, 429, f"{over.message}; try again in "
                              f"{over.retry_after_s:.1f} s", "rate_limit_error",
                              retry_after_s=over.retry_after_s, model=model,
                              reason=over.reason, key=key)
        # 3. A serving model with room takes it at once, unless others wait for it
        #    (max_concurrency), its key is at its own, or another model's turn to have its
        #    place has come (turns.py).
        elif entry is None and not (key and tenants.at_limit(key)) \
                and (into := self.state.route(rec, affinity, now)) is not None:
            self._serve_now(ticket, into, now, key, counted, cuttable)
        # 3b. A remote member takes what would wait here (its load begun: config/remote.py).
        elif spill:
            self._spill(ticket, rec, now, autoload)
        # 4. Without autoload, only a child that is there or on its way is worth a wait
        #    (a suspended one is there: it is woken).
        elif not autoload and self.state.absent(rec):
            self.moves.refuse(ticket, 400, f"model '{model}' is not loaded and autoload is off; "
                         "load it with POST /models/load", "invalid_request_error")
        # 5. A backoff that outlasts the request's patience: say when to come back.
        elif (breaker.is_open(now) and rules.queue_timeout_s
              and now + rules.queue_timeout_s < breaker.retry_at
              and rec.group not in self.state.groups.active):  # (no copy of it is up)
            self.moves.refuse(ticket, 503, self.moves.backoff_message(rec, now),
                         retry_after_s=breaker.retry_at - now, model=model, reason="backoff")
        # 6. A full queue refuses at once.
        elif rules.queue_max and entry is not None and len(entry.waiters) >= rules.queue_max:
            self.moves.refuse(ticket, 503, f"model '{model}' has {len(entry.waiters)} requests "
                         f"waiting already (queue_max {rules.queue_max}); try again later",
                         retry_after_s=1.0, model=model, reason="queue_full")
        # 7. Otherwise it waits, at most queue_timeout_s, in its class's order.
        else:
            self._queue(ticket, model, rec, now, key, counted, cuttable, affinity)
        if self.prefetch.on and (ticket in self.state.leases or ticket in self.state.queue):
            self.prefetch.asked(key, rec.group, now, ticket, affinity)  # (served, waiting)
        return self.moves.flush()

    def _serve_now(self, ticket: Hashable, into: ModelRecord, now: float, key: str,
                   counted: bool, cuttable: bool) -> None:
        """Step 3 of `acquire`: `into`, serving with room, takes the request at once."""
        if counted:
            self.state.tenants.take(key, now)
        self.moves.grant(ticket, into, now, key, cuttable=cuttable)
        self.quiet.granted(into, key, now)  # (its grant revoked, where the rules do)
        if into.rules.replicas is not None:  # busier copies: one more may be due
            self.rules.scaling.scale(now)
        if self.state.teams.brought:  # a together partner to bring back
            self.rules.pump(now)

    def _spill(self, ticket: Hashable, rec: ModelRecord, now: float, autoload: bool) -> None:
        """Step 3b of `acquire`: refused for a remote member to serve, after the load it
        would have waited for begins (as POST /models/load's), where one may."""
        copies = self.state.groups.of(rec)
        down = all(r.state in (S.UNLOADED, S.STOPPING, S.SUSPENDED) for r in copies)
        why = "it is busy" if not down else "it is on its way"
        if down and autoload and not rec.breaker.is_open(now):  # (a suspended one: woken)
            self.state.queue.open(rec.group).explicit = True
            self.rules.pump(now)
            why = "its load or wake begins"
        elif down:
            why = "autoload is off" if not autoload else "it backs off after failures"
        elif any(r.state in (S.LOADING, S.WAKING) for r in copies):
            why = "it is on its way"
        self.moves.refuse(ticket, 503, f"model '{rec.group}' cannot serve it at once ({why})",
                          retry_after_s=1.0, spill=True)  # (no refusal: /metrics)

    def _queue(self, ticket: Hashable, model: str, rec: ModelRecord, now: float, key: str,
               counted: bool, cuttable: bool, affinity: int) -> None:
        """Step 7 of `acquire`: the request waits for `model` (`rec`), at most
        queue_timeout_s, in its class's order; the rules run (it may be served at once,
        or cut its way in)."""
        rules, tenants = rec.rules, self.state.tenants
        joins = self.quiet.joins(model, key)  # (a wait under way, and nothing to decide)
        if counted:
            tenants.take(key, now)
        deadline = now + rules.queue_timeout_s if rules.queue_timeout_s else None
        if rules.replicas is not None:  # its queue: a copy may be due
            self.state.groups.wanting[model] = None
        entry = self.state.queue.add(ticket, model, now, deadline, key,
                                     tenants.of(key).level if key else tenants.level,
                                     cuttable, affinity=affinity)
        if deadline is not None:
            self.state.out.append(Later(rules.queue_timeout_s, WaitDue(ticket=ticket)))
        log.debug("request for %s queued (%d waiting for it, %d entries)",
                  model, len(entry.waiters), len(self.state.queue.entries))
        if (into := self.state.route(rec, affinity, now)) is not None:
            self.rules.serve_waiters(into, now)  # others wait only for their keys' limits
        if into is not None or not (joins and self.quiet.settled(now)):
            self.rules.pump(now)
        if counted and ticket not in self.state.queue and ticket not in self.state.leases:
            tenants.untake(key)  # refused as it came (every slot pinned): not counted
        self.cuts.ask(rec, now)

    def release(self, ticket: Hashable, now: float, shared: bool = False,
                idle_s: float = 0.0, tokens: int = 0) -> list[Effect]:
        """The request of `ticket` finished (or was never granted: then it is a cancel).
        `shared`: other requests joined its grant; `idle_s`: the front kept it that long
        after its last request (a lease), so that is when the model was last used;
        `tokens`: what it used, for its key's budget."""
        if (done := self.plain.release(ticket, now, shared, idle_s)) is not None:
            return done  # (no feature applies: plain.py)
        if ticket not in self.state.leases:
            return self.cancel(ticket, now) if ticket in self.state.queue else []
        lease = self.state.leases[ticket]
        self._let_go(ticket, now, shared, idle_s, tokens)
        if not self.quiet.ended(lease, shared or bool(idle_s), now):
            self.rules.pump(now)
        self.prefetch.step(now)
        return self.moves.flush()

    def spend(self, ticket: Hashable, tokens: int, now: float) -> None:
        """The stream of `ticket` has used `tokens` more so far: its key's budget counts
        them now (tenants.py), not only at its release. Decides nothing by itself."""
        lease = self.state.leases.get(ticket)
        if lease is not None and lease[2]:
            self.state.tenants.charge(lease[2], tokens, now)
            self.state.rested = False

    def release_all(self, releases: Iterable[tuple[Hashable, bool, float, int]],
                    now: float) -> list[Effect]:
        """Grants given back together (ticket, shared, idle_s, tokens): the front's answer
        to a Revoke. All are idle before the rules run, so the LRU victim is chosen among
        all of them, not the first to arrive."""
        for ticket, shared, idle_s, tokens in releases:
            if ticket in self.state.leases:
                self._let_go(ticket, now, shared, idle_s, tokens)
        self.rules.pump(now)
        self.prefetch.step(now)
        return self.moves.flush()

    def _let_go(self, ticket: Hashable, now: float, shared: bool, idle_s: float,
                tokens: int = 0) -> None:
        name, generation, key = self.state.leases.pop(ticket)
        if self.prefetch.on and (rec := self.state.models.get(name)) is not None:
            self.prefetch.ended(key, rec.group, ticket, now - idle_s)
        if self.state.cuts.of:
            self.state.cuts.forget(ticket)
        freed = False
        if key:  # a request with no key (corral has none) has no rules to keep
            freed = self.state.tenants.released(key, tokens, now)
        self._model_let_go(name, generation, now, shared, idle_s,
                           shared or not key.startswith(BATCH))
        if freed:  # the key was at its max_concurrency: its waiters may go now
            self.rules.serve_queued(now, key)
            self.cuts.where(now, key)

    def _model_let_go(self, name: str, generation: int, now: float, shared: bool,
                      idle_s: float, asked: bool = True) -> None:  # (by a class: choice.py)
        rec = self.state.models.get(name)
        # Invariant: a crash or stop zeroes in_flight, and a reload bumps the generation,
        # so only leases of the live generation still count.
        if rec is None or rec.generation != generation or not (
                rec.state.is_running or rec.state is S.REMOTE):
            return
        rec.in_flight -= 1
        rec.ended_at = max(rec.ended_at, now - idle_s)
        if shared or idle_s:
            rec.last_used = max(rec.last_used, now - idle_s)
            if asked:
                rec.asked_at = max(rec.asked_at, now - idle_s)
        if self.state.teams.partners:
            self.rules.teams.used_together(rec, now)
        if rec.retiring and rec.in_flight == 0 and rec.state.is_serving:
            reason, for_model, note = rec.retire_as  # drained: now it may go
            self.moves.stop(rec, reason, for_model, now, note=note)
        else:
            self.rules.serve_waiters(rec, now)  # max_concurrency: the next in line
        self.moves.idle(rec, now)

    def cancel(self, ticket: Hashable, now: float) -> list[Effect]:
        """The client of `ticket` left; a cancel that crossed its grant is a release (R-4.7)."""
        leaves = self.quiet.leaves(ticket)  # (from the middle of a wait: nothing to decide)
        if self._leave_queue(ticket) is None:
            return self.release(ticket, now) if ticket in self.state.leases else []
        if not (leaves and self.quiet.settled(now)):
            self.rules.pump(now)
        return self.state.flush()

    def _leave_queue(self, ticket: Hashable) -> Waiter | None:
        """Take a waiter out of the queue; None if it was not queued."""
        removed = self.state.queue.remove(ticket)
        if removed is None:
            return None
        waiter, gone = removed
        if gone:
            # Its claim (if any) goes with it: the load goes on, and the model then
            # sits idle, evictable; nothing is evicted on its behalf any more.
            for rec in self.state.groups.of(self.state.models[waiter.model]):
                self.moves.idle(rec)
        return waiter

    def wait_due(self, ticket: Hashable, now: float) -> list[Effect]:
        """A queued request's queue_timeout_s ran out: 503, and it leaves like a cancel."""
        waiter = self.state.queue.waiters.get(ticket)
        if waiter is None or waiter.deadline is None or now < waiter.deadline:
            return []  # granted, refused or gone meanwhile
        rec = self.state.models[waiter.model]
        why = (f"; {self.moves.backoff_message(rec, now)}" if rec.breaker.is_open(now) else
               f" (state {self.moves.state_word(rec)}"
               + (f"; {rec.waiting_for})" if rec.waiting_for else ")"))
        self._leave_queue(ticket)
        self.rules.pump(now)
        self.moves.refuse(ticket, 503, f"waited {now - waiter.queued_at:.1f} s for model "
                     f"'{waiter.model}' (queue_timeout_s){why}", retry_after_s=1.0,
                     model=waiter.model, reason="queue_timeout", key=waiter.key)
        return self.moves.flush()

    # ------------------------------------------------------------ management

    def set_tenants(self, tenants: dict[str, Tenant], aging_s: float,
                    now: float, preempt: bool | None = None) -> list[Effect]:
        """A reload's keys: new classes and limits (the windows of the keys that stay are
        kept); a waiter whose key's max_concurrency rose or went may go now."""
        self.state.tenants.replace(tenants)
        self.state.queue.aging_s = aging_s
        if preempt is not None:
            self.state.cuts.on = preempt
        self.rules.serve_queued(now)
        self.cuts.where(now)
        self.rules.pump(now)
        return self.moves.flush()

    def set_groups(self, groups: dict[str, ModelGroup], now: float) -> list[Effect]:
        """The model groups now (issue 25, teams.py): from the config, and each reload,
        applied to what runs: of an exclusive group's members running, all but the one
        used last go (once their requests have ended); a together group's running
        members bring the others; victims are offered anew."""
        self.moves.teams.apply(groups, now)
        state = self.state
        for rec in state.models.values():
            self.moves.idle(rec, now)
        self.rules.pump(now)
        return self.moves.flush()

    def load(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        return self.commands.load(ticket, model, now)

    def unload(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        return self.commands.unload(ticket, model, now)

    def drain(self, ticket: Hashable, node: str, drain: bool, now: float) -> list[Effect]:
        """POST /nodes/{node}/drain (or undrain): answered with its view once the moves
        are begun."""
        if drain:
            self.drains.drain(node, now)
        else:
            self.drains.undrain(node)
        self.rules.pump(now)
        self.state.out.append(Answer(ticket, self.drains.view(node)))
        return self.moves.flush()

    def shutdown(self, now: float) -> list[Effect]:
        return self.commands.shutdown(now)

    @property
    def all_stopped(self) -> bool:
        return not any(rec.state.is_running for rec in self.state.models.values())

    # ------------------------------------------------------------ timers

    def repump(self, now: float) -> list[Effect]:
        """A backoff or a min_resident_s ended."""
        if self.state.wake_at is not None and now >= self.state.wake_at:
            self.state.wake_at = None
        self.rules.pump(now)
        return self.moves.flush()
