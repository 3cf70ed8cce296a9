"""What the policy shows (GET /models, /metrics) and what must always hold of it."""

from __future__ import annotations

from ..config.keys import BATCH
from ..lifecycle import ModelState
from ..messages import (
    DevicesSnapshot,
    DeviceView,
    KeyView,
    ModelsSnapshot,
    ModelView,
    ReplicaView,
)
from .moves import shown
from .records import ModelRecord
from .replicas import UP
from .state import State

S = ModelState


def snapshot(p: State, now: float) -> ModelsSnapshot:
    views = []
    places = {name: i for i, name in enumerate(p.queue.entries)}
    for rec in p.models.values():
        if rec.removed or rec.rules.group:
            continue  # a replica is shown in its model's entry
        copies = p.groups.members.get(rec.name)
        every = p.groups.all_of(rec)  # its copies' records, a reload's new or old child too
        child = p.groups.of(rec)[0]  # its first copy's current record: what a request meets
        entry = p.queue.entry(rec.name)
        oldest = (now - p.queue.waiters[next(iter(entry.waiters))].queued_at
                  if entry is not None and entry.waiters else None)
        after = p.ttl_after(child)
        expires = child.idle_from + after - now if after is not None else None
        if copies is not None:  # when the first of its idle copies goes
            dues = [r.idle_from + a - now for r in copies
                    if r.state in UP and (a := p.ttl_after(r)) is not None]
            expires = min(dues) if dues else None
        views.append(ModelView(
            name=rec.name, state=shown(every), generation=child.generation,
            in_flight=sum(r.in_flight for r in every),
            waiting=len(entry.waiters) if entry else 0,
            pid=child.pid, port=child.port, exit_code=child.exit_code,
            last_exit=child.last_exit,
            last_eviction=max(every, key=lambda r: r.evicted_at).last_eviction,
            loads=sum(r.loads for r in every),
            loads_ok=sum(r.loads_ok for r in every),
            load_s_total=sum(r.load_s_total for r in every),
            evictions=evictions(p, [r.name for r in every]),
            memory=rec.memory_info(), info=child.info, progress=child.progress,
            failed=child.failed and child.state is S.UNLOADED,
            retry_after_s=rec.breaker.retry_at - now if rec.breaker.is_open(now) else None,
            expires_in_s=max(expires, 0.0) if expires is not None else None,
            devices=child.placement, node=child.node, queue_oldest_s=oldest,
            queue_wait=(h.view() if (h := p.stats.queue_wait.get(rec.name)) else None),
            load_time=(h.view() if (h := p.stats.load_time.get(rec.name)) else None),
            wake_time=(h.view() if (h := p.stats.wake_time.get(rec.name)) else None),
            state_for_s=now - child.state_since,
            refusals={r: n for (m, r), n in p.stats.refusals.items() if m == rec.name},
            queue_position=places.get(rec.name) if oldest is not None else None,
            phase=child.state.value if child.state.value != child.state.shown else None,
            host_bytes=rec.host_bytes or None, suspends=rec.suspends, wakes=rec.wakes,
            swap_times=child.times,
            prefetched=p.prefetched.get(child.name),
            ctx=child.n_ctx if child.rules.ctx_fit and child.state is not S.UNLOADED else None,
            replicas=[replica_view(r) for r in every  # (an alternate while it has a child)
                      if r in copies or r.state is not S.UNLOADED]
            if copies is not None else None))
    return ModelsSnapshot(models=views, running=p.running_count(), queue_depth=len(p.queue),
                          granted=p.stats.granted, queue_waits=p.stats.queue_waits,
                          queue_wait_s=p.stats.queue_wait_s, keys=key_views(p, now),
                          class_wait={c: h.view() for c, h in p.stats.class_wait.items()},
                          cuts=sum(p.stats.cuts.values()), suspended=p.n_suspended,
                          prefetches=dict(p.stats.prefetches))


def evictions(p: State, names: list[str]) -> dict[str, int]:
    """Reason -> children of these records stopped for it."""
    out: dict[str, int] = {}
    for (m, r), n in p.stats.evictions.items():
        if m in names:
            out[r] = out.get(r, 0) + n
    return out


def replica_view(rec: ModelRecord) -> ReplicaView:
    return ReplicaView(
        name=rec.name, state=rec.state.shown,
        phase=rec.state.value if rec.state.value != rec.state.shown else None,
        generation=rec.generation, in_flight=rec.in_flight, pid=rec.pid, port=rec.port,
        devices=rec.placement, node=rec.node, loads=rec.loads, last_exit=rec.last_exit)


def devices(p: State) -> DevicesSnapshot:
    """GET /devices."""
    led, memory = p.ledger, p.memory
    views = []
    for name, dev in led.devices.items():
        held = {m: devs[name] for m, devs in led.held.items() if name in devs}
        views.append(DeviceView(name=name, kind=dev.kind, total=dev.total, free=dev.free,
                                external=dev.external, held=held,
                                available=led.available(name) or 0))
    return DevicesSnapshot(memory_accounting=memory.on, margin=led.margin,
                           account_host=led.account_host, backends=memory.backends,
                           devices=views)


def key_views(p: State, now: float) -> list[KeyView]:
    out = []
    for name, rules in p.tenants.rules.items():
        if not name or (name.startswith(BATCH) and name not in p.tenants.usage):
            continue  # (a batch's class is shown once its lines have come)
        usage = p.tenants.usage.get(name)
        if usage is not None:
            usage.expire(now, rules.tokens_per_min)
        out.append(KeyView(
            name=name, priority=rules.priority, level=rules.level,
            in_flight=usage.in_flight if usage else 0,
            requests_last_min=(len(usage.taken) if usage else 0) if rules.requests_per_min
            else None,
            tokens_last_min=(usage.spent_sum if usage else 0) if rules.tokens_per_min else None,
            tokens_carried=(usage.carried if usage else 0) if rules.tokens_per_min else None,
            refusals={r: n for (k, r), n in p.stats.key_refusals.items() if k == name},
            cuts=sum(n for (_, k), n in p.stats.cuts.items() if k == name)))
    return out


def check(p: State) -> None:
    """Raise AssertionError if the state is inconsistent (tests run it after every step)."""
    _check_queue(p)
    _check_leases(p)
    _check_counts(p)
    _check_copies(p)
    _check_records(p)


def _check_queue(p: State) -> None:
    """Nobody waits for a model that could serve; a claimed entry has a child coming."""
    p.queue.check()
    for name, entry in p.queue.entries.items():
        copies = p.groups.of(p.models[name])
        for rec in copies:
            if rec.state.is_serving:
                limit = rec.rules.max_concurrency
                cutoff = p.cutoff(rec)  # (another's turn: what came after waits)
                assert rec.retiring or (limit and rec.in_flight >= limit) or all(
                    p.tenants.at_limit(key) for key in entry.lanes) or (
                    cutoff is not None and all(  # (the rest came after its cutoff)
                        p.queue.waiters[t].queued_at >= cutoff
                        or p.tenants.at_limit(p.queue.waiters[t].key) for t in entry.waiters)), \
                    f"{rec.name}: {name} queued while it could serve"
        if entry.claimed:
            assert any(r.state in (S.LOADING, S.STOPPING, S.WAKING) for r in copies), \
                f"{name}: claim without child"


def _check_leases(p: State) -> None:
    """Every grant is counted in flight once, by its model and by its key; a slot a
    higher class may cut is a grant's."""
    for rec in p.models.values():
        live = sum(1 for (n, g, _) in p.leases.values()
                   if n == rec.name and g == rec.generation)
        if rec.state.is_running or rec.state is S.REMOTE:
            assert rec.in_flight == live, f"{rec.name}: in_flight {rec.in_flight} != {live}"
        else:
            assert rec.in_flight == 0
            assert rec.node is None and rec.upstream_key is None, f"{rec.name}: no child"
    keyed: dict[str, int] = {}
    for (_, _, key) in p.leases.values():
        keyed[key] = keyed.get(key, 0) + 1
    for key, usage in p.tenants.usage.items():
        assert usage.in_flight == keyed.get(key, 0), f"key {key!r}: in_flight {usage.in_flight}"
    for ticket, slot in p.cuts.of.items():
        assert p.leases.get(ticket, ("",))[0] == slot.model, f"cut slot {ticket!r}: no lease"
        assert p.cuts.slots[slot.model][ticket] is slot
    assert sum(map(len, p.cuts.slots.values())) == len(p.cuts.of), "cut slots"


def _check_counts(p: State) -> None:
    """The counts kept for O(1) decisions are what the records say."""
    recs = list(p.models.values())
    assert p.n_running == sum(r.holds_slot for r in recs), "n_running"
    assert p.n_stopping == sum(r.state is S.STOPPING and r.holds_slot for r in recs)
    assert p.n_running_pinned == sum(r.holds_slot and r.pinned for r in recs)
    assert p.n_suspending == sum(r.state is S.SUSPENDING for r in recs), "n_suspending"
    assert p.n_suspended == sum(r.state in (S.SUSPENDING, S.SUSPENDED) for r in recs)
    assert p.models_max <= 0 or p.n_running <= p.models_max, "over models_max"
    assert not p.host.suspended_max or p.n_suspended <= p.host.suspended_max, "suspended_max"


def _check_copies(p: State) -> None:
    """A model's copies: at most its max, one generation each, active while one is up."""
    for name, group in p.groups.members.items():
        most = group[0].rules.replicas
        assert most is not None and (group[0].alternate_of or group[0].name) == name, \
            f"{name}: group"
        assert sum(not r.removed for r in group) <= most.most, f"{name}: above max"
        generations = [r.generation for r in group if r.state.is_running]
        assert len(set(generations)) == len(generations), f"{name}: a generation twice"
        assert (name in p.groups.active) == any(r.state in UP for r in group), \
            f"{name}: active {name in p.groups.active}"
        assert all(r.rules.replicas is not None and r.group == name and not r.removed
                   for r in group), f"{name}: a member that is not its copy"
    assert set(p.groups.active) <= set(p.groups.members), "active groups without members"


def _check_records(p: State) -> None:
    """Each record's flags agree with its state; memory is held only by a child."""
    recs = list(p.models.values())
    assert p.warming <= set(recs), "warming: a record that is not the model's"
    for rec in recs:
        assert not rec.releasing or rec in p.memory.releasing, f"{rec.name}: releasing"
        if rec.state is S.LOADING or rec.awaiting_usage:
            assert rec in p.unsettled, f"{rec.name}: unsettled, not listed"
        if rec.state in (S.SUSPENDING, S.SUSPENDED):
            assert rec.rules.suspend and not rec.in_flight, f"{rec.name}: suspended busy"
        assert not rec.draining or rec.state is S.SUSPENDED, f"{rec.name}: draining"
        assert rec.name not in p.host.unseen or rec.state in (
            S.SUSPENDING, S.SUSPENDED, S.WAKING, S.STOPPING), \
            f"{rec.name}: host bytes of no suspend"
    p.victims.check(p.models)
    for name in p.ledger.held:
        rec = p.models[name]
        assert rec.state.is_running or rec.releasing, f"{name}: holds memory, no child"
