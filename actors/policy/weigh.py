"""A memory plan (memory.py), and the weighing of the places a model may be loaded on
(R-5.9): with several, the cheapest wins. One where it fits as things are; then one
where it fits once the children already stopping are gone; then one where the idle models
to evict were used least recently; then one where it waits; ties go to the most free
memory, then to the first place.

Weighing a place costs a fit against the ledger, so each place first gets a lower bound
from facts found once per device, and places are weighed in the order of their bounds
until none left can cost less than the best weighed (R-5.9: the same choice, weighed
less).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from ..ledger import Breakdown, Ledger, node_of
from ..messages import Shortfall
from .nodes import NodeSlots, Room
from .places import Shortage
from .records import ModelRecord

Cost = tuple[float, ...]
"""A place's cost: its rank (0 fits now ... 4 refused), how recently its last victim was
used, less free memory, its index (unique: no two places tie)."""


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


class Fitter(Protocol):
    """What a weighing uses of the memory part (Memory)."""

    ledger: Ledger
    nodes: NodeSlots

    def need(self, rec: ModelRecord) -> Breakdown | None: ...

    def placed_need(self, rec: ModelRecord, devices: list[str] | None) -> Breakdown | None: ...

    def around(self, models: dict[str, ModelRecord]) -> Around: ...

    def fit(self, rec: ModelRecord, need: Breakdown | None, models: dict[str, ModelRecord],
            victims: Sequence[ModelRecord], on: set[str] | None = None,
            around: Around | None = None) -> Plan: ...


class Weighing:
    """The places `rec` may go now (none with a load in flight), weighed for one plan;
    `victims`: idle models, least recently used first."""

    def __init__(self, memory: Fitter, rec: ModelRecord, models: dict[str, ModelRecord],
                 victims: Sequence[ModelRecord], places: list[list[str]]) -> None:
        self.memory, self.rec, self.models, self.victims = memory, rec, models, victims
        self.places = places
        rooms = {node: memory.nodes.room(node, rec, models, victims)
                 for node in {node_of(p[0]) for p in places} if node is not None}
        self.full: dict[str, Room] = {node: room for node, room in rooms.items()
                                      if room.kind != "free"}
        """The nodes whose models_max_per_node slots are all taken."""
        available: dict[str, int | None] = dict(memory.ledger.all_available())
        get = available.get  # (one GPU a place, the most usual: no sum)
        self.frees = [get(p[0]) or 0 for p in places] if len(places[0]) == 1 else [
            sum([get(d) or 0 for d in devices]) for devices in places]
        self.short_at = Shortage(memory.need(rec), len(places[0]), available, memory.ledger)
        self.placed: dict[int, Breakdown | None] = {}
        self.spread = {d for devices in places for d in devices}

    def fits_now(self) -> Plan | None:
        """The cheapest plan there is: where it fits as things are, the most free memory
        of those, the first of equals (None: it fits nowhere as things are)."""
        short_at, places = self.short_at, self.places
        room_now = short_at.roomy(self.spread, None)
        fits = [i for i, devices in enumerate(places)
                if room_now.issuperset(devices) and node_of(devices[0]) not in self.full]
        if not fits:
            return None
        plan = Plan("go")
        plan.devices = list(places[min(fits, key=lambda i: (-self.frees[i], i))])
        return plan  # (the cached lists are shared: a copy)

    def cheapest(self, exhaustive: bool) -> Plan:
        """1. The facts per device, found once; 2. each place's lower bound; 3. places
        weighed in the order of their bounds, until none left can cost less than the best
        (`exhaustive`: all of them)."""
        self._facts()
        best: tuple[Cost, Plan] | None = None
        lows = self.bounds()  # (each ends in its place's index: unique)
        heapq.heapify(lows)
        while lows:
            low = heapq.heappop(lows)
            if best is not None and best[0] <= low and not exhaustive:
                break  # no place left can cost less
            weighed = self.weigh(int(low[-1]))
            if weighed is not None and (best is None or weighed[0] < best[0]):
                best = weighed
        return best[1] if best is not None else Plan("wait")

    def _facts(self) -> None:
        """What every place's bound and weight read: what is coming back and who holds
        memory where, the victims per device and their rank; per device, whether nothing
        else holds memory there (then it goes anyway) and whether it has room once what is
        coming back has come; per full node, the idle model whose slot it would take."""
        memory, rec = self.memory, self.rec
        self.around = memory.around(self.models)
        self.rank_of = {v.name: i for i, v in enumerate(self.victims)}
        self.on_device: dict[str, list[ModelRecord]] = {}  # the victims holding memory there
        for v in self.victims:
            for d in memory.ledger.held.get(v.name, {}):
                self.on_device.setdefault(d, []).append(v)
        self.first_on = {d: on[0].last_used for d, on in self.on_device.items()}
        holders = self.around.holders  # (a model holds memory on a device once)
        self.alone = {d for d in self.spread
                      if not (on := holders.get(d)) or (len(on) == 1 and on[0] is rec)}
        self.roomy = self.short_at.roomy(self.spread, self.around.coming_back)
        self.off_short = self.short_at([], self.around.coming_back)  # (off the GPUs)
        self.victim_of = {node: room.victim for node, room in self.full.items() if room.victim}

    def bounds(self) -> list[Cost]:
        """The least each place can cost: short even with what is coming back, it costs
        an eviction (its first victim's use at least) or a wait, unless nothing else
        holds memory there (then it goes anyway). One loop over thousands of places."""
        alone, roomy, first_on, victim_of = self.alone, self.roomy, self.first_on, self.victim_of
        roomy_too = not self.off_short
        out: list[Cost] = []
        for i, (devices, free) in enumerate(zip(self.places, self.frees, strict=True)):
            if alone.issuperset(devices):
                out.append((0, 0.0, -free, i))
            elif roomy_too and roomy.issuperset(devices):
                out.append((1, 0.0, -free, i))
            elif victim_of and (slot := victim_of.get(node_of(devices[0]) or "")) is not None:
                out.append((2, slot.last_used, -free, i))
            elif firsts := [first_on[d] for d in devices if d in first_on]:
                out.append((2, min(firsts), -free, i))
            else:
                out.append((3, 0.0, -free, i))
        return out

    def weigh(self, i: int) -> tuple[Cost, Plan] | None:
        """The plan at place i, and its cost: what it takes, how recently used its
        victims were, less free memory; None where the node's slots are all busy."""
        memory, rec, models, around = self.memory, self.rec, self.models, self.around
        devices = self.places[i]
        if i not in self.placed:
            self.placed[i] = memory.placed_need(rec, devices)
        need, on = self.placed[i], set(devices)
        useful = sorted({v.name: v for d in devices for v in self.on_device.get(d, [])}
                        .values(), key=lambda v: self.rank_of[v.name])
        room = self.full.get(node_of(devices[0]) or "")
        if room is not None and room.kind == "busy":
            return None  # the node has models_max_per_node running, none of them idle
        if room is None:
            plan = memory.fit(rec, need, models, useful, on, around)
        elif room.victim is None:  # "freeing": a child stopping there frees the slot
            plan = memory.fit(rec, need, models, useful, on, around)
            if plan.verdict == "go":
                plan.verdict, plan.fits_once_freed = "wait", True
        else:  # a slot on its node first: its least recently used idle model goes
            slot = room.victim
            useful = [v for v in useful if v is not slot]
            plan = memory.fit(rec, need, models, useful, on, around.but(slot, memory.ledger))
            plan.evict.insert(0, (slot, []))
            if plan.verdict == "go":
                plan.verdict = "wait"  # for the slot: its exit re-pumps
        plan.devices = list(devices)
        rank = (0 if plan.verdict == "go" and not plan.evict
                else 1 if plan.fits_once_freed and not plan.evict
                else 2 if plan.evict else 3 if plan.verdict != "refuse" else 4)
        recency = max((v.last_used for v, _ in plan.evict), default=0.0)
        return (rank, recency, -self.frees[i], i), plan
