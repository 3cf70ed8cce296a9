"""A ready child's liveness checks (R-3.5), a part its ModelInstance (actor.py) holds: a
tick per `liveness_interval_s`, a probe of its health path on a helper thread, and an
`Unhealthy` to the Scheduler after `liveness_failures` misses in a row (a late answer
the front saw counts as one). The actor drops a stale tick or result (another child, or
one not ready) before it calls this part; this part counts."""

from __future__ import annotations

import logging

from ..messages import Inbox, InstanceMessage, LivenessTick, SchedulerMessage, Unhealthy
from ..runtime.timers import Timers
from .health import Liveness
from .phases import SWITCHING, Phase
from .sidejobs import SideJobs


class LivenessWatch:
    """The liveness checks of one model's current child."""

    def __init__(self, model: str, inbox: Inbox[InstanceMessage],
                 scheduler: Inbox[SchedulerMessage], timers: Timers, jobs: SideJobs,
                 log: logging.Logger) -> None:
        self.model = model
        self.log = log
        self.inbox = inbox
        self.scheduler = scheduler
        self.timers = timers
        self.jobs = jobs
        self.rule = Liveness()
        """Its config's rule (top-level defaults filled in)."""
        self.on = False
        """Checks are made: an `http` child whose rule has an interval (a llama child
        says its own state)."""
        self.missed = 0
        """Checks failed in a row."""

    def start(self, rule: Liveness, llama: bool) -> None:
        """A new child: its rule; the checks begin once it is ready."""
        self.rule, self.on = rule, bool(rule.interval_s) and not llama

    def ready(self, spawn_id: int) -> None:
        """Child `spawn_id` is ready: its checks begin."""
        self.missed = 0
        self.arm(spawn_id)

    def arm(self, spawn_id: int) -> None:
        """The next check of child `spawn_id`."""
        if self.on:
            self.timers.after(self.rule.interval_s, self.inbox, LivenessTick(spawn_id=spawn_id))

    def tick(self, spawn_id: int, phase: Phase, host: str, port: int, path: str) -> None:
        """Child `spawn_id`'s check is due: its health path is asked, on a helper thread
        (a LivenessResult comes back); none while it is suspended, but the one chain of
        ticks goes on."""
        if phase in SWITCHING:
            self.arm(spawn_id)
        elif phase is Phase.READY:
            self.jobs.probe(spawn_id, host, port, path, min(self.rule.interval_s, 5.0))

    def result(self, spawn_id: int, generation: int, ok: bool, detail: str,
               poll: bool) -> None:
        """One check's finding for the ready child `spawn_id` (`poll`: a probe's; else a
        late answer the front saw): after `liveness_failures` misses in a row the
        Scheduler is told it is unhealthy, and stops it; else a probe's is followed by
        the next."""
        self.missed = 0 if ok else self.missed + 1
        if not ok:
            self.log.warning("%s#%d liveness check %d of %d failed: %s", self.model,
                             generation, self.missed, self.rule.failures, detail)
        if self.missed >= self.rule.failures:
            self.scheduler.tell(Unhealthy(model=self.model, generation=generation, detail=(
                f"{self.missed} liveness checks failed in a row, the last: {detail}")))
        elif poll:
            self.arm(spawn_id)
