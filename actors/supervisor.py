"""The actor system of one corral: start in order, lease models, stop in reverse (R-1.6, R-7.1)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import msgspec
import pykka

from .childproc import LogRing
from .config.keys import tenants_of
from .config.model import Config, ConfigError, ModelConfig
from .config.reload import same_child
from .config.rules import alternate_name
from .device import DeviceMonitor, discover
from .instance.actor import ModelInstance
from .instance.health import Liveness
from .ledger import MiB
from .measure import MeasureWorker
from .messages import (
    Acquire,
    Cancel,
    Event,
    Grant,
    Inbox,
    InstanceMessage,
    InstancesAttached,
    MeasureMessage,
    MonitorMessage,
    Reconfigure,
    Refusal,
    Release,
    ReloadSummary,
    Revoke,
    SchedulerMessage,
    Shutdown,
    Subscribe,
    WatchGrants,
    Withdraw,
)
from .runtime.bridge import Fanout, ThreadReply, acquire
from .runtime.timers import Timers
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .cluster import Cluster

log = logging.getLogger("corral")
A = TypeVar("A", bound=pykka.Actor)


class LeaseError(Exception):
    """A lease was refused; `status` is the HTTP status the front would have answered."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.status = refusal.status
        self.refusal = refusal


def _granted(answer: object) -> Grant:
    if isinstance(answer, Refusal):
        raise LeaseError(answer)
    assert isinstance(answer, Grant)
    return answer


class Supervisor:
    """Runs corral's actors inside the calling program, with or without the HTTP front.

        sup = Supervisor(config, on_event=print)
        sup.start()
        with sup.lease("chat") as base_url:
            ...  # the model stays loaded, and is not evicted, inside the block
        sup.stop()
    """

    def __init__(self, config: Config, *, on_event: Callable[[Event], None] | None = None,
                 on_crash: Callable[[str, BaseException], None] | None = None) -> None:
        """`on_event` runs on a corral thread: hand the event on, do not block in it.

        `on_crash(actor_name, exception)` is called once if an actor dies; the default
        logs it. After a crash, stop() the supervisor.
        """
        self.config = config
        self._on_event = on_event
        self._on_crash = on_crash
        self.crashed = threading.Event()
        self.logs = {name: LogRing() for name in config.instances()}
        """Each model's recent child output (GET /models/logs)."""
        self.timers: Timers | None = None
        self.scheduler: pykka.ActorRef[Scheduler] | None = None
        self.monitor: pykka.ActorRef[DeviceMonitor] | None = None
        self.measurer: pykka.ActorRef[MeasureWorker] | None = None
        self.instances: dict[str, Inbox[InstanceMessage]] = {}
        self.cluster: Cluster | None = None
        """With [cluster] ray_address: the links to the Ray nodes (actors/cluster/)."""
        self.started: list[Callable[[], object]] = []
        """How to stop each part, in the order they were started (OTP's child specs):
        `stop` runs them in reverse."""

    @property
    def scheduler_ref(self) -> pykka.ActorRef[Scheduler]:
        """The Scheduler's ref; pykka.ActorDeadError before start() and after stop(), as
        from a stopped actor (the front and the API answer 503 to it)."""
        if self.scheduler is None:
            raise pykka.ActorDeadError("corral is not running")
        return self.scheduler

    def _crash(self, actor: str, error: BaseException) -> None:
        if self.crashed.is_set():
            return
        self.crashed.set()
        log.critical("actor %s died (%s); corral must shut down", actor, error)
        if self._on_crash is not None:
            try:
                self._on_crash(actor, error)
            except Exception:  # the embedding app's callback: never into an actor
                log.exception("the on_crash callback raised")

    def start(self) -> None:
        """Start the timers, the Scheduler, the DeviceMonitor, the MeasureWorker, then one
        ModelInstance per model. Raises ConfigError if a device cannot be used."""
        config = self.config
        backends = discover(config)  # raises ConfigError before anything has started
        remote = sorted(name for name, m in config.models.items() if m.nodes)
        named = ([f"models {', '.join(remote)} name nodes"] if remote else []) + (
            ["[downloads] nodes is set"] if config.downloads.nodes else [])
        if named and config.cluster.ray_address is None:
            raise ConfigError(f"{' and '.join(named)}; join a Ray cluster with [cluster] "
                              "ray_address or --ray ADDRESS")
        if config.cluster.ray_address is not None:
            from .cluster import Cluster  # Ray only when asked for

            self.cluster = cluster = Cluster(config, self.logs)
            cluster.connect()  # a join that fails or is abandoned has nothing to stop
            self.started.append(cluster.stop)  # stopped last: the monitor reports to it
        self.timers = timers = Timers()
        self.started.append(timers.stop)
        self.scheduler = scheduler = self._started(
            Scheduler.start(config, self._crash, timers))
        if self._on_event is not None:
            scheduler.tell(Subscribe(sink=self._on_event))
        device_names = sorted(d.name for b in backends for d in b.sample())
        # In a cluster the head merges this machine's report with the nodes' ones.
        reports_to: Inbox[SchedulerMessage] = (scheduler if self.cluster is None else
                                               self.cluster.open(scheduler, self._crash, timers))
        self.monitor = self._started(DeviceMonitor.start(
            backends, reports_to, timers, config.device_poll_s, self._crash))
        self.measurer = self._started(MeasureWorker.start(
            config, scheduler, timers, device_names, self._crash))
        for name, model in config.instances().items():  # a model's copies each have one
            self.instances[name] = self._start_instance(name, model)
            if (model.nodes and self.cluster is not None) or model.ctx == "fit":
                alternate = alternate_name(name)  # where a drain moves it, or it grows
                self.instances[alternate] = self._start_instance(alternate, model)
        monitor: Inbox[MonitorMessage] = self.monitor
        measurer: Inbox[MeasureMessage] = self.measurer
        if self.cluster is not None:  # TrackModel and measuring go to the model's node
            monitor = measurer = self.cluster.start(self.monitor, self.measurer)
        scheduler.tell(InstancesAttached(instances=dict(self.instances), monitor=monitor,
                                         measurer=measurer))
        memory = (f"memory margin {config.memory_margin_mib:g} MiB on "
                  f"{', '.join(device_names) or 'no device'}"
                  if config.memory_accounting else "memory accounting off")
        log.info("corral started: %d models, models_max %d, %s", len(config.models),
                 config.models_max, memory)

    def _started(self, ref: pykka.ActorRef[A]) -> pykka.ActorRef[A]:
        self.started.append(partial(ref.stop, block=True, timeout=5.0))
        return ref

    def _start_instance(self, name: str, model: ModelConfig) -> Inbox[InstanceMessage]:
        self.logs.setdefault(name, LogRing())
        config = self.config
        if model.nodes and self.cluster is not None:
            return self.cluster.instance(name, model)  # stopped with the cluster's head
        assert self.scheduler is not None and self.timers is not None
        return self._started(ModelInstance.start(
            name, model, self.scheduler, self.timers, self.logs[name], self._crash,
            extra_env=config.child_env(), router_port=config.port,
            liveness=lambda m: Liveness(config.liveness_of(m), config.liveness_failures),
            prompt_cache=(config.state_path() / "prompt-cache",
                          int(config.prompt_cache_max_mib * MiB))))

    def reload(self, config: Config, timeout_s: float = 10.0) -> ReloadSummary:
        """Make `config`'s model table the live one (R-2.6): new models appear, removed
        ones are unloaded, running ones whose config changed restart once idle, the rest
        keep running. Top-level settings take effect on the next start."""
        # The management API calls this on a worker thread, one reload at a time, and
        # meanwhile reads self.config and self.logs on the event loop. No read tears:
        # self.config is replaced whole (a frozen Struct) by the one assignment at the
        # end, and self.logs only gains rings (a dict insert is atomic under the GIL),
        # each before the API's alias table, replaced on the loop once this returns,
        # can name it. self.instances is read only here and in stop().
        fixed = [k for k in Config.__struct_fields__  # (peers are models now)
                 if k not in ("models", "peers") and getattr(config, k) != getattr(self.config, k)]
        if fixed:
            log.warning("reload: %s changed; that takes effect when corral restarts",
                        ", ".join(fixed))
        for name, model in config.models.items():
            old = self.config.models.get(name)
            if old is not None and (old.nodes is None) != (model.nodes is None):
                raise ConfigError(f"models.{name}.nodes: whether a model runs on cluster "
                                  "nodes changes only with a restart")
            if old is not None and bool(old.url) != bool(model.url):
                raise ConfigError(f"models.{name}: a model changes between a child (cmd) "
                                  "and a remote (url) only with a restart")
            if model.nodes and self.cluster is None:
                raise ConfigError(f"models.{name}.nodes: this corral has joined no Ray "
                                  "cluster ([cluster] ray_address, or --ray)")
        before = self.config.instances()
        for name, model in config.instances().items():
            if name not in self.instances:
                self.instances[name] = self._start_instance(name, model)
            alternate = alternate_name(name)  # where a changed child loads beside the old
            if ((model.nodes or model.ctx == "fit"
                 or (name in before and not same_child(model, before[name])))
                    and alternate not in self.instances):
                self.instances[alternate] = self._start_instance(alternate, model)
        done = ThreadReply()
        self.scheduler_ref.tell(Reconfigure(models=dict(config.models),
                                        instances=dict(self.instances), reply=done,
                                        tenants=tenants_of(config),
                                        aging_s=config.priority_aging_s,
                                        preempt=config.priority_preempt,
                                        groups=dict(config.groups)))
        summary = done.wait(timeout_s)
        if not isinstance(summary, ReloadSummary):
            raise TimeoutError(f"the scheduler did not apply the reload within {timeout_s} s")
        self.config = msgspec.structs.replace(self.config, models=config.models,
                                              groups=config.groups, virtual=config.virtual)
        return summary

    def subscribe(self, loop: asyncio.AbstractEventLoop,
                  callback: Callable[[Event], None]) -> None:
        """Call `callback(event)` on `loop` for every event from now on."""
        self.scheduler_ref.tell(Subscribe(sink=Fanout(loop, callback)))

    def watch_grants(self, loop: asyncio.AbstractEventLoop,
                     callback: Callable[[Withdraw | Revoke], None]) -> None:
        """Call `callback(notice)` on `loop` when a grant may no longer be shared
        (Withdraw) or kept idle (Revoke)."""
        self.scheduler_ref.tell(WatchGrants(sink=Fanout(loop, callback)))

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stop every child, then every part in the reverse of its start; True if all
        children exited.

        Waits at most `timeout_s` (default: the longest stop_timeout_s plus 5 s) for the
        children; actors are stopped either way, and a child still alive then dies with
        its instance's thread (PR_SET_PDEATHSIG). The one step out of the reverse order
        comes first: the Scheduler stops every child while the rest still runs.
        """
        clean = True
        if self.scheduler is not None:
            if timeout_s is None:
                timeout_s = 5.0 + max(
                    (m.stop_timeout_s for m in self.config.models.values()), default=0.0)
            done = ThreadReply()
            clean = False
            try:
                self.scheduler.tell(Shutdown(reply=done))
            except pykka.ActorDeadError:  # it crashed: each instance's stop ends its child
                log.error("the Scheduler is gone; every child is stopped with its instance")
            else:
                clean = done.wait(timeout_s) is True
                if not clean:
                    log.error("children did not all exit within %.1f s of shutdown",
                              timeout_s)
        while self.started:  # also what a start() that failed half-way had started
            self.started.pop()()
        self.scheduler = None
        return clean

    # ------------------------------------------------------------ leases

    @contextlib.contextmanager
    def lease(self, model: str, timeout_s: float | None = None) -> Iterator[str]:
        """Hold `model` loaded for the block; yields the child's base URL (a remote
        model's own `url`: the lease counts it in flight, for its key-less limits).

        Raises LeaseError if corral refuses, TimeoutError after `timeout_s`.
        """
        ticket = ThreadReply()
        scheduler = self.scheduler_ref
        scheduler.tell(Acquire(ticket=ticket, model=model))
        answer = ticket.wait(timeout_s)
        if answer is None:
            scheduler.tell(Cancel(ticket=ticket))
            raise TimeoutError(f"model '{model}' was not ready within {timeout_s} s")
        grant = _granted(answer)
        try:
            yield self._url(grant)
        finally:
            scheduler.tell(Release(ticket=ticket))

    def _url(self, grant: Grant) -> str:
        model = self.config.models.get(grant.model)
        return model.url if model is not None and model.url else grant.base_url

    @contextlib.asynccontextmanager
    async def lease_async(self, model: str) -> AsyncIterator[str]:
        """The `async with` form of `lease`: never blocks the event loop.

        Cancelling the waiting task leaves the queue (or releases a crossing grant).
        """
        scheduler = self.scheduler_ref
        ticket, answer = await acquire(scheduler, model)
        grant = _granted(answer)
        try:
            yield self._url(grant)
        finally:
            scheduler.tell(Release(ticket=ticket))
