"""A ready child's liveness checks (R-3.5), as its ModelInstance (instance.py) makes
them: a tick per `liveness_interval_s`, a probe of its health path on a helper thread,
and an `Unhealthy` to the Scheduler after `liveness_failures` misses in a row (a late
answer the front saw counts as one)."""

from __future__ import annotations

import logging

from .base import Inbox
from .config import ModelConfig
from .health import Liveness
from .messages import InstanceMessage, LivenessTick, SchedulerMessage, Unhealthy
from .phases import SWITCHING, Phase
from .sidejobs import SideJobs
from .timers import Timers


class LivenessSteps:
    """The liveness steps of a ModelInstance."""

    model: str
    config: ModelConfig
    phase: Phase
    generation: int
    spawn_id: int
    host: str
    port: int
    llama: bool
    liveness: Liveness
    missed: int
    jobs: SideJobs
    timers: Timers
    scheduler: Inbox[SchedulerMessage]
    @property
    def inbox(self) -> Inbox[InstanceMessage]:
        raise NotImplementedError  # ModelInstance's
    log: logging.Logger

    def arm_liveness(self) -> None:
        """The next liveness check of a ready `http` child that has them."""
        if self.liveness.interval_s and not self.llama:
            self.timers.after(self.liveness.interval_s, self.inbox,
                              LivenessTick(spawn_id=self.spawn_id))

    def handle_liveness_tick(self, spawn_id: int) -> None:
        if spawn_id == self.spawn_id and self.phase in SWITCHING:
            self.arm_liveness()  # no check while suspended; the one chain goes on
            return
        if spawn_id != self.spawn_id or self.phase is not Phase.READY:
            return
        self.jobs.probe(spawn_id, self.host, self.port, self.config.health_path,
                        min(self.liveness.interval_s, 5.0))

    def handle_liveness_result(self, spawn_id: int, ok: bool, detail: str,
                               rearm: bool) -> None:
        if spawn_id != self.spawn_id or self.phase is not Phase.READY:
            return
        self.missed = 0 if ok else self.missed + 1
        if not ok:
            self.log.warning("%s#%d liveness check %d of %d failed: %s", self.model,
                             self.generation, self.missed, self.liveness.failures, detail)
        if self.missed >= self.liveness.failures:
            self.scheduler.tell(Unhealthy(model=self.model, generation=self.generation, detail=(
                f"{self.missed} liveness checks failed in a row, the last: {detail}")))
            return  # the Scheduler stops it
        if rearm:  # a poll's result: the next poll (a late answer is no poll)
            self.arm_liveness()
