"""Lifecycle hooks (issue 25): the commands a model's `hooks` table names, run around its
child by its ModelInstance (config/hooks.py says what each is for).

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
from typing import Any, Literal

import psutil

from ..childproc import ChildProcess, LogRing
from ..config.hooks import HOOK_PLACEHOLDER, HookName
from ..config.model import ModelConfig
from ..messages import HookRan, Inbox, InstanceMessage
from .hook_shim import MARK, SWEEPS_MAX, sweep
from .phases import Phase

END_GRACE_S = 2.0
"""How long a hook's group leader has, once told to end the hook, to kill what it
started before its group is SIGKILLed."""


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


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
            self.kill_all()
            done.wait()

    def kill_all(self) -> None:
        """SIGKILL the leader's group and every descendant of the leader. They are
        stopped first, then found, until no new one appears: a stopped process neither
        forks nor exits, so none slips out of the parent chain before it is killed (a
        leader too slow to sweep in its grace, on a busy machine, left a `setsid env -i`
        process behind: with the leader gone, nothing could find it again)."""
        assert self.child is not None
        if not self.child.signal_group(signal.SIGSTOP):
            return
        stopped: dict[int, psutil.Process] = {}
        try:
            for _ in range(SWEEPS_MAX):
                new = [p for p in psutil.Process(self.child.pid).children(recursive=True)
                       if p.pid not in stopped]
                if not new:
                    break
                for proc in new:
                    stopped[proc.pid] = proc
                    _signal(proc, signal.SIGSTOP)
        except psutil.Error:  # the leader gone: what it had is found by the mark
            pass
        self.child.signal_group(signal.SIGKILL)
        for proc in stopped.values():
            _signal(proc, signal.SIGKILL)

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
            self.child = ChildProcess([sys.executable, "-m", "actors.instance.hook_shim", *argv],
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
    """The hooks of one ModelInstance (actor.py), a part it holds: which hook runs, and
    what waits for its end. The actor says when each runs and carries its end out."""

    def __init__(self, model: str, inbox: Inbox[InstanceMessage], ring: LogRing,
                 log: logging.Logger) -> None:
        self.model = model
        self.inbox = inbox
        self.ring = ring
        self.log = log
        self.running: HookRun | None = None
        self.hook_id = 0
        """Stamps each hook's HookRan: an older one is stale."""
        self.waits: tuple[HookName, Waits] | None = None
        """What waits for the running hook's end: before_load the spawn, after_ready the
        ready's info, before_stop the stop's reason."""
        self.stop_kept: str | None = None
        """A stop that came while before_load ran (the child is then never started)."""
        self.stop_reason: str | None = None
        """Why corral stops the current child ({reason} of before_stop and after_exit)."""

    def waiting(self, name: HookName) -> bool:
        """Whether hook `name` runs, with something waiting for its end."""
        return self.waits is not None and self.waits[0] == name

    def run(self, name: HookName, config: ModelConfig, values: dict[str, str],
            then: Waits = None) -> bool:
        """Start hook `name` if `config` has one, its placeholders filled from `values`
        (`then`: what its end goes on with); whether it did. An after_exit hook is for
        nothing that follows: it is not the running hook (a later start neither waits for
        it nor kills it)."""
        argv = getattr(config.hooks, name)
        if not argv:
            return False
        argv = [HOOK_PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in argv]
        run, ref, ring = HookRun(), self.inbox, self.ring
        timeout_s = config.hook_timeout_s or 30.0
        hook_id = 0
        if name != "after_exit":
            self.hook_id += 1
            hook_id = self.hook_id
            self.running, self.waits = run, (name, then)

        def job() -> None:
            failure = run.run(name, argv, timeout_s, ring)
            tell: Callable[[InstanceMessage], None] = ref.tell
            try:
                tell(HookRan(hook_id=hook_id, hook=name, failure=failure))
            except Exception:  # the actor is gone: nobody waits for this hook
                pass

        threading.Thread(target=job, daemon=True, name=f"{self.model}-{name}").start()
        return True

    def kill(self, forget: bool = True) -> None:
        """End the running hook; `forget`: what waits for its end is gone too (its
        HookRan, when it comes, is stale), else its end still decides (a stop kept)."""
        if self.running is not None:
            self.running.kill()
        if forget:
            self.running = self.waits = None
            self.hook_id += 1

    def ran(self, hook_id: int, name: HookName, failure: str | None,
            generation: int) -> Waits | Literal[False]:
        """Hook `name` ended (`failure`: why it failed); what waited for its end, or
        False when nothing did (an after_exit, or a hook of a child gone meanwhile)."""
        if failure is not None:
            self.log.warning("%s#%d: hook %s failed: %s", self.model, generation, name,
                             failure)
        if hook_id != self.hook_id or self.waits is None:
            return False
        _, then = self.waits
        self.running = self.waits = None
        return then

    def load_stopped(self, failure: str | None) -> str | None:
        """before_load ended (`failure`: why it failed): why the child is not started
        (its hook failed, or a stop came meanwhile), None when it is."""
        kept, self.stop_kept = self.stop_kept, None
        if failure is not None:
            return f"before_load hook failed: {failure}"
        return None if kept is None else f"stopped ({kept}) while its before_load hook ran"
