"""The memory part of the policy (SPEC R-5.2, R-5.5 to R-5.7): the plan for a model about
to load: go, wait, evict these first, or refuse (what a measurement or a device report
means for the ledger: reports.py). It decides; the core carries the plan out.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from ..ledger import Breakdown, DeviceUse, Ledger, MiB, node_of
from ..lifecycle import ModelState
from ..messages import Shortfall
from .nodes import NodeSlots
from .places import Places, shortage
from .records import ModelRecord
from .reports import Reports

log = logging.getLogger("corral.scheduler")

S = ModelState


@dataclass
class Plan:
    verdict: Literal["go", "wait", "refuse"]
    evict: list[tuple[ModelRecord, list[Shortfall]]] = field(default_factory=list)
    """Stop these first (reason `memory`), with what the newcomer lacked on each device."""
    measure: bool = False
    """Ask for a measurement at the front of the measure queue."""
    refusal: str | None = None
    devices: list[str] | None = None
    """Where it goes, when corral places it (R-5.9)."""
    fits_once_freed: bool = False
    """It fits once the children already stopping have given their memory back."""
    note: str | None = None
    """What to log if this plan is carried out: a plan is a pure decision, weighed for
    places that may not be chosen, and logs nothing itself."""


@dataclass
class Around:
    """What a plan's places share: the memory of the models on their way out, and per
    device the models holding some of it."""

    coming_back: dict[str, int]
    holders: dict[str, list[ModelRecord]]

    def but(self, leaving: ModelRecord, ledger: Ledger) -> Around:
        """The same, with `leaving`'s memory coming back too."""
        coming_back = dict(self.coming_back)
        for d, size in ledger.held.get(leaving.name, {}).items():
            coming_back[d] = coming_back.get(d, 0) + size
        return Around(coming_back, self.holders)


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
        """What a load of `rec` holds until it is charged its real use: `max` if measured
        (it runs at its configured context), else `min`."""
        return rec.mem_max or rec.mem_min

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
        return self.places.of(rec.rules, self.ledger)

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
             victims: list[ModelRecord], busy: set[str] | None = None,
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
        inputs = (rec.generation, rec.rules, rec.memory, rec.mem_max, rec.mem_min,
                  self.ledger.version, self.epoch, frozenset(busy or ()), len(self.nodes.down))
        if not exhaustive and (last := self.waits.get(rec.name)) and last[0] == inputs:
            return last[1]
        plan = self._plan(rec, models, victims, busy, exhaustive)
        if plan.verdict == "wait" and plan.fits_once_freed and not plan.evict:
            self.waits[rec.name] = (inputs, plan)
        else:
            self.waits.pop(rec.name, None)
        return plan

    def _plan(self, rec: ModelRecord, models: dict[str, ModelRecord],
              victims: list[ModelRecord], busy: set[str] | None,
              exhaustive: bool) -> Plan:
        if not rec.memory_settled:
            return Plan("wait", measure=not rec.measure_requested_first)  # the measurement decides
        places = self.candidates(rec)
        nodes = rec.rules.nodes
        if nodes is not None and not any(node_of(d) in nodes for d in self.ledger.devices):
            return Plan("wait")  # none of its nodes has reported its devices yet
        if nodes is not None and not places:
            lost = all(n in self.nodes.down for n in nodes)
            return Plan("refuse", refusal=(
                f"model '{rec.name}' cannot be placed: {'node lost: ' if lost else ''}none "
                f"of its nodes ({', '.join(nodes)}) has a GPU up (GET /nodes)"))
        if not places:
            if rec.rules.placeable and (rec.rules.devices or rec.rules.devices_per_instance > 1):
                if not self.ledger.devices:
                    return Plan("wait")  # the first device report re-pumps
                gpus = sorted(n for n, d in self.ledger.devices.items() if d.kind == "device")
                return Plan("refuse", refusal=(
                    f"model '{rec.name}' cannot be placed: it needs "
                    f"{rec.rules.devices_per_instance} of {rec.rules.devices or 'any GPU'} "
                    f"(devices, devices_per_instance), and the GPUs seen are {gpus}"))
            return self._fit(rec, self.need(rec), models, victims)
        free_places = [p for p in places if not set(p) & busy] if busy else places
        if not free_places:
            return Plan("wait")  # each place has a load in flight: one per device at a time
        rooms = {node: self.nodes.room(node, rec, models, victims)
                 for node in {node_of(p[0]) for p in free_places} if node is not None}
        full = {node: room for node, room in rooms.items() if room.kind != "free"}
        available: dict[str, int | None] = dict(self.ledger.all_available())
        frees = [sum([available.get(d) or 0 for d in devices]) for devices in free_places]
        short_at = shortage(self.need(rec), len(free_places[0]), available, self.ledger)
        placed: dict[int, Breakdown | None] = {}

        def need_at(i: int) -> Breakdown | None:
            if i not in placed:
                placed[i] = self.placed_need(rec, free_places[i])
            return placed[i]

        # The cheapest there is: where it fits as things are, the most free memory of
        # those, the first of equals.
        spread = {d for devices in free_places for d in devices}
        room_now = set() if short_at([], None) else {d for d in spread
                                                     if not short_at([d], None)}
        fits = [i for i, devices in enumerate(free_places)
                if room_now.issuperset(devices) and node_of(devices[0]) not in full]
        if fits:
            plan = Plan("go")
            plan.devices = list(free_places[min(fits, key=lambda i: (-frees[i], i))])
            return plan  # (the cached lists are shared: a copy)
        around = self._around(models)
        rank_of = {v.name: i for i, v in enumerate(victims)}
        on_device: dict[str, list[ModelRecord]] = {}  # the victims holding memory there
        for v in victims:
            for d in self.ledger.held.get(v.name, {}):
                on_device.setdefault(d, []).append(v)

        def weigh(i: int) -> tuple[tuple[float, ...], Plan] | None:
            """The plan at place i, and its cost: what it takes, how recently used its
            victims were, less free memory; None where the node's slots are all busy."""
            devices, need = free_places[i], need_at(i)
            on = set(devices)
            useful = sorted({v.name: v for d in devices for v in on_device.get(d, [])}
                            .values(), key=lambda v: rank_of[v.name])
            room = full.get(node_of(devices[0]) or "")
            if room is not None and room.kind == "busy":
                return None  # the node has models_max_per_node running, none of them idle
            if room is None:
                plan = self._fit(rec, need, models, useful, on, around)
            elif room.victim is None:  # "freeing": a child stopping there frees the slot
                plan = self._fit(rec, need, models, useful, on, around)
                if plan.verdict == "go":
                    plan.verdict, plan.fits_once_freed = "wait", True
            else:  # a slot on its node first: its least recently used idle model goes
                slot = room.victim
                useful = [v for v in useful if v is not slot]
                plan = self._fit(rec, need, models, useful, on, around.but(slot, self.ledger))
                plan.evict.insert(0, (slot, []))
                if plan.verdict == "go":
                    plan.verdict = "wait"  # for the slot: its exit re-pumps
            plan.devices = list(devices)
            rank = (0 if plan.verdict == "go" and not plan.evict
                    else 1 if plan.fits_once_freed and not plan.evict
                    else 2 if plan.evict else 3 if plan.verdict != "refuse" else 4)
            recency = max((v.last_used for v, _ in plan.evict), default=0.0)
            return (rank, recency, -frees[i], i), plan

        # The lower bound of each place (weigh() only where it may win), from facts per
        # device found once: short even with what is coming back, a place costs an
        # eviction (its first victim's use at least) or a wait, unless nothing else holds
        # memory there (then it goes anyway).
        first_on = {d: on[0].last_used for d, on in on_device.items()}  # its LRU victim's
        alone = {d for d in spread if not any(r is not rec for r in around.holders.get(d, ()))}
        roomy = {d for d in spread if not short_at([d], around.coming_back)}
        off_short = short_at([], around.coming_back)  # (what it needs off the GPUs)
        victim_of = {node: room.victim for node, room in full.items() if room.victim}

        def bound(i: int) -> tuple[float, ...]:
            devices = free_places[i]
            if alone.issuperset(devices):
                return (0, 0.0, -frees[i], i)
            if not off_short and roomy.issuperset(devices):
                return (1, 0.0, -frees[i], i)
            slot = victim_of.get(node_of(devices[0]) or "") if victim_of else None
            if slot is not None:
                return (2, slot.last_used, -frees[i], i)
            firsts = [first_on[d] for d in devices if d in first_on]
            return (2, min(firsts), -frees[i], i) if firsts else (3, 0.0, -frees[i], i)

        best: tuple[tuple[float, ...], Plan] | None = None
        lows = [bound(i) for i in range(len(free_places))]  # (each ends in i: unique)
        heapq.heapify(lows)
        while lows:
            low = heapq.heappop(lows)
            i = int(low[-1])
            if best is not None and best[0] <= low and not exhaustive:
                break  # no place left can cost less (R-5.9: the same choice, weighed less)
            weighed = weigh(i)
            if weighed is not None and (best is None or weighed[0] < best[0]):
                best = weighed
        return best[1] if best is not None else Plan("wait")

    def _around(self, models: dict[str, ModelRecord]) -> Around:
        """What every place a plan weighs shares, computed once for all of them."""
        going = [name for name in self.ledger.held  # (only what they hold counts)
                 if (r := models.get(name)) is not None
                 and (r.state in (S.STOPPING, S.SUSPENDING) or r.releasing or r.draining)]
        holders: dict[str, list[ModelRecord]] = {}
        for name, devices in self.ledger.held.items():
            holder = models.get(name)
            if holder is not None and (holder.state.is_running or holder.releasing):
                for d in devices:
                    holders.setdefault(d, []).append(holder)
        return Around(self.ledger.holds_of(going), holders)

    def _fit(self, rec: ModelRecord, need: Breakdown | None, models: dict[str, ModelRecord],
             victims: list[ModelRecord], on: set[str] | None = None,
             around: Around | None = None) -> Plan:
        """Whether `need` fits, after evicting which of `victims`; `on`: the devices it is
        being placed on (then only models holding memory there count as "others")."""
        around = around or self._around(models)
        plan = Plan("wait")
        coming_back = dict(around.coming_back)
        short = self.ledger.deficit(need, coming_back)
        for victim in victims:
            if not short:
                break
            plan.evict.append((victim, [
                Shortfall(device=d, needed=row.self_bytes, available=self.ledger.available(d) or 0)
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
                  victims: list[ModelRecord], busy: set[str]) -> Plan:
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
        plan = self._fit(rec, extra, models, useful, on or None)
        plan.devices = rec.placement
        return plan
