"""The decisions every event ends in: the tick that picks LRU victims (R-4.5), the claims
of queue heads (R-4.3, with the memory plan), and serving the waiters of a model with room,
made of the moves in moves.py; core.py and children.py call them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal

from ..ledger import MiB
from ..lifecycle import ModelState
from ..messages import Repump
from .bringup import BringUp
from .choice import Choice
from .moves import Moves
from .queue import QueueEntry
from .records import Later, Measure, ModelRecord
from .scale import Scaling
from .state import State
from .turns import Turns

log = logging.getLogger("corral.scheduler")

S = ModelState
WARM_RETRY_S = 0.5
"""A warm model without room is looked at again this long after, not at every event."""


class Rules:
    """The decisions every event ends in, on one `State`, made of held parts that each
    call by name: the one-step `moves` (with the model groups' part, `moves.teams`), the
    victim `choice`, the way a model comes `up`, and the `scaling` of copies."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.moves = Moves(state)
        self.teams = self.moves.teams
        self.choice = Choice(state)
        self.up = BringUp(state, self.moves)
        self.scaling = Scaling(state, self.moves, self.choice, self.up)
        self.turns = Turns(state, self.up.plan)
        self.drains: Callable[[float], None] | None = None  # drains.py `step` (Policy's)
        self.prefetches: Callable[[float], None] | None = None  # prefetch.py `due_step`
        self.ask_cuts: Callable[[ModelRecord, float], None] | None = None  # preempt.py `ask`

    def pump(self, now: float) -> None:
        """Re-run the rules after any change to the queue or the running set (R-4.5)."""
        state = self.state
        state.now = state.pumped_at = now
        state.clean = False
        if state.shutting_down:
            return
        n, turn, warm_after = len(state.out), state.turn, state.warm_after
        self.run(now)
        state.clean = (len(state.out) == n and state.turn is turn  # (a warm retry's time:
                       and state.warm_after == warm_after)  # its Later comes next run)
        state.clean_at = len(state.out)

    def run(self, now: float) -> None:
        """One run of the rules (`pump`)."""
        if self.state.teams.dropped:
            self.teams.drop_partner_loads()
        if self.state.n_suspended:
            self.relieve_host(now)
        if self.state.nodes.draining and self.drains is not None:
            self.drains(now)
        self.tick(now)
        self.claim(now)
        while self.state.teams.brought:  # together partners queued: slots for them too
            self.state.teams.brought = False
            self.tick(now)
            self.claim(now)
        if self.state.turn is not None or self.state.queue.entries:
            self.take_turns(now)
        if self.state.groups.wanting:
            self.scaling.scale(now)
        if self.state.warm and not self.state.queue.entries:
            self.warm_up(now)
        if self.prefetches is not None:
            self.prefetches(now)

    def take_turns(self, now: float) -> None:
        """Find whose turn a slot is (turns.py); while it changes, the models it held
        serve what they may now, and the rules run again for the models it holds."""
        for _ in range(4):  # (each round claims, or spends a turn: a few at most)
            changed, self.turns.noted = self.turns.update(now) or self.turns.noted, False
            if not changed:
                break
            self.serve_queued(now)
            self.tick(now)
            self.claim(now)
        self.turns.revoking = False

    def revoke_kept(self, now: float) -> None:
        """A waiter needs what busy models hold: the grants the fronts keep are revoked,
        but for those of a held model in its batch (the turn is found first: turns.py)."""
        if self.state.revocable and self.state.queue.entries:
            self.turns.revoking = True  # (the held models' grants are withdrawn after)
            self.turns.noted |= self.turns.update(now)
        self.moves.revoke_kept()

    def warm_up(self, now: float) -> None:
        """Load or wake the `warm` models that have room as things are: a free slot, and
        memory free with no eviction (issue 23); once up, it is the first LRU victim."""
        state = self.state
        if now < state.warm_after:  # tried just now: once more after, not at every event
            if not state.warm_due:
                state.warm_due = True
                state.out.append(Later(state.warm_after - now, Repump()))
            return
        state.warm_due = False
        for name in state.warm:
            rec = state.models[name]
            if not state.has_capacity():
                state.warm_after = now + WARM_RETRY_S
                return
            if rec.state not in (S.UNLOADED, S.SUSPENDED) or rec.breaker.is_open(now) \
                    or rec.failed or rec.removed or self.teams.has_rival_up(rec.group):
                continue
            plan = self.up.plan(rec, []) if state.memory_on else None
            if plan is None and rec.rules.nodes is not None and rec.state is S.UNLOADED:
                choice = state.nodes.choose(rec, state.models, [])  # a node's free slot
                rec.node = choice.node if choice.verdict == "go" else None
            if (plan is not None and (plan.verdict != "go" or plan.note or plan.evict)) or (
                    plan is None and rec.rules.nodes is not None and rec.node is None):
                state.warm_after = now + WARM_RETRY_S  # only where it fits as things are
                continue
            state.warming.add(rec)
            self.up.go(rec, plan, now)

    def yield_warm(self, now: float) -> bool:
        """Background loads (warm models', prefetches) give way to a request; if any did."""
        given = sorted((r for r in self.state.warming  # (by name: a set of records
                        if r.state is S.LOADING and r.group not in self.state.queue.entries),
                       key=lambda r: r.name)  # iterates in their addresses' order)
        for rec in given:
            self.moves.stop(rec, "warm", None, now, why="a request needs its place")
        return bool(given)

    def relieve_host(self, now: float) -> None:
        """Less host RAM than host_memory_margin_mib is available: stop suspended models,
        least recently used first, until what they give back covers it (issue 23)."""
        state = self.state
        if not state.host.short([]):
            return  # the common case: nothing coming back is needed
        stopping = state.stopping_suspended()
        while short := state.host.short(stopping):
            victim = min((r for r in state.models.values() if r.state is S.SUSPENDED
                          and r.node in short), key=lambda r: r.last_used, default=None)
            if victim is None:
                return
            self.moves.stop(victim, "host_memory", None, now, why=(
                f"host RAM available{'' if victim.node is None else ' on ' + victim.node} "
                f"is below host_memory_margin_mib ({state.host.margin / MiB:.0f} MiB)"))
            stopping.append(victim)

    def tick(self, now: float) -> None:
        """Stop idle LRU victims until every entry that needs a slot can have one. O(1)
        unless a victim exists or every running model is pinned (then O(queue)): an entry
        needs one slot at most, so a queue no longer than the free slots needs nothing."""
        self.state.revoking = False
        if self.state.models_max <= 0 or not self.state.queue.entries:
            return
        # Stopping children count as free already: two waiters evict no two for one need.
        free = (self.state.models_max - self.state.n_running + self.state.n_stopping
                + self.state.n_suspending)
        if free >= len(self.state.queue.entries):
            return
        if self.state.warming and self.yield_warm(now):  # (before any LRU victim goes)
            return self.tick(now)
        state = self.state
        pinned_out = state.n_running > 0 and state.n_running_pinned == state.n_running \
            and self.state.n_stopping == 0 and self.state.n_suspending == 0
        if self.choice.pick_victim(now) is None and not pinned_out:
            state.revoking = True
            self.revoke_kept(now)
            if self.state.warming and any(self.state.needs_slot(e, now)
                                          for e in self.state.queue.entries.values()):
                self.yield_warm(now)
            return  # every running model is busy, wanted or young: a release re-ticks
        needing = [e.model for e in self.state.queue.ordered(now)
                   if self.state.needs_slot(e, now)  # (an exclusive rival's is coming free)
                   and not (state.teams.rivals and self.teams.has_rival_up(e.model))]
        while free < len(needing):
            model = needing[max(free, 0)]
            victim = self.choice.pick_victim(now, model)
            if victim is None and not pinned_out and state.queue.entries[model].batch_only():
                needing.remove(model)  # (its window is shut: the next may evict)
                continue
            if victim is None:
                if pinned_out:
                    self.refuse_pinned_out(needing[max(free, 0):])
                elif state.teams.kept and self.refuse_kept_out(model):
                    needing.remove(model)  # the next in line may evict what it may not
                    continue
                return
            self.moves.evict(victim, "lru", model, now)
            free += 1

    def refuse_kept_out(self, model: str) -> bool:
        """Refuse what no slot will ever come free for: every running model is pinned, or
        kept from `model` by a model group (teams.py), and none will stop by itself (a
        TTL, a swap); whether it was."""
        state = self.state
        running = [r for r in state.models.values() if r.state.is_running]
        if state.n_stopping or state.n_suspending or any(
                not (r.pinned or state.kept_from(r, model))
                or (r.rules.ttl_s and not r.pinned) or r.retiring for r in running):
            return False
        self.moves.refuse_entry(model, 503, (
            f"model '{model}' cannot be loaded: all {state.models_max} slots (models_max) "
            f"are held by models its model groups keep from it, or pinned ones "
            f"({', '.join(sorted(r.name for r in running))}): persistent members are never "
            "evicted for a model outside their group; unload one or raise models_max"),
            reason="persistent")
        return True

    def refuse_pinned_out(self, models: list[str]) -> None:
        """Refuse what no slot will ever come free for: every running model is pinned."""
        names = ", ".join(rec.name for rec in self.state.models.values() if rec.state.is_running)
        for model in models:
            self.moves.refuse_entry(model, 503, (
                f"model '{model}' cannot be loaded: all {self.state.models_max} slots (models_max) "
                f"are held by pinned models ({names}); unload one or raise models_max"),
                reason="pinned")

    def claim(self, now: float) -> None:
        """Spawn for queue heads, in order, while there is capacity (R-4.3); with
        classes, the entry of the highest ranked waiter first (queue.ordered).

        Scans only up to the first head that must wait (claimed entries before it are
        at most models_max); a refusal changes the queue, and the scan starts over. With
        every slot taken and no exclusive rival to clear, each entry is passed over or
        waits (claim_one's steps 1-2, which change nothing): no scan at all."""
        state = self.state
        if not state.teams.rivals and not state.has_capacity():
            return
        rescan = True
        while rescan:
            rescan = False
            for entry in state.queue.ordered(now):
                if entry.claimed:
                    continue  # (passed: its load runs; most of a busy cluster's entries)
                verdict = self.claim_one(entry, now)
                if verdict == "wait" and not entry.batch_only():
                    return  # the head waits, and nobody overtakes it (but a batch's lines)
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
        rec = state.groups.target(state.models[entry.model])
        assert rec is not None  # (needs_slot)
        # 2. Its last child is still stopping, or every slot (models_max) is taken, or
        #    another member of its exclusive group still runs (it is being stopped).
        if rec.state is S.STOPPING:
            return "wait"
        if state.teams.rivals and self.teams.clear_rivals(rec, now):
            return "passed"  # its rival's slot comes back to it; others need not wait
        if not state.has_capacity():
            return "wait"
        # 3. Bound to nodes, without memory accounting: a node's slot (models_max_per_node;
        #    a suspended model has its node already).
        if rec.rules.nodes is not None and not state.memory_on and rec.state is not S.SUSPENDED:
            if self.claim_node(rec, now):
                return "rescan"  # refused: the queue changed
            if rec.node is None:
                self.revoke_kept(now)
                return "wait"
        # 4. A suspended model wakes where it sleeps, if it fits there.
        if rec.state is S.SUSPENDED:
            return self.claim_wake(entry, rec, now)
        # 5. One load per device at a time, as in the reference.
        busy = self.moves.loading_devices(rec) if state.memory_on else set()
        if busy and not state.memory.candidates(rec) \
                and not busy.isdisjoint(state.memory.devices_of(rec)):
            self.yield_warm(now)  # (a background load on that device gives it up)
            return "wait"
        # 6. With memory accounting, the plan decides: evict, measure first, wait or refuse.
        plan = None
        if state.memory_on:
            plan = self.up.plan(rec, self.choice.victims_later(now, rec.group), busy)
            self.up.make_room(plan, rec.name, now)
            if plan.measure:
                rec.measure_requested_first = True
                state.out.append(Measure(rec.group, front=True))
            if plan.verdict == "refuse":
                assert plan.refusal is not None
                self.moves.refuse_entry(entry.model, 503, plan.refusal, reason="memory")
                return "rescan"
            if plan.verdict == "wait":
                self.revoke_kept(now)
                self.yield_warm(now)
                self.choice.wake_when_of_age(now)  # (a memory victim too young to go yet)
                return "wait"
            if plan.note:
                log.warning("%s", plan.note)  # said once, by the plan that was carried out
        # 7. It goes, and its together partners with it (queued as loads: a rescan).
        entry.claimed = True
        self.up.go(rec, plan, now, n_waiting=len(entry.waiters))
        if state.teams.partners and self.teams.bring_partners(rec, now):
            return "rescan"
        return "spawned"

    def claim_wake(self, entry: QueueEntry, rec: ModelRecord,
                   now: float) -> Literal["spawned", "wait", "rescan"]:
        """Wake the suspended `rec` for `entry`, making room on its devices as a load
        does; where only pinned models hold that room it is stopped, and the entry waits
        for its exit to load it anew (elsewhere, if it may go elsewhere)."""
        state = self.state
        if state.memory_on:
            plan = self.up.plan(rec, self.choice.victims_later(now, rec.group))
            self.up.make_room(plan, rec.name, now, reason="memory")
            if plan.verdict == "refuse":
                self.moves.stop(rec, "wake_elsewhere", None, now, why=plan.refusal)
                return "wait"
            if plan.verdict == "wait":
                self.revoke_kept(now)
                self.choice.wake_when_of_age(now)
                return "wait"
        self.up.go(rec, None, now, entry=entry)
        if state.teams.partners and self.teams.bring_partners(rec, now):
            return "rescan"
        return "spawned"

    def claim_node(self, rec: ModelRecord, now: float) -> bool:
        """Choose the node of `rec` (with `nodes`, no memory accounting): `rec.node` set, or it
        waits (an LRU victim stopped) or is refused (then True: the queue changed)."""
        choice = self.state.nodes.choose(rec, self.state.models,
                                         self.choice.nodes_victims(now, rec))
        rec.node = choice.node if choice.verdict == "go" else None
        rec.waiting_for = choice.why if choice.verdict == "wait" else None
        if choice.victim is not None:
            self.moves.stop(choice.victim, "lru", rec.name, now)
        elif choice.verdict == "wait":  # an idle model too young to go: wake when it is not
            self.choice.wake_when_of_age(now, rec.rules.nodes or [])
        if choice.verdict != "refuse":
            return False
        self.moves.refuse_entry(rec.group, 503, f"model '{rec.group}' cannot be started: "
                           f"{choice.why}", retry_after_s=1.0,
                           reason="node_lost" if (choice.why or "").startswith("node lost")
                           else "node_drained" if (choice.why or "").startswith("every node")
                           else "node_cap")
        return True

    def serve_waiters(self, rec: ModelRecord, now: float) -> None:
        """Grant the requests queued for a serving model while it has room: in arrival
        order, or with keys, in their classes' and fair share's order (queue.next_of),
        leaving those of keys at their max_concurrency to wait. A model with copies
        routes each to one of them (replicas.py)."""
        queue, tenants = self.state.queue, self.state.tenants
        entry = queue.entry(rec.group)
        if entry is None:
            return
        blocked = {key for key in entry.lanes if key and tenants.at_limit(key)}
        copies = rec.rules.replicas is not None
        while entry.waiters and self.state.has_room(rec):
            ticket = queue.next_of(entry, now, blocked)
            if ticket is None:
                break
            into = self.state.route(rec, queue.waiters[ticket].affinity, now,
                                    queue.waiters[ticket].queued_at) \
                if copies or self.state.turn is not None else rec
            if into is None and self.state.turn is not None:  # (held: turns.py)
                ticket = next((t for t in entry.waiters if queue.waiters[t].key not in blocked),
                              ticket)  # (the oldest: one that came before the cutoff, if any)
                into = self.state.route(rec, queue.waiters[ticket].affinity, now,
                                        queue.waiters[ticket].queued_at)
                if into is None:
                    queue.behind(rec.group)  # another's turn: the rest came after it began
            if into is None:
                break
            waiter = queue.take(ticket)
            if not waiter.again:  # one cut and waiting again: its wait is counted once
                self.state.stats.waited(rec.group, now - waiter.queued_at,
                                        tenants.of(waiter.key).priority if waiter.key else None)
            self.moves.grant(ticket, into, now, waiter.key, waiter)
            if waiter.key and tenants.at_limit(waiter.key):
                blocked.add(waiter.key)
        queue.close_if_empty(rec.group)
        if entry.waiters and self.state.cuts.on and self.ask_cuts is not None:
            self.ask_cuts(rec, now)  # (the waiters left may want cuts: a child came up)

    def serve_queued(self, now: float, key: str | None = None) -> None:
        """Serve the waiters of every serving model with room (of those `key` waits for):
        a key's limit has been lifted, or it is below its max_concurrency again."""
        for entry in list(self.state.queue):
            if key is None or key in entry.lanes:
                for rec in self.state.groups.of(self.state.models[entry.model]):
                    if self.state.has_room(rec):
                        self.serve_waiters(rec, now)

