"""Make-before-break reloads (issue 24): a running model whose config changed keeps serving
while its new config loads beside it; once that child is ready, requests go to it and the
old child drains and stops. Where a slot or memory is short for both at once, the old
stops first, as before, and its event says so.

Each copy of a model (a model with no replicas is one copy) may have two records: its
config record (`NAME`, `NAME@2`) and its alternate (`NAME@next`, `NAME@2@next`), made by
the first reload that needs it. One of the two is the copy's current record (replicas.py:
it serves, loads and is its group's member); a reload loads the new config in the other,
and makes it current once it is ready. Both always carry the newest rules and config.
"""

from __future__ import annotations

import logging

import msgspec

from ..config.rules import alternate_name
from ..ledger import node_of
from ..lifecycle import ModelState
from .context import fits
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
        self.moves = self.rules.moves
        self.pending: set[ModelRecord] = set()
        """Newcomers not started yet: their figures are not known, or the child the
        record had is still on its way out."""
        self.why: dict[str, str] = {}
        """Newcomer -> what it loads for: "reload", or "drain" (drains.py)."""
        self.stuck: dict[str, str] = {}
        """Record -> why a drain cannot move it, whatever room is made (drains.py)."""

    def begin(self, rec: ModelRecord, now: float, why: str = "reload") -> bool:
        """The config of `rec`'s copy changed (the new rules are set on both its
        records), or its node drains (`why`): load it beside the copy's serving child.
        False: none serves (or it is suspended), or the model has make_before_break off;
        the caller retires what runs."""
        groups = self.state.groups
        live = groups.current(rec)
        if (not rec.rules.make_before_break or not live.state.is_serving or live.retiring
                or live.state is S.SUSPENDED):
            return False
        new = groups.partner(live) or self.alternate(live)
        if new is None or new.removed:  # (one of a removed model's, still going)
            return False
        if new.state in (S.LOADING, S.SUSPENDED):  # an earlier config's: it goes first
            new.takes_over = None
            self.moves.stop(new, "reload", None, now)
        new.takes_over = live.name
        self.why[new.name] = why
        self.pending.add(new)
        self.attempt(new, now)
        if self.state.has_room(live):  # the new rules may let more in (max_concurrency)
            self.rules.serve_waiters(live, now)
        return True

    def alternate(self, rec: ModelRecord) -> ModelRecord | None:
        """`rec`'s alternate record, made the first time a reload needs it (None while
        one of a model removed under that name still goes)."""
        groups = self.state.groups
        name = alternate_name(rec.name)
        if name in self.state.models:
            return None
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
        if live is None or not live.state.is_serving or live.retiring or new.removed:
            self.pending.discard(new)
            new.takes_over = None
            return
        if new.state is not S.UNLOADED or (state.memory_on and not new.memory_settled):
            return  # its old child still goes, or it is being measured: tried again then
        self.pending.discard(new)
        short, never = None, False  # never: it cannot go elsewhere even once room is made
        if not state.has_capacity():
            short = f"no free slot (models_max {state.models_max})"
        elif state.memory_on:  # (ctx = "fit": its context chosen, as any load's)
            plan = self.rules.up.plan(new, [], self.moves.loading_devices(new))
            if plan.verdict != "go" or plan.note or plan.evict:
                short = "not enough free memory for both children"
                never = plan.verdict == "refuse"
            else:
                new.placement = plan.devices
                new.node = node_of(plan.devices[0]) if plan.devices else None
        elif new.rules.nodes is not None:  # a node's free slot (models_max_per_node)
            choice = state.nodes.choose(new, state.models, [])
            new.node = choice.node if choice.verdict == "go" else None
            if new.node is None:
                short = f"no node with a free slot ({choice.why})"
                never = choice.verdict == "refuse"
        if short is not None:
            new.takes_over = None
            self._short(live, new, short, never, now)
            return
        self.moves.spawn(new, 0, now, why=(
            f"{self.why.get(new.name, 'reload')}, make-before-break: loads beside "
            f"{live.name}#{live.generation}, which serves until this is ready"))

    def _short(self, live: ModelRecord, new: ModelRecord, short: str, never: bool,
               now: float) -> None:
        """`new` cannot load beside `live` as things are: `live` stops first (once its
        requests end, for a drain), or, for a drain it could not go elsewhere at all
        (`never`), it stays (drains.py reads `stuck`)."""
        if (grown := self.why.get(new.name, "reload")).startswith("context"):
            log.info("model %s: not grown (%s): %s", live.name, grown, short)
            self.why.pop(new.name)
            return  # (growing is never worth a stop: it keeps what it has)
        if grown == "reload":
            why = f"reload: {short}, so the old child stops before the new config loads"
        elif never:
            self.stuck[live.name] = short
            return
        else:
            why = (f"drain: {short}, so the old child stops once its requests end; the "
                   "next request loads it elsewhere")
        log.info("model %s: %s", live.name, why)
        self.moves.publish_state(live, why, now)
        self.moves.retire(live, now, "reload" if why.startswith("reload") else "drain")

    def grow(self, rec: ModelRecord, asked: int, slot_ctx: int, now: float) -> None:
        """`rec`'s child (ctx = "fit") refused a request of `asked` tokens (0: it did not
        say) as more than its context (`slot_ctx` a slot, where it said: llama-server's
        -np slots each get a share of it): its copy reloads beside it, make-before-break,
        with the most context that fits beside what is up (nothing is evicted for it),
        if that is more than it has and holds what was asked in a slot (issue 44, part 3)."""
        fit, live, had = rec.rules.ctx_fit, self.state.groups.current(rec), rec.n_ctx
        new = self.state.groups.partner(rec)
        if fit is None or live is not rec or had is None or had >= fit[1] \
                or not rec.state.is_serving or rec.retiring \
                or (new is not None and (new.state is not S.UNLOADED or new in self.pending)):
            return  # (at its most already, going, or a reload or growth under way)
        slots = max(1, round(had / slot_ctx)) if 0 < slot_ctx < had else 1
        why = (f"a request of {asked or 'more'} tokens, more than its {had} context"
               + (f" ({slot_ctx} a slot)" if slots > 1 else ""))
        new = new or self.alternate(rec)
        if asked * slots > fit[1] or new is None:
            log.info("model %s: not grown: %s and ctx_max %d", rec.name, why, fit[1])
            return
        # (its figures as its running child taught them: the same config, the same model)
        new.memory, new.mem_min, new.mem_max, new.ctx_per_token, new.mem_error = \
            rec.memory, rec.mem_min, rec.mem_max, rec.ctx_per_token, rec.mem_error
        short = None
        if not self.state.has_capacity():
            short = f"no free slot (models_max {self.state.models_max})"
        elif self.state.memory_on:
            plan = self.rules.up.plan(new, [], self.moves.loading_devices(new))
            if not fits(plan) or (new.n_ctx or 0) <= had or (new.n_ctx or 0) < asked * slots:
                short = (f"{new.n_ctx} context at most fits beside what is up"
                         if fits(plan) else "no room beside what is up")
        if short is not None:
            log.info("model %s: not grown (%s): %s", rec.name, why, short)
            return
        log.info("model %s: grows from %d to %d context (%s)", rec.name, had, new.n_ctx, why)
        self.begin(rec, now, why=f"context {had} -> {new.n_ctx}, after {why}")

    def retry(self, now: float) -> None:
        """Something that held a newcomer back may have changed (a measurement, an exit)."""
        for new in list(self.pending):
            self.attempt(new, now)

    def ready(self, new: ModelRecord, now: float) -> None:
        """`new` serves: it becomes its copy's current record, and the child it took over
        from drains and stops."""
        live = self.state.models.get(new.takes_over or "")
        new.takes_over = None
        self.state.groups.swap(new)
        if live is not None and (live.state.is_serving or live.state is S.SUSPENDED):
            self.moves.retire(live, now, "drain" if self.why.pop(new.name, "") == "drain"
                              else "reload")
