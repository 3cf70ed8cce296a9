"""A ModelInstance's phases, their transition table, and the steps of a child's stop."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ..childproc import ChildProcess
from ..config.model import STOP_PLACEHOLDER, ModelConfig
from ..lifecycle import State
from ..llama import LLAMA_EXIT
from ..messages import ChildTimedOut, Inbox, InstanceMessage
from ..runtime.timers import Timers

log = logging.getLogger("corral.instance")
_ROOT = str(Path(__file__).resolve().parents[2])
"""Where `actors` is: the hooks' shim is run as its module from there."""

KILL_GRACE_S = 2.0
"""After the exit command and stop_timeout_s, a llama child gets SIGTERM and this long."""


class Phase(State):
    IDLE = "idle"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    SUSPENDING = "suspending"
    SUSPENDED = "suspended"
    WAKING = "waking"


_GONE = frozenset({Phase.STOPPING, Phase.IDLE})
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.STARTING}),
    Phase.STARTING: frozenset({Phase.READY, *_GONE}),
    Phase.READY: frozenset({Phase.SUSPENDING, *_GONE}),
    Phase.STOPPING: frozenset({Phase.IDLE}),
    Phase.SUSPENDING: frozenset({Phase.SUSPENDED, Phase.READY, *_GONE}),  # ready: it failed
    Phase.SUSPENDED: frozenset({Phase.WAKING, *_GONE}),
    Phase.WAKING: frozenset({Phase.READY, Phase.SUSPENDED, *_GONE}),  # suspended: it failed
}
"""Its child's phases: IDLE (none), STARTING (spawned, not ready), READY, STOPPING (told
to go), and the suspended tier's; any but IDLE ends in IDLE when the child exits."""
SWITCHING = frozenset({Phase.SUSPENDING, Phase.SUSPENDED, Phase.WAKING})
"""Suspended, or on the way there or back."""

StopStep = tuple[str, float]
"""One step of a stop: what is sent ("exit", "SIGTERM", "SIGKILL"), then how long the
child has to exit before the next step."""


def said(what: str) -> str:
    return "the exit command" if what == "exit" else what


def stop_steps(llama: bool, stop_timeout_s: float,
               command: bool = False) -> tuple[StopStep, ...]:
    """How a ready child is stopped (R-3.4): by its stop_cmd first where it has one (a
    container's `docker stop`), else a llama child is asked to exit first."""
    if command:
        return (("stop_cmd", stop_timeout_s), ("SIGTERM", KILL_GRACE_S), ("SIGKILL", 0.0))
    if llama:
        return (("exit", stop_timeout_s), ("SIGTERM", KILL_GRACE_S), ("SIGKILL", 0.0))
    return (("SIGTERM", stop_timeout_s), ("SIGKILL", 0.0))


class StopSequence:
    """The steps of a stop under way (R-3.4): the one taken last, and those left; each
    step but the last arms a ChildTimedOut for the child's time to exit."""

    def __init__(self, timers: Timers, inbox: Inbox[InstanceMessage]) -> None:
        self.timers = timers
        self.inbox = inbox
        self.left: tuple[StopStep, ...] = ()
        self.taken: StopStep = ("", 0.0)
        self.command: list[str] = []
        self.running: subprocess.Popen[bytes] | None = None
        """The stop_cmd under way, ended at the next step if it has not ended by then."""

    def begin(self, llama: bool, config: ModelConfig, model: str, port: int, pid: int) -> str:
        """Start a stop of child `pid` of `model`; returns its plan in words."""
        fill = {"{model}": model, "{port}": str(port), "{pid}": str(pid)}
        self.command = [STOP_PLACEHOLDER.sub(lambda m: fill[m.group(0)], arg)
                        for arg in config.stop_cmd or []]
        self.left = steps = stop_steps(llama, config.stop_timeout_s, bool(self.command))
        return ", ".join([said(steps[0][0])] + [
            f"{said(what)} after {wait_s:g} s"
            for (_, wait_s), (what, _) in itertools.pairwise(steps)])

    def take(self, child: ChildProcess, spawn_id: int) -> None:
        """Take the next step, and give child `spawn_id` its time to exit before the one
        after it (if any)."""
        self.taken, self.left = self.left[0], self.left[1:]
        what, wait_s = self.taken
        self.end_command()
        if what == "stop_cmd":
            if shutil.which(self.command[0]) is None:  # (nothing to wait for: the next step)
                log.warning("stop_cmd %s cannot run (no such program); %s now",
                            self.command, said(self.left[0][0]))
                self.take(child, spawn_id)
                return
            # (led by the hooks' shim: its whole group ends with it, or with corral)
            self.running = subprocess.Popen(
                [sys.executable, "-m", "actors.instance.hook_shim", *self.command],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, start_new_session=True, cwd=_ROOT)
        elif what == "exit":
            child.write_stdin(LLAMA_EXIT)
        else:
            child.signal_group(getattr(signal, what))
        if self.left:
            self.timers.after(wait_s, self.inbox,
                              ChildTimedOut(spawn_id=spawn_id, stage="stop"))

    def end_command(self) -> None:
        """End the stop_cmd if it still runs (the child's end, or the next step, came
        first), and reap it."""
        running, self.running = self.running, None
        if running is None:
            return
        ended = running.poll()
        with contextlib.suppress(ProcessLookupError):  # (and what it left in its group)
            os.killpg(running.pid, signal.SIGKILL)
        running.wait()
        if ended not in (None, 0):
            log.warning("stop_cmd %s exited %d", self.command, ended)

    def ignored(self) -> str:
        """What the child ignored, and what comes next."""
        what, wait_s = self.taken
        return f"ignored {said(what)} for {wait_s:g} s; {said(self.left[0][0])}"

