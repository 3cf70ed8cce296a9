"""ModelInstance actor: owns one model's child process, its readiness and its stop sequence.

It never chooses victims or touches the queue: it does what the Scheduler tells it and
reports facts back (`InstanceReady`, `InstanceExited`). Slow work (waiting for the exit,
polling the health path, deadlines) runs on helper threads that tell one message back,
so a stop arriving mid-start is handled at once.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, assert_never

from ..base import BaseActor, CrashHandler, tell_or_drop
from ..childproc import CHILD_HOST, ChildProcess, LogRing, pick_port, port_in_use
from ..config.hooks import HookName
from ..config.model import ModelConfig
from ..config.suspend import Step
from ..lifecycle import IllegalTransition, describe_exit
from ..llama import read_state, state_change
from ..messages import (
    ChildCached,
    ChildExited,
    ChildLine,
    ChildReady,
    ChildSwitched,
    ChildTimedOut,
    HookRan,
    Inbox,
    InstanceExited,
    InstanceMessage,
    InstanceReady,
    InstanceReported,
    InstanceStarted,
    InstanceSuspended,
    InstanceWoken,
    LivenessMiss,
    LivenessResult,
    LivenessTick,
    SchedulerMessage,
    StartInstance,
    StopInstance,
    SuspendInstance,
    WakeInstance,
)
from ..runtime.timers import Timers
from . import launch
from .health import Liveness
from .hooks import HookSteps, Waits
from .liveness import LivenessWatch
from .phases import TRANSITIONS, Phase, StopSequence
from .sidejobs import SideJobs

BIND_RETRIES = 3
"""A child that exits while its port is taken by someone else is respawned on a new port."""


class ModelInstance(BaseActor):
    """One model's child: spawn on StartInstance, stop on StopInstance, report facts."""

    def __init__(self, model: str, config: ModelConfig, scheduler: Inbox[SchedulerMessage],
                 timers: Timers, log_ring: LogRing, on_crash: CrashHandler,
                 extra_env: dict[str, str] | None = None, router_port: int = 0,
                 liveness: Callable[[ModelConfig], Liveness] | None = None,
                 host: str = CHILD_HOST, prompt_cache: tuple[Path, int] | None = None,
                 ) -> None:
        super().__init__(f"instance-{model}", on_crash)
        self.jobs = SideJobs(model, lambda m: tell_or_drop(self.actor_ref, m), log_ring,
                             prompt_cache)
        """Suspends, wakes, prompt caches and liveness checks, on helper threads."""
        self.hooks = HookSteps(model, self.actor_ref, log_ring, self.log)
        self.watch = LivenessWatch(model, self.actor_ref, scheduler, timers, self.jobs,
                                   self.log)
        self.liveness_of = liveness or (lambda _: Liveness())
        """The liveness rule of a config (top-level defaults filled in)."""
        self.devices: list[str] | None = None
        """Where the Scheduler placed the current child (None: where its config says)."""
        self.key: str | None = None
        """The key the current child requires (a child on a cluster node: issue 19, R8)."""
        self.model = model
        self.serves = model
        """`{model}` in its argv: its own name, or the model a replica copies (issue 24)."""
        self.host = host
        """Where its children listen: loopback, or this node's address on a Ray node."""
        self.config = config
        self.extra_env = extra_env or {}
        """corral's own variables for the child (CORRAL_SIM_LEDGER, CORRAL_DEVICES)."""
        self.router_port = router_port
        self.scheduler = scheduler
        self.timers = timers
        self.log_ring = log_ring
        self.phase = Phase.IDLE
        self.generation = 0  # the Scheduler's, of the current (or last) child
        self.spawn_id = 0
        """Bumped at every spawn, bind retries included; stamps helper-thread messages."""
        self.child: ChildProcess | None = None
        self.port = 0
        self.cause: str | None = None
        """Why corral ended the child, if it did (load timeout); else its exit speaks."""
        self.bind_retries = 0
        self.llama = config.health == "llama"
        self.asleep = False
        """A llama child said `sleeping` (and has not said `ready` since)."""
        self.stopping = StopSequence(timers, self.actor_ref)

    def on_receive(self, message: InstanceMessage) -> None:
        match message:
            case StartInstance(generation=gen, config=config, devices=devices, key=key,
                               serves=serves):
                self.handle_start(gen, config, devices, key, serves)
            case StopInstance(generation=generation, reason=reason):
                self.handle_stop(generation, reason)
            case SuspendInstance(generation=generation):
                self.handle_switch(generation, "sleep")
            case WakeInstance(generation=generation):
                self.handle_switch(generation, "wake")
            case ChildSwitched(spawn_id=spawn_id, step=step, failure=failure,
                               host_bytes=host_bytes):
                self.handle_switched(spawn_id, step, failure, host_bytes)
            case ChildReady(spawn_id=spawn_id):
                if spawn_id == self.spawn_id and self.phase is Phase.STARTING:
                    self.ready(None)
            case ChildCached(spawn_id=spawn_id, step=step, tokens=tokens):
                self.handle_cached(spawn_id, step, tokens)
            case ChildLine(spawn_id=spawn_id, line=line):
                if spawn_id == self.spawn_id and self.phase in (Phase.STARTING, Phase.READY):
                    self.handle_state_line(line)
            case ChildExited(spawn_id=spawn_id):
                self.handle_exited(spawn_id)
            case ChildTimedOut(spawn_id=spawn_id, stage="load"):
                self.handle_load_timeout(spawn_id)
            case ChildTimedOut(spawn_id=spawn_id):
                self.handle_stop_timeout(spawn_id)
            case LivenessTick(spawn_id=spawn_id) if spawn_id == self.spawn_id:
                self.watch.tick(spawn_id, self.phase, self.host, self.port,
                                self.config.health_path)
            case LivenessResult(spawn_id=spawn_id, ok=ok, detail=detail) \
                    if spawn_id == self.spawn_id and self.phase is Phase.READY:
                self.watch.result(spawn_id, self.generation, ok, detail, poll=True)
            case LivenessMiss(generation=generation, detail=detail) \
                    if generation == self.generation and self.phase is Phase.READY:
                self.watch.result(self.spawn_id, generation, False, detail, poll=False)
            case LivenessTick() | LivenessResult() | LivenessMiss():
                pass  # stale: another child's, or one not ready
            case HookRan(hook_id=hook_id, hook=hook, failure=failure):
                self.handle_hook_ran(hook_id, hook, failure)
            case _:
                assert_never(message)

    def on_stop(self) -> None:
        # Last resort on an abnormal stop: this thread's exit would SIGKILL the child
        # (PR_SET_PDEATHSIG) anyway; say so, and take its group with it.
        if self.child is not None and self.child.returncode is None:
            self.log.warning("actor stopping with child pid %d alive; killing its group",
                             self.child.pid)
            self.child.signal_group(signal.SIGKILL)
        self.hooks.kill()

    def _to(self, phase: Phase) -> None:
        if phase not in TRANSITIONS[self.phase]:
            raise IllegalTransition(f"{self.model}: {self.phase.value} -> {phase.value}")
        self.phase = phase

    # ------------------------------------------------------------ handlers

    def handle_start(self, generation: int, config: ModelConfig,
                     devices: list[str] | None = None, key: str | None = None,
                     serves: str | None = None) -> None:
        if self.phase is not Phase.IDLE:
            raise RuntimeError(f"{self.model}: StartInstance#{generation} while "
                               f"{self.phase.value} (#{self.generation})")
        self.generation, self.config, self.serves = generation, config, serves or self.model
        self.llama = config.health == "llama"
        self.watch.start(self.liveness_of(config), self.llama)
        self.devices = devices
        self.key = self.jobs.key = key if config.key_argument is not None else None
        self.bind_retries = 0
        self.hooks.stop_reason = None
        if not self.run_hook("before_load"):
            self.spawn_child()

    def spawn_child(self) -> None:
        self.spawn_id += 1
        spawn_id = self.spawn_id
        self.port = pick_port(self.host)
        self.cause = None
        argv, shown = launch.argv(self.config, self.serves, self.host, self.port,
                                  self.devices, self.jobs.cache_args(self.config), self.key)
        env = launch.env(self.config, self.extra_env, self.devices, self.router_port)
        ref = self.actor_ref
        self.log_ring.append(f"corral: {self.model}#{self.generation} starting on port "
                             f"{self.port}")  # marks each generation for log followers
        try:
            self.child = launch.spawn(argv, env, self.log_ring, self.model, self.llama,
                                      spawn_id, lambda m: tell_or_drop(ref, m))
        except (OSError, subprocess.SubprocessError) as e:
            self.log.error("cannot start %s: %s", shown[0], e)
            self.scheduler.tell(InstanceExited(
                model=self.model, generation=self.generation, returncode=127,
                description=f"could not be started: {e}"))
            return
        self._to(Phase.STARTING)
        self.scheduler.tell(InstanceStarted(model=self.model, generation=self.generation,
                                            pid=self.child.pid))
        self.log.info("spawned %s#%d pid %d on port %d: %s", self.model, self.generation,
                      self.child.pid, self.port, " ".join(shown))
        self.asleep = self.jobs.restoring = False
        if not self.llama:  # a llama child says `ready` itself
            self.jobs.poll_ready(spawn_id, self.host, self.port, self.config.health_path)
        self.timers.after(self.config.load_timeout_s, ref,
                          ChildTimedOut(spawn_id=spawn_id, stage="load"))

    def ready(self, info: dict[str, Any] | None) -> None:
        """The child answers: it is ready once its saved prompt cache, if any, is back."""
        if self.jobs.restoring:
            return
        if not self.jobs.cached:
            self.become_ready(info)
            return
        self.jobs.restore(self.spawn_id, self.host, self.port, self.config.stop_timeout_s,
                          info)

    def handle_cached(self, spawn_id: int, step: str, tokens: int) -> None:
        if spawn_id != self.spawn_id:
            return
        self.log.info("%s#%d: %d prompt tokens %sd", self.model, self.generation, tokens, step)
        if step == "restore" and self.jobs.restoring and self.phase is Phase.STARTING:
            self.become_ready(self.jobs.restored())
        elif step == "save" and self.jobs.saving is not None and self.phase is Phase.STOPPING:
            self.begin_stop_steps(self.jobs.saved())

    def become_ready(self, info: dict[str, Any] | None) -> None:
        if not self.run_hook("after_ready", info):
            self.report_ready(info)

    def report_ready(self, info: dict[str, Any] | None) -> None:
        assert self.child is not None
        self._to(Phase.READY)
        took = time.monotonic() - self.child.started_at
        self.log.info("%s#%d ready on port %d after %.3f s", self.model, self.generation,
                      self.port, took)
        self.scheduler.tell(InstanceReady(
            model=self.model, generation=self.generation, pid=self.child.pid, port=self.port,
            info=info, host=self.host, upstream_key=self.key))
        self.watch.ready(self.spawn_id)

    def handle_state_line(self, line: str) -> None:
        """One line of the llama child protocol: loading progress, ready, sleeping."""
        said = read_state(line)
        if isinstance(said, str):
            self.log.warning("%s#%d: %s", self.model, self.generation, said)
            return
        payload = said.payload if isinstance(said.payload, dict) else {}
        change = state_change(said.state, self.phase is Phase.STARTING, self.asleep)
        if change == "ready":
            self.ready(payload or None)
        elif change is not None:
            if change != "loading":
                self.asleep = change == "sleeping"
            self.scheduler.tell(InstanceReported(model=self.model, generation=self.generation,
                                                 state=change, payload=payload))

    def handle_stop(self, generation: int, reason: str) -> None:
        if generation == self.generation and self.hooks.waiting("before_load"):
            self.hooks.stop_kept = reason  # said once the hook has ended (it is ended now)
            self.hooks.kill(forget=False)
            return
        if generation != self.generation or self.phase in (Phase.IDLE, Phase.STOPPING):
            return  # stale, or already on its way out
        assert self.child is not None
        self.jobs.stop_polling()
        self.hooks.stop_reason, was = reason, self.phase
        if self.phase is Phase.STARTING:
            # still loading: it may not handle SIGTERM yet, so kill at once
            self.log.info("stopping %s#%d while loading (%s): SIGKILL", self.model,
                          generation, reason)
            self.child.signal_group(signal.SIGKILL)
            self.hooks.kill()  # an after_ready hook has nothing to wait for now
            self._to(Phase.STOPPING)
            return
        self._to(Phase.STOPPING)
        if not self.run_hook("before_stop", (reason, was), reason):
            self.stop_steps(reason, was)

    def stop_steps(self, reason: str, was: Phase) -> None:
        """The stop of a child that was `was`, after its before_stop hook."""
        if self.jobs.here is not None and was is Phase.READY and reason != "unhealthy":
            # its stop steps begin once the slots are saved
            self.jobs.save(self.spawn_id, self.host, self.port, self.config.stop_timeout_s,
                           reason)
        else:
            self.begin_stop_steps(reason)

    def begin_stop_steps(self, reason: str) -> None:
        assert self.child is not None
        plan = self.stopping.begin(self.llama, self.config, self.serves, self.port, self.child.pid)
        self.log.info("stopping %s#%d (%s): %s", self.model, self.generation, reason, plan)
        self.stopping.take(self.child, self.spawn_id)

    def handle_switch(self, generation: int, step: Step) -> None:
        """Suspend (`sleep`) or wake the child by its config's `suspend` method, on a
        helper thread that tells a ChildSwitched back (issue 23)."""
        start = Phase.READY if step == "sleep" else Phase.SUSPENDED
        how = self.config.suspend
        if generation != self.generation or self.phase is not start or how is None:
            return  # stale, or gone meanwhile: its exit tells the Scheduler
        assert self.child is not None
        self._to(Phase.SUSPENDING if step == "sleep" else Phase.WAKING)
        self.log.info("%s#%d: %s", self.model, generation,
                      "suspending" if step == "sleep" else "waking")
        self.jobs.switch(self.spawn_id, how, step, self.host, self.port, self.child.pid,
                         self.config.suspend_timeout_s)

    def handle_switched(self, spawn_id: int, step: Step, failure: str | None,
                        host_bytes: int) -> None:
        sleep, ok = step == "sleep", failure is None
        if spawn_id != self.spawn_id or self.phase is not (
                Phase.SUSPENDING if sleep else Phase.WAKING):
            return  # stopped or gone meanwhile
        self._to(Phase.SUSPENDED if sleep == ok else Phase.READY)  # a failure: as it was
        gen, detail = self.generation, failure or ""
        self.scheduler.tell(InstanceSuspended(
            model=self.model, generation=gen, ok=ok, detail=detail, host_bytes=host_bytes)
            if sleep else InstanceWoken(model=self.model, generation=gen, ok=ok, detail=detail))

    def handle_load_timeout(self, spawn_id: int) -> None:
        if spawn_id != self.spawn_id or self.phase is not Phase.STARTING:
            return
        assert self.child is not None
        self.cause = f"not ready within load_timeout_s={self.config.load_timeout_s:g}"
        self.log.warning("%s#%d %s; killing it", self.model, self.generation, self.cause)
        self.jobs.stop_polling()
        self.child.signal_group(signal.SIGKILL)

    def handle_stop_timeout(self, spawn_id: int) -> None:
        if spawn_id != self.spawn_id or self.phase is not Phase.STOPPING \
                or not self.stopping.left:
            return
        assert self.child is not None
        self.log.warning("%s#%d %s", self.model, self.generation, self.stopping.ignored())
        self.stopping.take(self.child, spawn_id)

    def handle_exited(self, spawn_id: int) -> None:
        if spawn_id != self.spawn_id or self.child is None or self.phase is Phase.IDLE:
            return
        self.jobs.stop_polling()
        was = self.phase
        returncode = self.child.reap()
        self._to(Phase.IDLE)
        description = self.cause or describe_exit(returncode)
        if (was is Phase.STARTING and self.cause is None
                and self.bind_retries < BIND_RETRIES and port_in_use(self.port, self.host)):
            # Someone took the port between pick_port and the child's bind.
            self.bind_retries += 1
            self.log.warning("%s#%d %s while port %d is taken; retrying on a new port",
                             self.model, self.generation, description, self.port)
            self.spawn_child()
            return
        self.log.info("%s#%d pid %d %s", self.model, self.generation, self.child.pid, description)
        self.log_ring.append(f"corral: {self.model}#{self.generation} pid "
                             f"{self.child.pid} {description}")
        self.scheduler.tell(InstanceExited(model=self.model, generation=self.generation,
                                           returncode=returncode, description=description))
        self.hooks.kill()  # (an after_ready or before_stop one, now for nothing)
        self.stopping.end_command()
        self.run_hook("after_exit", reason=self.hooks.stop_reason or description)

    # ------------------------------------------------------------ hooks

    def run_hook(self, name: HookName, then: Waits = None, reason: str = "") -> bool:
        """Start hook `name` if the config has one (`then`: what its end goes on with)."""
        pid = self.child.pid if self.child is not None and name != "before_load" else ""
        return self.hooks.run(name, self.config, {
            "model": self.serves, "port": str(self.port) if pid else "", "pid": str(pid),
            "devices": ",".join(self.devices or []), "reason": reason}, then)

    def handle_hook_ran(self, hook_id: int, name: HookName, failure: str | None) -> None:
        then = self.hooks.ran(hook_id, name, failure, self.generation)
        if then is False:
            return  # stale
        if name == "before_load" and self.phase is Phase.IDLE:
            why = self.hooks.load_stopped(failure)
            if why is None:
                self.spawn_child()
            else:
                self.scheduler.tell(InstanceExited(model=self.model, generation=self.generation,
                                                   returncode=1, description=why))
        elif name == "after_ready" and self.phase is Phase.STARTING:
            if failure is None:
                self.report_ready(then if isinstance(then, dict) else None)
            elif self.child is not None:
                self.cause = f"after_ready hook failed: {failure}"
                self.child.signal_group(signal.SIGKILL)
        elif name == "before_stop" and self.phase is Phase.STOPPING \
                and isinstance(then, tuple):
            self.stop_steps(*then)
