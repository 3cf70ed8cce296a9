"""The policy's core: what each event means, in the order the rules are applied.

The rules are those of llama.cpp's router (shared/reference/server-models-sched.cpp), with
its mutex and condition variables replaced by one owner: the Scheduler actor calls these
methods one message at a time and executes the effects they return. Nothing here does
I/O, reads a clock or sleeps; the time comes in as an argument, and a timer is an effect
(`Later`) whose message comes back as an event, so tests drive it all synchronously.

Requests are named by their *ticket*, any hashable the caller chose (the Router uses the
reply object itself); the policy never looks inside one. The parts it composes:

    queue.RequestQueue   who waits for which model, and since when
    victims.Victims      the least recently used model that may go
    memory.Memory        the ledger, and a plan for each load (go / wait / evict / refuse)
    breaker.Breaker      one per model: restart intensity, backoff, half-open
    views                GET /models, GET /devices and the invariants
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from ..config import ModelRules
from ..ledger import Breakdown, MiB
from ..lifecycle import ModelState, check_transition
from ..messages import (
    DeviceReport,
    DevicesSnapshot,
    Done,
    Evicted,
    EvictionReason,
    Grant,
    ModelsSnapshot,
    Refusal,
    Repump,
    Shortfall,
    StatusChanged,
    TtlDue,
    WaitDue,
    Withdraw,
)
from ..records import (
    Answer,
    Effect,
    Later,
    Measure,
    ModelRecord,
    Publish,
    Spawn,
    Stats,
    Stop,
    Track,
)
from . import views
from .breaker import Breaker
from .memory import Memory
from .queue import QueueEntry, RequestQueue
from .victims import Victims

log = logging.getLogger("corral.scheduler")

S = ModelState


class Policy:
    """The scheduling state of one corral and the rules that change it."""

    def __init__(self, models_max: int, restart_intensity: int = 3,
                 restart_period_s: float = 60.0, memory_margin: int = 0,
                 account_host: bool = False, restart_backoff_max_s: float = 60.0,
                 restart_healthy_s: float = 30.0) -> None:
        self.models_max = models_max
        self.breaker_args = (restart_intensity, restart_period_s, restart_backoff_max_s,
                             restart_healthy_s)
        self.models: dict[str, ModelRecord] = {}
        self.queue = RequestQueue()
        self.leases: dict[Hashable, tuple[str, int]] = {}
        """Ticket -> (model, generation), for every granted request not yet released."""
        self.memory = Memory(memory_margin, account_host)
        self.victims = Victims(self._evictable)
        self.stats = Stats()
        self.shutting_down = False
        self.n_running = 0
        self.n_stopping = 0
        self.n_running_pinned = 0
        """Counts kept by `_transition` (and a pin change), so a decision is O(1)."""
        self.last_generation: dict[str, int] = {}
        """Model -> the generation of its record when a reload dropped it: a model added
        back goes on counting from there, so a late lease or event of its old record is
        never taken for one of its new."""
        self.wake_at: float | None = None
        """A Repump is due then (a young victim comes of age)."""
        self._out: list[Effect] = []

    @property
    def ledger(self) -> Any:
        return self.memory.ledger

    @property
    def memory_on(self) -> bool:
        return self.memory.on

    def add_model(self, name: str, now: float, *, pinned: bool = False,
                  rules: ModelRules | None = None) -> None:
        self.models[name] = ModelRecord(name=name, rules=rules or ModelRules(pinned=pinned),
                                        breaker=Breaker(*self.breaker_args), state_since=now,
                                        generation=self.last_generation.pop(name, 0))

    def _drop(self, name: str) -> None:
        """Forget a model a reload removed (its child, if any, is reaped)."""
        rec = self.models.pop(name)
        self.last_generation[name] = rec.generation
        self.victims.forget(name)
        self.ledger.release(name)

    # ------------------------------------------------------------ requests

    def acquire(self, ticket: Hashable, model: str, now: float,
                autoload: bool = True) -> list[Effect]:
        """A request for `model` arrived: grant it now, queue it, or refuse it."""
        rec = self._find(model)
        # 1. Nothing is served while shutting down, nor for a model that is not there.
        if self.shutting_down:
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
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
                         retry_after_s=breaker.retry_at - now)
        # 5. A full queue refuses at once.
        elif rules.queue_max and entry is not None and len(entry.waiters) >= rules.queue_max:
            self._refuse(ticket, 503, f"model '{model}' has {len(entry.waiters)} requests "
                         f"waiting already (queue_max {rules.queue_max}); try again later",
                         retry_after_s=1.0)
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
        removed = self.queue.remove(ticket)
        if removed is None:
            return self.release(ticket, now) if ticket in self.leases else []
        waiter, gone = removed
        if gone:
            # Its claim (if any) goes with it: the load goes on, and the model then
            # sits idle, evictable; nothing is evicted on its behalf any more.
            self._idle(self.models[waiter.model])
        self._pump(now)
        return self._flush()

    def wait_due(self, ticket: Hashable, now: float) -> list[Effect]:
        """A queued request's queue_timeout_s ran out: 503, and it leaves like a cancel."""
        waiter = self.queue.waiters.get(ticket)
        if waiter is None or waiter.deadline is None or now < waiter.deadline:
            return []  # granted, refused or gone meanwhile
        rec = self.models[waiter.model]
        why = (f"; {self._backoff_message(rec, now)}" if rec.breaker.is_open(now) else
               f" (state {self._state_word(rec)})")
        self._out.extend(self.cancel(ticket, now))
        self._refuse(ticket, 503, f"waited {now - waiter.queued_at:.1f} s for model "
                     f"'{waiter.model}' (queue_timeout_s){why}", retry_after_s=1.0)
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

    # ------------------------------------------------------------ instance facts

    def instance_started(self, model: str, generation: int, pid: int) -> list[Effect]:
        """The child of `generation` runs as `pid`: from now on its memory is corral's."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation or rec.state is not S.LOADING:
            return []
        rec.pid = pid
        if self.memory_on:
            self._out.append(Track(model, "spawned", pid))
        return self._flush()

    def instance_ready(self, model: str, generation: int, pid: int, base_url: str,
                       now: float, info: dict[str, Any] | None = None) -> list[Effect]:
        """The child of `generation` answers: grant everyone queued for it, atomically (R-4.6)."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation or rec.state is not S.LOADING:
            return []  # stale, or already being stopped: never proxy into a stopping child
        rec.pid = pid
        rec.base_url = base_url
        rec.loads_ok += 1
        rec.load_s_total += now - rec.state_since
        rec.info, rec.progress = info, None
        rec.failed = False
        rec.ready_at = rec.last_used = now
        rec.breaker.ready()
        self._transition(rec, S.LOADED, f"ready, pid {pid}", now, info=info)
        if self.memory_on:
            rec.awaiting_usage = True
            self._out.append(Track(model, "ready", pid))
            if rec.memory == "failed" and rec.measure_attempts < 2:
                # The files may have been missing at measure time: try once more.
                rec.memory = "unmeasured"
                self._out.append(Measure(model, front=False))
        entry = self.queue.entry(model)
        if entry is not None:
            entry.claimed = entry.explicit = False
            self._serve_waiters(rec, now)
        self._idle(rec)
        self._pump(now)
        return self._flush()

    def instance_reported(self, model: str, generation: int, state: str,
                          payload: dict[str, Any], now: float) -> list[Effect]:
        """A llama child's progress, or that it went to sleep or woke up (R-3.6)."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation:
            return []
        if state == "loading" and rec.state is S.LOADING:
            rec.progress = payload
            self._out.append(Publish(StatusChanged(model, "loading", "loading progress",
                                                   progress=payload)))
        elif state == "sleeping" and rec.state is S.LOADED:
            # It keeps its slot (and stays an eviction candidate) but gives its memory
            # back; a request wakes it, and then it holds again.
            self._transition(rec, S.SLEEPING, "idle, the child sleeps", now)
            self.ledger.release(model)
        elif state == "awake" and rec.state is S.SLEEPING:
            self._transition(rec, S.LOADED, "woken by a request", now)
            if self.memory_on:
                self.ledger.reserve(model, rec.mem_effective or rec.mem_min)
        self._idle(rec)
        self._pump(now)
        return self._flush()

    def instance_unhealthy(self, model: str, generation: int, detail: str,
                           now: float) -> list[Effect]:
        """A loaded child failed its liveness checks: stop it; the next request reloads."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation or not rec.state.is_serving:
            return []
        log.warning("model %s#%d is unhealthy (%s); stopping it", model, generation, detail)
        rec.failed = True
        self._stop(rec, "unhealthy", None, now)
        self._pump(now)
        return self._flush()

    def instance_exited(self, model: str, generation: int, returncode: int,
                        description: str, now: float) -> list[Effect]:
        """The child of `generation` is gone and reaped: free its slot; a crash or failed
        load answers its waiters and may open the breaker (R-3.7, R-4.8)."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation or not rec.state.is_running:
            return []
        was, up_since = rec.state, rec.ready_at
        rec.in_flight = 0
        rec.pid = rec.base_url = rec.ready_at = None
        rec.exit_code = returncode
        rec.last_exit = description
        rec.mem_effective = None
        rec.info = rec.progress = None
        rec.awaiting_usage = False
        if self.memory_on:
            rec.releasing = model in self.ledger.held
            self._out.append(Track(model, "exited"))
        entry = self.queue.entry(model)
        if entry is not None:
            entry.claimed = False  # a dead child's claim is void; the head retries
        if rec.removed:
            self._transition(rec, S.UNLOADED, f"stopped, {description}", now, returncode)
            self._drop(model)
        elif was is S.STOPPING:
            self._transition(rec, S.UNLOADED, f"stopped, {description}", now, returncode)
        else:
            self._failed(rec, was, up_since, description, returncode, now)
        self._pump(now)
        return self._flush()

    def _failed(self, rec: ModelRecord, was: ModelState, up_since: float | None,
                description: str, returncode: int, now: float) -> None:
        what = "load failed" if was is S.LOADING else "crashed"
        attempt = rec.breaker.attempt
        killed = returncode < 0
        backoff = rec.breaker.failed(now, up_since, grow=was is S.LOADING and not killed)
        rec.failed = True
        cause = f"{what}: {description}"
        if backoff:
            cause += (f"; {len(rec.breaker.failures)} failures in "
                      f"{rec.breaker.period_s:g} s, no load for {backoff:g} s")
            self._out.append(Later(backoff, Repump()))
        self._transition(rec, S.UNLOADED, cause, now, returncode)
        if was is S.LOADING:
            # the requests that waited on this load get one error each. A load
            # killed by a signal (the OOM killer, an operator) may have been no fault of
            # the model's: its waiters get one more try, and the next failure answers them.
            message = f"model '{rec.name}' failed to load (attempt {attempt}): {description}"
            if killed:
                for ticket, _ in self.queue.keep_for_one_retry(rec.name):
                    self._refuse(ticket, 503, message, retry_after_s=max(backoff, 1.0))
                self._idle(rec)
            else:
                self._refuse_entry(rec.name, 503, message, retry_after_s=max(backoff, 1.0))
        if rec.rules.permanent:
            self.queue.open(rec.name).explicit = True  # back at once (or after it)

    # ------------------------------------------------------------ memory facts

    def start_measuring(self) -> list[Effect]:
        self._out.extend(self.memory.unmeasured(self.models.values()))
        return self._flush()

    def measure_started(self, model: str) -> list[Effect]:
        rec = self.models.get(model)
        if rec is not None:
            rec.memory = "measuring"
            rec.measure_attempts += 1
        return []

    def measured(self, model: str, ok: bool, min_: Breakdown | None,
                 max_: Breakdown | None, now: float, error: str | None = None) -> list[Effect]:
        rec = self.models.get(model)
        if rec is None:
            return []
        self._out.extend(self.memory.measured(rec, ok, min_, max_, error))
        self._pump(now)
        return self._flush()

    def devices_reported(self, report: DeviceReport, now: float) -> list[Effect]:
        self.memory.reported(report, self.models)
        self._pump(now)
        return self._flush()

    def devices_snapshot(self) -> DevicesSnapshot:
        return self.memory.snapshot()

    # ------------------------------------------------------------ reload

    def reconfigure(self, added: dict[str, ModelRules | bool], removed: list[str],
                    changed: dict[str, ModelRules | bool],
                    now: float) -> tuple[list[Effect], list[str]]:
        """A reload (R-2.6): models added, removed, or with a changed config (name ->
        rules, or just `pinned`). Running models whose config changed, or that are gone,
        stop once their requests have finished; the queue and unchanged models are kept.
        Returns the effects and the models that restart."""
        for name, given in added.items():
            rules = given if isinstance(given, ModelRules) else ModelRules(pinned=given)
            old = self.models.get(name)
            if old is not None and old.removed:
                # Back before its old child was reaped: one record, which counts that
                # child until it exits.
                old.removed = False
                self._set_rules(old, rules)
            else:
                self.add_model(name, now, rules=rules)
            if self.memory_on:
                self._out.append(Measure(name, front=False))
        for name in removed:
            rec = self.models[name]
            rec.removed = True
            self._refuse_entry(name, 400, f"model '{name}' was removed by a reload")
            if rec.state.is_running:
                self._retire(rec, now)
            else:
                self._drop(name)  # a child still releasing: external from now on
        restarted = []
        for name, given in changed.items():
            rec = self.models[name]
            self._set_rules(rec, given if isinstance(given, ModelRules)
                            else ModelRules(pinned=given))
            rec.breaker.reset()
            if self.memory_on:  # new arguments, new figures
                rec.memory, rec.mem_min, rec.mem_max = "unmeasured", None, None
                self._out.append(Measure(name, front=False))
            if rec.state.is_running and rec.state is not S.STOPPING:
                restarted.append(name)
                self._retire(rec, now)
        self._pump(now)
        return self._flush(), restarted

    def _set_rules(self, rec: ModelRecord, rules: ModelRules) -> None:
        if rec.state.is_running:
            self.n_running_pinned += int(rules.pinned) - int(rec.pinned)
        rec.rules = rules
        self._idle(rec)

    def _retire(self, rec: ModelRecord, now: float) -> None:
        """Stop `rec` for a reload now if idle, else once its last request is released."""
        if rec.state is S.STOPPING:
            return
        if rec.in_flight == 0:
            self._stop(rec, "reload", None, now)
        else:
            rec.stale = True
            self._out.append(Withdraw(rec.name, rec.generation))

    def _find(self, model: str) -> ModelRecord | None:
        rec = self.models.get(model)
        return None if rec is None or rec.removed else rec

    # ------------------------------------------------------------ views

    def snapshot(self, now: float = 0.0) -> ModelsSnapshot:
        return views.snapshot(self, now)

    def running_count(self) -> int:
        return self.n_running

    def check_invariants(self) -> None:
        views.check(self)

    # ------------------------------------------------------------ the rules

    def _pump(self, now: float) -> None:
        """Re-run the rules after any change to the queue or the running set (R-4.5)."""
        if self.shutting_down:
            return
        self._tick(now)
        self._claim(now)

    def _needs_slot(self, entry: QueueEntry, now: float) -> bool:
        rec = self.models[entry.model]
        return (not entry.claimed and rec.state in (S.UNLOADED, S.STOPPING)
                and not rec.breaker.is_open(now))

    def _has_capacity(self) -> bool:
        return self.models_max <= 0 or self.n_running < self.models_max

    def _has_room(self, rec: ModelRecord) -> bool:
        """May a request be proxied into `rec` now?"""
        limit = rec.rules.max_concurrency
        return (rec.state.is_serving and not rec.stale
                and (not limit or rec.in_flight < limit))

    def _tick(self, now: float) -> None:
        """Stop idle LRU victims until every entry that needs a slot can have one.

        O(1) unless a victim exists or every running model is pinned (then O(queue)):
        at most one slot is needed per entry, so a queue no longer than the free
        slots needs nothing.
        """
        if self.models_max <= 0 or not self.queue.entries:
            return
        # Stopping children free their slot once reaped, so they count as free already:
        # this is what stops two waiters from evicting two victims for one need.
        free = self.models_max - self.n_running + self.n_stopping
        if free >= len(self.queue.entries):
            return
        pinned_out = self.n_running > 0 and self.n_running_pinned == self.n_running \
            and self.n_stopping == 0
        if self._pick_victim(now) is None and not pinned_out:
            return  # every running model is busy, wanted or young: a release re-ticks
        needing = [e.model for e in self.queue if self._needs_slot(e, now)]
        while free < len(needing):
            victim = self._pick_victim(now)
            if victim is None:
                if pinned_out:
                    self._refuse_pinned_out(needing[max(free, 0):])
                return
            self._stop(victim, "lru", needing[max(free, 0)], now)
            free += 1

    def _refuse_pinned_out(self, models: list[str]) -> None:
        """Refuse what no slot will ever come free for: every running model is pinned."""
        names = ", ".join(rec.name for rec in self.models.values() if rec.state.is_running)
        for model in models:
            self._refuse_entry(model, 503, (
                f"model '{model}' cannot be loaded: all {self.models_max} slots (models_max) "
                f"are held by pinned models ({names}); unload one or raise models_max"))

    def _evictable(self, rec: ModelRecord) -> bool:
        return (rec.state.is_serving and not rec.in_flight and not rec.pinned
                and rec.name not in self.queue.entries and not rec.removed)

    def _resident_until(self, rec: ModelRecord) -> float:
        return (rec.ready_at or rec.state_since) + rec.rules.min_resident_s

    def _pick_victim(self, now: float) -> ModelRecord | None:
        """The least recently used model that is idle, serving, unpinned, not wanted and
        resident for its min_resident_s; if only young ones are left, wake up when the
        first comes of age (R-4.4)."""
        victim, wake = self.victims.pick(self.models, now, self._resident_until)
        if wake is not None and (self.wake_at is None or wake < self.wake_at):
            self.wake_at = wake
            self._out.append(Later(wake - now, Repump()))
        return victim

    def _idle(self, rec: ModelRecord) -> None:
        """`rec` may have become idle: offer it as a victim, and arm its TTL."""
        self.victims.offer(rec)
        if (rec.rules.ttl_s and not rec.ttl_armed and self._evictable(rec)):
            rec.ttl_armed = True
            self._out.append(Later(rec.rules.ttl_s, TtlDue(rec.name, rec.generation)))

    def _claim(self, now: float) -> None:
        """Spawn for queue heads, in order, while there is capacity (R-4.3).

        Scans only up to the first head that must wait (claimed entries before it are
        at most models_max); a refusal changes the queue, and the scan starts over.
        """
        rescan = True
        while rescan:
            rescan = False
            for entry in self.queue:
                if not self._needs_slot(entry, now):
                    continue
                rec = self.models[entry.model]
                if rec.state is S.STOPPING or not self._has_capacity():
                    return  # the head waits, and nobody overtakes it
                if self.memory_on:
                    victims = self.victims.ranked(self.models, now, self._resident_until)
                    plan = self.memory.plan(rec, self.models, victims)
                    for victim, shortfalls in plan.evict:
                        self._stop(victim, "memory", rec.name, now, shortfalls)
                    if plan.measure:
                        rec.measure_front = True
                        self._out.append(Measure(rec.name, front=True))
                    if plan.verdict == "refuse":
                        assert plan.refusal is not None
                        self._refuse_entry(rec.name, 503, plan.refusal)
                        rescan = True
                        break
                    if plan.verdict == "wait":
                        return
                entry.claimed = True
                self._spawn(rec, len(entry.waiters), now)

    def _spawn(self, rec: ModelRecord, n_waiting: int, now: float) -> None:
        rec.generation += 1
        rec.loads += 1
        rec.last_used = now
        rec.stale = rec.ttl_armed = False
        attempt = rec.breaker.loading()
        cause = f"spawn for {n_waiting} waiting request(s)"
        if attempt > 1:
            cause += f", attempt {attempt}"
        self._transition(rec, S.LOADING, cause, now)
        if self.memory_on:
            self.memory.spawning(rec)
        self._out.append(Spawn(rec.name, rec.generation))

    def _serve_waiters(self, rec: ModelRecord, now: float) -> None:
        """Grant the requests queued for a serving model, oldest first, while it has room."""
        entry = self.queue.entry(rec.name)
        if entry is None:
            return
        while entry.waiters and self._has_room(rec):
            ticket = next(iter(entry.waiters))
            waiter = self.queue.take(ticket)
            self.stats.queue_waits += 1
            self.stats.queue_wait_s += now - waiter.queued_at
            self._grant(ticket, rec, now)
        self.queue.close_if_empty(rec.name)

    def _stop(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
              now: float, shortfalls: list[Shortfall] | None = None) -> None:
        cause = f"{reason} eviction" + (f" for {for_model}" if for_model else "")
        if shortfalls:
            cause += " (" + ", ".join(f"{s.device}: needs {s.needed / MiB:.0f} MiB, "
                                      f"{s.available / MiB:.0f} MiB available"
                                      for s in shortfalls) + ")"
        self._transition(rec, S.STOPPING, cause, now)
        rec.last_eviction = Evicted(model=rec.name, reason=reason, for_model=for_model,
                                    devices=shortfalls or [])
        key = (rec.name, reason)
        self.stats.evictions[key] = self.stats.evictions.get(key, 0) + 1
        self._out.append(Publish(rec.last_eviction))
        self._out.append(Stop(rec.name, rec.generation, reason))

    def _grant(self, ticket: Hashable, rec: ModelRecord, now: float) -> None:
        # The grant and the in-flight count happen in one step, so no tick can pick
        # this model as a victim between "ready" and "proxied" (llama.cpp #28698).
        assert rec.base_url is not None
        rec.in_flight += 1
        rec.last_used = now
        self.stats.granted += 1
        self.leases[ticket] = (rec.name, rec.generation)
        self._out.append(Answer(ticket, Grant(rec.name, rec.generation, rec.base_url,
                                              shareable=not rec.rules.max_concurrency)))

    def _refuse(self, ticket: Hashable, status: int, message: str,
                type_: str = "server_error", retry_after_s: float | None = None) -> None:
        self._out.append(Answer(ticket, Refusal(status, message, type_, retry_after_s)))

    def _refuse_entry(self, model: str, status: int, message: str,
                      retry_after_s: float | None = None) -> None:
        waiters = self.queue.drop(model)
        rec = self.models[model]
        self._idle(rec)
        for ticket, _ in waiters:
            self._refuse(ticket, status, message, retry_after_s=retry_after_s)

    def _backoff_message(self, rec: ModelRecord, now: float) -> str:
        return (f"model '{rec.name}' failed {len(rec.breaker.failures)} times in "
                f"{rec.breaker.period_s:g} s (last: {rec.last_exit}); the next load may "
                f"start in {rec.breaker.retry_at - now:.1f} s")

    def _state_word(self, rec: ModelRecord) -> str:
        return rec.state.value + (", failed" if rec.failed else "")

    def _transition(self, rec: ModelRecord, new: ModelState, cause: str, now: float,
                    exit_code: int | None = None, info: dict[str, Any] | None = None) -> None:
        check_transition(rec.name, rec.state, new)
        running = int(new.is_running) - int(rec.state.is_running)
        self.n_running += running
        self.n_running_pinned += running * rec.pinned
        self.n_stopping += int(new is S.STOPPING) - int(rec.state is S.STOPPING)
        took = now - rec.state_since
        log.info("model %s#%d: %s -> %s (%s, after %.2f s)", rec.name, rec.generation,
                 rec.state.value, new.value, cause, took)
        if rec.state.is_serving and not new.is_serving:
            self._out.append(Withdraw(rec.name, rec.generation))
        rec.state = new
        rec.state_since = now
        self._publish_state(rec, cause, now, exit_code, info)

    def _publish_state(self, rec: ModelRecord, cause: str, now: float,
                       exit_code: int | None = None,
                       info: dict[str, Any] | None = None) -> None:
        failed = rec.failed and rec.state is S.UNLOADED
        retry = rec.breaker.retry_at - now if rec.breaker.is_open(now) else None
        self._out.append(Publish(StatusChanged(
            rec.name, rec.state.value, cause, exit_code, info, failed=failed,
            exit=rec.last_exit if failed else None, retry_after_s=retry)))

    def _flush(self) -> list[Effect]:
        out, self._out = self._out, []
        return out
