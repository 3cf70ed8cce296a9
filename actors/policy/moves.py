"""The moves every decision is made of, each one step with its effects: a state transition
(logged and published), a spawn, a stop, a grant, a refusal, an offer as a victim. rules.py
decides which to make; the events that call both are in core.py, children.py, preempt.py
and tiers.py."""

from __future__ import annotations

import logging
from collections.abc import Hashable
from typing import Any, Literal

from ..config.keys import BATCH
from ..ledger import MiB
from ..lifecycle import ModelState, check_transition
from ..messages import (
    Evicted,
    EvictionReason,
    Grant,
    Refusal,
    Revoke,
    Shortfall,
    StatusChanged,
    TtlDue,
    Withdraw,
)
from .costs import guessed, weigh
from .cuts import Slot
from .queue import QueueEntry, Waiter
from .records import (
    Answer,
    Effect,
    Later,
    ModelRecord,
    Publish,
    Spawn,
    Stop,
    Suspend,
    Track,
    Wake,
    eviction_cause,
)
from .state import State
from .teamwork import Teamwork

log = logging.getLogger("corral.scheduler")

S = ModelState
SUSPENDED = frozenset({S.SUSPENDING, S.SUSPENDED})
ROOM_KEPT = 8
"""What is kept of what was done to make room for a model (ModelRecord.room)."""


def shown(copies: list[ModelRecord]) -> str:
    """What a model is shown as (llama.cpp's words): the most available of its copies'."""
    if len(copies) == 1:
        return copies[0].state.shown
    words = {r.state.shown for r in copies}
    return next((w for w in ("loaded", "loading", "sleeping", "stopping") if w in words),
                copies[0].state.shown)


class Moves:
    """One-step changes of one `State`, each adding its effects to `state.out`. A step that
    the model groups extend (a transition, a grant, a stop) calls their part last (teamwork.py)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.teams = Teamwork(state, self)

    def revoke_kept(self) -> None:
        """A queued request waits for a slot or memory that busy models hold. A model may
        look busy only because the front keeps its grant after its last request (a lease:
        it counts in flight), so every such grant granted since the last revocation is
        revoked: the front gives it back at once if no request is on it, else when its last
        request ends, and the model is then idle, an LRU or memory victim like any other
        (R-4.4). O(1) a decision: a model is revoked once per grant."""
        revocable, state = self.state.revocable, self.state
        if not revocable:
            return
        batching = {(r.group, r.generation) for n in state.turn.held
                    if (r := state.models.get(n)) and (cutoff := state.cutoff(r)) is not None
                    and cutoff > state.now} if state.turn is not None else set()
        # (a held model in its batch keeps its grants until its cutoff: turns.py)
        grants = tuple(g for g in revocable if g not in batching)
        if grants:  # (a grant given back meanwhile is not the front's: it ignores it)
            self.state.out.append(Revoke(grants=grants))
        for g in grants:
            del revocable[g]

    def idle(self, rec: ModelRecord, now: float | None = None) -> None:
        """`rec` may have become idle: offer it as a victim, and arm its TTL (due from
        its last use, when `now` is given)."""
        self.state.victims.offer(rec)
        after = self.state.ttl_after(rec)
        if after is not None and not rec.ttl_armed:
            rec.ttl_armed = True
            delay = after if now is None else max(0.0, rec.idle_from + after - now)
            self.state.out.append(Later(delay, TtlDue(model=rec.name,
                                                      generation=rec.generation)))

    def spawn(self, rec: ModelRecord, n_waiting: int, now: float,
              why: str | None = None) -> None:
        """Start `rec`'s next child, for `n_waiting` requests (or `why`)."""
        rec.generation = self.state.groups.next_generation(rec)
        rec.loads += 1
        rec.last_used = now
        rec.retiring = rec.ttl_armed = False
        rec.waiting_for = None
        attempt = rec.breaker.loading()
        cause = why or ("warm-up load" if rec in self.state.warming
                        else f"spawn for {n_waiting} waiting request(s)")
        cause += (f", attempt {attempt}" if attempt > 1 else "") + (
            f", at {rec.n_ctx} context" if rec.n_ctx and rec.rules.ctx_fit else "")
        if rec.placement:
            cause += f", on {', '.join(rec.placement)}"
        elif rec.node is not None:
            cause += f", on node {rec.node}"
        self.transition(rec, S.LOADING, cause, now)
        self.state.unsettled.add(rec)
        if self.state.watched(rec):
            self.state.memory.spawning(rec)
        self.state.out.append(Spawn(rec.name, rec.generation, rec.placement, rec.node,
                                    rec.rules.group or None, rec.n_ctx))

    def stop(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
             now: float, shortfalls: list[Shortfall] | None = None,
             why: str | None = None, note: str | None = None) -> None:
        """Stop `rec`'s child; `why`: why it was not suspended instead; `note`: what
        else the event says (a model group's rule)."""
        cause = eviction_cause(reason, for_model, shortfalls)
        if why:
            cause += f"; not suspended: {why}"
        if note:
            cause += f"; {note}"
        self.transition(rec, S.STOPPING, cause, now)
        self.evicted(rec, reason, for_model, shortfalls, "stop", why or note)
        key = (rec.name, reason)
        self.state.stats.evictions[key] = self.state.stats.evictions.get(key, 0) + 1
        self.state.out.append(Stop(rec.name, rec.generation, reason))
        if self.state.teams.partners:  # a unit stop stops its together partners
            self.teams.stopped(rec, reason, for_model, now)

    def suspend(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
                now: float, shortfalls: list[Shortfall] | None = None,
                because: str | None = None) -> None:
        """Suspend `rec`'s child (issue 23): its slot and devices come free once it is
        done, and its host copy is counted until then at its estimate; `because`: why
        that is cheaper than a stop (costs.py)."""
        host = self.state.host
        host.suspending(rec, self.state.ledger)
        cause = eviction_cause(reason, for_model, shortfalls)
        why = f"suspended to host RAM (about {rec.host_bytes / MiB:.0f} MiB)" + (
            f": {because}" if because else "")
        self.transition(rec, S.SUSPENDING, f"{cause}; {why}", now)
        self.evicted(rec, reason, for_model, shortfalls, "suspend", why)
        key = (rec.name, reason)
        self.state.stats.suspends[key] = self.state.stats.suspends.get(key, 0) + 1
        self.state.out.append(Suspend(rec.name, rec.generation))

    def wake(self, rec: ModelRecord, entry: QueueEntry | None, now: float) -> None:
        """Wake the suspended `rec` for `entry`'s waiters (None: to keep it warm): a
        load, so its devices hold its need from now on (the need it was last seen
        using)."""
        if entry is not None:
            entry.claimed = True
        rec.waiting_for = None
        rec.ttl_armed = False
        cause = (f"wake for {len(entry.waiters)} waiting request(s)" if entry is not None
                 else "wake to keep it warm") + (
            f", on {', '.join(rec.placement)}" if rec.placement else "")
        self.transition(rec, S.WAKING, cause, now)
        if self.state.watched(rec):
            self.state.ledger.reserve(rec.name, self.state.memory.wake_need(rec))
            self.state.out.append(Track(rec.name, "waking", rec.pid))
        self.state.out.append(Wake(rec.name, rec.generation))

    def evict(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
              now: float, shortfalls: list[Shortfall] | None = None) -> None:
        """Make room with the idle `rec`: suspend it if it has a way to and host memory
        allows (at suspended_max, the least recently used suspended model is stopped for
        it), else stop it; the event says which, and why (issue 23). One already on its
        way out (a together partner of an earlier victim) is left to go."""
        state = self.state
        if rec.state is S.STOPPING or not rec.state.is_running:
            return
        if not rec.rules.suspend or rec.state is S.SUSPENDED or state.handing_over(rec):
            self.stop(rec, reason, for_model, now, shortfalls)
            return
        why = state.host.why_not(rec, state.ledger, state.stopping_suspended())
        because = None
        if why is None and rec.rules.suspend_by_cost:  # (costs.py)
            cheaper, because = weigh(rec.times, state.host.estimate(rec, state.ledger),
                                     rec.guess_stops)
            why = None if cheaper else because
            rec.guess_stops += not cheaper and guessed(rec.times)
        if why is None and state.host.suspended_max \
                and state.n_suspended >= state.host.suspended_max:
            oldest = min((r for r in state.models.values() if r.state is S.SUSPENDED),
                         key=lambda r: r.last_used, default=None)
            if oldest is None or oldest.last_used > rec.last_used:
                why = f"suspended_max ({state.host.suspended_max}) models are suspended"
            else:
                self.stop(oldest, "suspended_max", rec.name, now,
                          why=f"suspended_max ({state.host.suspended_max}) reached")
        if why is None:
            self.suspend(rec, reason, for_model, now, shortfalls, because)
        else:
            self.stop(rec, reason, for_model, now, shortfalls, why=why)

    def loading_devices(self, rec: ModelRecord) -> set[str]:
        """The devices of the loads not yet charged their real use (still loading, or
        ready but not yet in a device report): judging another load on them before that
        would judge it against figures that do not hold the last one yet."""
        busy: set[str] = set()
        unsettled = self.state.unsettled
        for other in list(unsettled):
            if other.state is not S.LOADING and not other.awaiting_usage:
                unsettled.discard(other)  # charged since
            elif other is not rec:
                busy |= self.state.memory.devices_of(other)
        return busy

    def evicted(self, rec: ModelRecord, reason: EvictionReason, for_model: str | None,
                shortfalls: list[Shortfall] | None, action: Literal["stop", "suspend"],
                why: str | None) -> None:
        rec.last_eviction = Evicted(model=rec.name, reason=reason, for_model=for_model,
                                    devices=shortfalls or [], action=action, why=why)
        rec.evicted_at = self.state.now
        self.state.out.append(Publish(rec.last_eviction))
        beneficiary = self.state.models.get(for_model) if for_model else None
        if beneficiary is not None:
            beneficiary.room.append((self.state.now, f"{action} {rec.name}"))
            del beneficiary.room[:-ROOM_KEPT]

    def grant(self, ticket: Hashable, rec: ModelRecord, now: float, key: str = "",
              waiter: Waiter | None = None, cuttable: bool = False) -> None:
        """Proxy `ticket` (`waiter`, when it was queued) into `rec`."""
        # The grant and the in-flight count happen in one step, so no tick can pick
        # this model as a victim between "ready" and "proxied" (llama.cpp #28698).
        assert rec.host is not None and rec.port is not None
        rec.in_flight += 1
        rec.last_used = now
        if not key.startswith(BATCH):  # (a batch's line is no use of a class: choice.py)
            rec.asked_at = now
        self.state.stats.granted += 1
        self.state.leases[ticket] = (rec.name, rec.generation, key)
        tenants = self.state.tenants
        # One grant of a model with copies serves one request at a time: the front would
        # send the requests that join a grant to its copy, past the routing (replicas.py);
        # it may keep one idle for the next lone request (Grant.solo).
        cutoff = self.state.cutoff(rec) if self.state.turn is not None else None
        shareable = not rec.rules.max_concurrency and (cutoff is None or now < cutoff)
        solo = shareable and rec.rules.replicas is not None
        if (waiter.cuttable if waiter else cuttable) and rec.rules.max_concurrency \
                and self.state.cuts.on:
            self.state.cuts.granted(ticket, Slot(  # one request a grant: it may be cut
                rec.name, rec.generation, key, waiter.level if waiter else
                tenants.of(key).level, now, waiter.queued_at if waiter else now))
        if key:
            tenants.granted(key)
            self.state.queue.served(rec.group, key, 1.0)
            # a key with limits: the Scheduler must see each of its requests (shares.py)
            shareable = shareable and not tenants.limited(key)
        if shareable and not rec.pinned:
            self.state.revocable[(rec.group, rec.generation)] = None  # as the front has it
        if rec.rules.replicas is not None:  # busier copies: one more may be due
            self.state.groups.wanting[rec.group] = None
        waited, took = "", 0.0  # what a queued request waited for, and the room made
        room: tuple[str, ...] = ()
        if waiter is not None and rec.ready_at is not None and rec.ready_at >= waiter.queued_at:
            waited = "wake" if rec.woke_at == rec.ready_at else "load"
            took = rec.ready_took
            room = tuple(what for at, what in rec.room if at >= waiter.queued_at)
        self.state.out.append(Answer(ticket, Grant(
            model=rec.group, generation=rec.generation, host=rec.host, port=rec.port,
            shareable=shareable, upstream_key=rec.upstream_key, epoch=rec.wakes,
            instance=rec.copy_name, solo=solo, waited=waited, waited_s=took, room=room)))
        if self.state.teams.partners:  # its together partners were used too
            self.teams.granted(rec, now)

    def refuse(self, ticket: Hashable, status: int, message: str,
                type_: str = "server_error", retry_after_s: float | None = None,
                model: str | None = None, reason: str | None = None, key: str = "",
                spill: bool = False) -> None:
        """Answer with corral's own error; a request for a model counts under `reason`
        (queue_full, queue_timeout, backoff, load_failed, pinned, memory, ...), and under
        its `key`'s name too."""
        stats = self.state.stats
        if model is not None and reason is not None:
            stats.refusals[(model, reason)] = stats.refusals.get((model, reason), 0) + 1
            if key:
                stats.key_refusals[(key, reason)] = stats.key_refusals.get((key, reason), 0) + 1
        self.state.out.append(Answer(ticket, Refusal(
            status=status, message=message, error_type=type_, retry_after_s=retry_after_s,
            model=model or "", spill=spill)))

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
        state, old = self.state, rec.state
        state.memory.epoch += 1  # (a plan that waited is made again)
        if state.prefetched and not (new.is_serving or new in (S.LOADING, S.WAKING)) \
                and state.prefetched.pop(rec.name, None) is not None:
            state.stats.prefetches["wasted"] += 1  # (prefetched, gone before it served)
        held = rec.holds_slot
        rec.draining = rec.draining and new is S.SUSPENDED
        rec.slotless = new is S.STOPPING and (old is S.SUSPENDED or rec.slotless)
        holds = new.holds_slot and not rec.slotless
        running = int(holds) - int(held)
        state.n_running += running
        state.n_running_pinned += running * rec.pinned
        state.n_stopping += int(new is S.STOPPING and holds) - int(old is S.STOPPING and held)
        state.n_suspending += int(new is S.SUSPENDING) - int(old is S.SUSPENDING)
        state.n_suspended += int(new in SUSPENDED) - int(old in SUSPENDED)
        took = now - rec.state_since
        log.info("model %s#%d: %s -> %s (%s, after %.2f s)", rec.name, rec.generation,
                 rec.state.value, new.value, cause, took)
        if (rec.state.is_serving and not new.is_serving) or (
                rec.state is S.STOPPING and new is S.UNLOADED):
            self.state.out.append(Withdraw(model=rec.group, generation=rec.generation,
                                           epoch=rec.wakes, instance=rec.copy_name,
                                           gone=new is S.UNLOADED, stopping=new is S.STOPPING))
        rec.state = new
        rec.state_since = now
        if rec.rules.replicas is not None:
            state.groups.moved(rec)
        self.publish_state(rec, cause, now, exit_code, info)
        if rec.takes_over and old is S.LOADING and new is not S.LOADED:
            self.not_taken_over(rec, now)
        elif old.is_serving and not new.is_serving and state.groups.alternates:
            partner = state.groups.partner(rec)  # a reload's newcomer is its copy's now
            if partner is not None and partner.takes_over == rec.name and not partner.removed:
                state.groups.swap(partner)
        if state.teams.partners:  # its partners' evictability may have changed
            self.teams.moved(rec, now)

    def retire(self, rec: ModelRecord, now: float, reason: EvictionReason = "reload",
               for_model: str | None = None, note: str | None = None) -> None:
        """Stop `rec` for a reload (or `reason`, `note` as stop's) now if idle, else once
        its last request is released (core.py): no new request joins it meanwhile."""
        if rec.state is S.STOPPING:
            return
        if rec.in_flight == 0:
            self.stop(rec, reason, for_model, now, note=note)
        else:
            rec.retiring, rec.retire_as = True, (reason, for_model, note)
            self.state.out.append(Withdraw(model=rec.group, generation=rec.generation,
                                           epoch=rec.wakes, instance=rec.copy_name))

    def not_taken_over(self, new: ModelRecord, now: float) -> None:
        """`new`'s child, loading to take over from another for a reload (handover.py),
        ended before it got ready: the old child keeps serving its model."""
        live = self.state.models.get(new.takes_over or "")
        new.takes_over = None
        if live is not None and live.state.is_serving and not live.retiring:
            why = (f"reload: the new config did not load ({new.last_exit or 'stopped'}); "
                   "the old child keeps serving until it stops"
                   if live.node not in self.state.nodes.draining else
                   f"drain: its child on another node did not load ({new.last_exit or 'stopped'}"
                   f"); the old child keeps serving on node {live.node}")
            log.warning("model %s: %s", live.name, why)
            self.publish_state(live, why, now)

    def publish_state(self, rec: ModelRecord, cause: str, now: float,
                       exit_code: int | None = None,
                       info: dict[str, Any] | None = None) -> None:
        failed = rec.failed and rec.state is S.UNLOADED
        retry = rec.breaker.retry_at - now if rec.breaker.is_open(now) else None
        copy = rec.name if rec.rules.replicas is not None else None  # said of the model
        self.state.out.append(Publish(StatusChanged(
            model=rec.group, status=shown(self.state.groups.all_of(rec)), cause=cause,
            exit_code=exit_code, info=info, failed=failed,
            exit=rec.last_exit if failed else None, retry_after_s=retry, replica=copy)))

    def flush(self) -> list[Effect]:
        return self.state.flush()
