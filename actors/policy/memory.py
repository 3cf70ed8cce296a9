"""The memory part of the policy (SPEC R-5.2, R-5.5 to R-5.7): the plan for a model about
to load: go, wait, evict these first, or refuse (what a measurement or a device report
means for the ledger: reports.py). It decides; the core carries the plan out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..ledger import Breakdown, DeviceUse, Ledger, MiB, node_of
from ..lifecycle import ModelState
from ..messages import Shortfall
from .context import sized
from .nodes import NodeSlots
from .places import Places
from .records import ModelRecord
from .reports import Reports
from .weigh import Around, Plan, Weighing

log = logging.getLogger("corral.scheduler")

S = ModelState
GOING = frozenset({S.STOPPING, S.SUSPENDING})
"""A model on its way out: what it holds is coming back."""


class Memory(Reports):
    def __init__(self, margin: int, account_host: bool, nodes: NodeSlots | None = None) -> None:
        self.on = margin > 0
        """Memory accounting decides loads; off at margin 0, as in the reference."""
        self.ledger = Ledger(margin, account_host)
        self.nodes = nodes or NodeSlots()
        """The cluster's nodes and models_max_per_node (shared with the core)."""
        self.places = Places()
        self.releasing: set[ModelRecord] = set()
        """The records whose `releasing` was set (a superset of those it still is)."""
        self.backends: list[str] = []
        self.kept: Callable[[ModelRecord, str | None], bool] = lambda victim, model: False
        """Whether a model group keeps `victim` from being evicted for `model` (State's
        kept_from): such memory is as good as pinned to a plan's refusal."""
        self.epoch = 0
        """Bumped by every change of a record's state and every device report: with the
        ledger's version, what a plan that waits for memory coming back depends on."""
        self.waits: dict[str, tuple[tuple[object, ...], Plan]] = {}
        """Model -> the inputs and the plan of its last wait for memory coming back."""
        self.usage_seen: dict[str, tuple[dict[str, int], int]] = {}
        """Model -> its usage in the last device report, and the ledger's shape then: the
        same again needs no work."""

    @staticmethod
    def need(rec: ModelRecord) -> Breakdown | None:
        """What a load of `rec` holds until it is charged its real use: at the context
        chosen for it (ctx = "fit": context.py), else `max` if measured (it runs at its
        configured context), else `min`."""
        return sized(rec) or rec.mem_max or rec.mem_min

    def devices_of(self, rec: ModelRecord) -> set[str]:
        """The devices a load of `rec` uses; every one it may use while that is not known
        yet (a probe, or a model corral places)."""
        if rec.placement:
            return set(rec.placement)
        gpus = {n for n, d in self.ledger.devices.items() if d.kind == "device"}
        unknown = rec.memory in ("at_load", "failed") and not rec.mem_effective
        if self.candidates(rec) or unknown:
            return set(rec.rules.devices or gpus) & gpus if rec.rules.devices else gpus
        need = rec.mem_max or rec.mem_min or rec.mem_effective
        return {row.name for row in need.devices if row.kind == "device"} if need else set()

    def spawning(self, rec: ModelRecord) -> None:
        """A child still releasing from its last run is replaced by the new hold."""
        rec.releasing = False
        self.ledger.release(rec.name)
        self.ledger.reserve(rec.name, self.placed_need(rec, rec.placement))

    # ------------------------------------------------------------ placement

    def candidates(self, rec: ModelRecord) -> list[list[str]]:
        """The device sets `rec` may be placed on (places.py)."""
        places = self.places.of(rec.rules, self.ledger)
        if self.nodes.draining and rec.rules.nodes is not None:  # (a place is on one node)
            return [p for p in places if node_of(p[0]) not in self.nodes.draining]
        return places

    def placed_need(self, rec: ModelRecord, devices: list[str] | None) -> Breakdown | None:
        """`rec`'s need moved onto `devices`: what it measured on GPUs, split evenly over
        them (the measurement names the GPUs it happened to run on), host rows as they are."""
        need = self.need(rec)
        if need is None or not devices:
            return need
        gpu = sum(r.self_bytes for r in need.devices if r.kind == "device")
        rows = [r for r in need.devices if r.kind != "device"]
        rows += [DeviceUse(kind="device", name=d, model=gpu // len(devices)) for d in devices]
        return Breakdown(need.n_ctx, rows)

    # ------------------------------------------------------------ the rule

    def plan(self, rec: ModelRecord, models: dict[str, ModelRecord],
             victims: Sequence[ModelRecord], busy: set[str] | None = None,
             exhaustive: bool = False) -> Plan:
        """R-5.7: may `rec` spawn now, and where? `victims`: idle models, least recently
        used first. With several places it may go, the cheapest wins: one where it fits
        as things are, then one where it fits once the children already stopping are
        gone, then one where the idle models to evict were used least recently, then one
        where it waits; ties go to the most free memory (R-5.9).

        A plan that waits for memory coming back is the cheapest there is but for one
        that fits as things are: no new victim makes a cheaper one, so while no record's
        state, device figure or hold has changed, the same plan is given again (a full
        cluster's head of queue is planned at every request that comes or goes)."""
        inputs = (rec.generation, rec.rules, rec.memory, rec.mem_max, rec.mem_min, rec.n_ctx,
                  self.ledger.version, self.epoch, frozenset(busy or ()), self.nodes.version)
        if not exhaustive and (last := self.waits.get(rec.name)) and last[0] == inputs:
            return last[1]
        plan = self._plan(rec, models, victims, busy, exhaustive)
        if plan.verdict == "wait" and plan.fits_once_freed and not plan.evict:
            self.waits[rec.name] = (inputs, plan)
        else:
            self.waits.pop(rec.name, None)
        return plan

    def _plan(self, rec: ModelRecord, models: dict[str, ModelRecord],
              victims: Sequence[ModelRecord], busy: set[str] | None,
              exhaustive: bool) -> Plan:
        """R-5.7's decision, in this order."""
        # 1. A model not measured yet waits: its measurement decides.
        if not rec.memory_settled:
            return Plan("wait", measure=not rec.measure_requested_first)
        # 2. Bound to nodes, or placed by corral, with no place to go: it waits for the
        #    devices to report, or is refused; one corral does not place fits as it is.
        places = self.candidates(rec)
        nowhere = self._nowhere(rec, places)
        if nowhere is not None:
            return nowhere
        if not places:
            return self.fit(rec, self.need(rec), models, victims)
        # 3. One load per device at a time: the places with a load in flight wait.
        free_places = [p for p in places if busy.isdisjoint(p)] if busy else places
        if not free_places:
            return Plan("wait")
        # 4. Where it fits as things are: the cheapest there is. Else each place is
        #    weighed, in the order of its lower bound, until none left can cost less.
        weighing = Weighing(self, rec, models, victims, free_places)
        return weighing.fits_now() or weighing.cheapest(exhaustive)

    def _nowhere(self, rec: ModelRecord, places: list[list[str]]) -> Plan | None:
        """Step 2 of a plan: a wait or a refusal for a model with no place to go, bound
        to nodes or to be placed on GPUs (None: it has places, or needs none)."""
        nodes = rec.rules.nodes
        if nodes is not None and not places:
            reported = {node_of(d) for d in self.ledger.devices}
            if any(n not in reported for n in nodes if n not in self.nodes.draining):
                return Plan("wait")  # one of its nodes has not reported its devices yet
            if drained := [n for n in nodes if n in self.nodes.draining]:
                return Plan("refuse", refusal=f"model '{rec.name}' cannot be placed: "
                            + self.nodes.drained_why(nodes, drained))
            lost = all(n in self.nodes.down for n in nodes)
            return Plan("refuse", refusal=(
                f"model '{rec.name}' cannot be placed: {'node lost: ' if lost else ''}none "
                f"of its nodes ({', '.join(nodes)}) has a GPU up (GET /nodes)"))
        if places or not (rec.rules.placeable and (rec.rules.devices
                                                   or rec.rules.devices_per_instance > 1)):
            return None
        if not self.ledger.devices:
            return Plan("wait")  # the first device report re-pumps
        gpus = sorted(n for n, d in self.ledger.devices.items() if d.kind == "device")
        return Plan("refuse", refusal=(
            f"model '{rec.name}' cannot be placed: it needs "
            f"{rec.rules.devices_per_instance} of {rec.rules.devices or 'any GPU'} "
            f"(devices, devices_per_instance), and the GPUs seen are {gpus}"))

    def around(self, models: dict[str, ModelRecord]) -> Around:
        """What every place a plan weighs shares, computed once for all of them."""
        going: list[str] = []  # (only what they hold counts)
        holders: dict[str, list[ModelRecord]] = {}
        for name, devices in self.ledger.held.items():
            holder = models.get(name)
            if holder is None:
                continue
            if holder.state in GOING or holder.releasing or holder.draining:
                going.append(name)
            if holder.state.is_running or holder.releasing:
                for d in devices:
                    holders.setdefault(d, []).append(holder)
        return Around(self.ledger.holds_of(going), holders)

    def fit(self, rec: ModelRecord, need: Breakdown | None, models: dict[str, ModelRecord],
             victims: Sequence[ModelRecord], on: set[str] | None = None,
             around: Around | None = None) -> Plan:
        """Whether `need` fits, after evicting which of `victims`; `on`: the devices it is
        being placed on (then only models holding memory there count as "others")."""
        around = around or self.around(models)
        plan = Plan("wait")
        coming_back = dict(around.coming_back)
        short = self.ledger.deficit(need, coming_back)
        for victim in victims:
            if not short:
                break
            plan.evict.append((victim, [
                Shortfall(device=d, needed=row.self_bytes, available=self.ledger.available(d) or 0,
                          margin=self.ledger.margin)
                for row in (need.devices if need else []) if (d := row.name) in short]))
            for d, size in self.ledger.held.get(victim.name, {}).items():
                coming_back[d] = coming_back.get(d, 0) + size
            short = self.ledger.deficit(need, coming_back)
        if not short:
            # It fits once what is being stopped has come back.
            plan.verdict = "go" if not self.ledger.deficit(need) else "wait"
            plan.fits_once_freed = plan.verdict == "wait"
            return plan
        if on is None:
            others = [r for r in models.values()
                      if r is not rec and (r.state.is_running or r.releasing)]
        else:
            others = list({r.name: r for d in on for r in around.holders.get(d, [])
                           if r is not rec}.values())
        missing = ", ".join(f"{b / MiB:.0f} MiB on {d}" for d, b in short.items())
        if not others:
            return Plan("go", note=f"model {rec.name} is projected to be short by {missing} "
                        "with nothing else loaded; loading anyway (the minimum is pessimistic)")
        if all((r.pinned or self.kept(r, rec.group)) and r.state is not S.STOPPING
               and not r.releasing for r in others):
            return Plan("refuse", refusal=(
                f"model '{rec.name}' does not fit: short by {missing} beyond "
                f"memory_margin_mib, and the models holding memory are pinned, or kept "
                f"from it by a model group ({', '.join(r.name for r in others)}); "
                "unload one"))
        return plan  # busy models finish, stops complete: both re-pump

    # ------------------------------------------------------------ waking (issue 23)

    def wake_need(self, rec: ModelRecord) -> Breakdown | None:
        """What a wake of `rec` holds until it is charged its real use: what it was seen
        using before its suspend, else its need where it was placed."""
        return rec.mem_effective or self.placed_need(rec, rec.placement)

    def plan_wake(self, rec: ModelRecord, models: dict[str, ModelRecord],
                  victims: Sequence[ModelRecord], busy: set[str]) -> Plan:
        """May the suspended `rec` wake now, where it sleeps? A load's plan on its
        devices, for its need less what its sleeping child holds there still: go, wait
        (after evicting idle models there), or refuse (only pinned models hold the
        memory: it is stopped, and loaded anew, elsewhere if it may)."""
        on = self.devices_of(rec)
        if not busy.isdisjoint(on):
            return Plan("wait")  # one load per device at a time
        need = self.wake_need(rec)
        own = self.ledger.held.get(rec.name, {})
        extra = need and Breakdown(need.n_ctx, [
            DeviceUse(kind=row.kind, name=row.name, total=row.total, free=row.free,
                      model=max(0, row.self_bytes - own.get(row.name, 0)))
            for row in need.devices])
        useful = [v for v in victims if not on.isdisjoint(self.ledger.held.get(v.name, {}))]
        plan = self.fit(rec, extra, models, useful, on or None)
        plan.devices = rec.placement
        return plan
