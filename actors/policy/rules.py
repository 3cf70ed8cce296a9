"""The policy's state and the decisions every event ends in: the tick that picks LRU
victims (R-4.5), the claims of queue heads (R-4.3, with the memory plan), spawns, stops,
grants, refusals and state transitions. The events themselves are in children.py (what
children, measurements and reloads report) and core.py (requests, management, timers).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any

from ..config import ModelRules
from ..histogram import observe
from ..ledger import MiB, node_of
from ..lifecycle import ModelState, check_transition
from ..messages import (
    Evicted,
    EvictionReason,
    Grant,
    ModelsSnapshot,
    QueueChanged,
    Refusal,
    Repump,
    Shortfall,
    StatusChanged,
    TtlDue,
    Withdraw,
)
from . import views
from .breaker import Breaker
from .memory import Memory
from .nodes import NodeSlots
from .queue import QueueEntry, RequestQueue
from .records import (
    Answer,
    Effect,
    Later,
    Measure,
    ModelRecord,
    Publish,
    Spawn,
    Stats,
    Stop,
)
from .victims import Victims

log = logging.getLogger("corral.scheduler")

S = ModelState


class Rules:
    """The scheduling state, and the decisions the events end in."""

    def __init__(self, models_max: int, restart_intensity: int = 3,
                 restart_period_s: float = 60.0, memory_margin: int = 0,
                 account_host: bool = False, restart_backoff_max_s: float = 60.0,
                 restart_healthy_s: float = 30.0, models_max_per_node: int = 0) -> None:
        self.models_max = models_max
        self.breaker_args = (restart_intensity, restart_period_s, restart_backoff_max_s,
                             restart_healthy_s)
        self.models: dict[str, ModelRecord] = {}
        self.queue = RequestQueue()
        self.leases: dict[Hashable, tuple[str, int]] = {}
        """Ticket -> (model, generation), for every granted request not yet released."""
        self.nodes = NodeSlots(models_max_per_node)
        """The cluster's nodes that are up, and the models_max_per_node rule."""
        self.memory = Memory(memory_margin, account_host, self.nodes)
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
        self.now = 0.0
        """The time of the latest event (what a `queue` event's waits are measured at)."""
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
        self.now = now
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
                f"are held by pinned models ({names}); unload one or raise models_max"),
                reason="pinned")

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
                if rec.rules.nodes is not None and not self.memory_on:
                    if self._claim_node(rec, now):
                        rescan = True
                        break
                    if rec.node is None:
                        return  # it waits for a node, and nobody overtakes it
                busy = self._loading_devices(rec) if self.memory_on else set()
                if busy and not self.memory.candidates(rec) \
                        and not busy.isdisjoint(self.memory.devices_of(rec)):
                    return  # one load per device at a time, as in the reference
                if self.memory_on:
                    victims = self.victims.ranked(self.models, now, self._resident_until)
                    plan = self.memory.plan(rec, self.models, victims, busy)
                    for victim, shortfalls in plan.evict:  # none: a node's slot
                        self._stop(victim, "memory" if shortfalls else "lru", rec.name, now,
                                   shortfalls)
                    if plan.measure:
                        rec.measure_front = True
                        self._out.append(Measure(rec.name, front=True))
                    if plan.verdict == "refuse":
                        assert plan.refusal is not None
                        self._refuse_entry(rec.name, 503, plan.refusal, reason="memory")
                        rescan = True
                        break
                    if plan.verdict == "wait":
                        return
                    rec.placement = plan.devices
                    rec.node = node_of(plan.devices[0]) if plan.devices else None
                entry.claimed = True
                self._spawn(rec, len(entry.waiters), now)

    def _claim_node(self, rec: ModelRecord, now: float) -> bool:
        """Choose the node of `rec` (a model with `nodes`, no memory accounting): sets
        `rec.node` when it may spawn now; else it waits, after stopping the LRU idle model
        of a node at its cap, or its requests are refused (then True: the queue changed)."""
        victims = self.victims.ranked(self.models, now, self._resident_until)
        choice = self.nodes.choose(rec, self.models, victims)
        rec.node = choice.node if choice.verdict == "go" else None
        rec.waiting_for = choice.why if choice.verdict == "wait" else None
        if choice.victim is not None:
            self._stop(choice.victim, "lru", rec.name, now)
        elif choice.verdict == "wait":  # an idle model too young to go: wake when it is not
            young = [until for r in self.models.values()
                     if r.node in (rec.rules.nodes or []) and self._evictable(r)
                     and (until := self._resident_until(r)) > now]
            if young and (self.wake_at is None or min(young) < self.wake_at):
                self.wake_at = min(young)
                self._out.append(Later(self.wake_at - now, Repump()))
        if choice.verdict != "refuse":
            return False
        self._refuse_entry(rec.name, 503, f"model '{rec.name}' cannot be started: "
                           f"{choice.why}", retry_after_s=1.0,
                           reason="node_lost" if (choice.why or "").startswith("node lost")
                           else "node_cap")
        return True

    def _loading_devices(self, rec: ModelRecord) -> set[str]:
        """The devices of the loads not yet charged their real use (still loading, or
        ready but not yet in a device report): judging another load on them before that
        would judge it against figures that do not hold the last one yet."""
        busy: set[str] = set()
        for other in self.models.values():
            if other is not rec and (other.state is S.LOADING or other.awaiting_usage):
                busy |= self.memory.devices_of(other)
        return busy

    def _spawn(self, rec: ModelRecord, n_waiting: int, now: float) -> None:
        rec.generation += 1
        rec.loads += 1
        rec.last_used = now
        rec.stale = rec.ttl_armed = False
        rec.waiting_for = None
        attempt = rec.breaker.loading()
        cause = f"spawn for {n_waiting} waiting request(s)"
        if attempt > 1:
            cause += f", attempt {attempt}"
        if rec.placement:
            cause += f", on {', '.join(rec.placement)}"
        elif rec.node is not None:
            cause += f", on node {rec.node}"
        self._transition(rec, S.LOADING, cause, now)
        if self.memory_on:
            self.memory.spawning(rec)
        self._out.append(Spawn(rec.name, rec.generation, rec.placement, rec.node))

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
            observe(self.stats.queue_wait, rec.name, now - waiter.queued_at)
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
                                              shareable=not rec.rules.max_concurrency,
                                              upstream_key=rec.upstream_key)))

    def _refuse(self, ticket: Hashable, status: int, message: str,
                type_: str = "server_error", retry_after_s: float | None = None,
                model: str | None = None, reason: str | None = None) -> None:
        """Answer with corral's own error; a request for a model counts under `reason`
        (queue_full, queue_timeout, backoff, load_failed, pinned, memory, ...)."""
        if model is not None and reason is not None:
            key = (model, reason)
            self.stats.refusals[key] = self.stats.refusals.get(key, 0) + 1
        self._out.append(Answer(ticket, Refusal(status, message, type_, retry_after_s)))

    def _refuse_entry(self, model: str, status: int, message: str,
                      retry_after_s: float | None = None, reason: str = "other") -> None:
        waiters = self.queue.drop(model)
        rec = self.models[model]
        self._idle(rec)
        for ticket, _ in waiters:
            self._refuse(ticket, status, message, retry_after_s=retry_after_s, model=model,
                         reason=reason)

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
        if (rec.state.is_serving and not new.is_serving) or (
                rec.state is S.STOPPING and new is S.UNLOADED):
            self._out.append(Withdraw(rec.name, rec.generation, gone=new is S.UNLOADED))
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
        for model in self.queue.changed:
            waiting, oldest = self.queue.view(model, self.now)
            self._out.append(Publish(QueueChanged(model, waiting, oldest)))
        self.queue.changed.clear()
        out, self._out = self._out, []
        return out
