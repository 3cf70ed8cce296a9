"""Drained cluster nodes (issue 42): a person takes a node out of service
(`POST /nodes/{id}/drain`, `corral drain NODE`) and puts it back (`undrain`).

- No child is started on a draining node: nodes.py `choose` and memory.py `candidates`
  leave it out, for loads, wakes of copies and reloads alike.
- Each model serving there loads beside itself on another of its nodes first, as a
  reload does (handover.py): where a slot and memory are free for both as things are,
  the new child serves once ready and the old one drains and stops; else the old child
  stops once its requests end, and the next request loads the model elsewhere, making
  room there as any load does. One try per child: a move that fails leaves the model
  where it is, shown, until a node comes up or goes.
- A model with no other node up that it may run on stays, and the drain says why; so
  does one that could not go elsewhere whatever room were made (the slots there held by
  pinned models, or memory that refuses it); each moves once a node comes up or goes.
- A suspended child there is stopped (it would wake where it sleeps): its next request
  loads it elsewhere.
- The node is drained when no child of corral's runs there but those that stay.
- `undrain`: the node takes children again; what moved stays where it went.

The API keeps the drained nodes across restarts (actors/http/nodes_api.py); here a drain
is state like any other, with no file.
"""

from __future__ import annotations

import logging

from ..lifecycle import ModelState
from ..messages import DrainView
from .handover import Handovers
from .records import ModelRecord
from .state import State

log = logging.getLogger("corral.scheduler")

S = ModelState


class Drains:
    """The drained nodes of one `State`, and the moves off them."""

    def __init__(self, state: State, handovers: Handovers) -> None:
        self.state = state
        self.handovers = handovers
        self.moves = handovers.moves
        self.tried: set[tuple[str, int]] = set()
        """(record, generation) of the children a move was begun for, once each."""
        self.stays: dict[str, dict[str, str]] = {}
        """Draining node -> model -> why it stays there."""
        self.version = -1
        """The nodes' version `tried` is of (nodes.py `NodeSlots.version`)."""

    def drain(self, node: str, now: float) -> None:
        nodes = self.state.nodes
        if node not in nodes.draining:
            nodes.draining.add(node)
            nodes.version += 1
        self.step(now)

    def undrain(self, node: str) -> None:
        nodes = self.state.nodes
        if node in nodes.draining:
            nodes.draining.discard(node)
            nodes.version += 1
        self.stays.pop(node, None)

    def step(self, now: float) -> None:
        """Begin the moves that can begin (the rules call this at each pump while a node
        drains), and say what stays: each child on a draining node, once while the nodes
        stay as they are (a node that comes up, or goes, is a new chance)."""
        nodes = self.state.nodes
        if nodes.version != self.version:
            self.version, self.tried = nodes.version, set()
            self.handovers.stuck.clear()
        stays: dict[str, dict[str, str]] = {node: {} for node in nodes.draining}
        for rec in list(self.state.models.values()):
            node = rec.node
            if (node is None or node not in nodes.draining or rec.removed or rec.retiring
                    or rec.takes_over or rec.state in (S.UNLOADED, S.STOPPING)):
                continue
            if rec.state is S.SUSPENDED:  # it would wake where it sleeps: load it anew
                self.moves.stop(rec, "drain", None, now, note=f"node {node} drains")
            elif rec.state.is_serving and self.state.groups.current(rec) is not rec:
                self.moves.retire(rec, now, "drain")  # (its copy's other child serves)
            elif (partner := self.state.groups.partner(rec)) and partner.takes_over == rec.name:
                continue  # its move is under way
            elif rec.state.is_serving and (why := self._stays(rec)) is not None:
                if rec.group not in self.stays.get(node, {}):
                    log.info("model %s stays on draining node %s: %s", rec.group, node, why)
                stays[node][rec.group] = why
            elif rec.state.is_serving and (rec.name, rec.generation) not in self.tried:
                self._move(rec, node, now)
        self.stays = stays

    def _stays(self, rec: ModelRecord) -> str | None:
        """Why `rec` (serving on a draining node, not moving) stays there; None: it
        moves."""
        partner = self.state.groups.partner(rec)
        if not self._elsewhere(rec):
            return (f"no other node it may run on is up and in service (nodes: "
                    f"{', '.join(rec.rules.nodes or [])})")
        if (stuck := self.handovers.stuck.get(rec.name)) is not None:
            return f"it cannot load on another node: {stuck}"
        if (rec.name, rec.generation) in self.tried:
            return (f"its move failed ({partner.last_exit if partner else 'stopped'}); it "
                    "serves here until a node comes up or goes, or the node is undrained")
        return None

    def _move(self, rec: ModelRecord, node: str, now: float) -> None:
        self.tried.add((rec.name, rec.generation))
        why = f"node {node} drains: moves to {' or '.join(self._elsewhere(rec))}"
        log.info("model %s: %s", rec.name, why)
        self.moves.publish_state(rec, why, now)
        if not self.handovers.begin(rec, now, why="drain"):
            self.moves.retire(rec, now, "drain")

    def _elsewhere(self, rec: ModelRecord) -> list[str]:
        nodes = self.state.nodes
        return [n for n in rec.rules.nodes or []
                if n in nodes.up and n not in nodes.draining]

    def view(self, node: str) -> DrainView:
        """What GET /nodes shows of `node`'s drain."""
        if node not in self.state.nodes.draining:
            return DrainView(node=node, state="in_service")
        stays = self.stays.get(node, {})
        there = sorted(r.group for r in self.state.models.values()
                       if r.node == node and r.state.is_running)
        moving = [m for m in dict.fromkeys(there) if m not in stays]
        return DrainView(node=node, state="draining" if moving else "drained",
                         moving=moving, stays=dict(stays))
