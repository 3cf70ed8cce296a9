"""The policy's core: what each event means, in the order the rules are applied.

The rules are those of llama.cpp's router (shared/reference/server-models-sched.cpp), with
its mutex and condition variables replaced by one owner: the Scheduler actor calls these
methods one message at a time and executes the effects they return. Nothing here does
I/O, reads a clock or sleeps; the time comes in as an argument, and a timer is an effect
(`Later`) whose message comes back as an event, so tests drive it all synchronously.

Requests are named by their *ticket*, any hashable the caller chose (the front uses the
reply object itself); the policy never looks inside one. The parts it composes:

    queue.RequestQueue   who waits for which model, and since when
    victims.Victims      the least recently used model that may go
    memory.Memory        the ledger, and a plan for each load (go / wait / evict / refuse)
    breaker.Breaker      one per model: restart intensity, backoff, half-open
    views                GET /models, GET /devices and the invariants

in three layers, each calling only down: `core.Policy` (requests, people, timers) on
`children.Children` (children, measurements, reloads) on `rules.Rules` (the state, and
the decisions every event ends in: tick, claim, spawn, stop, grant, refuse).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

from ..lifecycle import ModelState
from ..messages import (
    Done,
    TtlDue,
    WaitDue,
)
from .children import Children
from .queue import Waiter
from .records import (
    Answer,
    Effect,
    Later,
)

log = logging.getLogger("corral.scheduler")

S = ModelState



class Policy(Children):
    """The scheduling state of one corral and the rules that change it: what a request,
    a person and a timer cause, each event method reading top-down."""

    # ------------------------------------------------------------ requests

    def acquire(self, ticket: Hashable, model: str, now: float,
                autoload: bool = True) -> list[Effect]:
        """A request for `model` arrived: grant it now, queue it, or refuse it."""
        rec = self._find(model)
        # 1. Nothing is served while shutting down, nor for a model that is not there.
        if self.shutting_down:
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0,
                         model=model, reason="shutdown")
            return self._flush()
        if rec is None:
            self._refuse(ticket, 400, f"model '{model}' not found", "invalid_request_error")
            return self._flush()
        rules, breaker = rec.rules, rec.breaker
        entry = self.queue.entry(model)
        # 2. A serving model with room takes it at once, unless others wait for it
        #    (max_concurrency): nobody overtakes them.
        if self._has_room(rec) and entry is None:
            self._grant(ticket, rec, now)
        # 3. Without autoload, only a child that is there or on its way is worth a wait.
        elif not autoload and rec.state is not S.LOADING and not rec.state.is_serving:
            self._refuse(ticket, 400, f"model '{model}' is not loaded and autoload is off; "
                         "load it with POST /models/load", "invalid_request_error")
        # 4. A backoff that outlasts the request's patience: say when to come back.
        elif (breaker.is_open(now) and rules.queue_timeout_s
              and now + rules.queue_timeout_s < breaker.retry_at):
            self._refuse(ticket, 503, self._backoff_message(rec, now),
                         retry_after_s=breaker.retry_at - now, model=model, reason="backoff")
        # 5. A full queue refuses at once.
        elif rules.queue_max and entry is not None and len(entry.waiters) >= rules.queue_max:
            self._refuse(ticket, 503, f"model '{model}' has {len(entry.waiters)} requests "
                         f"waiting already (queue_max {rules.queue_max}); try again later",
                         retry_after_s=1.0, model=model, reason="queue_full")
        # 6. Otherwise it waits, at most queue_timeout_s.
        else:
            deadline = now + rules.queue_timeout_s if rules.queue_timeout_s else None
            entry = self.queue.add(ticket, model, now, deadline)
            if deadline is not None:
                self._out.append(Later(rules.queue_timeout_s, WaitDue(ticket)))
            log.debug("request for %s queued (%d waiting for it, %d entries)",
                      model, len(entry.waiters), len(self.queue.entries))
            self._pump(now)
        return self._flush()

    def release(self, ticket: Hashable, now: float, shared: bool = False) -> list[Effect]:
        """The request of `ticket` finished (or was never granted: then it is a cancel).
        `shared`: other requests joined its grant, so the model was in use until now."""
        lease = self.leases.pop(ticket, None)
        if lease is None:
            return self.cancel(ticket, now) if ticket in self.queue else []
        name, generation = lease
        rec = self.models.get(name)
        # Invariant: a crash or stop zeroes in_flight, and a reload bumps the generation,
        # so only leases of the live generation still count.
        if rec is not None and rec.generation == generation and rec.state.is_running:
            rec.in_flight -= 1
            if shared:
                rec.last_used = now
            if rec.stale and rec.in_flight == 0 and rec.state.is_serving:
                self._stop(rec, "reload", None, now)  # drained: now it may restart
            else:
                self._serve_waiters(rec, now)  # max_concurrency: the next in line
            self._idle(rec)
        self._pump(now)
        return self._flush()

    def cancel(self, ticket: Hashable, now: float) -> list[Effect]:
        """The client of `ticket` left; a cancel that crossed its grant is a release (R-4.7)."""
        if self._leave_queue(ticket) is None:
            return self.release(ticket, now) if ticket in self.leases else []
        self._pump(now)
        return self._flush()

    def _leave_queue(self, ticket: Hashable) -> Waiter | None:
        """Take a waiter out of the queue; None if it was not queued."""
        removed = self.queue.remove(ticket)
        if removed is None:
            return None
        waiter, gone = removed
        if gone:
            # Its claim (if any) goes with it: the load goes on, and the model then
            # sits idle, evictable; nothing is evicted on its behalf any more.
            self._idle(self.models[waiter.model])
        return waiter

    def wait_due(self, ticket: Hashable, now: float) -> list[Effect]:
        """A queued request's queue_timeout_s ran out: 503, and it leaves like a cancel."""
        waiter = self.queue.waiters.get(ticket)
        if waiter is None or waiter.deadline is None or now < waiter.deadline:
            return []  # granted, refused or gone meanwhile
        rec = self.models[waiter.model]
        why = (f"; {self._backoff_message(rec, now)}" if rec.breaker.is_open(now) else
               f" (state {self._state_word(rec)}"
               + (f"; {rec.waiting_for})" if rec.waiting_for else ")"))
        self._leave_queue(ticket)
        self._pump(now)
        self._refuse(ticket, 503, f"waited {now - waiter.queued_at:.1f} s for model "
                     f"'{waiter.model}' (queue_timeout_s){why}", retry_after_s=1.0,
                     model=waiter.model, reason="queue_timeout")
        return self._flush()

    # ------------------------------------------------------------ management

    def load(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        """POST /models/load: queue a load with no request behind it; ends a backoff."""
        rec = self._find(model)
        if rec is None:
            self._refuse(ticket, 404, f"model '{model}' not found", "not_found_error")
        elif rec.state.is_running and rec.state is not S.STOPPING:
            self._refuse(ticket, 400, f"model '{model}' is already running",
                         "invalid_request_error")
        elif self.shutting_down:
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        else:
            rec.breaker.reset()
            self.queue.open(model).explicit = True
            self._out.append(Answer(ticket, Done()))
            self._pump(now)
        return self._flush()

    def unload(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        """POST /models/unload: stop the child now (busy or not); clears a failure."""
        rec = self._find(model)
        if rec is None:
            self._refuse(ticket, 404, f"model '{model}' not found", "not_found_error")
            return self._flush()
        entry = self.queue.entry(model)
        if entry is not None and entry.explicit:
            entry.explicit = False
            if self.queue.close_if_empty(model):
                self._idle(rec)
        if rec.state is S.UNLOADED and rec.failed:
            rec.failed = False
            rec.breaker.reset()
            self._publish_state(rec, "failure cleared by unload", now)
        elif not rec.state.is_running or rec.state is S.STOPPING:
            self._refuse(ticket, 400, f"model '{model}' is not running",
                         "invalid_request_error")
            return self._flush()
        else:
            self._stop(rec, "manual", None, now)
        self._out.append(Answer(ticket, Done()))
        self._pump(now)
        return self._flush()

    def shutdown(self, now: float) -> list[Effect]:
        """Refuse every waiter, stop every child; `all_stopped` tells when it is over."""
        self.shutting_down = True
        for ticket in self.queue.clear():
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        for rec in self.models.values():
            if rec.state.is_running and rec.state is not S.STOPPING:
                self._stop(rec, "shutdown", None, now)
        return self._flush()

    @property
    def all_stopped(self) -> bool:
        return not any(rec.state.is_running for rec in self.models.values())

    # ------------------------------------------------------------ timers

    def ttl_due(self, model: str, generation: int, now: float) -> list[Effect]:
        """A model's idle TTL may have run out: stop it if it has really been idle that
        long, else look again when it would have (R-3.6)."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation:
            return []
        rec.ttl_armed = False
        if not self._evictable(rec) or not rec.rules.ttl_s:
            return []  # busy, wanted or pinned now: armed again once idle
        due = rec.last_used + rec.rules.ttl_s
        if now >= due:
            self._stop(rec, "ttl", None, now)
            self._pump(now)
        else:
            rec.ttl_armed = True
            self._out.append(Later(due - now, TtlDue(model, generation)))
        return self._flush()

    def repump(self, now: float) -> list[Effect]:
        """A backoff or a min_resident_s ended."""
        if self.wake_at is not None and now >= self.wake_at:
            self.wake_at = None
        self._pump(now)
        return self._flush()
