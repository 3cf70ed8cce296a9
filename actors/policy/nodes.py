"""Cluster nodes in the policy: which are up, and the one rule of `models_max_per_node`.

A node at its cap makes room as `models_max` does for the whole corral: its least recently
used idle model is stopped, and the newcomer waits for that slot (issue 19). With memory
accounting the plan weighs that slot against the other places (memory.py); without it,
`NodeSlots.choose` picks the node. Pure: the Scheduler tells it what the links see.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..lifecycle import ModelState
from .records import ModelRecord

S = ModelState

RoomKind = Literal["free", "evict", "freeing", "busy"]


@dataclass(frozen=True)
class Room:
    """What a node offers a newcomer: a free slot; a slot once `victim` (its least recently
    used idle model) is stopped; a slot once a child already stopping there is gone; or
    none until one of its busy models is released."""

    kind: RoomKind
    victim: ModelRecord | None = None
    pinned: bool = False
    """busy, and every model there is pinned: no slot will come free by itself."""


@dataclass(frozen=True)
class NodeChoice:
    """Where a model with `nodes` (and no memory accounting) goes: `node` (go); or it waits,
    after stopping `victim` on `node` if one is named; or it is refused, saying why."""

    verdict: Literal["go", "wait", "refuse"]
    node: str | None = None
    victim: ModelRecord | None = None
    why: str | None = None
    """What it waits for, or why it is refused (said to the requests)."""


class NodeSlots:
    def __init__(self, per_node_max: int = 0) -> None:
        self.per_node_max = per_node_max
        """models_max_per_node: most children running on one node (0: any number)."""
        self.down: dict[str, str] = {}
        """Node -> why its agent is not up (lost, or never reached)."""
        self.up: set[str] = set()
        """Nodes whose agent is up. A node in neither is not heard of yet."""
        self.draining: set[str] = set()
        """Nodes a person drained (drains.py): no child is started there."""
        self.version = 0
        """Counts the changes of `down` and `draining` (what a memory plan depends on)."""

    def changed(self, node: str, up: bool, why: str) -> None:
        self.version += 1
        if up:
            self.up.add(node)
            self.down.pop(node, None)
        else:
            self.up.discard(node)
            self.down[node] = why

    def room(self, node: str, rec: ModelRecord, models: dict[str, ModelRecord],
             victims: Sequence[ModelRecord]) -> Room:
        """What `node` offers `rec`. `victims`: idle models, least recently used first.
        Children being stopped free their slot once reaped, so a node where one is
        stopping waits for it rather than stopping another (as `Rules.tick` counts them)."""
        if not self.per_node_max:
            return Room("free")
        live = stopping = 0
        pinned = True
        for r in models.values():
            if r is rec or r.node != node or not r.state.is_running:
                continue
            if r.state is S.STOPPING:
                stopping += 1
            else:
                live += 1
                pinned = pinned and r.pinned
        if live + stopping < self.per_node_max:
            return Room("free")
        if live < self.per_node_max:
            return Room("freeing")
        victim = next((v for v in victims if v.node == node), None)
        if victim is not None:
            return Room("evict", victim)
        return Room("busy", pinned=pinned)

    def choose(self, rec: ModelRecord, models: dict[str, ModelRecord],
               victims: list[ModelRecord], avoid: set[str | None] | None = None) -> NodeChoice:
        """The first of `rec`'s nodes that is up and has a free slot (those in `avoid`
        last: where other copies of its model run); else the node whose least recently
        used idle model was used least recently, once that one is stopped; else a wait
        (a stop or a release re-pumps), or a refusal when no slot can come."""
        nodes = sorted(rec.rules.nodes or [], key=lambda n: n in (avoid or ()))
        up = [n for n in nodes if n in self.up and n not in self.draining]
        if not up:
            unheard = [n for n in nodes if n not in self.down and n not in self.draining]
            if unheard:
                return NodeChoice("wait", why=f"node {unheard[0]} not reached yet")
            if drained := [n for n in nodes if n in self.draining]:
                return NodeChoice("refuse", why=self.drained_why(nodes, drained))
            return NodeChoice("refuse", why=(
                "node lost: none of its nodes has an agent up ("
                + "; ".join(f"{n}: {self.down[n]}" for n in nodes)
                + "); see GET /nodes"))
        rooms = {n: self.room(n, rec, models, victims) for n in up}
        free = [n for n in up if rooms[n].kind == "free"]
        if free:
            return NodeChoice("go", free[0])
        evict = [n for n in up if rooms[n].kind == "evict"]
        cap = f"(models_max_per_node {self.per_node_max})"
        if evict:  # as models_max: the least recently used of the idle models goes
            rank = {v.name: i for i, v in enumerate(victims)}
            node = min(evict, key=lambda n: rank[rooms[n].victim.name])  # type: ignore[union-attr]
            return NodeChoice("wait", node, rooms[node].victim,
                              why=f"node {node} at its cap {cap}: its least recently used "
                                  "idle model is being stopped")
        if any(rooms[n].kind == "freeing" for n in up):
            return NodeChoice("wait", why=f"node at its cap {cap}: waiting for a child "
                                          "being stopped there")
        names = ", ".join(up)
        if all(rooms[n].pinned for n in up):
            return NodeChoice("refuse", why=(
                f"node at its cap {cap}: every model running on {names} is pinned; "
                "unload one or raise models_max_per_node"))
        return NodeChoice("wait", why=f"node at its cap {cap}: every model on {names} is "
                                      "busy")

    def drained_why(self, nodes: list[str], drained: list[str]) -> str:
        """Why a model whose nodes are all drained or lost cannot be started."""
        lost = [f"{n}: {self.down[n]}" for n in nodes if n in self.down and n not in drained]
        return (f"every node it may run on is drained or lost (drained: {', '.join(drained)}"
                + (f"; lost: {'; '.join(lost)}" if lost else "")
                + "); POST /nodes/NODE/undrain, or see GET /nodes")
