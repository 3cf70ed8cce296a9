"""A node's side: the NodeAgent Ray actor, its ModelInstances and their Outbox."""

from __future__ import annotations

import collections
import logging
import os
import threading
from typing import Any

import msgspec

from ..childproc import LogRing
from ..config import Config, ConfigError, ModelConfig
from ..instance import Liveness, ModelInstance, Phase
from ..messages import (
    DevicesReported,
    MeasureModel,
    Remember,
    StartInstance,
    TrackModel,
)
from .wire import OUTBOX_LINES, Batch, FromInstance, Running, ToAgent, digest

log = logging.getLogger("corral.cluster")


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
        from ..timers import Timers

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
        self.measurer: Any = None
        """Measures the models placed here, on this node's devices (R-5.3)."""
        self.device_names: list[str] = []
        """The devices the monitor watches (what a measurement names)."""
        self.config = Config()
        self._configure(config)

    def _configure(self, data: bytes) -> None:
        from ..device import DeviceMonitor, discover
        from ..measure import MeasureWorker

        top = msgspec.msgpack.decode(data, type=Config)
        # Simulated devices are this node's own: their ledger must not be another's.
        config = msgspec.structs.replace(
            top, simulated_ledger_dir=str(top.sim_ledger_path() / self.node))
        changed = (config.memory_accounting, config.devices, config.device_poll_s) != (
            self.config.memory_accounting, self.config.devices, self.config.device_poll_s)
        if self.monitor is not None and changed:
            self.monitor.stop()
            self.monitor = None
        if self.measurer is not None:  # a new head's config: measure as it says
            self.measurer.stop()
            self.measurer = None
        self.config = config
        if not config.memory_accounting:
            return
        if self.monitor is None:
            try:
                backends = discover(config)
            except ConfigError as e:
                log.error("%s: no device monitor: %s", self.node, e)
                backends = []
            self.device_names = sorted(d.name for b in backends for d in b.sample())
            self.monitor = DeviceMonitor.start(backends, self.outbox, self.timers,
                                               config.device_poll_s, self._crashed)
        self.measurer = MeasureWorker.start(config, self.outbox, self.timers,
                                            self.device_names, self._crashed)

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
        elif isinstance(message, MeasureModel | Remember):
            if self.measurer is not None:
                self.measurer.tell(message)
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


