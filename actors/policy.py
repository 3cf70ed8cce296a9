"""Pure scheduling: the queue, claims, the tick, victim choice, the restart budget and the
memory rules (R-5.7).

The rules are those of llama.cpp's router (shared/reference/server-models-sched.cpp), with
its mutex and condition variables replaced by one owner: the Scheduler actor calls these
methods one message at a time and executes the effects they return. Nothing here does
I/O, reads a clock or sleeps; the time comes in as an argument, so tests drive it
synchronously.

Requests are named by their *ticket*, any hashable the caller chose (the Router uses the
reply object itself); the policy never looks inside one.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Hashable
from typing import Any

from .ledger import Ledger, MiB
from .lifecycle import ModelState, check_transition
from .memory_rules import MemoryRules
from .messages import (
    Done,
    Evicted,
    EvictionReason,
    Grant,
    ModelsSnapshot,
    ModelView,
    Refusal,
    Shortfall,
    StatusChanged,
    Withdraw,
)
from .records import (
    Answer,
    Effect,
    Measure,
    ModelRecord,
    Publish,
    QueueEntry,
    RestartBudget,
    Spawn,
    Stats,
    Stop,
    Track,
)

log = logging.getLogger("corral.scheduler")

S = ModelState


class Policy(MemoryRules):
    """The scheduling state of one corral and the rules that change it."""

    def __init__(self, models_max: int, restart_intensity: int = 3,
                 restart_period_s: float = 60.0, memory_margin: int = 0,
                 account_host: bool = False) -> None:
        self.models_max = models_max
        self.memory_on = memory_margin > 0
        """Memory accounting decides loads; off at margin 0, as in the reference."""
        self.ledger = Ledger(memory_margin, account_host)
        self.backends: list[str] = []
        self.restart_intensity = restart_intensity
        self.restart_period_s = restart_period_s
        self.models: dict[str, ModelRecord] = {}
        self.queue: dict[str, QueueEntry] = {}
        """Insertion-ordered: the first unclaimed entry is the head (R-4.3)."""
        self.waiting: dict[Hashable, str] = {}
        """Ticket -> model, for every queued request."""
        self.leases: dict[Hashable, tuple[str, int]] = {}
        """Ticket -> (model, generation), for every granted request not yet released."""
        self.queued_at: dict[Hashable, float] = {}
        """Ticket -> when it joined the queue (same keys as `waiting`)."""
        self.stats = Stats()
        self.shutting_down = False
        self.n_running = 0
        self.n_stopping = 0
        self.n_running_pinned = 0
        """Counts kept by `_transition` (and a pin change), so a decision is O(1)."""
        self.idle: list[tuple[float, int, str]] = []
        """Heap of (last_used, seq, model) offered as victims; an entry is valid while the
        model is evictable and its last_used unchanged. Invariant: every evictable model
        has a valid entry."""
        self._idle_seq = itertools.count()
        self._out: list[Effect] = []

    def add_model(self, name: str, now: float, *, pinned: bool = False) -> None:
        budget = RestartBudget(self.restart_intensity, self.restart_period_s)
        self.models[name] = ModelRecord(name=name, pinned=pinned, budget=budget,
                                        state_since=now)

    # ------------------------------------------------------------ requests

    def acquire(self, ticket: Hashable, model: str, now: float,
                autoload: bool = True) -> list[Effect]:
        """A request for `model` arrived: grant it now, queue it, or refuse it."""
        rec = self._find(model)
        if self.shutting_down:
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        elif rec is None:
            self._refuse(ticket, 400, f"model '{model}' not found", "invalid_request_error")
        elif rec.state.is_serving and not rec.stale:
            self._grant(ticket, rec, now)
        elif rec.gave_up is not None:
            self._refuse(ticket, 500, rec.gave_up)
        elif not autoload and rec.state is not S.LOADING:
            self._refuse(ticket, 400, f"model '{model}' is not loaded and autoload is off; "
                         "load it with POST /models/load", "invalid_request_error")
        else:
            entry = self.queue.get(model)
            if entry is None:
                entry = self.queue[model] = QueueEntry(model)
            entry.waiters[ticket] = None
            self.waiting[ticket] = model
            self.queued_at[ticket] = now
            log.debug("request for %s queued (%d waiting for it, %d entries)",
                      model, len(entry.waiters), len(self.queue))
            self._pump(now)
        return self._flush()

    def release(self, ticket: Hashable, now: float, shared: bool = False) -> list[Effect]:
        """The request of `ticket` finished (or was never granted: then it is a cancel).
        `shared`: other requests joined its grant, so the model was in use until now."""
        lease = self.leases.pop(ticket, None)
        if lease is None:
            return self.cancel(ticket, now) if ticket in self.waiting else []
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
            self._maybe_idle(rec)
        self._pump(now)
        return self._flush()

    def cancel(self, ticket: Hashable, now: float) -> list[Effect]:
        """The client of `ticket` left; a cancel that crossed its grant is a release (R-4.7)."""
        name = self.waiting.pop(ticket, None)
        if name is None:
            return self.release(ticket, now) if ticket in self.leases else []
        del self.queued_at[ticket]
        entry = self.queue[name]
        del entry.waiters[ticket]
        if not entry.waiters and not entry.explicit:
            # Its claim (if any) goes with it: the load goes on, and the model then
            # sits idle, evictable; nothing is evicted on its behalf any more.
            del self.queue[name]
            self._maybe_idle(self.models[name])
        self._pump(now)
        return self._flush()

    # ------------------------------------------------------------ management

    def load(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        """POST /models/load: queue a load with no request behind it; clears `failed`."""
        rec = self._find(model)
        if rec is None:
            self._refuse(ticket, 404, f"model '{model}' not found", "not_found_error")
        elif rec.state.is_running and rec.state is not S.STOPPING:
            self._refuse(ticket, 400, f"model '{model}' is already running",
                         "invalid_request_error")
        elif self.shutting_down:
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        else:
            rec.gave_up = None
            rec.budget.reset()
            entry = self.queue.get(model)
            if entry is None:
                entry = self.queue[model] = QueueEntry(model)
            entry.explicit = True
            self._out.append(Answer(ticket, Done()))
            self._pump(now)
        return self._flush()

    def unload(self, ticket: Hashable, model: str, now: float) -> list[Effect]:
        """POST /models/unload: stop the child now (busy or not); clears `failed`."""
        rec = self._find(model)
        if rec is None:
            self._refuse(ticket, 404, f"model '{model}' not found", "not_found_error")
            return self._flush()
        entry = self.queue.get(model)
        if entry is not None and entry.explicit:
            entry.explicit = False
            if not entry.waiters:
                del self.queue[model]
                self._maybe_idle(rec)
        if rec.state is S.FAILED:
            rec.gave_up = None
            rec.budget.reset()
            self._transition(rec, S.UNLOADED, "failure cleared by unload", now)
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
        for ticket in list(self.waiting):
            self._refuse(ticket, 503, "corral is shutting down", retry_after_s=1.0)
        self.waiting.clear()
        self.queued_at.clear()
        self.queue.clear()
        for rec in self.models.values():
            if rec.state.is_running and rec.state is not S.STOPPING:
                self._stop(rec, "shutdown", None, now)
        return self._flush()

    @property
    def all_stopped(self) -> bool:
        return not any(rec.state.is_running for rec in self.models.values())

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
        self._transition(rec, S.LOADED, f"ready, pid {pid}", now, info=info)
        rec.last_used = now
        if self.memory_on:
            rec.awaiting_usage = True
            self._out.append(Track(model, "ready", pid))
            if rec.memory == "failed" and rec.measure_attempts < 2:
                # The files may have been missing at measure time: try once more.
                rec.memory = "unmeasured"
                self._out.append(Measure(model, front=False))
        entry = self.queue.pop(model, None)
        if entry is not None:
            for ticket in entry.waiters:
                del self.waiting[ticket]
                self.stats.queue_waits += 1
                self.stats.queue_wait_s += now - self.queued_at.pop(ticket)
                self._grant(ticket, rec, now)
        self._maybe_idle(rec)
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
        self._maybe_idle(rec)
        self._pump(now)
        return self._flush()

    def instance_exited(self, model: str, generation: int, returncode: int,
                        description: str, now: float) -> list[Effect]:
        """The child of `generation` is gone and reaped: free its slot, count a failure."""
        rec = self.models.get(model)
        if rec is None or rec.generation != generation or not rec.state.is_running:
            return []
        rec.in_flight = 0
        rec.pid = None
        rec.base_url = None
        rec.exit_code = returncode
        rec.last_exit = description
        rec.mem_effective = None
        rec.info = rec.progress = None
        rec.awaiting_usage = False
        if self.memory_on:
            rec.releasing = model in self.ledger.held
            self._out.append(Track(model, "exited"))
        entry = self.queue.get(model)
        if entry is not None:
            entry.claimed = False  # a dead child's claim is void; the head retries
        if rec.removed:
            self._transition(rec, S.UNLOADED, f"stopped, {description}", now, returncode)
            self.ledger.release(model)
            del self.models[model]
        elif rec.state is S.STOPPING:
            self._transition(rec, S.UNLOADED, f"stopped, {description}", now, returncode)
        else:
            what = "load failed" if rec.state is S.LOADING else "crashed"
            spent = rec.budget.record(now)
            self._transition(rec, S.FAILED, f"{what}: {description}", now, returncode)
            if spent:
                rec.gave_up = (
                    f"model '{model}' failed {len(rec.budget.failures)} times in "
                    f"{rec.budget.period_s:g} s (last: {what}, {description}); not restarting "
                    "until it is loaded again (POST /models/load)")
                log.error("%s", rec.gave_up)
                self._refuse_entry(model, 500, rec.gave_up)
        self._pump(now)
        return self._flush()

    # ------------------------------------------------------------ reload

    def reconfigure(self, added: dict[str, bool], removed: list[str],
                    changed: dict[str, bool], now: float) -> tuple[list[Effect], list[str]]:
        """A reload (R-2.6): models added (name -> pinned), removed, or with a changed
        config. Running models whose config changed, or that are gone, stop once their
        requests have finished; the queue and unchanged models are kept. Returns the
        effects and the models that restart."""
        for name, pinned in added.items():
            self.add_model(name, now, pinned=pinned)
            if self.memory_on:
                self._out.append(Measure(name, front=False))
        for name in removed:
            rec = self.models[name]
            rec.removed = True
            self._refuse_entry(name, 400, f"model '{name}' was removed by a reload")
            if rec.state.is_running:
                self._retire(rec, now)
            else:
                del self.models[name]
        restarted = []
        for name, pinned in changed.items():
            rec = self.models[name]
            if rec.state.is_running:
                self.n_running_pinned += int(pinned) - int(rec.pinned)
            rec.pinned = pinned
            self._maybe_idle(rec)
            rec.gave_up = None
            rec.budget.reset()
            if rec.state is S.FAILED:
                self._transition(rec, S.UNLOADED, "failure cleared by a reload", now)
            if self.memory_on:  # new arguments, new figures
                rec.memory, rec.mem_min, rec.mem_max = "unmeasured", None, None
                self._out.append(Measure(name, front=False))
            if rec.state.is_running and rec.state is not S.STOPPING:
                restarted.append(name)
                self._retire(rec, now)
        self._pump(now)
        return self._flush(), restarted

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

    def snapshot(self) -> ModelsSnapshot:
        views = []
        for rec in self.models.values():
            if rec.removed:
                continue
            entry = self.queue.get(rec.name)
            port = int(rec.base_url.rsplit(":", 1)[1]) if rec.base_url else None
            views.append(ModelView(
                name=rec.name, state=rec.state.value, generation=rec.generation,
                in_flight=rec.in_flight, waiting=len(entry.waiters) if entry else 0,
                pid=rec.pid, port=port, exit_code=rec.exit_code, last_exit=rec.last_exit,
                last_eviction=rec.last_eviction, loads=rec.loads, loads_ok=rec.loads_ok,
                load_s_total=rec.load_s_total,
                evictions={r: n for (m, r), n in self.stats.evictions.items() if m == rec.name},
                memory=rec.memory_info(), info=rec.info, progress=rec.progress))
        return ModelsSnapshot(models=views, running=self.running_count(),
                              queue_depth=len(self.waiting),
                              granted=self.stats.granted, queue_waits=self.stats.queue_waits,
                              queue_wait_s=self.stats.queue_wait_s)

    def running_count(self) -> int:
        return self.n_running

    def check_invariants(self) -> None:
        """Raise AssertionError if the state is inconsistent (used by tests)."""
        assert self.waiting.keys() == self.queued_at.keys()
        for ticket, name in self.waiting.items():
            assert ticket in self.queue[name].waiters, (ticket, name)
        for name, entry in self.queue.items():
            rec = self.models[name]
            assert entry.waiters or entry.explicit, f"{name}: empty entry"
            assert not rec.state.is_serving or rec.stale, f"{name}: queued while serving"
            if entry.claimed:
                assert rec.state in (S.LOADING, S.STOPPING), f"{name}: claim without child"
            for ticket in entry.waiters:
                assert self.waiting[ticket] == name
        for rec in self.models.values():
            live = sum(1 for (n, g) in self.leases.values()
                       if n == rec.name and g == rec.generation)
            if rec.state.is_running:
                assert rec.in_flight == live, f"{rec.name}: in_flight {rec.in_flight} != {live}"
            else:
                assert rec.in_flight == 0
        recs = list(self.models.values())
        assert self.n_running == sum(r.state.is_running for r in recs), "n_running"
        assert self.n_stopping == sum(r.state is S.STOPPING for r in recs), "n_stopping"
        assert self.n_running_pinned == sum(r.state.is_running and r.pinned for r in recs)
        offered = {(name, last) for last, _, name in self.idle}
        for rec in recs:
            if self._evictable(rec):
                assert (rec.name, rec.last_used) in offered, f"{rec.name}: evictable, unoffered"
        for name in self.ledger.held:
            rec = self.models[name]
            assert rec.state.is_running or rec.releasing, f"{name}: holds memory, no child"

    # ------------------------------------------------------------ the rules

    def _pump(self, now: float) -> None:
        """Re-run the rules after any change to the queue or the running set (R-4.5)."""
        if self.shutting_down:
            return
        self._tick(now)
        self._claim(now)

    def _needs_slot(self, entry: QueueEntry) -> bool:
        state = self.models[entry.model].state
        return not entry.claimed and state in (S.UNLOADED, S.FAILED, S.STOPPING)

    def _has_capacity(self) -> bool:
        return self.models_max <= 0 or self.n_running < self.models_max

    def _tick(self, now: float) -> None:
        """Stop idle LRU victims until every entry that needs a slot can have one.

        O(1) unless a victim exists or every running model is pinned (then O(queue)):
        at most one slot is needed per entry, so a queue no longer than the free
        slots needs nothing.
        """
        if self.models_max <= 0 or not self.queue:
            return
        # Stopping children free their slot once reaped, so they count as free already:
        # this is what stops two waiters from evicting two victims for one need.
        free = self.models_max - self.n_running + self.n_stopping
        if free >= len(self.queue):
            return
        pinned_out = self.n_running > 0 and self.n_running_pinned == self.n_running \
            and self.n_stopping == 0
        if self._pick_victim() is None and not pinned_out:
            return  # every running model is busy or wanted: a release re-ticks
        needing = [e.model for e in self.queue.values() if self._needs_slot(e)]
        while free < len(needing):
            victim = self._pick_victim()
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
                and rec.name not in self.queue and not rec.removed)

    def _maybe_idle(self, rec: ModelRecord) -> None:
        """Offer `rec` to the victim heap if it is evictable now (stale offers are
        dropped when they reach the top)."""
        if self._evictable(rec):
            heapq.heappush(self.idle, (rec.last_used, next(self._idle_seq), rec.name))

    def _pick_victim(self) -> ModelRecord | None:
        """The least recently used model that is idle, serving, unpinned and not wanted."""
        while self.idle:
            last_used, _, name = self.idle[0]
            rec = self.models.get(name)
            if rec is not None and rec.last_used == last_used and self._evictable(rec):
                return rec
            heapq.heappop(self.idle)
        return None

    def _claim(self, now: float) -> None:
        """Spawn for queue heads, in order, while there is capacity (R-4.3).

        Scans only up to the first head that must wait (claimed entries before it are
        at most models_max); a refusal changes the queue, and the scan starts over.
        """
        rescan = True
        while rescan:
            rescan = False
            for entry in self.queue.values():
                if not self._needs_slot(entry):
                    continue
                rec = self.models[entry.model]
                if rec.state is S.STOPPING or not self._has_capacity():
                    return  # the head waits, and nobody overtakes it
                if self.memory_on:
                    room = self._make_room(rec, now)
                    if room == "refused":
                        rescan = True
                        break
                    if room == "wait":
                        return
                entry.claimed = True
                self._spawn(rec, len(entry.waiters), now)

    def _spawn(self, rec: ModelRecord, n_waiting: int, now: float) -> None:
        rec.generation += 1
        rec.loads += 1
        rec.last_used = now
        rec.stale = False
        self._transition(rec, S.LOADING, f"spawn for {n_waiting} waiting request(s)", now)
        if self.memory_on:
            # A child still releasing from its last run is replaced by the new hold.
            rec.releasing = False
            self.ledger.release(rec.name)
            self.ledger.reserve(rec.name, rec.mem_effective or rec.mem_min)
        self._out.append(Spawn(rec.name, rec.generation))

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
        self._out.append(Answer(ticket, Grant(rec.name, rec.generation, rec.base_url)))

    def _refuse(self, ticket: Hashable, status: int, message: str,
                type_: str = "server_error", retry_after_s: float | None = None) -> None:
        self._out.append(Answer(ticket, Refusal(status, message, type_, retry_after_s)))

    def _refuse_entry(self, model: str, status: int, message: str) -> None:
        entry = self.queue.pop(model, None)
        if entry is None:
            return
        self._maybe_idle(self.models[model])
        for ticket in entry.waiters:
            del self.waiting[ticket]
            del self.queued_at[ticket]
            self._refuse(ticket, status, message)

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
        self._out.append(Publish(StatusChanged(rec.name, new.value, cause, exit_code, info)))

    def _flush(self) -> list[Effect]:
        out, self._out = self._out, []
        return out
