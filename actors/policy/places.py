"""Where a model may be placed (R-5.9): the device sets its rules allow, among the devices
the ledger knows. A plan weighs them (memory.py); listing them is cached per rules and
ledger shape, since models, and the copies of one, share rules far more often than not,
and listing 2,800 places at every decision cost most of a full cluster's plan.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from ..config.rules import ModelRules
from ..ledger import Breakdown, Ledger, node_of

NOTHING: dict[str, int] = {}


class Places:
    def __init__(self) -> None:
        self._cached: dict[tuple[object, ...], tuple[int, list[list[str]]]] = {}
        """(nodes, devices, devices_per_instance) -> the ledger's shape, and the places
        for those rules then."""

    def of(self, rules: ModelRules, ledger: Ledger) -> list[list[str]]:
        """The device sets a model of `rules` may be placed on; none when there is
        nothing to choose (one GPU and no `devices` key) or its env pins
        CUDA_VISIBLE_DEVICES. The lists are shared: copy one before changing it."""
        if not rules.placeable:
            return []
        key = (tuple(rules.nodes) if rules.nodes is not None else None,
               tuple(rules.devices) if rules.devices is not None else None,
               rules.devices_per_instance)
        cached = self._cached.get(key)
        if cached is not None and cached[0] == ledger.shape:
            return cached[1]
        places = self._list(rules, ledger)
        self._cached[key] = (ledger.shape, places)
        return places

    @staticmethod
    def _list(rules: ModelRules, ledger: Ledger) -> list[list[str]]:
        gpus = sorted(n for n, d in ledger.devices.items()
                      if d.kind == "device" and d.total > 0  # 0: a lost node's
                      and (node_of(n) in rules.nodes if rules.nodes is not None
                           else node_of(n) is None))
        if rules.devices is None and len(gpus) <= 1 and rules.nodes is None:
            return []
        allowed = sorted((d for d in (rules.devices or gpus) if d in gpus),
                         key=lambda d: node_of(d) or "")  # one child, one node
        return [list(c) for _, on_node in itertools.groupby(allowed, node_of)
                for c in itertools.combinations(on_node, rules.devices_per_instance)]


class Shortage:
    """`short(devices, back)`: whether `ledger.deficit(placed_need(devices), back)` has
    any row, for a model of `need` placed on `per_place` GPUs, asked of thousands of
    places at one cost each: its rows off the GPUs are the same everywhere (looked at
    once with and once without `back`, one plan's memory coming back), and on each GPU
    of a place it needs an even share of its GPU bytes (Memory.placed_need).
    `available`: device -> ledger.available(device), as the plan began."""

    def __init__(self, need: Breakdown | None, per_place: int,
                 available: dict[str, int | None], ledger: Ledger) -> None:
        self.need, self.available, self.ledger = need, available, ledger
        self.share = 0 if need is None else sum(
            r.self_bytes for r in need.devices if r.kind == "device") // per_place
        self.off_gpu = None if need is None else Breakdown(
            need.n_ctx, [r for r in need.devices if r.kind != "device"])
        self.off_short: dict[bool, bool] = {}
        self.memo: dict[int, dict[str, bool]] = {}
        """id(back) -> device -> short there (a plan asks of a device from every place it
        is in, with at most two `back`s, both alive for the plan)."""

    def __call__(self, devices: list[str], back: dict[str, int] | None) -> bool:
        if self.need is None:
            return False
        coming = back if back is not None else NOTHING
        known = self.memo.setdefault(id(coming), {})
        available, margin, share = self.available, self.ledger.margin, self.share
        for d in devices:
            there = known.get(d)
            if there is None:
                a = available.get(d)
                there = known[d] = a is not None and a + coming.get(d, 0) - margin < share
            if there:
                return True
        return self.off(back)

    def off(self, back: dict[str, int] | None) -> bool:
        """Short off the GPUs (host memory, with account_host), whatever the place."""
        if self.off_gpu is None:
            return False
        if (back is None) not in self.off_short:
            self.off_short[back is None] = bool(self.ledger.deficit(self.off_gpu, back))
        return self.off_short[back is None]

    def roomy(self, devices: Iterable[str], back: dict[str, int] | None) -> set[str]:
        """The devices among `devices` where a share fits: those `d` for which
        `short([d], back)` is False, found in one pass (a plan asks of every GPU)."""
        if self.need is None:
            return set(devices)
        if self.off(back):
            return set()
        coming = back if back is not None else NOTHING
        available, floor = self.available, self.ledger.margin + self.share
        return {d for d in devices
                if (a := available.get(d)) is None or a + coming.get(d, 0) >= floor}
