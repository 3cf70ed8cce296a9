"""The decisions every event ends in: the tick that picks LRU victims (R-4.5), the claims
of queue heads (R-4.3, with the memory plan), spawns, stops, grants, refusals and state
transitions. They change the `State` (state.py) and add effects to it; the events that
call them are in core.py (requests, management, timers) and children.py (what children,
measurements and reloads report).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, Literal

from ..histogram import observe
from ..ledger import MiB, node_of
from ..lifecycle import ModelState, check_transition
from ..messages import (
    Evicted,
    EvictionReason,
    Grant,
    QueueChanged,
    Refusal,
    Repump,
    Revoke,
    Shortfall,
    StatusChanged,
    TtlDue,
    Withdraw,
)
from .cuts import Slot
from .queue import QueueEntry, Waiter
from .records import (
    Answer,
    Effect,
    Later,
    Measure,
    ModelRecord,
    Publish,
    Spawn,
    Stop,
)
from .state import State

log = logging.getLogger("corral.scheduler")

S = ModelState


class Rules:
    """The decisions every event ends in, on one `State`."""

    def __init__(self, state: State) -> None:
        self.state = state

    def pump(self, now: float) -> None:
        """Re-run the rules after any change to the queue or the running set (R-4.5)."""
        self.state.now = now
        if self.state.shutting_down:
            return
        self.tick(now)
        self.claim(now)

    def revoke_kept(self) -> None:
        """A queued request waits for a slot or memory that busy models hold. A model may
        look busy only because the front keeps its grant after its last request (a lease:
        it counts in flight), so every such grant granted since the last revocation is
        revoked: the front gives it back at once if no request is on it, else when its last
        request ends, and the model is then idle, an LRU or memory victim like any other
        (R-4.4). O(1) a decision: a model is revoked once per grant."""
        revocable = self.state.revocable
        if revocable:  # (a grant given back meanwhile is not the front's: it ignores it)
            self.state.out.append(Revoke(grants=tuple(revocable.items())))
            revocable.clear()

    def tick(self, now: float) -> None:
        """Stop idle LRU victims until every entry that needs a slot can have one.

        O(1) unless a victim exists or every running model is pinned (then O(queue)):
        at most one slot is needed per entry, so a queue no longer than the free
        slots needs nothing.
        """
        if self.state.models_max <= 0 or not self.state.queue.entries:
            return
        # Stopping children free their slot once reaped, so they count as free already:
        # this is what stops two waiters from evicting two victims for one need.
        free = self.state.models_max - self.state.n_running + self.state.n_stopping
        if free >= len(self.state.queue.entries):
            return
        state = self.state
        pinned_out = state.n_running > 0 and state.n_running_pinned == state.n_running \
            and self.state.n_stopping == 0
        if self.pick_victim(now) is None and not pinned_out:
            self.revoke_kept()
            return  # every running model is busy, wanted or young: a release re-ticks
        needing = [e.model for e in self.state.queue.ordered(now)
                   if self.state.needs_slot(e, now)]
        while free < len(needing):
            victim = self.pick_victim(now)
            if victim is None:
                if pinned_out:
                    self.refuse_pinned_out(needing[max(free, 0):])
                return
            self.stop(victim, "lru", needing[max(free, 0)], now)
            free += 1

    def refuse_pinned_out(self, models: list[str]) -> None:
        """Refuse what no slot will ever come free for: every running model is pinned."""
        names = ", ".join(rec.name for rec in self.state.models.values() if rec.state.is_running)
        for model in models:
            self.refuse_entry(model, 503, (
                f"model '{model}' cannot be loaded: all {self.state.models_max} slots (models_max) "
                f"are held by pinned models ({names}); unload one or raise models_max"),
                reason="pinned")

    def pick_victim(self, now: float) -> ModelRecord | None:
        """The least recently used model that is idle, serving, unpinned, not wanted and
        resident for its min_resident_s; if only young ones are left, wake up when the
        first comes of age (R-4.4)."""
        victim, wake = self.state.victims.pick(self.state.models, now, self.state.resident_until)
        if wake is not None and (self.state.wake_at is None or wake < self.state.wake_at):
            self.state.wake_at = wake
            self.state.out.append(Later(wake - now, Repump()))
        return victim

    def idle(self, rec: ModelRecord, now: float | None = None) -> None:
        """`rec` may have become idle: offer it as a victim, and arm its TTL (due from
        its last use, when `now` is given)."""
        self.state.victims.offer(rec)
        if (rec.rules.ttl_s and not rec.ttl_armed and self.state.evictable(rec)):
            rec.ttl_armed = True
            delay = (rec.rules.ttl_s if now is None
                     else max(0.0, rec.idle_from + rec.rules.ttl_s - now))
            self.state.out.append(Later(delay, TtlDue(model=rec.name,
                                                      generation=rec.generation)))

    def claim(self, now: float) -> None:
        """Spawn for queue heads, in order, while there is capacity (R-4.3); with
        classes, the entry of the highest ranked waiter first (queue.ordered).

        Scans only up to the first head that must wait (claimed entries before it are
        at most models_max); a refusal changes the queue, and the scan starts over.
        """
        rescan = True
        while rescan:
            rescan = False
            for entry in self.state.queue.ordered(now):
                verdict = self.claim_one(entry, now)
                if verdict == "wait":
                    return  # the head waits, and nobody overtakes it
                if verdict == "rescan":
                    rescan = True
                    break

    def claim_one(self, entry: QueueEntry,
                  now: float) -> Literal["passed", "spawned", "wait", "rescan"]:
        """What one queue entry gets, decided in this order."""
        state = self.state
        # 1. An entry that needs no slot (claimed, served, or in backoff) is passed over.
        if not state.needs_slot(entry, now):
            return "passed"
        rec = state.models[entry.model]
        # 2. Its last child is still stopping, or every slot (models_max) is taken.
        if rec.state is S.STOPPING or not state.has_capacity():
            return "wait"
        # 3. Bound to nodes, without memory accounting: a node's slot (models_max_per_node).
        if rec.rules.nodes is not None and not state.memory_on:
            if self.claim_node(rec, now):
                return "rescan"  # refused: the queue changed
            if rec.node is None:
                self.revoke_kept()
                return "wait"
        # 4. One load per device at a time, as in the reference.
        busy = self.loading_devices(rec) if state.memory_on else set()
        if busy and not state.memory.candidates(rec) \
                and not busy.isdisjoint(state.memory.devices_of(rec)):
            return "wait"
        # 5. With memory accounting, the plan decides: evict, measure first, wait or refuse.
        if state.memory_on:
            victims = state.victims.ranked(state.models, now, state.resident_until)
            plan = state.memory.plan(rec, state.models, victims, busy)
            for victim, shortfalls in plan.evict:  # none: a node's slot
                self.stop(victim, "memory" if shortfalls else "lru", rec.name, now,
                          shortfalls)
            if plan.measure:
                rec.measure_requested_first = True
                state.out.append(Measure(rec.name, front=True))
            if plan.verdict == "refuse":
                assert plan.refusal is not None
                self.refuse_entry(rec.name, 503, plan.refusal, reason="memory")
                return "rescan"
            if plan.verdict == "wait":
                self.revoke_kept()
                return "wait"
            if plan.note:
                log.warning("%s", plan.note)  # said once, by the plan that was carried out
            rec.placement = plan.devices
            rec.node = node_of(plan.devices[0]) if plan.devices else None
        # 6. It goes.
        entry.claimed = True
        self.spawn(rec, len(entry.waiters), now)
        return "spawned"

    def claim_node(self, rec: ModelRecord, now: float) -> bool:
        """Choose the node of `rec` (a model with `nodes`, no memory accounting): sets
        `rec.node` when it may spawn now; else it waits, after stopping the LRU idle model
        of a node at its cap, or its requests are refused (then True: the queue changed)."""
        victims = self.state.victims.ranked(self.state.models, now, self.state.resident_until)
        choice = self.state.nodes.choose(rec, self.state.models, victims)
        rec.node = choice.node if choice.verdict == "go" else None
        rec.waiting_for = choice.why if choice.verdict == "wait" else None
        if choice.victim is not None:
            self.stop(choice.victim, "lru", rec.name, now)
        elif choice.verdict == "wait":  # an idle model too young to go: wake when it is not
            young = [until for r in self.state.models.values()
                     if r.node in (rec.rules.nodes or []) and self.state.evictable(r)
                     and (until := self.state.resident_until(r)) > now]
            if young and (self.state.wake_at is None or min(young) < self.state.wake_at):
                self.state.wake_at = min(young)
                self.state.out.append(Later(self.state.wake_at - now, Repump()))
        if choice.verdict != "refuse":
            return False
        self.refuse_entry(rec.name, 503, f"model '{rec.name}' cannot be started: "
                           f"{choice.why}", retry_after_s=1.0,
                           reason="node_lost" if (choice.why or "").startswith("node lost")
                           else "node_cap")
        return True

    def loading_devices(self, rec: ModelRecord) -> set[str]:
        """The devices of the loads not yet charged their real use (still loading, or
        ready but not yet in a device report): judging another load on them before that
        would judge it against figures that do not hold the last one yet."""
        busy: set[str] = set()
        for other in self.state.models.values():
            if other is not rec and (other.state is S.LOADING or other.awaiting_usage):
                busy |= self.state.memory.devices_of(other)
        return busy

    def spawn(self, rec: ModelRecord, n_waiting: int, now: float) -> None:
        rec.generation += 1
        rec.loads += 1
        rec.last_used = now
        rec.retiring = rec.ttl_armed = False
        rec.waiting_for = None
        attempt = rec.breaker.loading()
        cause = f"spawn for {n_waiting} waiting request(s)"
        if attempt > 1:
            cause += f", attempt {attempt}"
        if rec.placement:
            cause += f", on {', '.join(rec.placement)}"
        elif rec.node is not None:
            cause += f", on node {rec.node}"
        self.transition(rec, S.LOADING, cause, now)
        if self.state.memory_on:
            self.state.memory.spawning(rec)
        self.state.out.append(Spawn(rec.name, rec.generation, rec.placement, rec.node))

    def serve_waiters(self, rec: ModelRecord, now: float) -> None:
        """Grant the requests queued for a serving model while it has room: in arrival
        order, or with keys, in their classes' and fair share's order (queue.next_of),
        leaving those of keys at their max_concurrency to wait."""
        queue, tenants = self.state.queue, self.state.tenants
        entry = queue.entry(rec.name)
        if entry is None:
            return
        blocked = {key for key in entry.lanes if key and tenants.at_limit(key)}
        while entry.waiters and self.state.has_room(rec):
            ticket = queue.next_of(entry, now, blocked)
            if ticket is None:
                break
            waiter = queue.take(ticket)
            waited = now - waiter.queued_at
            if not waiter.again:  # one cut and waiting again: its wait is counted once
                self.state.stats.queue_waits += 1
                self.state.stats.queue_wait_s += waited
                observe(self.state.stats.queue_wait, rec.name, waited)
                if waiter.key:
                    observe(self.state.stats.class_wait, tenants.of(waiter.key).priority,
                            waited)
            self.grant(ticket, rec, now, waiter.key, waiter)
            if waiter.key and tenants.at_limit(waiter.key):
                blocked.add(waiter.key)
        queue.close_if_empty(rec.name)

    def serve_queued(self, now: float, key: str | None = None) -> None:
        """Serve the waiters of every serving model with room (of those `key` waits for):
        a key's limit has been lifted, or it is below its max_concurrency again."""
        for entry in list(self.state.queue):
            if key is None or key in entry.lanes:
                rec = self.state.models[entry.model]
                if self.state.has_room(rec):
                    self.serve_waiters(rec, now)

    def stop(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
              now: float, shortfalls: list[Shortfall] | None = None) -> None:
        cause = f"{reason} eviction" + (f" for {for_model}" if for_model else "")
        if shortfalls:
            cause += " (" + ", ".join(f"{s.device}: needs {s.needed / MiB:.0f} MiB, "
                                      f"{s.available / MiB:.0f} MiB available"
                                      for s in shortfalls) + ")"
        self.transition(rec, S.STOPPING, cause, now)
        rec.last_eviction = Evicted(model=rec.name, reason=reason, for_model=for_model,
                                    devices=shortfalls or [])
        key = (rec.name, reason)
        self.state.stats.evictions[key] = self.state.stats.evictions.get(key, 0) + 1
        self.state.out.append(Publish(rec.last_eviction))
        self.state.out.append(Stop(rec.name, rec.generation, reason))

    def grant(self, ticket: Hashable, rec: ModelRecord, now: float, key: str = "",
              waiter: Waiter | None = None, cuttable: bool = False) -> None:
        """Proxy `ticket` (`waiter`, when it was queued) into `rec`."""
        # The grant and the in-flight count happen in one step, so no tick can pick
        # this model as a victim between "ready" and "proxied" (llama.cpp #28698).
        assert rec.host is not None and rec.port is not None
        rec.in_flight += 1
        rec.last_used = now
        self.state.stats.granted += 1
        self.state.leases[ticket] = (rec.name, rec.generation, key)
        tenants = self.state.tenants
        shareable = not rec.rules.max_concurrency
        if (waiter.cuttable if waiter else cuttable) and not shareable and self.state.cuts.on:
            self.state.cuts.granted(ticket, Slot(  # one request a grant: it may be cut
                rec.name, rec.generation, key, waiter.level if waiter else
                tenants.of(key).level, now, waiter.queued_at if waiter else now))
        if key:
            tenants.granted(key)
            self.state.queue.served(rec.name, key, 1.0)
            # a key with limits: the Scheduler must see each of its requests (shares.py)
            shareable = shareable and not tenants.limited(key)
        if shareable and not rec.pinned:
            self.state.revocable[rec.name] = rec.generation
        self.state.out.append(Answer(ticket, Grant(
            model=rec.name, generation=rec.generation, host=rec.host, port=rec.port,
            shareable=shareable, upstream_key=rec.upstream_key)))

    def refuse(self, ticket: Hashable, status: int, message: str,
                type_: str = "server_error", retry_after_s: float | None = None,
                model: str | None = None, reason: str | None = None, key: str = "") -> None:
        """Answer with corral's own error; a request for a model counts under `reason`
        (queue_full, queue_timeout, backoff, load_failed, pinned, memory, ...), and under
        its `key`'s name too."""
        stats = self.state.stats
        if model is not None and reason is not None:
            stats.refusals[(model, reason)] = stats.refusals.get((model, reason), 0) + 1
            if key:
                stats.key_refusals[(key, reason)] = stats.key_refusals.get((key, reason), 0) + 1
        self.state.out.append(Answer(ticket, Refusal(
            status=status, message=message, error_type=type_, retry_after_s=retry_after_s)))

    def refuse_entry(self, model: str, status: int, message: str,
                      retry_after_s: float | None = None, reason: str = "other") -> None:
        waiters = self.state.queue.drop(model)
        rec = self.state.models[model]
        self.idle(rec)
        for ticket, waiter in waiters:
            self.refuse(ticket, status, message, retry_after_s=retry_after_s, model=model,
                        reason=reason, key=waiter.key)

    def backoff_message(self, rec: ModelRecord, now: float) -> str:
        return (f"model '{rec.name}' failed {len(rec.breaker.failures)} times in "
                f"{rec.breaker.period_s:g} s (last: {rec.last_exit}); the next load may "
                f"start in {rec.breaker.retry_at - now:.1f} s")

    def state_word(self, rec: ModelRecord) -> str:
        return rec.state.value + (", failed" if rec.failed else "")

    def transition(self, rec: ModelRecord, new: ModelState, cause: str, now: float,
                    exit_code: int | None = None, info: dict[str, Any] | None = None) -> None:
        check_transition(rec.name, rec.state, new)
        running = int(new.is_running) - int(rec.state.is_running)
        self.state.n_running += running
        self.state.n_running_pinned += running * rec.pinned
        self.state.n_stopping += int(new is S.STOPPING) - int(rec.state is S.STOPPING)
        took = now - rec.state_since
        log.info("model %s#%d: %s -> %s (%s, after %.2f s)", rec.name, rec.generation,
                 rec.state.value, new.value, cause, took)
        if (rec.state.is_serving and not new.is_serving) or (
                rec.state is S.STOPPING and new is S.UNLOADED):
            self.state.out.append(Withdraw(model=rec.name, generation=rec.generation,
                                           gone=new is S.UNLOADED))
        rec.state = new
        rec.state_since = now
        self.publish_state(rec, cause, now, exit_code, info)

    def publish_state(self, rec: ModelRecord, cause: str, now: float,
                       exit_code: int | None = None,
                       info: dict[str, Any] | None = None) -> None:
        failed = rec.failed and rec.state is S.UNLOADED
        retry = rec.breaker.retry_at - now if rec.breaker.is_open(now) else None
        self.state.out.append(Publish(StatusChanged(
            model=rec.name, status=rec.state.value, cause=cause, exit_code=exit_code, info=info,
            failed=failed, exit=rec.last_exit if failed else None, retry_after_s=retry)))

    def flush(self) -> list[Effect]:
        for model in self.state.queue.changed:
            waiting, oldest = self.state.queue.view(model, self.state.now)
            self.state.out.append(Publish(QueueChanged(model=model, waiting=waiting,
                                                       oldest_wait_s=oldest)))
        self.state.queue.changed.clear()
        out, self.state.out = self.state.out, []
        return out
