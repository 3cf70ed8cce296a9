"""A node's side: the NodeAgent Ray actor, its ModelInstances and their Outbox."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import pykka

from ..config.model import Config, ConfigError
from ..config.paths import folder_name
from ..instance.actor import ModelInstance
from ..instance.health import Liveness
from ..ledger import MiB
from ..messages import (
    CancelDownload,
    ForgetDownload,
    FromNode,
    InstanceExited,
    InstanceReady,
    InstanceStarted,
    InstanceWoken,
    MeasureModel,
    Remember,
    Running,
    StartDownload,
    StartInstance,
    StopInstance,
    SuspendInstance,
    TrackModel,
)
from .fetch import NodeFetches
from .outbox import ForwardedRing, Outbox
from .wire import (
    GAP_S,
    Batch,
    ToAgent,
    digest,
)

if TYPE_CHECKING:
    from ..device import DeviceMonitor
    from ..measure import MeasureWorker

log = logging.getLogger("corral.cluster")


class Child(msgspec.Struct):
    """One child on this node, as its agent knows it: from the StartInstance it handed on
    and the facts the child's ModelInstance has sent since."""

    generation: int
    digest: str
    """Of the config it was started with."""
    devices: list[str] | None
    pid: int | None = None
    """From InstanceStarted (None: not spawned yet)."""
    port: int = 0
    ready: bool = False
    key: str | None = None
    """The key it requires (InstanceReady.upstream_key)."""
    suspended: bool = False
    """Told to suspend, and not woken since (Running.suspended)."""


class Tap:
    """The node's ModelInstances' `scheduler`: each fact goes to `learn` (the agent's table
    of children), then to the Outbox for the head."""

    def __init__(self, learn: Callable[[FromNode], None], outbox: Outbox) -> None:
        self.learn = learn
        self.outbox = outbox

    def tell(self, message: FromNode) -> None:
        self.learn(message)
        self.outbox.tell(message)


class NodeAgent:
    """corral's side of one node: a ModelInstance per model placed here, their children,
    the node's DeviceMonitor, and the Outbox the head polls. Runs as a detached, named Ray
    actor pinned to its node (threaded, so `poll` can wait while `tell` runs). Children
    are forked by the ModelInstances' own threads, which live as long as this process:
    they die with it (PR_SET_PDEATHSIG), as on one machine. It outlives its head: the
    next head `attach`es, with its own config. What runs here it learns from the facts
    its instances send (`Tap`), never by asking them."""

    def __init__(self, node: str, host: str, config: bytes) -> None:
        from ..runtime.timers import Timers

        logging.basicConfig(level=logging.INFO,
                            format=f"%(asctime)s %(levelname)s {node} %(name)s: %(message)s")
        self.node = node
        self.host = host
        self.outbox = Outbox()
        self.tap = Tap(self.learn, self.outbox)
        self.timers = Timers()
        self.instances: dict[str, pykka.ActorRef[ModelInstance]] = {}
        self.serving: dict[str, int] = {}
        """Model -> the generation its instance in `instances` was last told to start."""
        self.children: dict[tuple[str, int], Child] = {}
        """(model, generation) -> a child started here and not yet reported exited."""
        self.retired: list[tuple[pykka.ActorRef[ModelInstance], str, int]] = []
        """Instances replaced while their child (model, generation) still stopped (a new
        head's start); each is stopped once that child has exited."""
        self.lock = threading.Lock()
        # Not an actor: it is the Ray boundary itself. Ray runs this actor's calls on up to
        # 8 threads, and the instances report on theirs: the lock puts the head's messages
        # back in its order and guards `children`; nothing under it waits on an instance.
        self.epoch = 0
        """Counted up at each `attach`: only the messages of the latest head are taken."""
        self.next_seq = 0
        self.pending: dict[int, ToAgent] = {}
        """Messages that came before one with a lower number (Ray ran them early)."""
        self.gap_since: float | None = None
        """Since when `next_seq` is missing while later ones wait (None: no gap)."""
        self.gap_s = GAP_S
        self.monitor: pykka.ActorRef[DeviceMonitor] | None = None
        self.measurer: pykka.ActorRef[MeasureWorker] | None = None
        """Measures the models placed here, on this node's devices (R-5.3)."""
        self.device_names: list[str] = []
        """The devices the monitor watches (what a measurement names)."""
        self.config = Config()
        self.fetches = NodeFetches(node, self.outbox.tell)
        """The downloads the head asks of this node (downloads.nodes)."""
        self._configure(config)

    def _configure(self, data: bytes) -> None:
        from ..device import DeviceMonitor, discover
        from ..measure import MeasureWorker

        top = msgspec.msgpack.decode(data, type=Config)
        # Simulated devices are this node's own: their ledger must not be another's.
        config = msgspec.structs.replace(
            top, simulated_ledger_dir=str(top.sim_ledger_path() / folder_name(self.node)))
        changed = (config.memory_accounting, config.devices, config.device_poll_s) != (
            self.config.memory_accounting, self.config.devices, self.config.device_poll_s)
        if self.monitor is not None and changed:
            self.monitor.stop()
            self.monitor = None
        if self.measurer is not None:  # a new head's config: measure as it says
            self.measurer.stop()
            self.measurer = None
        self.config = config
        if self.monitor is None:  # always, as on corral's own machine: its host RAM is
            # the suspended tier's, memory accounting or not
            try:
                backends = discover(config)
            except ConfigError as e:
                log.error("%s: no device monitor: %s", self.node, e)
                backends = []
            self.device_names = sorted(d.name for b in backends for d in b.sample())
            self.monitor = DeviceMonitor.start(backends, self.outbox, self.timers,
                                               config.device_poll_s, self._crashed)
        if config.memory_accounting:
            self.measurer = MeasureWorker.start(config, self.outbox, self.timers,
                                                self.device_names, self._crashed)

    def _instance(self, model: str, start: StartInstance) -> pykka.ActorRef[ModelInstance]:
        """The model's ModelInstance, a new one if the last still has a child that an
        earlier head left (it finishes stopping on its own). Holds `lock`."""
        ref = self.instances.get(model)
        if ref is not None and (model, self.serving[model]) in self.children:
            self.retired.append((ref, model, self.serving[model]))
            ref = None
        if ref is None:
            top = self.config
            ref = self.instances[model] = ModelInstance.start(
                model, start.config, self.tap, self.timers, ForwardedRing(model, self.outbox),
                self._crashed, extra_env=top.child_env(),
                liveness=lambda m: Liveness(top.liveness_of(m), top.liveness_failures),
                host=self.host, prompt_cache=(
                    top.state_path() / "nodes" / folder_name(self.node) / "prompt-cache",
                    int(top.prompt_cache_max_mib * MiB)))
        for old in [r for r in self.retired if (r[1], r[2]) not in self.children]:
            self.retired.remove(old)
            old[0].stop(block=False)
        self.serving[model] = start.generation
        self.children[(model, start.generation)] = Child(
            generation=start.generation, digest=digest(start.config), devices=start.devices)
        return ref

    def learn(self, message: FromNode) -> None:
        """A fact from one of this node's instances (on its thread), for the table."""
        with self.lock:
            match message:
                case InstanceStarted(model=model, generation=generation, pid=pid):
                    if (child := self.children.get((model, generation))) is not None:
                        child.pid = pid  # again after a bind retry, with the new pid
                case InstanceReady(model=model, generation=generation, port=port,
                                   upstream_key=key):
                    if (child := self.children.get((model, generation))) is not None:
                        child.port, child.ready, child.key = port, True, key
                case InstanceWoken(model=model, generation=generation, ok=True):
                    if (child := self.children.get((model, generation))) is not None:
                        child.suspended = False
                case InstanceExited(model=model, generation=generation):
                    self.children.pop((model, generation), None)
                case _:
                    pass

    def _crashed(self, actor: str, error: BaseException) -> None:
        log.critical("%s: actor %s died (%s)", self.node, actor, error)

    def hello(self) -> dict[str, str | int]:
        return {"node": self.node, "host": self.host, "pid": os.getpid()}

    def attach(self, config: bytes) -> dict[str, str | int]:
        """A head (re)connects: its config from now on, and nothing kept for the last
        head. Returns `hello()` with the new `epoch`, which every message of this head
        carries; its messages are counted from 0 in that epoch (R11)."""
        with self.lock:
            self._configure(config)
            self.epoch += 1
            self.next_seq, self.pending, self.gap_since = 0, {}, None
            self.outbox.clear()
            epoch = self.epoch
        return {**self.hello(), "epoch": epoch}

    def running(self) -> bytes:
        """The children running here, for a new head to adopt or stop (msgpack)."""
        with self.lock:
            found = [Running(model=model, generation=generation, pid=child.pid,
                             port=child.port, ready=child.ready, digest=child.digest,
                             devices=child.devices, key=child.key, suspended=child.suspended)
                     for (model, generation), child in self.children.items()
                     if child.pid is not None and self.serving.get(model) == generation]
        return msgspec.msgpack.encode(found)

    def tell(self, data: bytes) -> None:
        envelope = msgspec.msgpack.decode(data, type=ToAgent)
        with self.lock:  # in the head's order, whatever order Ray ran the calls in
            if envelope.epoch != self.epoch:
                log.warning("%s: dropped a message of epoch %d (now %d): a head that has "
                            "gone, or that has reconnected since", self.node, envelope.epoch,
                            self.epoch)
                return
            if envelope.seq < self.next_seq or envelope.seq in self.pending:
                log.warning("%s: dropped message %d of epoch %d: seen already", self.node,
                            envelope.seq, envelope.epoch)
                return
            self.pending[envelope.seq] = envelope
            self._hand_on_in_order()

    def _hand_on_in_order(self) -> None:
        """Hand on every message next in sequence; note when a gap opens. Holds `lock`."""
        while (next_one := self.pending.pop(self.next_seq, None)) is not None:
            self.next_seq += 1
            self._hand_on(next_one)
        if not self.pending:
            self.gap_since = None
        elif self.gap_since is None:
            self.gap_since = time.monotonic()

    def _close_gap(self) -> None:
        """A message missing for gap_s is taken as lost: the later ones are handed on
        without it, and the head is told which numbers it never got (R11)."""
        with self.lock:
            if self.gap_since is None or time.monotonic() - self.gap_since < self.gap_s:
                return
            first = min(self.pending)
            lost = list(range(self.next_seq, first))
            log.error("%s: messages %s of epoch %d never arrived within %g s; going on "
                      "without them", self.node, lost, self.epoch, self.gap_s)
            self.outbox.skipped(lost)
            self.next_seq, self.gap_since = first, None
            self._hand_on_in_order()

    def _hand_on(self, envelope: ToAgent) -> None:
        message = envelope.message
        if isinstance(message, TrackModel):
            if self.monitor is not None:
                self.monitor.tell(message)
        elif isinstance(message, MeasureModel | Remember):
            if self.measurer is not None:
                self.measurer.tell(message)
        elif isinstance(message, StartInstance):
            self._instance(envelope.model, message).tell(message)
        elif isinstance(message, StartDownload | CancelDownload | ForgetDownload):
            self.fetches.order(self.config, envelope.model, message)
        elif (ref := self.instances.get(envelope.model)) is not None:
            child = self.children.get((envelope.model, message.generation))
            if isinstance(message, StopInstance) and child is not None:
                child.ready = False  # stopping: a new head must not adopt it as serving
            if isinstance(message, SuspendInstance) and child is not None:
                child.suspended = True  # nor one that is asleep, or going to sleep
            ref.tell(message)

    def poll(self, timeout_s: float, epoch: int | None = None) -> bytes:
        """What happened since the last poll (a Batch), waiting at most `timeout_s` for
        something; a poll of an earlier epoch is told it has been superseded."""
        if epoch is not None and epoch != self.epoch:
            return msgspec.msgpack.encode(Batch(superseded=True))
        self._close_gap()
        wait_s = timeout_s if self.gap_since is None else min(timeout_s, self.gap_s)
        batch = self.outbox.take(wait_s)
        self._close_gap()
        return msgspec.msgpack.encode(batch)

    def wake(self, epoch: int) -> None:
        """The head of `epoch` stops: its poll under way returns now."""
        if epoch == self.epoch:
            self.outbox.nudge()

    def child_pids(self) -> dict[str, int]:
        """The running children's pids by model (for tests)."""
        with self.lock:
            return {model: child.pid for (model, generation), child in self.children.items()
                    if child.pid is not None and self.serving.get(model) == generation}
