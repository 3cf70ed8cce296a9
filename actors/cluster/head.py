"""The head's side: a RemoteInstance per model, an AgentLink per node, the Cluster."""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, cast

import msgspec
import pykka
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..childproc import LogRing
from ..config import Config, ModelConfig
from ..ledger import Breakdown, local_name, node_of, on_node
from ..messages import (
    DevicesReported,
    InstanceAdopted,
    InstanceExited,
    InstanceSeen,
    LivenessMiss,
    Measured,
    MeasureModel,
    NodeChanged,
    Remember,
    Running,
    StartInstance,
    StopInstance,
)
from .agent import NodeAgent
from .devices import DeviceHub
from .join import Waker, join
from .wire import AGENT_PREFIX, POLL_S, Batch, ToAgent, digest

log = logging.getLogger("corral.cluster")


class RemoteInstance:
    """The head's stand-in for a ModelInstance on another node: the Scheduler tells it
    what it would tell a local one, and it passes that on to the node the model runs on."""

    def __init__(self, name: str, model: ModelConfig, cluster: Cluster) -> None:
        self.name = name
        self.model = model
        self.cluster = cluster
        self.generation = 0
        self.node: str | None = None
        """Where the current generation runs (None: nowhere)."""
        self.lock = threading.Lock()
        """tell() runs on the Scheduler's thread, node_lost() on a link's."""

    def tell(self, message: Any) -> None:
        with self.lock:
            self._tell(message)

    def _tell(self, message: Any) -> None:
        match message:
            case StartInstance(generation=generation, config=config, devices=devices,
                               node=node):
                # The policy chose the node (models_max_per_node is its rule alone); by
                # fit, the devices say it.
                self.generation, self.model = generation, config
                chosen = node_of(devices[0]) if devices else node
                self.node = chosen if chosen is not None and self.cluster.is_up(chosen) \
                    else None
                if self.node is None:  # lost since the policy chose it: its exit follows
                    self.cluster.scheduler.tell(InstanceExited(
                        self.name, generation, -1, f"could not be started: node lost: "
                        f"the agent on node {chosen} is not up (GET /nodes)"))
                    return
                log.info("%s#%d goes to node %s", self.name, generation, self.node)
                # The child requires the head's key; its InstanceReady brings it back
                # to the Scheduler, which puts it in each grant (R8).
                self.cluster.send(self.node, self.name, StartInstance(
                    generation, config, [local_name(d) for d in devices]
                    if devices else None, key=self.cluster.key))
            case StopInstance(generation=generation, reason="shutdown") if (
                    self.cluster.config.cluster.keep_on_exit and self.node is not None
                    and generation == self.generation):
                # The head is stopping: the child stays for the next head to adopt.
                node, self.node = self.node, None
                self.cluster.scheduler.tell(InstanceExited(
                    self.name, generation, 0, f"left running on node {node} for the next "
                    "corral (cluster.keep_on_exit)"))
            case StopInstance(generation=generation) | LivenessMiss(generation=generation):
                if generation == self.generation and self.node is not None:
                    self.cluster.send(self.node, self.name, message)

    def exited(self, node: str, generation: int) -> None:
        with self.lock:
            if self.node == node and self.generation == generation:
                self.node = None

    def adopt(self, generation: int, node: str) -> bool:
        with self.lock:
            if self.node is not None:
                return False
            self.generation, self.node = generation, node
            return True

    def node_lost(self, node: str, why: str) -> None:
        with self.lock:
            if self.node != node:
                return
            self.node = None
            self.cluster.scheduler.tell(InstanceExited(self.name, self.generation, -1,
                                                       f"node lost: {why}"))

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """The Supervisor stops its actors at the end; there is no local one here."""


def renamed(figures: Breakdown | None, node: str, local: bool = False) -> Breakdown | None:
    """`figures` with each row's device named as on `node` in the head's ledger (or, with
    `local`, as on the node itself)."""
    if figures is None:
        return None
    return Breakdown(figures.n_ctx, [
        msgspec.structs.replace(row, name=local_name(row.name) if local
                                else on_node(node, row.name)) for row in figures.devices])


class MeasureRouter:
    """The Scheduler's measurer in a cluster: a model with `nodes` is measured by the agent
    of the first of them that is up, on that node's devices; any other by the head's own
    MeasureWorker."""

    def __init__(self, cluster: Cluster, local: Any) -> None:
        self.cluster = cluster
        self.local = local

    def tell(self, message: MeasureModel | Remember) -> None:
        remote = self.cluster.instances.get(message.model)
        if remote is None:
            self.local.tell(message)
            return
        if isinstance(message, Remember):  # figures of the node it runs on
            node = remote.node
            if node is not None:
                self.cluster.send(node, message.model, msgspec.structs.replace(
                    message, figures=renamed(message.figures, node, local=True)))
            return
        up = [n for n in message.config.nodes or [] if self.cluster.links[n].state == "up"]
        if up:
            self.cluster.send(up[0], message.model, message)
        else:
            self.cluster.scheduler.tell(Measured(
                message.model, "failed", error=f"no agent is up on {message.config.nodes} "
                "to measure it"))


class AgentLink:
    """The head's link to one node's agent: creates (or finds) it, long-polls it on its own
    thread, and turns its death into `node_lost` for every model that ran there."""

    def __init__(self, cluster: Cluster, node: str) -> None:
        self.cluster = cluster
        self.node = node
        self.handle: Any = None
        self.host: str | None = None
        self.epoch = 0
        """What the agent's attach returned: every message carries it (R11)."""
        self.seq = 0
        """The next message's number (ToAgent.seq), counted from 0 at each attach."""
        self.send_lock = threading.Lock()
        self.state = "connecting"
        """connecting, up, or lost (retried every cluster.agent_retry_s)."""
        self.since = time.time()
        self.tried = threading.Event()
        """Set once the first attempt to reach the agent is over, either way."""
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"agent-link-{node}")

    def _connect(self) -> bool:
        cluster = self.cluster
        found = cluster.find_node(self.node)
        if found is None:
            log.warning("node %s: no live Ray node has a resource or label %r", self.node,
                        self.node)
            return False
        host = cluster.config.cluster.advertise.get(self.node) or found["NodeManagerAddress"]
        actor = ray.remote(NodeAgent).options(
            name=AGENT_PREFIX + self.node, namespace=cluster.config.cluster.namespace,
            lifetime="detached", get_if_exists=True, num_cpus=0, num_gpus=0,
            max_concurrency=8, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(found["NodeID"], soft=False))
        config = msgspec.msgpack.encode(cluster.agent_config)
        handle: Any = actor.remote(self.node, host, config)
        hello = ray.get(handle.attach.remote(config), timeout=60)
        if "epoch" not in hello:  # an agent of a corral from before epochs (issue 19)
            log.warning("node %s: its agent runs an older corral; stopping it and its "
                        "children to start this corral's", self.node)
            ray.kill(handle)
            return False
        with self.send_lock:
            self.handle, self.seq, self.epoch = handle, 0, int(hello["epoch"])
        self.host = hello["host"]
        running = msgspec.msgpack.decode(ray.get(handle.running.remote(), timeout=60),
                                         type=list[Running])
        log.info("node %s: agent up (pid %d on %s), %d children running", self.node,
                 hello["pid"], self.host, len(running))
        cluster.take_over(self.node, hello["host"], running)
        return True

    def _run(self) -> None:
        retry_s = self.cluster.config.cluster.agent_retry_s
        while not self.stopping.is_set():
            if self.state != "up":
                try:
                    up = self._connect()
                except (ray.exceptions.RayError, TimeoutError) as e:
                    log.warning("node %s: cannot start its agent: %s", self.node, e)
                    up = False
                if up:
                    self.state, self.since = "up", time.time()
                    self.cluster.tell(NodeChanged(self.node, True))
                else:
                    self.cluster.hub.absent(self.node)
                    self.cluster.tell(NodeChanged(self.node, False,
                                                  "its agent could not be started"))
                self.tried.set()
                self.cluster.wake()
                if not up:
                    self.stopping.wait(retry_s)
                    continue
            try:
                data = ray.get(self.handle.poll.remote(POLL_S, self.epoch))
            except ray.exceptions.RayError as e:
                if self.stopping.is_set():
                    return
                self._lost(f"the agent on node {self.node} died ({type(e).__name__})")
                self.stopping.wait(retry_s)
                continue
            batch = msgspec.msgpack.decode(data, type=Batch)
            if batch.superseded:
                self._lost(f"another corral attached to the agent on node {self.node} "
                           f"(Ray namespace {self.cluster.config.cluster.namespace}); "
                           "run one corral per namespace")
                self.stopping.wait(retry_s)
                continue
            self.cluster.deliver(self.node, batch)

    def _lost(self, why: str) -> None:
        log.error("node %s lost: %s; its models fail, and it is avoided for %g s",
                  self.node, why, self.cluster.config.cluster.agent_retry_s)
        with self.send_lock:
            self.state, self.since, self.handle = "lost", time.time(), None
        self.cluster.tell(NodeChanged(self.node, False, why))  # first: nothing goes there
        self.cluster.node_lost(self.node, why)

    def send(self, model: str, message: Any) -> None:
        with self.send_lock:
            if self.handle is None:
                return  # lost: its models' exits are reported already
            self.handle.tell.remote(msgspec.msgpack.encode(
                ToAgent(self.epoch, self.seq, model, message)))
            self.seq += 1


class Cluster:
    """The head's view of the Ray cluster: one AgentLink per configured node."""

    def __init__(self, config: Config, logs: dict[str, LogRing]) -> None:
        self.config = config
        self.agent_config = msgspec.structs.replace(config, api_key=None, api_key_file=None)
        """What the agents get: the head's config without its clients' key (R8: Ray keeps
        an actor's arguments in its GCS, and sends them in clear)."""
        self.key = secrets.token_urlsafe(32)
        """This head's key for the children it starts on nodes: each requires it (passed
        with its server's own key flag), and the front sends it (Grant.upstream_key)."""
        self.logs = logs
        self.scheduler: Any = None
        self.links = {node: AgentLink(self, node) for node in config.cluster.nodes}
        self.instances: dict[str, RemoteInstance] = {}
        self.hub = DeviceHub(self)
        self.waker = Waker()
        """Ends the startup's waits (joining, reaching the agents) when corral must stop."""

    def connect(self) -> None:
        """Join the Ray cluster as a driver within cluster.connect_timeout_s: raises
        ConfigError if it cannot, saying what to check; Abandoned if `abandon` is called
        meanwhile."""
        address = self.config.cluster.ray_address
        join(self.config.cluster, self.waker)
        log.info("joined the Ray cluster at %s (namespace %s); nodes %s", address,
                 self.config.cluster.namespace, ", ".join(self.links))

    def abandon(self) -> None:
        """corral stops during its startup: `connect` and `start` return at once, raising
        Abandoned (call from any thread but a signal handler)."""
        self.waker.abandon()

    def wake(self) -> None:
        self.waker.wake()

    def start(self, scheduler: Any, timeout_s: float = 60.0) -> None:
        """Reach every node's agent (starting those not there); return once each is up or
        has failed once (then it is retried every agent_retry_s). Raises Abandoned."""
        self.scheduler = scheduler
        for link in self.links.values():
            link.thread.start()
        deadline = time.monotonic() + timeout_s
        self.waker.wait_for(lambda: all(link.tried.is_set() for link in self.links.values()),
                            deadline)
        down = [n for n, link in self.links.items() if link.state != "up"]
        if down:
            log.warning("nodes without an agent yet: %s; their models go elsewhere",
                        ", ".join(down))

    def stop(self) -> None:
        for link in self.links.values():
            link.stopping.set()
        for link in self.links.values():
            if link.thread.is_alive():
                link.thread.join(POLL_S + 1.0)
        ray.shutdown()

    def instance(self, name: str, model: ModelConfig) -> RemoteInstance:
        remote = self.instances[name] = RemoteInstance(name, model, self)
        return remote

    def take_over(self, node: str, host: str, running: list[Running]) -> None:
        """What an agent runs when the head (re)connects: a ready child of a model that may
        run there, with the config it has now, is adopted; any other is stopped."""
        for r in running:
            remote = self.instances.get(r.model)
            why = ("it is not a model of this corral's on this node"
                   if remote is None or node not in (remote.model.nodes or [])
                   else "its config changed" if digest(remote.model) != r.digest
                   else "it was still loading" if not r.ready
                   else None)
            if why is None and remote is not None and remote.adopt(r.generation, node):
                log.info("node %s: adopting %s#%d (pid %d, port %d)", node, r.model,
                         r.generation, r.pid, r.port)
                devices = [on_node(node, d) for d in r.devices] if r.devices else None
                self.scheduler.tell(InstanceAdopted(r.model, r.generation, r.pid, host, r.port,
                                                    devices, node, r.key))
                continue
            log.info("node %s: stopping %s#%d (pid %d), not adopted: %s", node, r.model,
                     r.generation, r.pid, why or "the model runs elsewhere")
            if remote is not None:  # its next generation is a later one than this child's
                self.scheduler.tell(InstanceSeen(r.model, r.generation))
            self.send(node, r.model, StopInstance(r.generation, "not adopted"))

    def describe(self) -> list[dict[str, Any]]:
        """GET /nodes: each node's agent, its address, since when it is in its state, its
        last device report and the models running there."""
        return [{"node": node, "state": link.state, "address": link.host,
                 "since": round(link.since, 3),
                 "last_report": (round(self.hub.reported_at[node], 3)
                                 if node in self.hub.reported_at else None),
                 "models": sorted(name for name, r in self.instances.items()
                                  if r.node == node)}
                for node, link in self.links.items()]

    def find_node(self, selector: str) -> dict[str, Any] | None:
        """The live Ray node with a custom resource or a label named `selector`."""
        nodes: list[dict[str, Any]] = cast(Any, ray).nodes()  # untyped in ray
        for node in nodes:
            if node.get("Alive") and (selector in node.get("Resources", {})
                                      or selector in (node.get("Labels") or {}).values()):
                return dict(node)
        return None

    def is_up(self, node: str) -> bool:
        """Whether `node`'s agent is up now (where to place is the policy's choice)."""
        link = self.links.get(node)
        return link is not None and link.state == "up"

    def tell(self, message: NodeChanged) -> None:
        """Tell the Scheduler a node fact (dropped once it has stopped)."""
        try:
            self.scheduler.tell(message)
        except pykka.ActorDeadError:
            pass

    def send(self, node: str, model: str, message: Any) -> None:
        self.links[node].send(model, message)

    def deliver(self, node: str, batch: Batch) -> None:
        for message in batch.messages:
            if isinstance(message, DevicesReported):
                self.hub.reported(node, message.report)
                continue
            if isinstance(message, InstanceExited) and message.model in self.instances:
                self.instances[message.model].exited(node, message.generation)
            if isinstance(message, Measured):  # the node's devices, by their cluster names
                message = msgspec.structs.replace(
                    message, min=renamed(message.min, node),
                    max=renamed(message.max, node))
            try:
                self.scheduler.tell(message)
            except pykka.ActorDeadError:
                return  # the head is stopping
        for model, line in batch.lines:
            ring = self.logs.get(model)
            if ring is not None:
                ring.append(line)
        if batch.dropped_lines:
            log.warning("%d lines of child output were dropped before they reached the head",
                        batch.dropped_lines)
        if batch.skipped:
            log.error("node %s: messages %s from this head never reached its agent (it "
                      "went on without them after a wait)", node, batch.skipped)

    def node_lost(self, node: str, why: str) -> None:
        self.hub.lost(node)  # first: nothing may be placed there once its models fail
        for remote in self.instances.values():
            remote.node_lost(node, why)


