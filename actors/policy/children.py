"""What the children, the measurements and a reload report, and what the policy makes
of it: readiness grants the waiters (R-4.6), an exit frees the slot and, for a crash or
a failed load, answers the waiters and may open the breaker (R-3.7, R-4.8).
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from ..config.rules import ModelRules, alternate_name
from ..histogram import observe
from ..ledger import Breakdown, node_of
from ..lifecycle import ModelState
from ..messages import DeviceReport, DevicesSnapshot, Repump, StatusChanged
from . import views
from .costs import SwapTimes, learned
from .handover import Handovers
from .records import Effect, Later, Measure, ModelRecord, Publish, Stop, Track
from .rules import Rules
from .state import State

log = logging.getLogger("corral.scheduler")

S = ModelState


class Children:
    """The events that come from children, the memory actors and a reload."""

    def __init__(self, state: State, rules: Rules) -> None:
        self.state = state
        self.rules = rules
        self.moves = self.rules.moves
        self.handovers = Handovers(state, rules)

    # ------------------------------------------------------------ instance facts

    def instance_started(self, model: str, generation: int, pid: int) -> list[Effect]:
        """The child of `generation` runs as `pid`: from now on its memory is corral's."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation or rec.state is not S.LOADING:
            return []
        rec.pid = pid
        if self.state.watched(rec):
            self.state.out.append(Track(model, "spawned", pid))
        return self.moves.flush()

    def instance_ready(self, model: str, generation: int, pid: int, host: str, port: int,
                       now: float, info: dict[str, Any] | None = None,
                       upstream_key: str | None = None) -> list[Effect]:
        """The child of `generation` answers: grant everyone queued for it, atomically
        (R-4.6); `upstream_key`: the key it requires (a child on a cluster node)."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation or rec.state is not S.LOADING:
            return []  # stale, or already being stopped: never proxy into a stopping child
        rec.pid, rec.host, rec.port, rec.upstream_key = pid, host, port, upstream_key
        rec.loads_ok += 1
        rec.load_s_total += now - rec.state_since
        rec.times = learned(rec.times, cold_s=now - rec.state_since)  # (costs.py)
        observe(self.state.stats.load_time, model, now - rec.state_since)
        rec.info, rec.progress = info, None
        rec.failed = False
        rec.ready_at, rec.ready_took = now, now - rec.state_since
        # A warm-up nobody asked for since: the first victim.
        warmed = rec in self.state.warming and rec.group not in self.state.queue.entries
        rec.last_used = 0.0 if warmed else now
        rec.ended_at = now
        self.state.warming.discard(rec)
        rec.breaker.ready()
        self.moves.transition(rec, S.LOADED, f"ready, pid {pid}", now, info=info)
        if rec.takes_over:  # a reload's new config: the old child drains now
            self.handovers.ready(rec, now)
        if self.state.watched(rec):
            rec.awaiting_usage = True
            self.state.unsettled.add(rec)
            self.state.out.append(Track(model, "ready", pid))
        entry = self.state.queue.entry(rec.group)
        if entry is not None:
            entry.claimed = entry.explicit = False
            self.rules.serve_waiters(rec, now)
        self.moves.idle(rec)
        self.rules.pump(now)
        return self.moves.flush()

    def instance_adopted(self, model: str, generation: int, pid: int, host: str, port: int,
                         devices: list[str] | None, now: float, node: str | None = None,
                         upstream_key: str | None = None) -> list[Effect]:
        """A ready child an earlier corral left on a Ray node (its head restarted) is
        this model's generation `generation`, loaded (R-3, issue 14), unless the model
        runs or went past it: it stops it (a generation is never given twice: R12)."""
        rec = self.state.models.get(model)
        if rec is not None and rec.state.is_running and generation == rec.generation:
            return []  # its own child (never stop that one)
        other = (self.state.groups.partner(rec) if rec is not None  # (a drain's or reload's)
                 else self.state.models.get(model.removesuffix(alternate_name(""))))
        why = ("a drain or reload moved its model" if other is not None and (
            rec is None or (other.state.is_running and other.state is not S.STOPPING))
            else None if rec is None else "it runs already" if rec.state is not S.UNLOADED
            else f"its generation {generation} is older than the model's {rec.generation}"
            if generation < rec.generation else None)
        if why is not None:
            log.info("model %s: not adopting pid %d (#%d): %s; stopping it", model, pid,
                     generation, why)
            self.state.out.append(Stop(model, generation, f"not adopted: {why}"))
            return self.moves.flush()
        if rec is None:
            return []
        rec.generation = generation
        rec.placement = devices
        rec.node = node or (node_of(devices[0]) if devices else None)
        rec.upstream_key = upstream_key
        self.moves.transition(rec, S.LOADING, f"adopting pid {pid}", now)
        if self.state.memory_on:
            self.state.memory.spawning(rec)
        rec.pid, rec.host, rec.port = pid, host, port
        rec.failed = False
        rec.ready_at = rec.last_used = now
        self.moves.transition(rec, S.LOADED, f"adopted, pid {pid}", now)
        if self.state.memory_on:
            rec.awaiting_usage = True
            self.state.unsettled.add(rec)
            self.state.out.append(Track(model, "ready", pid))
        self.moves.idle(rec)
        self.rules.pump(now)
        return self.moves.flush()

    def node_changed(self, node: str, up: bool, why: str, now: float) -> list[Effect]:
        """A cluster node's agent came up, or was lost (or could not be reached): models
        that may run only on lost nodes are refused, saying so, and not failed."""
        self.state.nodes.changed(node, up, why)
        self.rules.pump(now)
        return self.moves.flush()

    def instance_seen(self, model: str, generation: int) -> None:
        """Another corral's child of `model` runs as `generation` (being stopped): this
        model's next generation is a later one."""
        rec = self.state.models.get(model)
        if rec is not None and rec.state is S.UNLOADED:
            rec.generation = max(rec.generation, generation)

    def instance_reported(self, model: str, generation: int, state: str,
                          payload: dict[str, Any], now: float) -> list[Effect]:
        """A llama child's progress, that it went to sleep or woke up (R-3.6), or that
        it refused a request past its context."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation:
            return []
        if state == "loading" and rec.state is S.LOADING:
            rec.progress = payload
            self.state.out.append(Publish(StatusChanged(
                model=model, status="loading", cause="loading progress", progress=payload)))
        elif state == "sleeping" and rec.state is S.LOADED:
            # It keeps its slot (and stays an eviction candidate) but gives its memory
            # back; a request wakes it, and then it holds again.
            self.moves.transition(rec, S.SLEEPING, "idle, the child sleeps", now)
            self.state.ledger.unreserve(model)  # what the device still shows for it stays held
        elif state == "awake" and rec.state is S.SLEEPING:
            self.moves.transition(rec, S.LOADED, "woken by a request", now)
            if self.state.memory_on:
                self.state.ledger.reserve(model, rec.mem_effective or self.state.memory.need(rec))
        elif state == "context":  # (llama.py context_refused: ints) it may grow
            self.handovers.grow(rec, payload.get("asked", 0), payload.get("n_ctx", 0), now)
        self.moves.idle(rec)
        self.rules.pump(now)
        return self.moves.flush()

    def instance_unhealthy(self, model: str, generation: int, detail: str,
                           now: float) -> list[Effect]:
        """A loaded child failed its liveness checks: stop it; the next request reloads."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation or not rec.state.is_serving:
            return []
        log.warning("model %s#%d is unhealthy (%s); stopping it", model, generation, detail)
        rec.failed = True
        self.moves.stop(rec, "unhealthy", None, now)
        self.rules.pump(now)
        return self.moves.flush()

    def instance_exited(self, model: str, generation: int, returncode: int,
                        description: str, now: float) -> list[Effect]:
        """The child of `generation` is gone and reaped: free its slot; a crash or failed
        load answers its waiters and may open the breaker (R-3.7, R-4.8)."""
        rec = self.state.models.get(model)
        if rec is None or rec.generation != generation or not rec.state.is_running:
            return []
        was, up_since = rec.state, rec.ready_at
        rec.in_flight = 0
        self.state.host.gone(rec)  # (on its node: before the record forgets it)
        rec.pid = rec.host = rec.port = rec.ready_at = rec.placement = rec.node = None
        rec.upstream_key = None
        rec.exit_code = returncode
        rec.last_exit = description
        rec.mem_effective = None
        rec.info = rec.progress = None
        rec.awaiting_usage = False
        self.state.warming.discard(rec)
        if self.state.watched(rec):
            rec.releasing = model in self.state.ledger.held
            if rec.releasing:
                self.state.memory.releasing.add(rec)
            self.state.out.append(Track(model, "exited"))
        entry = self.state.queue.entry(rec.group)
        if entry is not None and not self.state.groups.others_up(rec):
            entry.claimed = False  # a dead child's claim is void; the head retries
        if rec.removed:
            self.moves.transition(rec, S.UNLOADED, f"stopped, {description}", now, returncode)
            self.state.drop(model)
        elif was is S.STOPPING:
            self.moves.transition(rec, S.UNLOADED, f"stopped, {description}", now, returncode)
        else:
            self._failed(rec, was, up_since, description, returncode, now)
        if self.handovers.pending:  # a newcomer may have waited for this one to go
            self.handovers.retry(now)
        self.rules.pump(now)
        return self.moves.flush()

    def _failed(self, rec: ModelRecord, was: ModelState, up_since: float | None,
                description: str, returncode: int, now: float) -> None:
        what = "load failed" if was is S.LOADING else "crashed"
        attempt = rec.breaker.attempt
        killed = returncode < 0
        backoff = rec.breaker.failed(now, up_since, grow=was is S.LOADING and not killed)
        rec.failed = True
        cause = f"{what}: {description}"
        if backoff:
            cause += (f"; {len(rec.breaker.failures)} failures in "
                      f"{rec.breaker.period_s:g} s, no load for {backoff:g} s")
            self.state.out.append(Later(backoff, Repump()))
        self.moves.transition(rec, S.UNLOADED, cause, now, returncode)
        if was is S.LOADING and self.state.groups.others_up(rec):
            pass  # another copy serves its model, or will: its waiters wait for that
        elif was is S.LOADING:
            # the requests that waited on this load get one error each. A load
            # killed by a signal (the OOM killer, an operator) may have been no fault of
            # the model's: its waiters get two more tries, and the next failure answers
            # them (as the front sends a request whose child died on, twice: issue 19).
            message = f"model '{rec.group}' failed to load (attempt {attempt}): {description}"
            if killed:
                for ticket, _ in self.state.queue.keep_for_retries(rec.group):
                    self.moves.refuse(ticket, 503, message, retry_after_s=max(backoff, 1.0),
                                 model=rec.group, reason="load_failed")
                self.moves.idle(rec)
            else:
                self.moves.refuse_entry(rec.group, 503, message,
                                        retry_after_s=max(backoff, 1.0), reason="load_failed")
        if rec.rules.permanent and not self.state.groups.others_up(rec):
            self.state.queue.open(rec.group).explicit = True  # back at once (or after it)

    # ------------------------------------------------------------ memory facts

    def start_measuring(self) -> list[Effect]:
        self.state.out.extend(self.state.memory.unmeasured(self.state.models.values()))
        return self.moves.flush()

    def measure_started(self, model: str) -> list[Effect]:
        rec = self.state.models.get(model)
        for copy in self.state.groups.all_of(rec) if rec is not None else []:
            copy.memory = "measuring"
        return []

    def measured(self, model: str, ok: bool, min_: Breakdown | None,
                 max_: Breakdown | None, now: float, error: str | None = None,
                 at_load: bool = False, per_token: int = 0) -> list[Effect]:
        rec = self.state.models.get(model)
        if rec is None:
            return []
        for copy in self.state.groups.all_of(rec):  # a model's figures are its copies'
            if at_load and copy.state.is_serving:
                continue  # it runs already: the running child is sampled instead
            self.state.out.extend(self.state.memory.measured(copy, ok, min_, max_, error,
                                                             at_load, per_token))
        if self.handovers.pending:
            self.handovers.retry(now)
        self.rules.pump(now)
        return self.moves.flush()

    def devices_reported(self, report: DeviceReport, now: float) -> list[Effect]:
        self.state.out.extend(self.state.memory.reported(report, self.state.models))
        self.state.host.reported(report, self.state.models)
        self.rules.pump(now)
        return self.moves.flush()

    def devices_snapshot(self) -> DevicesSnapshot:
        return views.devices(self.state)

    # ------------------------------------------------------------ reload

    def reconfigure(self, added: dict[str, ModelRules | bool], removed: list[str],
                    changed: dict[str, ModelRules | bool], now: float,
                    retuned: dict[str, ModelRules] | None = None,
                    ) -> tuple[list[Effect], list[str]]:
        """A reload (R-2.6): models added, removed, or with a changed config (name ->
        rules, or just `pinned`); `retuned`: a change only the policy sees (replicas),
        its children kept. A changed running model loads beside its old child, which
        drains (handover.py), or without room for both, stops first once its requests
        have finished (as a removed one). Returns the effects and what restarts."""
        self.state.now = now
        for name, rules in (retuned or {}).items():
            self._set_rules(self.state.models[name], rules)
        self._add(added, now)
        self._remove(removed, now)
        restarted = self._change(changed, now)
        groups = self.state.groups
        for entry in self.state.queue.entries.values():  # its copy was taken out: claim again
            if entry.claimed and not any(r.state in (S.LOADING, S.STOPPING, S.WAKING)
                                         for r in groups.of(self.state.models[entry.model])):
                entry.claimed = False
        for name in (*changed, *(retuned or {})):  # a limit raised where a child serves on
            rec = self.state.models[name]  # (a remote model's, or copies retuned): its
            if rec.state.is_serving and not rec.retiring:  # waiters may go now
                self.rules.serve_waiters(rec, now)
        self.rules.pump(now)
        return self.moves.flush(), restarted

    def _add(self, added: dict[str, ModelRules | bool], now: float) -> None:
        """A reload's new models (a copy is measured as its model)."""
        for name, given in added.items():
            rules = given if isinstance(given, ModelRules) else ModelRules(pinned=given)
            old = self.state.models.get(name)
            if old is not None and old.removed:
                # Back before its old child was reaped: one record, which counts that
                # child until it exits.
                old.removed = False
                self._set_rules(old, rules)
            else:
                self.state.add_model(name, now, rules=rules)
            if self.state.memory_on and not rules.group and not rules.remote:
                self.state.out.append(Measure(name, front=False))  # (a copy: as its model)

    def _remove(self, removed: list[str], now: float) -> None:
        """A reload's removed models (and their reloads' newcomers): their requests are
        refused, their children stop once their requests have ended."""
        alternates = self.state.groups.alternates
        for name in dict.fromkeys(removed + [a.name for n in removed
                                             if (a := alternates.get(n)) is not None
                                             and a.name in self.state.models]):
            rec = self.state.models[name]
            rec.removed = True
            self.state.groups.drop(rec)  # a copy going: no longer one of its model's
            if not rec.rules.group:
                self.moves.refuse_entry(name, 400, f"model '{name}' was removed by a reload",
                                        reason="removed")
            if rec.state.is_running:
                self.moves.retire(rec, now)
            else:
                self.state.drop(name)  # a child still releasing: external from now on

    def _change(self, changed: dict[str, ModelRules | bool], now: float) -> list[str]:
        """A reload's changed models: new rules and figures; a running one hands over to
        a new child (or stops first where both do not fit). Returns those that restart."""
        groups, restarted = self.state.groups, []
        for name, given in changed.items():
            rec = self.state.models[name]
            self._set_rules(rec, given if isinstance(given, ModelRules)
                            else ModelRules(pinned=given))
            rec.breaker.reset()
            pair = [r for r in (rec, groups.partner(rec)) if r is not None]
            for r in pair:  # new arguments: new figures, new times (costs.py)
                r.times, r.guess_stops = SwapTimes(), 0
                if self.state.memory_on and not rec.rules.remote:
                    r.memory, r.mem_min, r.mem_max = "unmeasured", None, None
            if self.state.memory_on and not rec.rules.remote and not rec.rules.group:
                self.state.out.append(Measure(name, front=False))
            running = [r for r in pair if r.state.is_running and r.state is not S.STOPPING]
            if running:
                restarted.append(name)
                if not self.handovers.begin(rec, now):
                    for r in running:
                        self.moves.retire(r, now)
        return restarted

    def _set_rules(self, rec: ModelRecord, rules: ModelRules) -> None:
        """`rules` for config record `rec`, and its alternate (handover.py)."""
        groups = self.state.groups
        current = groups.current(rec)
        groups.drop(current)  # a reload may give or take its copies (issue 24)
        for r in (rec, groups.partner(rec)):
            if r is None:
                continue
            given = rules if r is rec else msgspec.structs.replace(rules, group=rec.group)
            if r.holds_slot:  # (a suspended child holds none: issue 23)
                self.state.n_running_pinned += int(given.pinned) - int(r.pinned)
            r.rules = given
        groups.add(current)
        groups.moved(current)
        self.state.rewarm()
        self.moves.idle(current)

