"""corral across machines, on a Ray cluster: the head's links and the node agents.

    head: corral serve --ray ADDR                       Ray node B
      front, API, Scheduler, policy
      RemoteInstance (one per model) --tell(bytes)-->   NodeAgent (detached actor, pinned)
      AgentLink (one per node) <--poll(): a Batch--       ModelInstance per model -> child
      front ---------------- HTTP, as to a local child ---------------> child on B's address

Ray is the control plane only: it carries the same msgspec messages as the local actors
exchange (encoded as msgpack), and no request or token. A model with `nodes` gets a
RemoteInstance in place of a ModelInstance; the Scheduler cannot tell them apart. The
agent runs the unchanged ModelInstance, whose `scheduler` is an Outbox that the head
drains with a long poll. An agent that dies (or whose node does) is a message too: every
model that ran there gets `InstanceExited(..., "node lost ...")`, and the node is avoided
until its agent is back.

Imported only when `[cluster] ray_address` is set: single-machine corral never imports Ray.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import threading
import time
from typing import Any, cast

import msgspec
import pykka
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from .childproc import LogRing
from .config import Config, ConfigError, ModelConfig
from .instance import Liveness, ModelInstance, Phase
from .ledger import DeviceSample
from .messages import (
    DeviceReport,
    DevicesReported,
    InstanceAdopted,
    InstanceExited,
    InstanceReady,
    InstanceReported,
    InstanceSeen,
    InstanceStarted,
    LivenessMiss,
    StartInstance,
    StopInstance,
    TrackModel,
    Unhealthy,
)
from .policy.memory import node_of

log = logging.getLogger("corral.cluster")

POLL_S = 2.0
"""How long an agent holds the head's poll when it has nothing to say."""
OUTBOX_LINES = 20_000
"""Child output an agent keeps for the head between two polls; older lines are dropped."""
AGENT_PREFIX = "corral-agent-"


class ToAgent(msgspec.Struct, frozen=True):
    """Head -> agent: one message for one model's ModelInstance (or the node's monitor).
    `seq` counts from 0 per head: a threaded Ray actor may run calls out of order, so the
    agent puts them back in order before handing them on."""

    seq: int
    model: str
    message: StartInstance | StopInstance | LivenessMiss | TrackModel


FromInstance = (InstanceStarted | InstanceReady | InstanceReported | InstanceExited | Unhealthy
                | DevicesReported)


class Running(msgspec.Struct, frozen=True):
    """Agent -> a new head: a child running on the node, for adoption."""

    model: str
    generation: int
    pid: int
    port: int
    ready: bool
    digest: str
    """Of the model config it was started with (`digest`)."""
    devices: list[str] | None = None


def digest(config: ModelConfig) -> str:
    """Equal for equal configs, whatever the order of their tables' keys."""
    canonical = json.dumps(msgspec.to_builtins(config), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


class Batch(msgspec.Struct, frozen=True):
    """Agent -> head: what happened since the last poll."""

    messages: list[FromInstance] = []
    lines: list[tuple[str, str]] = []
    """(model, line) of child output, in order."""
    dropped_lines: int = 0


# ------------------------------------------------------------------ the agent's side


class Outbox:
    """What an agent's ModelInstances say (it is their `scheduler`), kept for the head."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._messages: list[FromInstance] = []
        self._lines: collections.deque[tuple[str, str]] = collections.deque()
        self._dropped = 0

    def tell(self, message: FromInstance) -> None:
        with self._cv:
            if isinstance(message, DevicesReported):  # only the latest one matters
                self._messages = [m for m in self._messages
                                  if not isinstance(m, DevicesReported)]
            self._messages.append(message)
            self._cv.notify_all()

    def clear(self) -> None:
        """A new head: what was kept for the last one is no news to it."""
        with self._cv:
            self._messages, self._dropped = [], 0
            self._lines.clear()

    def line(self, model: str, line: str) -> None:
        with self._cv:
            if len(self._lines) >= OUTBOX_LINES:
                self._lines.popleft()
                self._dropped += 1
            self._lines.append((model, line))
            self._cv.notify_all()

    def take(self, timeout_s: float) -> Batch:
        with self._cv:
            self._cv.wait_for(lambda: self._messages or self._lines, timeout_s)
            batch = Batch(self._messages, list(self._lines), self._dropped)
            self._messages, self._dropped = [], 0
            self._lines.clear()
            return batch


class ForwardedRing(LogRing):
    """A child's output on its node: kept a little, and passed on to the head."""

    def __init__(self, model: str, outbox: Outbox) -> None:
        super().__init__(capacity=200, backlog_bytes=0)
        self.model = model
        self.outbox = outbox

    def append(self, line: str) -> None:
        super().append(line)
        self.outbox.line(self.model, line)


class NodeAgent:
    """corral's side of one node: a ModelInstance per model placed here, their children,
    the node's DeviceMonitor, and the Outbox the head polls. Runs as a detached, named Ray
    actor pinned to its node (threaded, so `poll` can wait while `tell` runs). Children
    are forked by the ModelInstances' own threads, which live as long as this process:
    they die with it (PR_SET_PDEATHSIG), as on one machine. It outlives its head: the
    next head `attach`es, with its own config."""

    def __init__(self, node: str, host: str, config: bytes) -> None:
        from .timers import Timers

        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s {node} %(name)s: %(message)s")
        self.node = node
        self.host = host
        self.outbox = Outbox()
        self.timers = Timers()
        self.instances: dict[str, Any] = {}
        self.retired: list[Any] = []
        """Instances replaced while their child still stopped (a new head's start)."""
        self.lock = threading.Lock()
        self.next_seq = 0
        self.pending: dict[int, ToAgent] = {}
        self.monitor: Any = None
        self.config = Config()
        self._configure(config)

    def _configure(self, data: bytes) -> None:
        from .device import DeviceMonitor, discover

        top = msgspec.msgpack.decode(data, type=Config)
        # Simulated devices are this node's own: their ledger must not be another's.
        config = msgspec.structs.replace(
            top, simulated_ledger_dir=str(top.sim_ledger_path() / self.node))
        changed = (config.memory_accounting, config.devices, config.device_poll_s) != (
            self.config.memory_accounting, self.config.devices, self.config.device_poll_s)
        if self.monitor is not None and changed:
            self.monitor.stop()
            self.monitor = None
        self.config = config
        if config.memory_accounting and self.monitor is None:
            try:
                backends = discover(config)
            except ConfigError as e:
                log.error("%s: no device monitor: %s", self.node, e)
                backends = []
            self.monitor = DeviceMonitor.start(backends, self.outbox, self.timers,
                                               config.device_poll_s, self._crashed)

    def _instance(self, model: str, config: ModelConfig) -> Any:
        """The model's ModelInstance, a new one if the last is still busy with a child
        that an earlier head left (it finishes stopping on its own)."""
        ref = self.instances.get(model)
        if ref is not None and ref.proxy().phase.get(timeout=5) is not Phase.IDLE:
            self.retired.append(ref)
            ref = None
        if ref is None:
            top = self.config
            ref = self.instances[model] = ModelInstance.start(
                model, config, self.outbox, self.timers, ForwardedRing(model, self.outbox),
                self._crashed, extra_env=top.child_env(),
                liveness=lambda m: Liveness(top.liveness_of(m), top.liveness_failures),
                host=self.host)
        for old in [r for r in self.retired if r.proxy().phase.get(timeout=5) is Phase.IDLE]:
            self.retired.remove(old)
            old.stop()
        return ref

    def _crashed(self, actor: str, error: BaseException) -> None:
        log.critical("%s: actor %s died (%s)", self.node, actor, error)

    def hello(self) -> dict[str, Any]:
        return {"node": self.node, "host": self.host, "pid": os.getpid()}

    def attach(self, config: bytes) -> dict[str, Any]:
        """A head (re)connects: its config from now on, its messages counted from 0, and
        nothing kept for the last head."""
        with self.lock:
            self._configure(config)
            self.next_seq, self.pending = 0, {}
            self.outbox.clear()
        return self.hello()

    def running(self) -> bytes:
        """The children running here, for a new head to adopt or stop (msgpack)."""
        found = []
        for model, ref in list(self.instances.items()):
            instance = ref.proxy()
            child = instance.child.get(timeout=5)
            if child is None or child.returncode is not None:
                continue
            found.append(Running(
                model, instance.generation.get(timeout=5), child.pid,
                instance.port.get(timeout=5), instance.phase.get(timeout=5) is Phase.READY,
                digest(instance.config.get(timeout=5)), instance.devices.get(timeout=5)))
        return msgspec.msgpack.encode(found)

    def tell(self, data: bytes) -> None:
        envelope = msgspec.msgpack.decode(data, type=ToAgent)
        with self.lock:  # in the head's order, whatever order Ray ran the calls in
            self.pending[envelope.seq] = envelope
            while (next_one := self.pending.pop(self.next_seq, None)) is not None:
                self.next_seq += 1
                self._hand_on(next_one)

    def _hand_on(self, envelope: ToAgent) -> None:
        message = envelope.message
        if isinstance(message, TrackModel):
            if self.monitor is not None:
                self.monitor.tell(message)
        elif isinstance(message, StartInstance):
            self._instance(envelope.model, message.config).tell(message)
        elif (ref := self.instances.get(envelope.model)) is not None:
            ref.tell(message)

    def poll(self, timeout_s: float) -> bytes:
        return msgspec.msgpack.encode(self.outbox.take(timeout_s))

    def child_pids(self) -> dict[str, int]:
        """The running children's pids by model (for tests)."""
        pids = {}
        for model, ref in list(self.instances.items()):
            child = ref.proxy().child.get(timeout=5)
            if child is not None and child.returncode is None:
                pids[model] = child.pid
        return pids


# ------------------------------------------------------------------ the head's side


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
            case StartInstance(generation=generation, config=config, devices=devices):
                self.generation, self.model = generation, config
                if devices:  # placed by fit: the devices say the node
                    node = node_of(devices[0])
                    self.node = self.cluster.pick([node] if node else [], self.name)
                    message = StartInstance(generation, config,
                                            [d.rpartition("/")[2] for d in devices])
                else:
                    self.node = self.cluster.pick(config.nodes or [], self.name)
                if self.node is None:
                    self.cluster.scheduler.tell(InstanceExited(
                        self.name, generation, -1, "could not be started: no agent is up "
                        f"on {devices or config.nodes} with a free slot "
                        "(models_max_per_node)"))
                    return
                log.info("%s#%d goes to node %s", self.name, generation, self.node)
                self.cluster.send(self.node, self.name, message)
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


class AgentLink:
    """The head's link to one node's agent: creates (or finds) it, long-polls it on its own
    thread, and turns its death into `node_lost` for every model that ran there."""

    def __init__(self, cluster: Cluster, node: str) -> None:
        self.cluster = cluster
        self.node = node
        self.handle: Any = None
        self.host: str | None = None
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
        config = msgspec.msgpack.encode(cluster.config)
        handle: Any = actor.remote(self.node, host, config)
        hello = ray.get(handle.attach.remote(config), timeout=60)
        with self.send_lock:
            self.handle, self.seq = handle, 0
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
                else:
                    self.cluster.hub.absent(self.node)
                self.tried.set()
                if not up:
                    self.stopping.wait(retry_s)
                    continue
            try:
                data = ray.get(self.handle.poll.remote(POLL_S))
            except ray.exceptions.RayError as e:
                if self.stopping.is_set():
                    return
                self._lost(f"the agent on node {self.node} died ({type(e).__name__})")
                self.stopping.wait(retry_s)
                continue
            self.cluster.deliver(self.node, msgspec.msgpack.decode(data, type=Batch))

    def _lost(self, why: str) -> None:
        log.error("node %s lost: %s; its models fail, and it is avoided for %g s",
                  self.node, why, self.cluster.config.cluster.agent_retry_s)
        with self.send_lock:
            self.state, self.since, self.handle = "lost", time.time(), None
        self.cluster.node_lost(self.node, why)

    def send(self, model: str, message: Any) -> None:
        with self.send_lock:
            if self.handle is None:
                return  # lost: its models' exits are reported already
            self.handle.tell.remote(msgspec.msgpack.encode(ToAgent(self.seq, model, message)))
            self.seq += 1


class Cluster:
    """The head's view of the Ray cluster: one AgentLink per configured node."""

    def __init__(self, config: Config, logs: dict[str, LogRing]) -> None:
        self.config = config
        self.logs = logs
        self.scheduler: Any = None
        self.links = {node: AgentLink(self, node) for node in config.cluster.nodes}
        self.instances: dict[str, RemoteInstance] = {}
        self.hub = DeviceHub(self)

    def connect(self) -> None:
        """Join the Ray cluster as a driver (raises ConfigError if it cannot)."""
        address = self.config.cluster.ray_address
        try:
            ray.init(address=address, namespace=self.config.cluster.namespace,
                     log_to_driver=False, logging_level=logging.WARNING)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise ConfigError(f"cluster.ray_address: cannot join the Ray cluster at "
                              f"{address}: {e}") from None
        log.info("joined the Ray cluster at %s (namespace %s); nodes %s", address,
                 self.config.cluster.namespace, ", ".join(self.links))

    def start(self, scheduler: Any, timeout_s: float = 60.0) -> None:
        """Reach every node's agent (starting those not there); return once each is up or
        has failed once (then it is retried every agent_retry_s)."""
        self.scheduler = scheduler
        for link in self.links.values():
            link.thread.start()
        deadline = time.monotonic() + timeout_s
        for link in self.links.values():
            link.tried.wait(max(0.0, deadline - time.monotonic()))
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
                devices = [f"{node}/{d}" for d in r.devices] if r.devices else None
                self.scheduler.tell(InstanceAdopted(r.model, r.generation, r.pid, host, r.port,
                                                    devices))
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

    def pick(self, nodes: list[str], model: str) -> str | None:
        """The first of `nodes` whose agent is up and that runs fewer than
        models_max_per_node children (what the policy checks itself when it places)."""
        cap = self.config.models_max_per_node

        def room(node: str) -> bool:
            return not cap or sum(r.node == node for name, r in self.instances.items()
                                  if name != model) < cap
        return next((n for n in nodes if n in self.links and self.links[n].state == "up"
                     and room(n)), None)

    def send(self, node: str, model: str, message: Any) -> None:
        self.links[node].send(model, message)

    def deliver(self, node: str, batch: Batch) -> None:
        for message in batch.messages:
            if isinstance(message, DevicesReported):
                self.hub.reported(node, message.report)
                continue
            if isinstance(message, InstanceExited) and message.model in self.instances:
                self.instances[message.model].exited(node, message.generation)
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

    def node_lost(self, node: str, why: str) -> None:
        self.hub.lost(node)  # first: nothing may be placed there once its models fail
        for remote in self.instances.values():
            remote.node_lost(node, why)


def on_node(node: str, report: DeviceReport) -> DeviceReport:
    """A node's report with its devices named `node/device`."""
    def named(device: str) -> str:
        return f"{node}/{device}"
    return DeviceReport(
        devices=[msgspec.structs.replace(d, name=named(d.name)) for d in report.devices],
        managed={named(d): n for d, n in report.managed.items()},
        usage={m: {named(d): n for d, n in use.items()} for m, use in report.usage.items()},
        tracked=report.tracked, backends=[f"{node}:{b}" for b in report.backends],
        ready=report.ready)


def merged(reports: list[DeviceReport]) -> DeviceReport:
    usage: dict[str, dict[str, int]] = {}
    for r in reports:
        for model, use in r.usage.items():
            usage.setdefault(model, {}).update(use)
    return DeviceReport(
        devices=[d for r in reports for d in r.devices],
        managed={d: n for r in reports for d, n in r.managed.items()},
        usage=usage, tracked=sorted({m for r in reports for m in r.tracked}),
        backends=sorted({b for r in reports for b in r.backends}),
        ready=sorted({m for r in reports for m in r.ready or []}))


class DeviceHub:
    """Between the device monitors and the Scheduler: the head's own monitor and every
    node's report here, and the Scheduler gets one report of all devices (a node's named
    `node/device`), as from a single monitor. The Scheduler's TrackModel goes to the
    monitor of the node the model runs on. A lost node's devices are reported empty until
    it is back, so nothing is placed there."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.local: Any = None
        """The head's own DeviceMonitor."""
        self.reports: dict[str | None, DeviceReport] = {}
        self.reported_at: dict[str, float] = {}
        """When each node last reported its devices (wall clock)."""
        self.lock = threading.Lock()

    def tell(self, message: Any) -> None:
        match message:
            case DevicesReported(report=report):  # from the head's own monitor
                self._update(None, report)
            case TrackModel(model=model):
                remote = self.cluster.instances.get(model)
                if remote is None:
                    if self.local is not None:
                        self.local.tell(message)
                elif remote.node is not None:
                    self.cluster.send(remote.node, model, message)

    def absent(self, node: str) -> None:
        """A node whose agent could not be reached yet: a device with no memory stands for
        it, so its models are told it cannot be placed rather than left waiting."""
        with self.lock:
            if node in self.reports:
                return
        self._update(node, DeviceReport(
            devices=[DeviceSample(f"{node}/unreachable", "device", 0, 0, "cluster")],
            managed={}, usage={}, tracked=[], backends=[], ready=[]))

    def reported(self, node: str, report: DeviceReport) -> None:
        self.reported_at[node] = time.time()
        self._update(node, on_node(node, report))

    def lost(self, node: str) -> None:
        with self.lock:
            last = self.reports.get(node)
        if last is not None:
            self._update(node, DeviceReport(
                devices=[DeviceSample(d.name, d.kind, 0, 0, d.backend) for d in last.devices],
                managed={}, usage={}, tracked=[], backends=last.backends, ready=[]))

    def _update(self, source: str | None, report: DeviceReport) -> None:
        with self.lock:
            self.reports[source] = report
            whole = merged(list(self.reports.values()))
        if self.cluster.scheduler is not None:
            self.cluster.scheduler.tell(DevicesReported(whole))
