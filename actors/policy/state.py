"""The policy's state: model records, the queue, leases, the composed parts and the counts
kept beside them, with the queries every rule asks (R-4). Plain data and reads; the
decisions that change it are in rules.py, the events in core.py and children.py.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from ..config.keys import Tenant
from ..config.rules import ModelRules
from ..ledger import Ledger
from ..lifecycle import ModelState
from ..messages import Prefetched, QueueChanged, WaitDue
from .breaker import Breaker
from .cuts import Cuts
from .host import HostTier
from .memory import Memory
from .nodes import NodeSlots
from .queue import QueueEntry, RequestQueue
from .records import Effect, Later, ModelRecord, Publish, Stats, Turn
from .replicas import UP, Groups
from .teams import Teams
from .tenants import Tenants
from .victims import Victims

S = ModelState


class State:
    """Everything the policy knows: the model records, the queue, the leases and the
    composed parts, the counts that keep decisions O(1), and the effects decided so far
    (`out`, handed to the Scheduler by `Rules.flush`). The queries here read it; they
    change nothing."""

    def __init__(self, models_max: int, restart_intensity: int = 3,
                 restart_period_s: float = 60.0, memory_margin: int = 0,
                 account_host: bool = False, restart_backoff_max_s: float = 60.0,
                 restart_healthy_s: float = 30.0, models_max_per_node: int = 0,
                 tenants: dict[str, Tenant] | None = None, aging_s: float = 0.0,
                 host_margin: int = 0, suspended_max: int = 0) -> None:
        self.models_max = models_max
        self.breaker_args = (restart_intensity, restart_period_s, restart_backoff_max_s,
                             restart_healthy_s)
        self.models: dict[str, ModelRecord] = {}
        self.queue = RequestQueue(aging_s)
        self.leases: dict[Hashable, tuple[str, int, str]] = {}
        """Ticket -> (model, generation, key), for every granted request not yet
        released."""
        self.revocable: dict[tuple[str, int], None] = {}
        """(model, generation) of the unpinned children granted a shareable grant since the
        last revocation (a set, in order): the front may be keeping it idle after its last
        request (a lease, actors/http/shares.py)."""
        self.unsettled: set[ModelRecord] = set()
        """Records that were loading or not yet charged their real use (awaiting_usage)
        when last looked at: a superset of those that are (Moves.loading_devices)."""
        self.stats = Stats()
        self.shutting_down = False
        self.last_generation: dict[str, int] = {}
        """Model -> the generation of its record when a reload dropped it: a model added
        back goes on counting from there, so a late lease or event of its old record is
        never taken for one of its new."""
        self.now = 0.0
        """The time of the latest event (what a `queue` event's waits are measured at)."""
        self.wake_at: float | None = None
        """A Repump is due then (a young victim comes of age)."""
        self.turn: Turn | None = None
        """The model whose turn a slot is, and the models it holds (turns.py)."""
        self.spent: Turn | None = None
        """The last turn that could not help (turns.py)."""
        self.spent_turns: set[tuple[str, float]] = set()
        self.spent_epoch = 0
        """The turns (model, since) spent while no model changed state (the memory's
        epoch then): not had again until one does (turns.py `was_spent`)."""
        self.out: list[Effect] = []
        """Effects decided since the last event, in order."""
        self.dues: list[float] = []
        """When the `Later`s asked for come (a heap, kept by Moves.flush): what the rules
        wait for in time (a backoff, a young victim, a cutoff) changes only then."""
        self.pumped_at = 0.0
        """When the rules last ran (Rules.pump)."""
        self.clean, self.clean_at = False, 0
        """The rules' last run in this event changed nothing (no effect, the same turn),
        and how many effects the event had then (quiet.py)."""
        self.rested = False
        """Nothing changed after that, to the event's end: a fixed point of the rules
        (Moves.flush), which a quiet decision keeps (quiet.py)."""
        self.revoking = False
        """The rules' last tick revoked the grants the fronts keep: a waiter needs what
        busy models hold (rules.py `tick`)."""
        self._compose(tenants, models_max_per_node, memory_margin, account_host, host_margin,
                      suspended_max)
        self._count()

    def _compose(self, tenants: dict[str, Tenant] | None, models_max_per_node: int,
                 memory_margin: int, account_host: bool, host_margin: int,
                 suspended_max: int) -> None:
        """The parts, each keeping one concern of what the policy knows."""
        self.tenants = Tenants(tenants)
        """Every key's class, limits and usage (issue 22)."""
        self.cuts = Cuts()
        """The requests that may be cut for a higher class (priority_preempt)."""
        self.nodes = NodeSlots(models_max_per_node)
        """The cluster's nodes that are up, and the models_max_per_node rule."""
        self.memory = Memory(memory_margin, account_host, self.nodes)
        self.memory.kept = self.kept_from
        self.host = HostTier(host_margin, suspended_max)
        """Host RAM for suspended models (issue 23)."""
        self.victims = Victims(self.evictable)
        self.groups = Groups()
        """The models that run as several copies (issue 24)."""
        self.teams = Teams()
        """The model groups: exclusive, together, persistent (issue 25)."""

    def _count(self) -> None:
        """The counts kept by `Moves.transition` (and a pin change), so that a decision is
        O(1), and the warm models' bookkeeping."""
        self.n_running = 0
        """The children that hold a slot (models_max)."""
        self.n_stopping = 0
        self.n_running_pinned = 0
        self.n_suspending = 0
        self.prefetched: dict[str, Prefetched] = {}
        """The record a prefetch (prefetch.py) brought up -> the prefetch, while its child
        is up and has served nothing: asked, it is used; gone first, wasted."""
        self.n_suspended = 0
        """The suspended and suspending children (suspended_max)."""
        self.warm: list[str] = []
        """The models with `warm`, in config order (kept by `rewarm`)."""
        self.warming: set[ModelRecord] = set()
        """Records whose load (or wake) is a warm model's that nobody asked for: a
        request waiting for a place makes it give way (rules.yield_warm), and once it
        serves it is the first victim."""
        self.warm_after = 0.0
        self.warm_due = False
        """No warm-up is tried before `warm_after`; a Repump for then is pending."""

    @property
    def ledger(self) -> Ledger:
        return self.memory.ledger

    @property
    def memory_on(self) -> bool:
        return self.memory.on

    def watched(self, rec: ModelRecord) -> bool:
        """The DeviceMonitor follows `rec`'s child: with memory accounting, or for a model
        that may be suspended (what its suspend moves to the host is what it holds)."""
        return self.memory.on or rec.rules.suspend

    def rewarm(self) -> None:
        """The model table or a model's rules changed: list the `warm` ones again."""
        self.warm = [name for name, rec in self.models.items()  # a model, not its copies
                     if rec.rules.warm and not rec.rules.group]

    def add_model(self, name: str, now: float, *, pinned: bool = False,
                  rules: ModelRules | None = None, alternate_of: str | None = None) -> None:
        self.models[name] = rec = ModelRecord(
            name=name, rules=rules or ModelRules(pinned=pinned),
            breaker=Breaker(*self.breaker_args), state_since=now,
            generation=self.last_generation.pop(name, 0), alternate_of=alternate_of)
        if rec.rules.remote:  # (served by a server corral does not run: config/remote.py)
            rec.state, rec.host, rec.port, rec.ready_at = S.REMOTE, "", 0, now
            rec.memory = "remote"
            rec.generation += 1  # (a lease of one dropped before is not this one's)
        self.groups.add(rec)
        self.rewarm()
        self.rested = False

    def drop(self, name: str) -> None:
        """Forget a model a reload removed (its child, if any, is reaped)."""
        rec = self.models.pop(name)
        groups = self.groups
        generation = max(r.generation for r in [rec, *groups.all_of(rec)])
        groups.drop(rec)
        config = rec.alternate_of or name  # its copy's pair is no more, once both are gone
        alternate = groups.alternates.get(config)
        if alternate is not None and (alternate is rec or alternate.name not in self.models):
            del groups.alternates[config]
            groups.owners.pop(alternate.name, None)
            groups.turned.pop(config, None)
        self.last_generation[name] = generation
        self.victims.forget(name)
        self.ledger.release(name)
        self.warming.discard(rec)
        self.rewarm()

    def handing_over(self, rec: ModelRecord) -> bool:
        """A reload's new child loads to take over from `rec`'s (handover.py): `rec` is
        stopped, never suspended (it would be left suspended, its copy served by another)."""
        partner = self.groups.partner(rec) if self.groups.alternates else None
        return partner is not None and partner.takes_over == rec.name

    def flush(self) -> list[Effect]:
        """The event's effects, handed out (Moves.flush): whether the rules rest now
        (quiet.py), the queues that changed published, and when the Laters among them
        come kept (`dues`)."""
        self.rested = self.clean and len(self.out) == self.clean_at
        self.clean = False
        out, self.out, queue = self.out, [], self.queue
        if changed := queue.changed:  # (in one order, whatever the hash seed)
            for model in sorted(changed) if len(changed) > 1 else changed:
                waiting, oldest = queue.view(model, self.now)
                out.append(Publish(QueueChanged(model=model, waiting=waiting,
                                                oldest_wait_s=oldest)))
            queue.changed.clear()
        for effect in out:  # (a queue timeout is its own event: the rules read none)
            if type(effect) is Later and type(effect.message) is not WaitDue:
                heapq.heappush(self.dues, self.now + effect.delay_s)
        return out

    def find(self, model: str) -> ModelRecord | None:
        rec = self.models.get(model)
        return None if rec is None or rec.removed else rec

    def running_count(self) -> int:
        return self.n_running

    # ------------------------------------------------------------ queries

    def needs_slot(self, entry: QueueEntry, now: float) -> bool:
        """A slot (models_max) would go to `entry`'s model: a load, or a wake."""
        if entry.claimed:  # (most of a busy cluster's entries: their loads run)
            return False
        rec = self.groups.target(self.models[entry.model])
        return (rec is not None
                and rec.state in (S.UNLOADED, S.STOPPING, S.SUSPENDED)
                and not rec.breaker.is_open(now) and not self.only_blocked(entry))

    def route(self, rec: ModelRecord, affinity: int = 0, now: float | None = None,
              came: float | None = None) -> ModelRecord | None:
        """The copy of `rec`'s model a request (that `came` then: now, if not given) may be
        proxied into now (replicas.py): not one another model's turn holds (turns.py)."""
        now = self.now if now is None else now
        if self.turn is None:
            return self.groups.route(rec, affinity, self.has_room, now)
        at = now if came is None else came
        return self.groups.route(rec, affinity,
                                 lambda r: self.has_room(r) and self.takes(r, at), now)

    def absent(self, rec: ModelRecord) -> bool:
        """No copy of `rec`'s model runs, or all are stopping."""
        return all(r.state in (S.UNLOADED, S.STOPPING) for r in self.groups.of(rec))

    def only_blocked(self, entry: QueueEntry) -> bool:
        """Every waiter of `entry` is of a key at its max_concurrency: a load for them
        would take a slot (and evict for it) that nobody could use until one of those
        keys' requests ends; the release that ends it runs the rules again."""
        lanes = entry.lanes
        return (bool(lanes) and "" not in lanes
                and all(self.tenants.at_limit(key) for key in lanes))

    def has_capacity(self) -> bool:
        return self.models_max <= 0 or self.n_running < self.models_max

    def has_room(self, rec: ModelRecord) -> bool:
        """May a request be proxied into `rec` now?"""
        limit = rec.rules.max_concurrency
        return (rec.state.is_serving and not rec.retiring
                and (not limit or rec.in_flight < limit))

    def evictable(self, rec: ModelRecord) -> bool:
        return (rec.state.is_serving and not rec.in_flight and not rec.pinned
                and rec.state is not S.REMOTE
                and (rec.group not in self.queue.entries or self.held(rec)) and not rec.removed
                and not (self.teams.partners and self.partner_busy(rec)))

    def held(self, rec: ModelRecord) -> bool:
        """`rec` is held for the model whose turn it is (turns.py): it serves, and that
        model needs it gone."""
        turn = self.turn
        return turn is not None and rec.name in turn.held and rec.state.is_serving

    def cutoff(self, rec: ModelRecord) -> float | None:
        """The requests `rec` takes came before this (None: all of them, it is not held):
        what waited for it when it became ready, and what came before the turn began,
        and its swap_delay_s after the later of the two (turns.py)."""
        turn = self.turn
        return None if turn is None or not self.held(rec) else \
            max(turn.since, rec.ready_at or 0.0) + rec.rules.swap_delay_s

    def takes(self, rec: ModelRecord, at: float) -> bool:
        """`rec` may take a request that came at `at`."""
        cutoff = self.cutoff(rec) if self.turn is not None else None
        return cutoff is None or at < cutoff

    def kept_from(self, rec: ModelRecord, for_model: str | None) -> bool:
        """`rec` is no victim for `for_model` (teams.py): it is in a persistent group
        that model is not in (or a together partner of it is: it would go with it), or it
        is one of that model's own together partners (it comes with it)."""
        teams = self.teams
        if for_model is None or not (teams.kept or teams.partners):
            return False
        if rec.group in teams.partners.get(for_model, {}):
            return True
        return bool(teams.kept) and any(
            teams.keeps(name, for_model) is not None
            for name in (rec.group, *teams.partners.get(rec.group, {})))

    def partner_busy(self, rec: ModelRecord) -> bool:
        """A together partner of `rec` has a request in flight (teams.py)."""
        return any(r.in_flight for partner in self.teams.partners.get(rec.group, {})
                   if partner in self.models
                   for r in self.groups.all_of(self.models[partner]))

    def stopping_suspended(self) -> list[ModelRecord]:
        """Suspended children being stopped: their host copies are coming back."""
        return [r for r in self.models.values() if r.state is S.STOPPING and r.host_bytes]

    def ttl_after(self, rec: ModelRecord) -> float | None:
        """How long after its last use the idle `rec` is due for its TTL: ttl_suspend_s to
        be suspended, then ttl_s to be stopped (R-3.6, issue 23); None: never, or not
        idle."""
        rules = rec.rules
        if rules.warm and not self.above_min(rec):
            return None  # it would be back at once (a copy above min is not)
        if rec.state is S.SUSPENDED:
            idle = rec.group not in self.queue.entries and not rec.removed
            return rules.ttl_s or None if idle else None
        if not self.evictable(rec):
            return None
        copies = rules.replicas
        if copies is not None and copies.scale_down_idle_s and self.above_min(rec):
            return min(copies.scale_down_idle_s, rules.ttl_s or copies.scale_down_idle_s)
        if (rules.ttl_suspend_s and rules.suspend and rec.state is S.LOADED
                and rec.ttl_skipped != rec.idle_from
                and (not rules.ttl_s or rules.ttl_suspend_s < rules.ttl_s)):
            return rules.ttl_suspend_s
        return rules.ttl_s or None

    def above_min(self, rec: ModelRecord) -> bool:
        """`rec` is a copy its model may do without: more than `min` of them are up."""
        copies = rec.rules.replicas
        return copies is not None and rec.state in UP and \
            sum(r.state in UP for r in self.groups.of(rec)) > copies.min

    def resident_until(self, rec: ModelRecord) -> float:
        return (rec.ready_at or rec.state_since) + rec.rules.min_resident_s
