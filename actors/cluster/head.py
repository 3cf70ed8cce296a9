"""The ClusterHead: the head's one actor for the cluster (what runs where, what is sent)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal, assert_never

import msgspec

from ..base import BaseActor, CrashHandler, tell_or_drop
from ..config.model import ClusterConfig
from ..ledger import local_name, node_of, on_node
from ..messages import (
    CancelDownload,
    ClusterHeadMessage,
    DeviceReport,
    DevicesReported,
    DownloadFailed,
    ForDownload,
    ForgetDownload,
    ForModel,
    HeadAttached,
    Inbox,
    InstanceAdopted,
    InstanceExited,
    InstanceMessage,
    InstanceSeen,
    InstanceSuspended,
    InstanceWoken,
    LivenessMiss,
    Measured,
    MeasureMessage,
    MeasureModel,
    MonitorMessage,
    NodeBatch,
    NodeChanged,
    NodeDownload,
    NodeLost,
    NodeUnreachable,
    NodeUp,
    Remember,
    RemoteModel,
    Running,
    SchedulerMessage,
    StartDownload,
    StartInstance,
    StepDue,
    StopInstance,
    SuspendInstance,
    TrackModel,
    WakeInstance,
)
from ..runtime.timers import Timers
from .devices import DeviceReports, renamed
from .placed import Agent, Placed, Shown
from .wire import ToAgent, digest

log = logging.getLogger("corral.cluster")

STEP_GRACE_S = 15.0
"""A suspend or wake step on a node is failed by the head if no answer has come within the
model's suspend_timeout_s and this (the node ends the step itself at suspend_timeout_s;
this covers the way there and back, and a message the agent waited GAP_S for)."""


class ClusterHead(BaseActor):
    """The head's side of the cluster, one actor: each model's node and generation, each
    node's agent (and the only sender to it), the merged device reports, and where
    TrackModel and measuring go. The Scheduler talks to it through each model's
    RemoteInstance (as to a ModelInstance) and as its monitor and measurer; the links'
    threads only post what their agents say."""

    def __init__(self, cluster: ClusterConfig, key: str, scheduler: Inbox[SchedulerMessage],
                 publish: Callable[[Shown], None], on_crash: CrashHandler,
                 timers: Timers | None = None,
                 downloads: Callable[[str, NodeDownload | None], None] | None = None) -> None:
        super().__init__("cluster", on_crash)
        self.cluster = cluster
        self.key = key
        """This head's key for the children it starts on nodes (StartInstance.key)."""
        self.scheduler = scheduler
        self.publish = publish
        """Where what the API shows goes after each message (Cluster.shown)."""
        self.models: dict[str, Placed] = {}
        self.agents = {node: Agent() for node in cluster.nodes}
        self.devices = DeviceReports()
        self.monitor: Inbox[MonitorMessage] | None = None
        """The head's own DeviceMonitor (models without `nodes`)."""
        self.measurer: Inbox[MeasureMessage] | None = None
        """The head's own MeasureWorker (models without `nodes`)."""
        self.timers = timers
        """Where a suspend or wake step's deadline is set (StepDue)."""
        self.downloads = downloads
        """Where the nodes' download events go (the API's Downloads; None: a node lost)."""

    def on_receive(self, message: ClusterHeadMessage) -> None:
        match message:
            case ForModel(model=model, message=order):
                self.order(model, order)
            case RemoteModel(model=model, config=config, log=ring):
                self.models[model] = Placed(config, ring)
            case HeadAttached(monitor=monitor, measurer=measurer):
                self.monitor, self.measurer = monitor, measurer
            case NodeUp():
                self.node_up(message)
            case NodeUnreachable(node=node):
                self.report(self.devices.absent(node))
                self.to_scheduler(NodeChanged(node=node, up=False,
                                      why="its agent could not be started"))
            case NodeBatch():
                self.deliver(message)
            case NodeLost(node=node, why=why):
                self.node_lost(node, why)
            case StepDue(model=model, generation=generation, step=step):
                self.step_due(model, generation, step)
            case ForDownload(node=node, model=model, order=order):
                if self.is_up(node):
                    self.send(node, model, order)
                elif self.downloads is not None:
                    self.downloads(node, NodeDownload(event=DownloadFailed(
                        model=model, error=f"node {node} is not up (GET /nodes)")))
            case TrackModel():
                self.track(message)
            case DevicesReported(report=report):  # from the head's own monitor
                self.report(self.devices.local(report))
            case MeasureModel() | Remember():
                self.measure(message)
            case _:
                assert_never(message)
        self.publish(self.shown())

    # ------------------------------------------------------------ the Scheduler's orders

    def order(self, model: str, message: InstanceMessage) -> None:
        """What the Scheduler told `model`'s RemoteInstance."""
        placed = self.models[model]
        match message:
            case StartInstance(generation=generation, config=config, devices=devices,
                               node=node, serves=serves):
                # The policy chose the node (models_max_per_node is its rule alone); by
                # fit, the devices say it.
                placed.generation, placed.config = generation, config
                chosen = node_of(devices[0]) if devices else node
                placed.node = chosen if chosen is not None and self.is_up(chosen) else None
                if placed.node is None:  # lost since the policy chose it: its exit follows
                    self.to_scheduler(InstanceExited(
                        model=model, generation=generation, returncode=-1,
                        description=f"could not be started: node lost: the agent on node "
                        f"{chosen} is not up (GET /nodes)"))
                    return
                log.info("%s#%d goes to node %s", model, generation, placed.node)
                # The child requires the head's key; its InstanceReady brings it back
                # to the Scheduler, which puts it in each grant (R8).
                self.send(placed.node, model, StartInstance(
                    generation=generation, config=config,
                    devices=[local_name(d) for d in devices] if devices else None,
                    key=self.key, serves=serves))
            case StopInstance(generation=generation, reason="shutdown") if (
                    self.cluster.keep_on_exit and placed.node is not None
                    and generation == placed.generation):
                # The head is stopping: the child stays for the next head to adopt.
                node, placed.node = placed.node, None
                self.to_scheduler(InstanceExited(
                    model=model, generation=generation, returncode=0,
                    description=f"left running on node {node} for the next corral "
                    "(cluster.keep_on_exit)"))
            case SuspendInstance(generation=generation) | WakeInstance(generation=generation):
                if generation == placed.generation and placed.node is not None:
                    # Sent to the node where it runs (it slept there, it wakes there).
                    placed.steps += 1
                    what: Literal["suspend", "wake"] = (
                        "suspend" if isinstance(message, SuspendInstance) else "wake")
                    placed.step = (generation, placed.steps, what)
                    self.send(placed.node, model, message)
                    if self.timers is not None:
                        self.timers.after(placed.config.suspend_timeout_s + STEP_GRACE_S,
                                          self.actor_ref, StepDue(
                                              model=model, generation=generation,
                                              step=placed.steps))
            case StopInstance(generation=generation) | LivenessMiss(generation=generation):
                if generation == placed.generation and placed.node is not None:
                    self.send(placed.node, model, message)
            case _:  # a local child's own helpers' messages: never the Scheduler's
                pass

    def track(self, message: TrackModel) -> None:
        """TrackModel goes to the monitor of the node the model runs on."""
        placed = self.models.get(message.model)
        if placed is None:
            if self.monitor is not None:  # stopped before the head: a late one is dropped
                tell_or_drop(self.monitor, message)
        elif placed.node is not None:
            self.send(placed.node, message.model, message)
        elif message.event == "exited" and placed.left is not None:
            self.send(placed.left, message.model, message)

    def measure(self, message: MeasureModel | Remember) -> None:
        """A model with `nodes` is measured by the agent of the first of them that is up,
        on that node's devices; any other by the head's own MeasureWorker."""
        placed = self.models.get(message.model)
        if placed is None:
            if self.measurer is not None:  # stopped before the head: a late one is dropped
                tell_or_drop(self.measurer, message)
            return
        if isinstance(message, Remember):  # figures of the node it runs on
            node = placed.node
            if node is not None:
                self.send(node, message.model, msgspec.structs.replace(
                    message, figures=renamed(message.figures, node, local=True)))
            return
        up = [n for n in message.config.nodes or [] if self.is_up(n)]
        if up:
            self.send(up[0], message.model, message)
        else:
            self.to_scheduler(Measured(
                model=message.model, result="failed", error=f"no agent is up on "
                f"{message.config.nodes} to measure it"))

    # ------------------------------------------------------------ what the links say

    def node_up(self, up: NodeUp) -> None:
        agent = self.agents[up.node]
        agent.handle, agent.epoch, agent.seq, agent.host = up.handle, up.epoch, 0, up.host
        agent.downloads.clear()
        self.take_over(up.node, up.host, up.running)
        agent.state, agent.since = "up", time.time()
        self.to_scheduler(NodeChanged(node=up.node, up=True))

    def take_over(self, node: str, host: str, running: list[Running]) -> None:
        """What an agent runs when the head (re)connects: a ready child of a model that may
        run there, with the config it has now, is adopted; any other is stopped."""
        for r in running:
            placed = self.models.get(r.model)
            why = ("it is not a model of this corral's on this node"
                   if placed is None or node not in (placed.config.nodes or [])
                   else "its config changed" if digest(placed.config) != r.digest
                   else "it was suspended (its devices given back)" if r.suspended
                   else "it was still loading" if not r.ready
                   else None)
            if why is None and placed is not None and placed.node is None:
                placed.generation, placed.node = r.generation, node
                log.info("node %s: adopting %s#%d (pid %d, port %d)", node, r.model,
                         r.generation, r.pid, r.port)
                devices = [on_node(node, d) for d in r.devices] if r.devices else None
                self.to_scheduler(InstanceAdopted(
                    model=r.model, generation=r.generation, pid=r.pid, host=host,
                    port=r.port, devices=devices, node=node, upstream_key=r.key))
                continue
            log.info("node %s: stopping %s#%d (pid %d), not adopted: %s", node, r.model,
                     r.generation, r.pid, why or "the model runs elsewhere")
            if placed is not None:  # its next generation is a later one than this child's
                self.to_scheduler(InstanceSeen(model=r.model, generation=r.generation))
            self.send(node, r.model, StopInstance(generation=r.generation,
                                                  reason="not adopted"))

    def deliver(self, batch: NodeBatch) -> None:
        node = batch.node
        for message in batch.messages:
            if isinstance(message, DevicesReported):
                self.report(self.devices.reported(node, message.report, time.time()))
                continue
            if isinstance(message, NodeDownload):
                if self.downloads is not None:
                    self.downloads(node, message)
                continue
            if isinstance(message, InstanceExited | InstanceSuspended | InstanceWoken):
                placed = self.models.get(message.model)
                if (placed is not None and placed.node == node
                        and placed.generation == message.generation):
                    placed.step = None  # answered (or moot)
                    if isinstance(message, InstanceExited):
                        placed.node, placed.left = None, node
            if isinstance(message, Measured):  # the node's devices, by their cluster names
                message = msgspec.structs.replace(
                    message, min=renamed(message.min, node), max=renamed(message.max, node))
            self.to_scheduler(message)
        for model, line in batch.lines:
            placed = self.models.get(model)
            if placed is not None:
                placed.log.append(line)
        if batch.dropped_lines:
            log.warning("%d lines of child output were dropped before they reached the head",
                        batch.dropped_lines)
        if batch.skipped:
            log.error("node %s: messages %s from this head never reached its agent (it "
                      "went on without them after a wait)", node, batch.skipped)
            lost = set(batch.skipped)
            for seq, repo in self.agents[node].downloads:
                if seq in lost and self.downloads is not None:
                    self.downloads(node, NodeDownload(event=DownloadFailed(
                        model=repo, error=f"the order never reached node {node}'s agent "
                        "(lost on the way); ask again")))

    def node_lost(self, node: str, why: str) -> None:
        log.error("node %s lost: %s; its models fail, and it is avoided for %g s",
                  node, why, self.cluster.agent_retry_s)
        agent = self.agents[node]
        agent.state, agent.since, agent.handle = "lost", time.time(), None
        self.to_scheduler(NodeChanged(node=node, up=False, why=why))  # first: nothing goes there
        if self.downloads is not None:
            self.downloads(node, None)  # its downloads' parts fail
        self.report(self.devices.lost(node))
        for model, placed in self.models.items():
            if placed.node == node:
                placed.node, placed.step = None, None
                self.to_scheduler(InstanceExited(model=model, generation=placed.generation,
                                         returncode=-1, description=f"node lost: {why}"))

    def step_due(self, model: str, generation: int, step: int) -> None:
        """A step's deadline: unanswered, it failed (the Scheduler then stops the child,
        as when a local step fails); a step answered or made moot since is left be."""
        placed = self.models.get(model)
        if placed is None or placed.step is None or placed.step[:2] != (generation, step):
            return
        what = placed.step[2]
        placed.step = None
        detail = (f"no answer from node {placed.node} within suspend_timeout_s="
                  f"{placed.config.suspend_timeout_s:g} + {STEP_GRACE_S:g} s")
        log.error("%s#%d: its %s step on node %s: %s", model, generation, what, placed.node,
                  detail)
        self.to_scheduler(InstanceSuspended(model=model, generation=generation, ok=False,
                                            detail=detail) if what == "suspend"
                          else InstanceWoken(model=model, generation=generation, ok=False,
                                             detail=detail))

    # ------------------------------------------------------------ helpers

    def is_up(self, node: str) -> bool:
        """Whether `node`'s agent is up now (where to place is the policy's choice)."""
        agent = self.agents.get(node)
        return agent is not None and agent.state == "up"

    def send(self, node: str, model: str, message: StartInstance | StopInstance
             | SuspendInstance | WakeInstance | LivenessMiss | TrackModel | MeasureModel
             | Remember | StartDownload | CancelDownload | ForgetDownload) -> None:
        agent = self.agents[node]
        if agent.handle is None:
            return  # lost: its models' exits are reported already
        agent.handle.tell.remote(msgspec.msgpack.encode(ToAgent(
            epoch=agent.epoch, seq=agent.seq, model=model, message=message)))
        if isinstance(message, StartDownload):
            agent.downloads.append((agent.seq, model))
        agent.seq += 1

    def to_scheduler(self, message: SchedulerMessage) -> None:
        tell_or_drop(self.scheduler, message)  # dropped once the Scheduler has stopped

    def report(self, whole: DeviceReport | None) -> None:
        if whole is not None:
            self.to_scheduler(DevicesReported(report=whole))

    def shown(self) -> Shown:
        at = self.devices.reported_at
        return Shown(nodes=[
            {"node": node, "state": agent.state, "address": agent.host,
             "since": round(agent.since, 3),
             "last_report": round(at[node], 3) if node in at else None,
             "models": sorted(m for m, p in self.models.items() if p.node == node)}
            for node, agent in self.agents.items()],
            placed={m: p.node for m, p in self.models.items() if p.node is not None})
