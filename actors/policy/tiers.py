"""The suspended tier's events (issue 23): a suspend or a wake that ended, and the idle
TTLs, which may suspend a model first (ttl_suspend_s) and stop it later (ttl_s).

A suspend frees the model's slot at once and its devices as the DeviceMonitor then sees
them (never assumed); its host copy counts in the host tier (host.py). A wake is a load:
claimed by a queue entry where it fits (Rules.claim_wake), charged its real use at the
next report. A suspend or a wake that fails stops the child and counts towards the
breaker; the requests waiting for a failed wake stay queued for the load that follows.
"""

from __future__ import annotations

import logging

from ..histogram import observe
from ..ledger import MiB
from ..lifecycle import ModelState
from ..messages import EvictionReason, Repump, TtlDue
from .costs import learned
from .records import Effect, Later, ModelRecord, Track
from .rules import Rules
from .state import State

log = logging.getLogger("corral.scheduler")

S = ModelState


class Tiers:
    """What the suspends and wakes report, and the TTL timers."""

    def __init__(self, state: State, rules: Rules) -> None:
        self.state = state
        self.rules = rules
        self.moves = self.rules.moves

    def suspended(self, model: str, generation: int, ok: bool, detail: str, host_bytes: int,
                  now: float) -> list[Effect]:
        """The suspend of `model`'s child ended."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation or rec.state is not S.SUSPENDING:
            return []  # stale, or stopped meanwhile
        if not ok:
            self.state.host.awake(rec)  # nothing went to the host
            self._failed(rec, "suspend_failed", f"its suspend failed: {detail}", now)
        else:
            self.state.host.suspended(rec, host_bytes)
            rec.times = learned(rec.times, suspend_s=now - rec.state_since)
            rec.suspends += 1
            rec.draining = self.state.watched(rec)
            self.moves.transition(rec, S.SUSPENDED, f"suspended, {host_bytes / MiB:.0f} MiB "
                                  "to host RAM", now)
            if self.state.watched(rec):
                # Its devices hold what the monitor still sees until its next report.
                self.state.ledger.unreserve(model)
                rec.awaiting_usage = False
            self.state.out.append(Track(model, "suspended", rec.pid))  # the host tier's too
            self.moves.idle(rec, now)
        self.rules.pump(now)
        return self.moves.flush()

    def woken(self, model: str, generation: int, ok: bool, detail: str,
              now: float) -> list[Effect]:
        """The wake of `model`'s child ended: on success it serves its waiters."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation or rec.state is not S.WAKING:
            return []
        entry = self.state.queue.entry(rec.group)
        if entry is not None:
            entry.claimed = False
        if not ok:
            self._failed(rec, "wake_failed", f"its wake failed: {detail}", now)
        else:
            took = now - rec.state_since
            observe(self.state.stats.wake_time, model, took)
            rec.times = learned(rec.times, wake_s=took)
            self.state.host.awake(rec)
            rec.wakes += 1
            rec.ready_at = rec.woke_at = now
            rec.ready_took = took
            warmed = rec in self.state.warming
            rec.last_used = 0.0 if warmed and entry is None else now  # unasked: first victim
            rec.ended_at = now
            self.state.warming.discard(rec)
            self.moves.transition(rec, S.LOADED, "woken", now)
            rec.awaiting_usage = self.state.watched(rec)
            self.state.unsettled.add(rec)
            self.state.out.append(Track(model, "woken", rec.pid))
            if entry is not None:
                entry.explicit = False
                self.rules.serve_waiters(rec, now)
            self.moves.idle(rec)
        self.rules.pump(now)
        return self.moves.flush()

    def _failed(self, rec: ModelRecord, reason: EvictionReason, why: str, now: float) -> None:
        """A suspend or wake failed: the child is stopped, and it counts as a failure."""
        log.warning("model %s#%d: %s; stopping it", rec.name, rec.generation, why)
        backoff = rec.breaker.failed(now, None, grow=False)
        if backoff:
            self.state.out.append(Later(backoff, Repump()))
        self.moves.stop(rec, reason, None, now, why=why)

    def ttl_due(self, model: str, generation: int, now: float) -> list[Effect]:
        """A model's idle TTL may have run out: suspend it (ttl_suspend_s) or stop it
        (ttl_s) if it has really been idle that long, else look again when it would have
        (R-3.6)."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation:
            return []
        rec.ttl_armed = False
        after = self.state.ttl_after(rec)
        if after is None:
            return []  # busy, wanted or pinned now: armed again once idle
        due = rec.idle_from + after
        if now < due:
            rec.ttl_armed = True
            self.state.out.append(Later(due - now, TtlDue(model=model, generation=generation)))
        elif rec.state is S.SUSPENDED or after == rec.rules.ttl_s \
                or self.state.above_min(rec) \
                or self.state.handing_over(rec):  # a copy above min (scale_down_idle_s)
            self.moves.stop(rec, "ttl", None, now)
            self.rules.pump(now)
        else:  # ttl_suspend_s: suspend if it may; else it stays until ttl_s
            state = self.state
            why = state.host.why_not(rec, state.ledger, state.stopping_suspended())
            if why is None and (not state.host.suspended_max
                                or state.n_suspended < state.host.suspended_max):
                self.moves.suspend(rec, "ttl", None, now)
                self.rules.pump(now)
            else:
                log.info("model %s: idle for ttl_suspend_s, not suspended: %s", model,
                         why or f"suspended_max ({state.host.suspended_max}) reached")
                rec.ttl_skipped = rec.idle_from
                self.moves.idle(rec, now)
        return self.moves.flush()
