"""A model's copies (issue 24): which records are the replicas of one model, which of them
a request goes to, and which one a load of the model starts.

Each replica is a record of its own (`NAME`, `NAME@2` ...: actors/config/rules.py), so a replica
loads, serves, is evicted, suspended and reaped as any model is. What they share is kept
on the model's own record, the first: its queue (requests wait for the model, not for a
copy), its breaker, its figures, and the generation count, so that `(model, generation)`
names one child however many copies there are and a grant can carry the model's name.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable

from ..config.rules import SEPARATOR, SESSION
from ..lifecycle import ModelState
from .records import ModelRecord

S = ModelState
HOMES_MAX = 4096
"""Prompts a model routed by prefix remembers the copy of (the least recent go first)."""
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
        self.wanting: dict[str, None] = {}
        """The active groups to look at for scaling at the next decision (scale.py), in
        the order they came to want a look (a set's order was the strings' hashes: which
        of two models got the one free GPU depended on PYTHONHASHSEED)."""
        self.active: dict[str, list[ModelRecord]] = {}
        """The groups with a copy up (only they may scale, or have spare copies): kept
        by `moved`, so a decision looks at those, not at every model with replicas."""
        self.alternates: dict[str, ModelRecord] = {}
        """Config record's name -> its alternate (`NAME@next`, handover.py)."""
        self.owners: dict[str, ModelRecord] = {}
        """Alternate's name -> its config record."""
        self.turned: dict[str, ModelRecord] = {}
        """Config record's name -> its alternate, while that is the current one."""
        self.homes: dict[str, OrderedDict[int, str]] = {}
        """Model routed by prefix -> the prompts (affinities) it has seen, least recently
        first -> the copy each went to (`home`)."""
        self.homed: dict[str, dict[str, int]] = {}
        """Model -> copy -> how many of those prompts went to it."""
        self.seen: dict[str, OrderedDict[int, float]] = {}
        """Model -> the sessions among its prompts, least recently first -> when each
        last came (`expire`)."""

    def add(self, rec: ModelRecord) -> None:
        if rec.rules.replicas is None or rec.removed or not self.is_current(rec):
            return
        group = self.members.setdefault(rec.group, [])
        group.append(rec)
        group.sort(key=number)  # the model's own record first
        if (group[0].alternate_of or group[0].name) == rec.group:
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
            self.wanting[rec.group] = None
        else:
            self.active.pop(rec.group, None)
            self.busy_since.pop(rec.group, None)

    # A copy's two records (handover.py): its config record and its alternate take turns
    # as its current one, which is what serves it, loads it and is its group's member;
    # the other holds at most a child on its way in or out.

    def current(self, rec: ModelRecord) -> ModelRecord:
        """The current record of the copy `rec` is a record of."""
        config = self.owners.get(rec.name, rec)
        return self.turned.get(config.name, config)

    def is_current(self, rec: ModelRecord) -> bool:
        turned = self.turned.get(rec.alternate_of or rec.name)
        return turned is rec if turned is not None else rec.alternate_of is None

    def partner(self, rec: ModelRecord) -> ModelRecord | None:
        """The other record of `rec`'s copy, if it has one."""
        return self.owners.get(rec.name) or self.alternates.get(rec.name)

    def swap(self, new: ModelRecord) -> None:
        """`new` becomes its copy's current record (its child is ready)."""
        old = self.current(new)
        config = self.owners.get(new.name, new)
        if new is config:
            self.turned.pop(config.name, None)
        else:
            self.turned[config.name] = new
        group = self.members.get(new.group)
        if group is not None and old in group:
            group[group.index(old)] = new
            self.moved(new)

    def of(self, rec: ModelRecord) -> list[ModelRecord]:
        """The current records of the copies of `rec`'s model."""
        group = self.members.get(rec.group)
        if group is not None:
            return group
        return [self.current(rec)] if self.alternates else [rec]

    def all_of(self, rec: ModelRecord) -> list[ModelRecord]:
        """Every record of `rec`'s model: its copies' current ones and their partners."""
        copies = self.of(rec)
        if not self.alternates:
            return copies
        return copies + [p for r in copies if (p := self.partner(r)) is not None]

    def others_up(self, rec: ModelRecord) -> bool:
        """Another copy of its model serves or is on its way: `rec` going leaves the
        model up (a child draining for a reload does not count)."""
        if rec.group not in self.members and not self.alternates:
            return False
        return any(r is not rec and r.state in UP and not r.retiring for r in self.of(rec))

    def next_generation(self, rec: ModelRecord) -> int:
        """The generation `rec`'s next child gets: above every copy's, those a reload took
        out of the group while their children still run included (a model's count only
        grows, so one taken out and added back never meets its own generation again)."""
        given = 1 + max(self.given.get(rec.group, 0),
                        *(r.generation for r in self.all_of(rec)))
        if rec.rules.replicas is not None or rec.group in self.given:
            self.given[rec.group] = given
        return given

    def target(self, rec: ModelRecord) -> ModelRecord | None:
        """The copy a load of `rec`'s model starts (a suspended one wakes first, else the
        first unloaded one); a stopping one when nothing else is free; None when a copy
        serves or is on its way already (the model needs no load)."""
        group = self.members.get(rec.group)
        if group is None:
            return self.current(rec) if self.alternates else rec
        if rec.group in self.active:  # a copy is up
            return None
        for wanted in (S.SUSPENDED, S.UNLOADED, S.STOPPING):
            for r in group:
                if r.state is wanted and not r.removed:
                    return r
        return None

    def route(self, rec: ModelRecord, affinity: int,
              has_room: Callable[[ModelRecord], bool], now: float = 0.0) -> ModelRecord | None:
        """The copy of `rec`'s model a request goes to now, None if none has room: a
        session's (`affinity` at or above SESSION), the copy it went to while it comes
        back within session_ttl_s; `prefix`, the copy `affinity` (a hash of the prompt's
        start) ranks first among those with room (rendezvous hashing: a copy that comes
        or goes moves only its own share); either unless that copy has more than
        prefix_overload requests above the least busy; else (`least_loaded`) the less
        busy of two picked at random."""
        group = self.members.get(rec.group)
        if group is None:
            rec = self.current(rec) if self.alternates else rec
            return rec if has_room(rec) else None
        ready = [r for r in group if has_room(r)]
        rules = rec.rules.replicas
        assert rules is not None
        session = affinity >= SESSION and rules.session_ttl_s > 0
        if len(ready) < 2:
            if session and ready:  # (its home now, as the other copies come up)
                self.expire(rec.group, affinity, now, rules.session_ttl_s)
                self.home(rec.group, affinity, ready, group)
            return ready[0] if ready else None
        if session or (rules.route == "prefix" and 0 < affinity < SESSION):
            least = min(ready, key=lambda r: r.in_flight)
            if session:
                self.expire(rec.group, affinity, now, rules.session_ttl_s)
            best = self.home(rec.group, affinity, ready, group)
            return best if best.in_flight - least.in_flight <= rules.prefix_overload else least
        a, b = self.rng.sample(ready, 2)
        return a if a.in_flight <= b.in_flight else b

    def expire(self, model: str, session: int, now: float, ttl_s: float) -> None:
        """A session's copy is forgotten once it has not come back for ttl_s (it goes
        where it fits now, as a new one); else its time is now."""
        seen = self.seen.setdefault(model, OrderedDict())
        last = seen.pop(session, None)
        if last is not None and now - last > ttl_s and (homes := self.homes.get(model)):
            name = homes.pop(session, None)
            if name is not None:
                self.homed[model][name] -= 1
        seen[session] = now
        while len(seen) > HOMES_MAX:  # (a session the homes let go of first: no matter)
            seen.popitem(last=False)

    def home(self, model: str, affinity: int, ready: list[ModelRecord],
             copies: list[ModelRecord]) -> ModelRecord:
        """The copy a prompt of `affinity` goes to: where it went last, while that copy
        serves (its prompt is in that copy's cache); a prompt new to the model goes to the
        copy rendezvous hashing ranks first among those below their even share of the
        prompts remembered (consistent hashing with bounded loads: a copy's cache holds
        its share of the conversations, not what a skewed hash gives it)."""
        homes = self.homes.setdefault(model, OrderedDict())
        counts = self.homed.setdefault(model, {})
        name = homes.get(affinity)
        if name is not None:
            copy = next((r for r in copies if r.name == name), None)
            if copy is not None and copy.state.is_serving and not copy.retiring:
                homes.move_to_end(affinity)  # (a copy at its max_concurrency: not now)
                return copy if copy in ready else min(ready, key=lambda r: r.in_flight)
            counts[name] -= 1  # its copy is gone or going: a new home
        share = -(-(len(homes) + (name is None)) // len(ready))  # ceil
        ranked = sorted(ready, key=lambda r: rank(affinity, r.name), reverse=True)
        copy = next((r for r in ranked if counts.get(r.name, 0) < share), ranked[0])
        homes[affinity] = copy.name
        homes.move_to_end(affinity)
        counts[copy.name] = counts.get(copy.name, 0) + 1
        if len(homes) > HOMES_MAX:
            _, gone = homes.popitem(last=False)
            counts[gone] -= 1
        return copy


def number(rec: ModelRecord) -> int:
    """A copy's number: 1 for the model's own record, N for `NAME@N` (and its alternate,
    `NAME@N@next`)."""
    name = rec.alternate_of or rec.name
    return 1 if name == rec.group else int(name.rpartition(SEPARATOR)[2])


def rank(affinity: int, name: str) -> int:
    """Rendezvous weight of copy `name` for a prompt of `affinity`."""
    digest = hashlib.blake2b(name.encode(), digest_size=8,
                             key=affinity.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little")
