"""A ModelInstance's phases, their transition table, and the steps of a child's stop."""

from __future__ import annotations

import itertools
import signal

from ..childproc import ChildProcess
from ..lifecycle import State
from ..llama import LLAMA_EXIT
from ..messages import ChildTimedOut, Inbox, InstanceMessage
from ..runtime.timers import Timers

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


def stop_steps(llama: bool, stop_timeout_s: float) -> tuple[StopStep, ...]:
    """How a ready child is stopped (R-3.4): a llama child is asked to exit first."""
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

    def begin(self, llama: bool, stop_timeout_s: float) -> str:
        """Start a stop; returns its plan in words."""
        self.left = steps = stop_steps(llama, stop_timeout_s)
        return ", ".join([said(steps[0][0])] + [
            f"{said(what)} after {wait_s:g} s"
            for (_, wait_s), (what, _) in itertools.pairwise(steps)])

    def take(self, child: ChildProcess, spawn_id: int) -> None:
        """Take the next step, and give child `spawn_id` its time to exit before the one
        after it (if any)."""
        self.taken, self.left = self.left[0], self.left[1:]
        what, wait_s = self.taken
        if what == "exit":
            child.write_stdin(LLAMA_EXIT)
        else:
            child.signal_group(getattr(signal, what))
        if self.left:
            self.timers.after(wait_s, self.inbox,
                              ChildTimedOut(spawn_id=spawn_id, stage="stop"))

    def ignored(self) -> str:
        """What the child ignored, and what comes next."""
        what, wait_s = self.taken
        return f"ignored {said(what)} for {wait_s:g} s; {said(self.left[0][0])}"
