"""A model's copies (issue 24): which records are the replicas of one model, which of them
a request goes to, and which one a load of the model starts.

Each replica is a record of its own (`NAME`, `NAME@2` ...: actors/rules.py), so a replica
loads, serves, is evicted, suspended and reaped as any model is. What they share is kept
on the model's own record, the first: its queue (requests wait for the model, not for a
copy), its breaker, its figures, and the generation count, so that `(model, generation)`
names one child however many copies there are and a grant can carry the model's name.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

from ..lifecycle import ModelState
from ..rules import SEPARATOR
from .records import ModelRecord

S = ModelState
UP = frozenset({S.LOADING, S.WAKING, S.LOADED, S.SLEEPING})
"""A copy that serves, or will once its load or wake ends."""


class Groups:
    """The models that run as several copies: model -> its records, the first the model's
    own. A model with one copy has no group (every query here is then about one record)."""

    def __init__(self) -> None:
        self.members: dict[str, list[ModelRecord]] = {}
        self.rng = random.Random(0)
        """For the two random choices of least_loaded (seeded: the policy is a function
        of its events)."""
        self.busy_since: dict[str, float] = {}
        """Model -> since when its copies have averaged more than target_in_flight."""
        self.due: dict[str, float] = {}
        """Model -> when a Repump is pending for its scaling."""
        self.given: dict[str, int] = {}
        """Model (with copies, now or once) -> the last generation given to one of them."""
        self.wanting: set[str] = set()
        """The active groups to look at for scaling at the next decision (scale.py)."""
        self.active: dict[str, list[ModelRecord]] = {}
        """The groups with a copy up (only they may scale, or have spare copies): kept
        by `moved`, so a decision looks at those, not at every model with replicas."""
        self.alternates: dict[str, ModelRecord] = {}
        """Config record's name -> its alternate (handover.py): serving beside it, or in
        its place, until that child ends; never a member, never a load's target."""
        self.owners: dict[str, ModelRecord] = {}
        """Alternate's name -> its config record."""

    def add(self, rec: ModelRecord) -> None:
        if rec.rules.replicas is None or rec.removed or rec.alternate_of:
            return
        group = self.members.setdefault(rec.group, [])
        group.append(rec)
        group.sort(key=number)  # the model's own record first
        if group[0].name == rec.group:
            for copy in group[1:]:
                copy.breaker = group[0].breaker  # one breaker for the model

    def drop(self, rec: ModelRecord) -> None:
        group = self.members.get(rec.group)
        if group is not None and rec in group:
            group.remove(rec)
            if not group:
                del self.members[rec.group]
                self.busy_since.pop(rec.group, None)
                self.due.pop(rec.group, None)
            self.moved(rec)

    def moved(self, rec: ModelRecord) -> None:
        """A copy changed state (or joined or left): its group is active while one of its
        copies is up."""
        group = self.members.get(rec.group)
        if group is not None and any(r.state in UP for r in group):
            self.active[rec.group] = group
            self.wanting.add(rec.group)
        else:
            self.active.pop(rec.group, None)
            self.busy_since.pop(rec.group, None)

    def of(self, rec: ModelRecord) -> list[ModelRecord]:
        """`rec` and the other copies of its model, their alternates included."""
        group = self.members.get(rec.group)
        if not self.alternates:
            return group or [rec]
        base = group or [self.owners[rec.name] if rec.alternate_of else rec]
        extra = [a for r in base if (a := self.alternates.get(r.name)) is not None]
        return base + extra if extra else base

    def others_up(self, rec: ModelRecord) -> bool:
        """Another copy of its model serves or is on its way: `rec` going leaves the
        model up."""
        if rec.group not in self.members and not self.alternates:
            return False
        return any(r is not rec and r.state in UP for r in self.of(rec))

    def next_generation(self, rec: ModelRecord) -> int:
        """The generation `rec`'s next child gets: above every copy's, those a reload took
        out of the group while their children still run included (a model's count only
        grows, so one taken out and added back never meets its own generation again)."""
        given = 1 + max(self.given.get(rec.group, 0), *(r.generation for r in self.of(rec)))
        if rec.rules.replicas is not None or rec.group in self.given:
            self.given[rec.group] = given
        return given

    def target(self, rec: ModelRecord) -> ModelRecord | None:
        """The copy a load of `rec`'s model starts (a suspended one wakes first, else the
        first unloaded one); a stopping one when nothing else is free; None when a copy
        serves or is on its way already (the model needs no load). Never an alternate:
        one loads only to take over from its config record (handover.py)."""
        group = self.members.get(rec.group)
        if self.alternates and any(r.alternate_of and r.state in UP for r in self.of(rec)):
            return None
        if group is None:
            return rec
        if rec.group in self.active:  # a copy is up
            return None
        for wanted in (S.SUSPENDED, S.UNLOADED, S.STOPPING):
            for r in group:
                if r.state is wanted and not r.removed:
                    return r
        return None

    def route(self, rec: ModelRecord, affinity: int,
              has_room: Callable[[ModelRecord], bool]) -> ModelRecord | None:
        """The copy of `rec`'s model a request goes to now, None if none has room:
        `least_loaded`, the less busy of two picked at random; `prefix`, the copy
        `affinity` (a hash of the prompt's start) ranks first among those with room
        (rendezvous hashing: a copy that comes or goes moves only its own share), unless
        it has more than prefix_overload requests above the least busy."""
        group = self.members.get(rec.group)
        if group is None and not self.alternates:
            return rec if has_room(rec) else None
        ready = [r for r in self.of(rec) if has_room(r)]
        if len(ready) < 2:
            return ready[0] if ready else None
        rules = rec.rules.replicas
        if rules is None:  # a model and its alternate, both serving (a reload's handover)
            return min(ready, key=lambda r: r.in_flight)
        if rules.route == "prefix" and affinity:
            least = min(ready, key=lambda r: r.in_flight)
            best = max(ready, key=lambda r: rank(affinity, r.name))
            return best if best.in_flight - least.in_flight <= rules.prefix_overload else least
        a, b = self.rng.sample(ready, 2)
        return a if a.in_flight <= b.in_flight else b


def number(rec: ModelRecord) -> int:
    """A copy's number: 1 for the model's own record, N for `NAME@N`."""
    return 1 if rec.name == rec.group else int(rec.name.rpartition(SEPARATOR)[2])


def rank(affinity: int, name: str) -> int:
    """Rendezvous weight of copy `name` for a prompt of `affinity`."""
    digest = hashlib.blake2b(name.encode(), digest_size=8,
                             key=affinity.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")
