"""Make-before-break reloads (issue 24): a running model whose config changed keeps serving
while its new config loads beside it, in its alternate instance (`NAME@next`); once that is
ready, requests go to it and the old child drains and stops. Where a slot or memory is
short for both at once, the old stops first, as before, and its event says so.

A config record and its alternate take turns: the next reload's new config loads in
whichever of the two is not serving. An alternate is never a load's target (replicas.py):
once its child ends, the model loads in its config record again.
"""

from __future__ import annotations

import logging

import msgspec

from ..ledger import node_of
from ..lifecycle import ModelState
from ..rules import alternate_name
from .records import ModelRecord
from .rules import Rules
from .state import State

log = logging.getLogger("corral.scheduler")

S = ModelState


class Handovers:
    """The reloads that load a model's new config beside its old child, on one `State`."""

    def __init__(self, state: State, rules: Rules) -> None:
        self.state = state
        self.rules = rules
        self.pending: set[ModelRecord] = set()
        """Newcomers whose figures are not known yet (they load once measured)."""

    def begin(self, rec: ModelRecord, now: float) -> bool:
        """`rec`'s config changed (its new rules are set): load the new one beside its
        serving child. False: nothing of it serves, or another handover of it is under
        way, or it has make_before_break off; the caller retires what runs."""
        groups = self.state.groups
        alt = groups.alternates.get(rec.name)
        live = next((r for r in (rec, alt) if r is not None and r.state.is_serving
                     and not r.retiring and r.state is not S.SUSPENDED), None)
        if (live is None or not rec.rules.make_before_break
                or any(r.takes_over for r in (rec, alt) if r is not None)):
            return False
        new = rec if live is not rec else self.alternate(rec)
        if new.state is not S.UNLOADED:  # (its last child still stopping)
            return False
        new.rules = rec.rules if new is rec else msgspec.structs.replace(
            rec.rules, group=rec.group)
        new.takes_over = live.name
        self.pending.add(new)
        self.attempt(new, now)
        return True

    def alternate(self, rec: ModelRecord) -> ModelRecord:
        """`rec`'s alternate record, made the first time a reload needs it."""
        groups = self.state.groups
        alt = groups.alternates.get(rec.name)
        if alt is None:
            name = alternate_name(rec.name)
            self.state.add_model(name, self.state.now, alternate_of=rec.name, rules=(
                msgspec.structs.replace(rec.rules, group=rec.group)))
            alt = self.state.models[name]
            groups.alternates[rec.name], groups.owners[name] = alt, rec
        alt.breaker = rec.breaker  # one model, one breaker
        alt.memory, alt.mem_min, alt.mem_max = rec.memory, rec.mem_min, rec.mem_max
        return alt

    def attempt(self, new: ModelRecord, now: float) -> None:
        """Load `new` beside the child it takes over from if a slot and memory are free
        as things are (nothing is evicted for it); else that child stops first."""
        state = self.state
        live = state.models.get(new.takes_over or "")
        if live is None or not live.state.is_serving or live.retiring:
            self.pending.discard(new)
            new.takes_over = None
            return
        if state.memory_on and not new.memory_settled:
            return  # measured() tries again
        self.pending.discard(new)
        short = None
        if not state.has_capacity():
            short = f"no free slot (models_max {state.models_max})"
        elif state.memory_on:
            plan = state.memory.plan(new, state.models, [], self.rules.loading_devices(new))
            if plan.verdict != "go" or plan.note or plan.evict:
                short = "not enough free memory for both children"
            else:
                new.placement = plan.devices
                new.node = node_of(plan.devices[0]) if plan.devices else None
        if short is not None:
            new.takes_over = None
            why = f"reload: {short}, so the old child stops before the new config loads"
            log.info("model %s: %s", live.name, why)
            self.rules.publish_state(live, why, now)
            self.rules.retire(live, now)
            return
        self.rules.spawn(new, 0, now, why=(
            f"reload, make-before-break: loads beside {live.name}#{live.generation}, "
            "which serves until this is ready"))

    def measured(self, now: float) -> None:
        for new in list(self.pending):
            self.attempt(new, now)

    def ready(self, new: ModelRecord, now: float) -> None:
        """`new` serves: the child it took over from drains and stops."""
        live = self.state.models.get(new.takes_over or "")
        new.takes_over = None
        if live is not None and live.state.is_serving:
            self.rules.retire(live, now)
