"""The head's links to the nodes (a thread per agent), the Scheduler's stand-in ref for a
model on nodes, and the Cluster the Supervisor holds."""

from __future__ import annotations

import logging
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import msgspec
import pykka
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..base import CrashHandler, tell_or_drop
from ..childproc import LogRing
from ..config.model import Config, ModelConfig
from ..downloads.registry import folder_of
from ..messages import (
    CancelDownload,
    ClusterHeadMessage,
    ForDownload,
    ForgetDownload,
    ForModel,
    HeadAttached,
    Inbox,
    InstanceMessage,
    MeasureMessage,
    MonitorMessage,
    NodeBatch,
    NodeDownload,
    NodeLost,
    NodeUnreachable,
    NodeUp,
    RemoteModel,
    Running,
    SchedulerMessage,
    StartDownload,
)
from ..runtime.timers import Timers
from .agent import NodeAgent
from .head import ClusterHead
from .join import Waker, join
from .placed import Shown
from .wire import AGENT_PREFIX, POLL_S, Batch

log = logging.getLogger("corral.cluster")


def find_node(selector: str) -> dict[str, Any] | None:
    """The live Ray node with a custom resource or a label named `selector`."""
    nodes: list[dict[str, Any]] = cast(Any, ray).nodes()  # untyped in ray
    for node in nodes:
        if node.get("Alive") and (selector in node.get("Resources", {})
                                  or selector in (node.get("Labels") or {}).values()):
            return dict(node)
    return None


class AgentLink:
    """The head's link to one node's agent: creates (or finds) it and long-polls it on its
    own thread. It decides nothing: what it learns goes to the ClusterHead as NodeUp,
    NodeBatch, NodeLost or NodeUnreachable."""

    def __init__(self, node: str, config: Config, agent_config: bytes,
                 head: Inbox[ClusterHeadMessage], waker: Waker) -> None:
        self.node = node
        self.config = config.cluster
        self.agent_config = agent_config
        self.head = head
        self.waker = waker
        self.reached = False
        """Whether the first attempt reached the agent (read once `tried` is set)."""
        self.tried = threading.Event()
        """Set once the first attempt to reach the agent is over, either way."""
        self.stopping = threading.Event()
        self.handle: Any = None
        """The agent's handle while it is up (for `wake`), and its epoch."""
        self.epoch = 0
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"agent-link-{node}")

    def _connect(self) -> tuple[Any, int] | None:
        """Attach to the agent (starting it if need be) and post NodeUp: its handle and
        epoch, or None if there is none to reach."""
        found = find_node(self.node)
        if found is None:
            log.warning("node %s: no live Ray node has a resource or label %r", self.node,
                        self.node)
            return None
        host = self.config.advertise.get(self.node) or found["NodeManagerAddress"]
        actor = ray.remote(NodeAgent).options(
            name=AGENT_PREFIX + self.node, namespace=self.config.namespace,
            lifetime="detached", get_if_exists=True, num_cpus=0, num_gpus=0,
            max_concurrency=8, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(found["NodeID"], soft=False))
        handle: Any = actor.remote(self.node, host, self.agent_config)
        hello = ray.get(handle.attach.remote(self.agent_config), timeout=60)
        if "epoch" not in hello:  # an agent of a corral from before epochs (issue 19)
            log.warning("node %s: its agent runs an older corral; stopping it and its "
                        "children to start this corral's", self.node)
            ray.kill(handle)
            return None
        epoch = int(hello["epoch"])
        running = msgspec.msgpack.decode(ray.get(handle.running.remote(), timeout=60),
                                         type=list[Running])
        log.info("node %s: agent up (pid %d on %s), %d children running", self.node,
                 hello["pid"], hello["host"], len(running))
        tell_or_drop(self.head, NodeUp(node=self.node, host=hello["host"], handle=handle,
                                       epoch=epoch, running=running))
        return handle, epoch

    def wake(self) -> None:
        """The link stops: its agent ends the poll under way now, not at POLL_S."""
        handle = self.handle
        if handle is not None:
            try:
                handle.wake.remote(self.epoch)
            except Exception as e:  # (an agent gone, or Ray's driver stopping)
                log.debug("node %s: no wake for its poll: %s", self.node, e)

    def _run(self) -> None:
        retry_s = self.config.agent_retry_s
        handle: Any = None
        epoch = 0
        while not self.stopping.is_set():
            if handle is None:
                try:
                    connected = self._connect()
                except (ray.exceptions.RayError, TimeoutError) as e:
                    log.warning("node %s: cannot start its agent: %s", self.node, e)
                    connected = None
                if connected is None:
                    tell_or_drop(self.head, NodeUnreachable(node=self.node))
                else:
                    handle, epoch = connected
                    self.handle, self.epoch = handle, epoch
                if not self.tried.is_set():
                    self.reached = connected is not None
                self.tried.set()
                self.waker.wake()
                if handle is None:
                    self.stopping.wait(retry_s)
                    continue
            try:
                data = ray.get(handle.poll.remote(POLL_S, epoch))
            except ray.exceptions.RayError as e:
                if self.stopping.is_set():
                    return
                why = f"the agent on node {self.node} died ({type(e).__name__})"
            else:
                batch = msgspec.msgpack.decode(data, type=Batch)
                if not batch.superseded:
                    tell_or_drop(self.head, NodeBatch(
                        node=self.node, messages=batch.messages, lines=batch.lines,
                        dropped_lines=batch.dropped_lines, skipped=batch.skipped))
                    continue
                why = (f"another corral attached to the agent on node {self.node} (Ray "
                       f"namespace {self.config.namespace}); run one corral per namespace")
            handle = None
            tell_or_drop(self.head, NodeLost(node=self.node, why=why))
            self.stopping.wait(retry_s)


class RemoteInstance:
    """The Scheduler's ref for a model with `nodes`, in place of a ModelInstance: what it
    is told goes to the ClusterHead, with the model's name. It holds nothing else."""

    def __init__(self, model: str, head: Inbox[ClusterHeadMessage]) -> None:
        self.model = model
        self.head = head

    def tell(self, message: InstanceMessage) -> None:
        self.head.tell(ForModel(model=self.model, message=message))

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """The Supervisor stops its actors at the end: Cluster.stop stops the head."""


def child_key() -> str:
    """A fresh key for a head's children: 256 random bits in hex. It goes on a child's
    command line after its key flag, so it must never look like an option: one urlsafe
    key in 64 began with "-", and argparse (the demo child) or llama-server then refused
    the command line (every child of that head "exited with status 2")."""
    return secrets.token_hex(32)


def agent_config(config: Config) -> Config:
    """What the agents get: the head's config without its clients' keys of any kind (R8,
    issue 37 S13: Ray keeps an actor's arguments in its GCS, and sends them in clear; a
    digest of a short key can be guessed offline, and a `key_env` or `key_file` names
    where a secret lies), and without its remote models and peers, whose keys, key
    variables and headers are the head's to send (issue 42). Agents start children; who
    may call is the head's alone, and so is what is called elsewhere."""
    # Its downloads (downloads.nodes) go where the head's would, with the head's
    # llama-server: the paths its models are served with.
    downloads = msgspec.structs.replace(
        config.downloads, dir=str(folder_of(config)), nodes=[],
        llama_server=config.downloads.llama_server or shutil.which("llama-server"))
    return msgspec.structs.replace(
        config, api_key=None, api_key_file=None, keys={}, peers={}, virtual={},
        models={name: model for name, model in config.models.items() if not model.url},
        downloads=downloads)


class Cluster:
    """The head's view of the Ray cluster, as the Supervisor holds it: joining, the
    ClusterHead actor, one AgentLink per configured node, and what the API shows."""

    def __init__(self, config: Config, logs: dict[str, LogRing]) -> None:
        self.config = config
        self.agent_config = agent_config(config)
        self.key = child_key()
        """This head's key for the children it starts on nodes: each requires it (passed
        with its server's own key flag), and the front sends it (Grant.upstream_key)."""
        self.logs = logs
        self.head: pykka.ActorRef[ClusterHead] | None = None
        self.links: dict[str, AgentLink] = {}
        self.shown = Shown()
        """What the API shows (GET /nodes, a model's node): the head publishes it."""
        self.waker = Waker()
        """Ends the startup's waits (joining, reaching the agents) when corral must stop."""
        self.download_sink: Callable[[str, NodeDownload | None], None] | None = None
        """Where the nodes' download events go (set by the API's downloads; called on the
        head's thread)."""

    def connect(self) -> None:
        """Join the Ray cluster as a driver within cluster.connect_timeout_s: raises
        ConfigError if it cannot, saying what to check; Abandoned if `abandon` is called
        meanwhile."""
        join(self.config.cluster, self.waker)
        log.info("joined the Ray cluster at %s (namespace %s); nodes %s",
                 self.config.cluster.ray_address, self.config.cluster.namespace,
                 ", ".join(self.config.cluster.nodes))

    def abandon(self) -> None:
        """corral stops during its startup: `connect` and `start` return at once, raising
        Abandoned (call from any thread but a signal handler)."""
        self.waker.abandon()

    def open(self, scheduler: Inbox[SchedulerMessage], on_crash: CrashHandler,
             timers: Timers | None = None) -> pykka.ActorRef[ClusterHead]:
        """Start the ClusterHead: from now on it takes the head's own device reports and
        its RemoteInstances' messages. Returns its ref."""
        self.head = ClusterHead.start(self.config.cluster, self.key, scheduler,
                                      self._publish, on_crash, timers, self._download_news)
        return self.head

    def _publish(self, shown: Shown) -> None:  # on the head's thread
        self.shown = shown

    def _download_news(self, node: str, news: NodeDownload | None) -> None:
        sink = self.download_sink  # on the head's thread
        if sink is not None:
            sink(node, news)

    def download(self, node: str, repo: str,
                 order: StartDownload | CancelDownload | ForgetDownload) -> None:
        """Send a download order to `node`'s agent (any thread)."""
        if self.head is not None:
            tell_or_drop(self.head, ForDownload(node=node, model=repo, order=order))

    def instance(self, name: str, model: ModelConfig) -> RemoteInstance:
        """The Scheduler's ref for `name`, which runs on `model.nodes` (after `open`)."""
        assert self.head is not None
        self.head.tell(RemoteModel(model=name, config=model, log=self.logs[name]))
        return RemoteInstance(name, self.head)

    def start(self, monitor: Inbox[MonitorMessage], measurer: Inbox[MeasureMessage],
              timeout_s: float = 60.0) -> pykka.ActorRef[ClusterHead]:
        """Reach every node's agent (starting those not there); return once each is up or
        has failed once (then it is retried every agent_retry_s), and the head has taken
        that in. Returns the head: the Scheduler's monitor and measurer, which sends each
        model's on to its node, and the others to `monitor` and `measurer`. Raises
        Abandoned."""
        head = self.head
        assert head is not None
        data = msgspec.msgpack.encode(self.agent_config)
        self.links = {node: AgentLink(node, self.config, data, head, self.waker)
                      for node in self.config.cluster.nodes}
        for link in self.links.values():
            link.thread.start()
        deadline = time.monotonic() + timeout_s
        self.waker.wait_for(lambda: all(link.tried.is_set() for link in self.links.values()),
                            deadline)
        head.ask(HeadAttached(monitor=monitor, measurer=measurer), timeout=timeout_s)
        down = [n for n, link in self.links.items() if not link.reached]
        if down:
            log.warning("nodes without an agent yet: %s; their models go elsewhere",
                        ", ".join(down))
        return head

    def stop(self) -> None:
        for link in self.links.values():
            link.stopping.set()
            link.wake()
        for link in self.links.values():
            if link.thread.is_alive():
                link.thread.join(POLL_S + 1.0)
        if self.head is not None:
            self.head.stop(block=True, timeout=5.0)
        ray.shutdown()

    def describe(self) -> list[dict[str, object]]:
        """GET /nodes: each node's agent, its address, since when it is in its state, its
        last device report and the models running there."""
        return self.shown.nodes

    def node_of(self, model: str) -> str | None:
        """The node `model`'s current child runs on (None: none, or not a model on nodes)."""
        return self.shown.placed.get(model)
