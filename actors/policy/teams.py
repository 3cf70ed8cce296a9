"""The model groups of issue 25 (`[groups.NAME]`), called teams here (a model's copies
are its `Groups`, replicas.py): `Teams`, the config's groups as the policy asks them;
their rules are carried out by `Teamwork` (teamwork.py; the persistent rule is the victim
choice's, choice.py):

- **persistent**: a member is never a victim for a model outside its group.
- **exclusive**: at most one member runs. Loading one stops the others first: an idle
  one at once, a busy one once its requests have ended (it takes no new ones meanwhile),
  a loading one once it is ready and has served what it loaded for. So a swap never
  cuts a request, and requests for the model going take their turn behind it.
- **together**: members load, are used and stop as a unit. Loading one loads the
  others (each as a `POST /models/load` would); a request to one counts as use of all
  (LRU, TTL), none is a victim while another is busy, and stopping one (LRU, memory,
  TTL, unload, a swap) stops the others.
"""

from __future__ import annotations

from ..config.rules import ModelGroup
from ..messages import EvictionReason

UNIT_STOPS: frozenset[EvictionReason] = frozenset({"lru", "memory", "ttl", "manual", "group"})
"""The stops of one member that stop its `together` partners (not a crash or a reload:
those restart the one child)."""


class Teams:
    """The config's `[groups]`, as the policy asks them (by model name)."""

    def __init__(self, groups: dict[str, ModelGroup] | None = None) -> None:
        self.groups: dict[str, ModelGroup] = {}
        self.rivals: dict[str, dict[str, str]] = {}
        """Model -> its exclusive rivals -> the group that makes them rivals."""
        self.partners: dict[str, dict[str, str]] = {}
        """Model -> its together partners -> their group."""
        self.kept: dict[str, frozenset[str]] = {}
        """Model -> the persistent groups it is in."""
        self.brought = False
        """Partners were queued by the last claims: the rules run once more."""
        self.dropped: set[str] = set()
        """Partners stopped with their group: a load of theirs queued with no request
        behind it is dropped at the next decision (else it would bring the group back)."""
        self.replace(groups or {})

    def replace(self, groups: dict[str, ModelGroup]) -> None:
        self.groups = dict(groups)
        self.rivals, self.partners = {}, {}
        kept: dict[str, set[str]] = {}
        for name, group in groups.items():
            for model in group.models:
                others = {o: name for o in group.models if o != model}
                if group.exclusive:
                    self.rivals.setdefault(model, {}).update(others)
                if group.together:
                    self.partners.setdefault(model, {}).update(others)
                if group.persistent:
                    kept.setdefault(model, set()).add(name)
        self.kept = {m: frozenset(g) for m, g in kept.items()}

    def keeps(self, victim: str, for_model: str | None) -> str | None:
        """The persistent group that keeps model `victim` from being evicted for
        `for_model` (None: it may be, or nobody is asking)."""
        groups = self.kept.get(victim)
        if not groups or for_model is None or for_model == victim:
            return None
        if any(for_model in self.groups[g].models for g in groups):
            return None
        return min(groups)
