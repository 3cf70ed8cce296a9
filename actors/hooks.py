"""Lifecycle hooks (issue 25): the commands a model's `hooks` table names, run around its
child by its ModelInstance (config_hooks.py says what each is for).

A hook is a child process like any other (childproc.py): argv exec'd, never a shell, in
its own process group, led by hook_shim.py so that the whole group dies with corral
(even SIGKILLed: a hook that forks leaves nothing); its output goes to the model's log,
framed by a line that names it and a line that says how it ended. It runs on a helper thread and
tells a `HookRan` back, so the instance keeps taking messages meanwhile: a stop that
comes while `before_load` runs is kept until it ends (and the child is then never
started), one that comes during `after_ready` kills the child and the hook.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .base import Inbox
from .childproc import ChildProcess, LogRing
from .config import ModelConfig
from .config_hooks import HOOK_PLACEHOLDER, HookName
from .hook_shim import MARK, sweep
from .messages import HookRan, InstanceExited, InstanceMessage, SchedulerMessage
from .phases import Phase

log = logging.getLogger("corral.instance")

END_GRACE_S = 2.0
"""How long a hook's group leader has, once told to end the hook, to kill what it
started before its group is SIGKILLed."""

Waits = dict[str, Any] | tuple[str, Phase] | None
"""What waits for a hook's end: the ready's info (after_ready), the stop's reason and the
phase it stops from (before_stop); before_load's is the spawn (nothing)."""


class HookRun:
    """One hook's process, on its helper thread; `kill` ends it early."""

    def __init__(self) -> None:
        self.child: ChildProcess | None = None
        self.killed = False
        self.wake = threading.Event()
        """Set by the hook's end, and by `kill`: its thread then ends it."""

    def kill(self) -> None:
        """Ask the hook's thread to end it (never blocks: the actor calls it)."""
        self.killed = True
        self.wake.set()

    def end(self, done: threading.Event) -> None:
        """End the hook: SIGTERM to its group leader, which kills every process the hook
        started (those that left the group too, hook_shim.py), then SIGKILL to the group
        if it has not ended within END_GRACE_S (the review: a SIGKILL first left the
        leader no time to find what had left its group)."""
        assert self.child is not None
        try:
            os.kill(self.child.pid, signal.SIGTERM)  # (not reaped yet: still ours)
        except ProcessLookupError:
            pass
        if not done.wait(END_GRACE_S):
            self.child.signal_group(signal.SIGKILL)
            done.wait()

    def run(self, name: HookName, argv: list[str], timeout_s: float,
            ring: LogRing) -> str | None:
        """Run it to its end; None if it exited 0, else why it failed."""
        ring.append(f"corral: hook {name}: {' '.join(argv)}")
        done, last = threading.Event(), [""]
        token = f"{os.getpid()}-{secrets.token_hex(8)}"

        def exited() -> None:
            done.set()
            self.wake.set()
        try:
            self.child = ChildProcess([sys.executable, "-m", "actors.hook_shim", *argv],
                                      {**os.environ, MARK: token}, ring, on_exit=exited,
                                      on_line=lambda line: last.__setitem__(0, line),
                                      label=f"hook-{name}")
        except (OSError, subprocess.SubprocessError) as e:
            why = f"cannot run {argv[0]}: {e}"
            ring.append(f"corral: hook {name} failed: {why}")
            return why
        deadline = time.monotonic() + timeout_s
        timed_out = False
        while not done.is_set() and not self.killed:
            timed_out = not self.wake.wait(max(0.0, deadline - time.monotonic()))
            if timed_out:
                break
            self.wake.clear()
        if not done.is_set():
            self.end(done)
        status = self.child.reap()
        # what left the group is the shim's to end; if it was killed first, it is ours
        if (left := sweep(token)) and not self.killed and not timed_out:
            ring.append(f"corral: hook {name}: {left} process(es) it left were killed")
        if timed_out:
            failure: str | None = (f"{argv[0]} did not finish within "
                                   f"hook_timeout_s={timeout_s:g}")
        elif self.killed:
            failure = f"{argv[0]} was stopped with its model's child"
        elif status != 0:
            failure = f"{argv[0]} exited with status {status}" + (
                f": {last[0][:200]}" if last[0] else "")
        else:
            failure = None
        ring.append(f"corral: hook {name} " + (f"failed: {failure}" if failure else "done"))
        return failure


class HookSteps:
    """The hook steps of a ModelInstance (instance.py): when each hook runs, and what its
    end does."""

    model: str
    serves: str
    config: ModelConfig
    phase: Phase
    generation: int
    spawn_id: int
    port: int
    devices: list[str] | None
    child: ChildProcess | None
    cause: str | None
    log_ring: LogRing
    scheduler: Inbox[SchedulerMessage]
    @property
    def inbox(self) -> Inbox[InstanceMessage]:
        raise NotImplementedError  # ModelInstance's

    hook_run: HookRun | None = None
    hook_id = 0
    """Stamps each hook's HookRan: an older one is stale."""
    hook_waits: tuple[HookName, Waits] | None = None
    """What waits for the running hook's end: before_load the spawn, after_ready the
    ready's info, before_stop the stop's reason."""
    stop_kept: str | None = None
    """A stop that came while before_load ran (the child is then never started)."""
    stop_reason: str | None = None
    """Why corral stops the current child ({reason} of before_stop and after_exit)."""

    def spawn_child(self) -> None: ...
    def report_ready(self, info: dict[str, Any] | None) -> None: ...
    def stop_steps(self, reason: str, was: Phase) -> None: ...

    def run_hook(self, name: HookName, then: Waits = None, reason: str = "") -> bool:
        """Start hook `name` if the config has one (`then`: what its end goes on with);
        whether it did. An after_exit hook is for nothing that follows: it is not the
        running hook (a later start neither waits for it nor kills it)."""
        argv = getattr(self.config.hooks, name)
        if not argv:
            return False
        pid = self.child.pid if self.child is not None and name != "before_load" else ""
        values = {"model": self.serves, "port": str(self.port) if pid else "",
                  "pid": str(pid), "devices": ",".join(self.devices or []),
                  "reason": reason}
        argv = [HOOK_PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in argv]
        run, ref = HookRun(), self.inbox
        timeout_s = self.config.hook_timeout_s or 30.0
        hook_id = 0
        if name != "after_exit":
            self.hook_id += 1
            hook_id = self.hook_id
            self.hook_run, self.hook_waits = run, (name, then)

        def job() -> None:
            failure = run.run(name, argv, timeout_s, self.log_ring)
            tell: Callable[[InstanceMessage], None] = ref.tell
            try:
                tell(HookRan(hook_id=hook_id, hook=name, failure=failure))
            except Exception:  # the actor is gone: nobody waits for this hook
                pass

        threading.Thread(target=job, daemon=True, name=f"{self.model}-{name}").start()
        return True

    def kill_hook(self, forget: bool = True) -> None:
        """End the running hook; `forget`: what waits for its end is gone too (its
        HookRan, when it comes, is stale), else its end still decides (a stop kept)."""
        if self.hook_run is not None:
            self.hook_run.kill()
        if forget:
            self.hook_run = self.hook_waits = None
            self.hook_id += 1

    def handle_hook_ran(self, hook_id: int, name: HookName, failure: str | None) -> None:
        if failure is not None:
            log.warning("%s#%d: hook %s failed: %s", self.model, self.generation, name,
                        failure)
        if hook_id != self.hook_id or self.hook_waits is None:
            return  # an after_exit, or a hook of a child gone meanwhile
        _, then = self.hook_waits
        self.hook_run = self.hook_waits = None
        if name == "before_load" and self.phase is Phase.IDLE:
            kept, self.stop_kept = self.stop_kept, None
            if kept is not None or failure is not None:
                self.scheduler.tell(InstanceExited(
                    model=self.model, generation=self.generation, returncode=1,
                    description=f"before_load hook failed: {failure}" if failure
                    else f"stopped ({kept}) while its before_load hook ran"))
            else:
                self.spawn_child()
        elif name == "after_ready" and self.phase is Phase.STARTING:
            if failure is None:
                self.report_ready(then if isinstance(then, dict) else None)
            elif self.child is not None:
                self.cause = f"after_ready hook failed: {failure}"
                self.child.signal_group(signal.SIGKILL)
        elif name == "before_stop" and self.phase is Phase.STOPPING \
                and isinstance(then, tuple):
            self.stop_steps(*then)

