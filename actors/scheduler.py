"""Scheduler actor: owns every model record and the queue; its mailbox replaces locks.

It turns each message into a call on the pure `Policy` and executes the effects that come
back: answers to tickets, Start/StopInstance to ModelInstance actors, events to subscribers.
It never does I/O, never sleeps and never waits on another actor."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar, assert_never, cast

from . import budgets, swap_times
from .base import BaseActor, CrashHandler
from .config.context import with_ctx
from .config.keys import tenants_of
from .config.model import Config, ModelConfig, ModelRules, copies
from .config.reload import same_child
from .config.rules import alternate_name, with_alternates
from .ledger import MiB
from .messages import (
    Acquire,
    Alive,
    AnswerLate,
    Cancel,
    ChildReport,
    Cut,
    DevicesReported,
    DrainNode,
    Event,
    GetDevices,
    GetDrains,
    GetModels,
    GetPlan,
    Inbox,
    InstanceAdopted,
    InstanceExited,
    InstanceMessage,
    InstanceReady,
    InstanceReported,
    InstancesAttached,
    InstanceSeen,
    InstanceStarted,
    InstanceSuspended,
    InstanceWoken,
    LivenessMiss,
    LoadModel,
    Measured,
    MeasureMessage,
    MeasureModel,
    MeasureStarted,
    MonitorMessage,
    NodeChanged,
    NotCut,
    Ping,
    Reconfigure,
    Release,
    Releases,
    ReloadSummary,
    Remember,
    Reply,
    Repump,
    Requeue,
    Revoke,
    SaveBudgets,
    SchedulerMessage,
    SchedulerOther,
    SchedulerRequest,
    Shutdown,
    Spend,
    StartInstance,
    StopInstance,
    Subscribe,
    SuspendInstance,
    TrackModel,
    TtlDue,
    Unhealthy,
    UnloadModel,
    WaitDue,
    WakeInstance,
    WatchGrants,
    Withdraw,
)
from .policy import Policy
from .policy.records import (
    Answer,
    Effect,
    Later,
    Learned,
    Measure,
    Preempt,
    Publish,
    Spawn,
    Stop,
    Suspend,
    Track,
    Wake,
)
from .runtime.timers import Timers

T = TypeVar("T")

EARLY_OK = (InstancesAttached, Subscribe, WatchGrants, Ping, GetModels, GetDevices, GetPlan,
            GetDrains, Shutdown)
"""What the Scheduler handles before its instances are attached: nothing that starts,
stops or tracks a child."""

CUT = Cut()


class Scheduler(BaseActor):
    """Dispatches messages to the policy and carries out its effects."""

    def __init__(self, config: Config, on_crash: CrashHandler, timers: Timers | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__("scheduler", on_crash)
        self.clock = clock
        self.timers = timers
        self.config = config
        self.policy = Policy(config.models_max, config.restart_intensity,
                             config.restart_period_s, int(config.memory_margin_mib * MiB),
                             config.account_host, config.restart_backoff_max_s,
                             config.restart_healthy_s, config.models_max_per_node,
                             tenants_of(config), config.priority_aging_s, config.priority_preempt,
                             int(config.host_memory_margin_mib * MiB), config.suspended_max,
                             config.prefetch)
        for name, (group, model) in copies(config.models).items():
            self.policy.add_model(name, clock(), rules=config.rules_of(model, group))
        self.policy.state.teams.replace(config.groups)
        self.configs = with_alternates(config.instances())
        self.models = dict(config.models)
        """The current model table (`configs`: by instance, copies included, and the
        alternates of reloads and drains): a spawn or a measure uses its moment's."""
        self.startup_loads = [n for n, m in config.models.items() if m.load_on_startup]
        self.instances: dict[str, Inbox[InstanceMessage]] = {}  # (set by InstancesAttached)
        self.monitor: Inbox[MonitorMessage] | None = None
        self.early: list[SchedulerMessage] | None = []
        """Messages about models and devices that came before InstancesAttached, handled in
        order right after it; None once attached. Invariant: no effect names an instance
        before it exists (issue 37: a warm load on the first device report crashed it)."""
        self.measurer: Inbox[MeasureMessage] | None = None
        self.budgets_dir = config.state_path()
        kept, away_s = budgets.load(self.budgets_dir)
        self.policy.state.tenants.restore(kept, clock(), away_s)
        self.times = swap_times.Keeper(self.budgets_dir, self.policy.state.models,
                                       self.policy.state.groups.current, self.configs)
        self.saved_changes = self.policy.state.tenants.changes
        self.subscribers: list[Callable[[Event], None]] = []
        self.grant_watchers: list[Callable[[Withdraw | Revoke], None]] = []
        self.shutdown_replies: list[Reply] = []

    def on_receive(self, message: SchedulerMessage) -> None:
        if self.early is not None and not isinstance(message, EARLY_OK):
            self.early.append(message)
            return
        now = self.clock()
        match message:
            case (Acquire() | Release() | Spend() | Releases() | Cancel() | Requeue()
                  | NotCut() | LoadModel() | UnloadModel() | DrainNode() | GetDrains()
                  | GetModels() | GetPlan() | Ping()):
                self.on_request(message, now)
            case (InstanceStarted() | InstanceReady() | InstanceAdopted() | NodeChanged()
                  | InstanceSeen() | InstanceReported() | InstanceExited()
                  | InstanceSuspended() | InstanceWoken() | MeasureStarted() | Measured()
                  | DevicesReported() | GetDevices()):
                self.on_report(message, now)
            case _:
                self.on_other(message, now)
        if self.shutdown_replies and self.policy.all_stopped:
            for reply in self.shutdown_replies:
                reply.send(True)
            self.shutdown_replies.clear()

    def on_request(self, message: SchedulerRequest, now: float) -> None:
        """What a front, the management API or an embedding program asks."""
        p = self.policy
        match message:
            case Acquire(ticket=ticket, model=model, autoload=autoload, key=key, retry=retry,
                         cuttable=cuttable, affinity=affinity, among=among, spill=spill):
                self._carry_out(p.acquire(ticket, model, now, autoload, key, retry, cuttable,
                                          affinity, among, spill))
            case Release(ticket=ticket, shared=shared, idle_s=idle_s, tokens=tokens):
                self._carry_out(p.release(ticket, now, shared, idle_s, tokens))
            case Spend(ticket=ticket, tokens=tokens):
                p.spend(ticket, tokens, now)
            case Releases(releases=releases):
                self._carry_out(p.release_all(
                    ((r.ticket, r.shared, r.idle_s, r.tokens) for r in releases), now))
            case Cancel(ticket=ticket):
                self._carry_out(p.cancel(ticket, now))
            case Requeue(ticket=ticket):
                self._carry_out(p.cuts.requeue(ticket, now))
            case NotCut(ticket=ticket):
                self._carry_out(p.cuts.not_cut(ticket, now))
            case LoadModel(model=model, reply=reply):
                self._carry_out(p.load(reply, model, now))
            case UnloadModel(model=model, reply=reply):
                self._carry_out(p.unload(reply, model, now))
            case DrainNode(node=node, drain=drain, reply=reply):
                self._carry_out(p.drain(reply, node, drain, now))
            case GetDrains(nodes=nodes, reply=reply):
                reply.send([p.drains.view(node) for node in nodes])
            case GetModels(reply=reply):
                reply.send(p.snapshot(now))
            case GetPlan(model=model, key=key, autoload=autoload, kept=kept, shown=shown,
                         affinity=affinity, reply=reply):
                reply.send(p.plan(model, now, key, autoload, kept, shown, affinity))
            case Ping(reply=reply):
                reply.send(Alive(running=p.running_count(), queue_depth=len(p.state.queue)))
            case _:
                assert_never(message)

    def on_report(self, message: ChildReport, now: float) -> None:
        """What a child's instance, the MeasureWorker or the DeviceMonitor reports."""
        p = self.policy
        match message:
            case InstanceStarted(model=model, generation=gen, pid=pid):
                self._carry_out(p.children.instance_started(model, gen, pid))
            case InstanceReady(model=model, generation=gen, pid=pid, port=port, info=info,
                               host=host, upstream_key=key):
                self._carry_out(p.children.instance_ready(model, gen, pid, host, port, now,
                                                          info, key))
            case InstanceAdopted(model=model, generation=gen, pid=pid, host=host, port=port,
                                 devices=devices, node=node, upstream_key=key):
                self._carry_out(p.children.instance_adopted(model, gen, pid, host, port,
                                                            devices, now, node, key))
            case NodeChanged(node=node, up=up, why=why):
                self._carry_out(p.children.node_changed(node, up, why, now))
            case InstanceSeen(model=model, generation=gen):
                p.children.instance_seen(model, gen)
            case InstanceReported(model=model, generation=gen, state=state, payload=payload):
                self._carry_out(p.children.instance_reported(model, gen, state, payload, now))
            case InstanceExited(model=model, generation=gen, returncode=rc, description=desc):
                self._carry_out(p.children.instance_exited(model, gen, rc, desc, now))
            case InstanceSuspended(model=model, generation=gen, ok=ok, detail=detail,
                                   host_bytes=host_bytes):
                self._carry_out(p.tiers.suspended(model, gen, ok, detail, host_bytes, now))
            case InstanceWoken(model=model, generation=gen, ok=ok, detail=detail):
                self._carry_out(p.tiers.woken(model, gen, ok, detail, now))
            case MeasureStarted(model=model):
                self._carry_out(p.children.measure_started(model))
            case Measured(model=model, result=result, min=min_, max=max_) as m:
                self._carry_out(p.children.measured(model, result == "measured", min_, max_,
                                                    now, m.error, result == "at_load", m.per_token))
            case DevicesReported(report=report):
                self._carry_out(p.children.devices_reported(report, now))
            case GetDevices(reply=reply):
                reply.send(p.children.devices_snapshot())
            case _:
                assert_never(message)

    def on_other(self, message: SchedulerOther, now: float) -> None:
        """Timers, subscriptions, liveness, reloads and the shutdown."""
        p = self.policy
        match message:
            case TtlDue(model=model, generation=gen):
                self._carry_out(p.tiers.ttl_due(model, gen, now))
            case WaitDue(ticket=ticket):
                self._carry_out(p.wait_due(ticket, now))
            case Repump():
                self._carry_out(p.repump(now))
            case SaveBudgets():
                self.save_budgets(now)
                if self.timers is not None:
                    self.timers.after(budgets.SAVE_EVERY_S, self.actor_ref, SaveBudgets())
            case Unhealthy(model=model, generation=gen, detail=detail):
                self._carry_out(p.children.instance_unhealthy(model, gen, detail, now))
            case AnswerLate(model=model, generation=gen, detail=detail):
                if model in self.instances:
                    self.instances[model].tell(LivenessMiss(generation=gen, detail=detail))
            case Subscribe(sink=sink):
                self.subscribers.append(sink)
            case WatchGrants(sink=sink):
                self.grant_watchers.append(sink)
            case InstancesAttached(instances=instances, monitor=monitor, measurer=measurer):
                self.attach(instances, monitor, measurer, now)
            case Reconfigure(models=models, instances=instances, reply=reply,
                             tenants=tenants, aging_s=aging_s, preempt=preempt, groups=groups):
                self.reconfigure(models, instances, reply, now)
                if tenants is not None:
                    self._carry_out(p.set_tenants(tenants, aging_s or 0.0, now, preempt))
                if groups is not None:
                    self._carry_out(p.set_groups(groups, now))
            case Shutdown(reply=reply):
                self.save_budgets(now)
                self.shutdown_replies.append(reply)
                self._carry_out(p.shutdown(now))
            case _:
                assert_never(message)

    def attach(self, instances: dict[str, Inbox[InstanceMessage]],
               monitor: Inbox[MonitorMessage] | None, measurer: Inbox[MeasureMessage] | None,
               now: float) -> None:
        """Every ModelInstance exists: handle what came before, then start what starts
        by itself (measurements, load_on_startup, warm models, replicas' minimum), in
        this one place."""
        self.instances = dict(instances)
        self.monitor, self.measurer = monitor, measurer
        early, self.early = self.early or [], None
        for message in early:
            self.on_receive(message)
        p = self.policy
        self._carry_out(p.children.start_measuring())
        for name in self.startup_loads:
            self._carry_out(p.load(None, name, now))
        self._carry_out(p.repump(now))
        if self.timers is not None:
            self.timers.after(budgets.SAVE_EVERY_S, self.actor_ref, SaveBudgets())

    def save_budgets(self, now: float) -> None:  # (and the swap times: swap_times.py)
        self.times.save(self.configs)
        tenants = self.policy.state.tenants
        if tenants.changes != self.saved_changes:
            self.saved_changes = tenants.changes
            budgets.save(self.budgets_dir, tenants.export(now))

    def reconfigure(self, models: dict[str, ModelConfig],
                    instances: dict[str, Inbox[InstanceMessage]], reply: Reply,
                    now: float) -> None:
        was, self.models = self.models, dict(models)
        table = copies(models)
        old = {n: model for n, (_, model) in copies(was).items()}
        alternates = {n: c for n, c in self.configs.items() if n not in old}
        self.configs = {n: model for n, (_, model) in table.items()} | alternates
        self.instances.update(instances)

        def rules(name: str) -> ModelRules:
            return self.config.rules_of(table[name][1], table[name][0])

        kept = [n for n in table if n in old and table[n][1] != old[n]]
        for n in kept:  # a changed child loads in its alternate beside the old one
            self.configs[alternate_name(n)] = table[n][1]
        self.configs |= with_alternates({n: m for n, (_, m) in table.items()})  # (new ones)
        effects, restarted = self.policy.children.reconfigure(
            {n: rules(n) for n in table if n not in old},
            [n for n in old if n not in table],
            {n: rules(n) for n in kept if not same_child(table[n][1], old[n])}, now,
            retuned={n: rules(n) for n in kept if same_child(table[n][1], old[n])})
        self._carry_out(effects)
        # said of models, not of their copies
        added = [n for n in models if n not in was]
        removed = [n for n in was if n not in models]
        changed = [n for n in models if n in was and models[n] != was[n]]
        restarted = list(dict.fromkeys(table[n][0] or n for n in restarted))
        summary = ReloadSummary(added=added, removed=removed, changed=changed, restarted=restarted)
        self.log.info("reload: added %s, removed %s, changed %s (restarting %s), %d unchanged",
                      added or "none", removed or "none", changed or "none",
                      restarted or "none", len(models) - len(added) - len(changed))
        reply.send(summary)

    def _hand(self, sink: Callable[[T], None], item: T) -> None:
        """Give `item` to a subscriber; an embedding app's callback that raises is logged,
        never allowed to take the Scheduler down."""
        try:
            sink(item)
        except Exception:
            self.log.exception("an event subscriber raised on %r; the event is dropped for it",
                               item)

    def _carry_out(self, effects: list[Effect]) -> None:
        for effect in effects:
            match effect:
                case Answer(ticket=ticket, value=value):
                    if ticket is not None:  # None: a load nobody waits on (load_on_startup)
                        cast(Reply, ticket).send(value)  # the tickets it was given: replies
                case Preempt(ticket=ticket):
                    cast(Reply, ticket).send(CUT)
                case Spawn(model=model, generation=gen, devices=devices, node=node,
                           serves=serves, n_ctx=n_ctx):  # (n_ctx: its `{ctx}`, chosen)
                    self.instances[model].tell(StartInstance(
                        generation=gen, config=with_ctx(self.configs[model], n_ctx),
                        devices=devices, node=node, serves=serves))
                case Stop(model=model, generation=gen, reason=reason):
                    self.instances[model].tell(StopInstance(generation=gen, reason=reason))
                case Suspend(model=model, generation=gen):
                    self.instances[model].tell(SuspendInstance(generation=gen))
                case Wake(model=model, generation=gen):
                    self.instances[model].tell(WakeInstance(generation=gen))
                case Publish(event=event):
                    for sink in self.subscribers:
                        self._hand(sink, event)
                case Withdraw() | Revoke():
                    for watcher in self.grant_watchers:
                        self._hand(watcher, effect)
                case Learned(model=model, figures=figures, high=high):
                    if self.measurer is not None and model in self.configs:
                        self.measurer.tell(Remember(model=model, config=self.configs[model],
                                                    figures=figures, high=high))
                case Later(delay_s=delay, message=message):
                    if self.timers is not None:
                        self.timers.after(delay, self.actor_ref, message)
                case Measure(model=model, front=front):
                    if self.measurer is not None:
                        self.measurer.tell(MeasureModel(model=model, config=self.configs[model],
                                                        front=front))
                case Track(model=model, event=event, pid=pid):
                    if self.monitor is not None:
                        self.monitor.tell(TrackModel(model=model, event=event, pid=pid))
                case _:
                    assert_never(effect)
