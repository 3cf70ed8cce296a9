"""Model groups (issue 25, policy/teams.py and choice.py), driven synchronously: exclusive
swaps that never cut a request, together loads and stops, persistent members that
outsiders never evict. Plus a random history per kind of group whose invariant is
checked after every step."""

from __future__ import annotations

import copy
import os
import random

import pytest

from actors.config.rules import ModelGroup, ModelRules
from actors.lifecycle import ModelState
from actors.messages import Evicted, Grant, Refusal, Withdraw
from actors.policy.records import Spawn, Stop
from tests.test_policy import World, drain, random_history

S = ModelState


def grouped(models_max: int, **groups: ModelGroup) -> World:
    w = World(models_max=models_max, rules={n: ModelRules(ttl_s=0) for n in "abcd"})
    w.run(w.p.set_groups(groups, w.now))
    return w


@pytest.fixture(autouse=True)
def _record_evictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep every Evicted event a World sees, as `World.evicted`."""
    real = World.run

    def run(self: World, effects: list) -> list:
        from actors.policy.records import Publish
        self.__dict__.setdefault("evicted", []).extend(
            e.event for e in effects if isinstance(e, Publish) and isinstance(e.event, Evicted))
        return real(self, effects)

    monkeypatch.setattr(World, "run", run)


def swap() -> ModelGroup:
    return ModelGroup(models=["a", "b"], exclusive=True)


# ------------------------------------------------------------------ exclusive


def test_an_exclusive_member_loads_only_after_the_other_has_stopped() -> None:
    w = grouped(4, s=swap())
    w.load_idle("a")
    assert w.acquire(1, "b") is None
    assert w.stops == [("a", "group")] and w.state("b") == "unloaded"
    last = w.evicted[-1]
    assert (last.model, last.reason, last.for_model) == ("a", "group", "b")
    assert "exclusive group 's'" in (last.why or "")
    w.exited("a")
    assert w.spawns[-1] == ("b", 1)
    w.ready("b")
    assert isinstance(w.answers[1], Grant)


def test_a_busy_member_finishes_its_requests_and_takes_no_new_ones_before_the_swap() -> None:
    w = grouped(4, s=swap())
    w.load_idle("a")
    assert isinstance(w.acquire(1, "a"), Grant)
    effects = w.run(w.p.acquire(2, "b", w.tick()))
    assert any(isinstance(e, Withdraw) and e.model == "a" for e in effects)
    assert w.stops == [] and w.p.state.models["a"].retiring
    assert w.acquire(3, "a") is None  # a late request for a waits behind the swap
    w.release(1)
    assert w.stops == [("a", "group")]
    w.exited("a")
    w.ready("b")
    assert isinstance(w.answers[2], Grant)
    w.release(2)  # then a's turn comes back: b goes the same way
    assert w.stops[-1] == ("b", "group")
    w.exited("b")
    w.ready("a")
    assert isinstance(w.answers[3], Grant)


def test_a_loading_member_serves_what_it_loaded_for_before_it_gives_way() -> None:
    w = grouped(4, s=swap())
    w.acquire(1, "a")
    assert w.acquire(2, "b") is None and w.stops == []
    w.ready("a")
    assert isinstance(w.answers[1], Grant)
    assert w.p.state.models["a"].retiring  # b waits now: a takes nothing new
    w.release(1)
    w.exited("a")
    w.ready("b")
    assert isinstance(w.answers[2], Grant)


def test_an_exclusive_swap_does_not_evict_an_outsider_for_the_slot() -> None:
    """models_max 2 with a and c loaded: b's slot is the one a gives up."""
    w = grouped(2, s=swap())
    w.load_idle("c", "a")
    w.acquire(1, "b")
    assert w.stops == [("a", "group")]
    w.exited("a")
    w.ready("b")
    assert w.state("c") == "loaded"


def test_a_warm_member_gives_way_and_does_not_load_beside_its_running_rival() -> None:
    w = World(models_max=4, rules={"a": ModelRules(), "b": ModelRules(warm=True),
                                   "c": ModelRules(), "d": ModelRules()})
    w.run(w.p.set_groups({"s": swap()}, w.now))
    assert w.state("b") == "loading"  # warm, with nothing else running
    w.acquire(1, "a")
    assert w.stops == [("b", "warm")]
    w.exited("b")
    w.ready("a")
    w.release(1)
    w.now += 10
    w.fire_timers()
    assert w.state("b") == "unloaded" and w.state("a") == "loaded"


# ------------------------------------------------------------------ together


def pair() -> ModelGroup:
    return ModelGroup(models=["a", "b"], together=True)


def test_a_together_member_brings_the_other() -> None:
    w = grouped(4, t=pair())
    w.acquire(1, "a")
    assert sorted(w.spawns) == [("a", 1), ("b", 1)]
    w.ready("a")
    w.ready("b")
    assert isinstance(w.answers[1], Grant)
    assert w.p.state.queue.entries == {}  # b's load was held by nothing else


def test_together_members_are_used_as_one_and_stop_as_one() -> None:
    w = grouped(3, t=pair())
    w.acquire(1, "a")
    w.settle()
    w.release(1)
    w.load_idle("c")
    w.acquire(2, "b")  # b used after c: c is the LRU, not a (a was "used" with b)
    w.release(2)
    w.acquire(3, "d")
    assert w.stops == [("c", "lru")]
    w.exited("c")
    w.ready("d")
    w.release(3)
    w.acquire(4, "c")  # now a and b are the least recently used: both go
    assert set(w.stops[1:]) == {("a", "lru"), ("b", "group")} or \
        set(w.stops[1:]) == {("b", "lru"), ("a", "group")}
    partner = w.evicted[-1]
    assert partner.reason == "group" and "together group 't'" in (partner.why or "")


def test_no_together_member_is_a_victim_while_another_is_busy() -> None:
    w = grouped(2, t=pair())
    w.acquire(1, "a")
    w.settle()
    assert isinstance(w.answers[1], Grant)
    assert w.acquire(2, "c") is None
    assert w.stops == []  # b is idle, but a is busy: the pair stays
    w.release(1)
    assert len(w.stops) == 2 and {m for m, _ in w.stops} == {"a", "b"}


def test_unloading_one_together_member_stops_the_other_once_it_is_idle() -> None:
    w = grouped(4, t=pair())
    w.acquire(1, "a")
    w.settle()
    w.acquire(2, "b")
    w.run(w.p.unload("u", "a", w.tick()))
    assert ("a", "manual") in w.stops and w.p.state.models["b"].retiring
    w.release(2)
    assert ("b", "group") in w.stops


def test_a_crash_of_one_together_member_does_not_stop_the_other() -> None:
    w = grouped(4, t=pair())
    w.acquire(1, "a")
    w.settle()
    w.release(1)
    w.exited("b", rc=1)
    assert w.state("a") == "loaded" and w.stops == []


# ------------------------------------------------------------------ persistent


def kept() -> ModelGroup:
    return ModelGroup(models=["a", "b"], persistent=True)


def test_persistent_members_are_never_evicted_for_an_outsider() -> None:
    w = grouped(3, p=kept())
    w.load_idle("a", "b", "c")
    w.acquire(1, "d")
    assert w.stops == [("c", "lru")]  # c is the newest, yet the only one that may go


def test_an_outsider_no_slot_will_free_for_is_refused_saying_why() -> None:
    w = grouped(2, p=kept())
    w.load_idle("a", "b")
    answer = w.acquire(1, "c")
    assert isinstance(answer, Refusal) and answer.status == 503
    assert "persistent members are never evicted" in answer.message
    assert w.stops == []


def test_persistent_members_evict_each_other() -> None:
    w = grouped(1, p=kept())
    w.load_idle("a")
    w.acquire(1, "b")
    assert w.stops == [("a", "lru")]


def test_groups_change_with_a_reload() -> None:
    w = grouped(2, p=kept())
    w.load_idle("a", "b")
    w.run(w.p.set_groups({}, w.tick()))
    w.acquire(1, "c")
    assert w.stops == [("a", "lru")]


# ------------------------------------------------------------------ random histories


def up(w: World, model: str) -> bool:
    return w.p.state.models[model].state is not S.UNLOADED


@pytest.mark.parametrize("seed", range(int(os.environ.get("CORRAL_GROUP_SEEDS", "12"))))
def test_random_histories_keep_each_groups_rule(seed: int) -> None:
    """Requests, releases, cancels, readies and crashes at random, with a group of each
    kind: after every step no two exclusive members run, nothing persistent was evicted
    for an outsider, and no decision was left undone (running the rules again changes
    nothing); at the end nothing waits."""
    rng = random.Random(seed)
    w = grouped(rng.choice([2, 3]), s=ModelGroup(models=["a", "b"], exclusive=True),
                p=ModelGroup(models=["c", "d"], persistent=True),
                t=ModelGroup(models=["b", "c"], together=True))
    real = w.run

    def checked(effects: list) -> list:
        out = real(effects)
        assert not (up(w, "a") and up(w, "b")), "two exclusive members run"
        for e in w.evicted:
            if e.reason in ("lru", "memory") and e.model in "cd":
                assert e.for_model in ("c", "d", None), e
        again = [e for e in copy.deepcopy(w.p).repump(w.now) if isinstance(e, (Spawn, Stop))]
        assert again == [], f"left undone: {again}"
        return out

    w.run = checked  # type: ignore[method-assign]
    tickets = random_history(w, rng, {"acquire": 0.4, "release": 0.25, "cancel": 0.05,
                                      "ready": 0.2, "exit": 0.1}, exit_codes=[0, 1])
    drain(w, tickets, rounds=200)


# ------------------------------------------------------------------ a hostile review's cases


def settle_all(w: World) -> None:
    while w.settle():
        pass


def test_a_memory_plan_that_evicts_both_together_members_stops_each_once() -> None:
    """Review finding 1: stopping the first member stopped its partner, and the plan's
    own eviction of the partner then raised (stopping -> stopping) in the Scheduler."""
    from tests.test_policy_memory import MemWorld
    w = MemWorld({"a": 4, "b": 4, "c": 8})
    w.run(w.p.set_groups({"t": pair()}, w.now))
    w.acquire(1, "a")
    settle_all(w)
    w.release(1)
    w.acquire(2, "c")
    assert (w.state("a"), w.state("b")) == ("stopping", "stopping")


def test_memory_only_persistent_members_hold_is_a_503_not_a_wait_for_ever() -> None:
    """Review finding 6: memory held by persistent members of another group never comes
    free for an outsider; the plan now refuses, saying so, as for pinned models."""
    from tests.test_policy_memory import MemWorld
    w = MemWorld({"a": 1, "b": 6, "c": 4, "d": 4})
    w.run(w.p.set_groups({"p": ModelGroup(models=["c", "d"], persistent=True)}, w.now))
    w.load_idle("c", "d")
    answer = w.acquire(1, "b")
    assert isinstance(answer, Refusal) and "kept from it by a model group" in answer.message
    assert isinstance(w.acquire(2, "a"), (Grant, type(None)))  # a fits: it is not held up


def test_a_persistent_member_does_not_go_with_its_together_partner_for_an_outsider() -> None:
    """Review finding 7."""
    w = grouped(3, p=ModelGroup(models=["a", "c"], persistent=True), t=pair())
    w.acquire(1, "a")
    settle_all(w)
    w.release(1)
    w.load_idle("c")
    w.acquire(2, "d")
    assert w.stops == [] and isinstance(w.answers[2], Refusal)


def test_a_swap_waiting_for_a_busy_rival_does_not_hold_up_other_models() -> None:
    """Review finding 14: the claim scan stopped at the waiting swap."""
    w = grouped(4, s=swap())
    w.load_idle("a")
    w.acquire("long", "a")
    w.acquire(1, "b")
    w.acquire(2, "c")
    assert ("c", 1) in w.spawns  # a free slot: c need not wait for a's request


def test_a_together_partner_crashed_or_idle_after_a_crash_keeps_its_ttl() -> None:
    """Review findings 9 and 13: after a's crash its idle partner's TTL was never armed
    again; a crashed partner comes back with the group's next use."""
    w = World(models_max=4, rules={n: ModelRules(ttl_s=30) for n in "abcd"})
    w.run(w.p.set_groups({"t": pair()}, w.now))
    w.acquire(1, "a")
    settle_all(w)
    w.exited("a", rc=1)
    for _ in range(5):
        w.now += 20
        w.fire_timers()
    assert w.state("b") in ("stopping", "unloaded")
    settle_all(w)
    w.acquire(2, "a")
    settle_all(w)
    assert w.state("b") in ("loading", "loaded")  # used as one: the partner is back


def test_a_warm_load_a_request_waits_for_is_not_given_up_for_a_rival() -> None:
    """Review finding 16."""
    w = World(models_max=4, rules={"a": ModelRules(warm=True), "b": ModelRules(),
                                   "c": ModelRules(), "d": ModelRules()})
    w.run(w.p.set_groups({"s": swap()}, w.now))
    w.acquire(1, "a")  # joins a's warm-up load
    w.acquire(2, "b")
    assert ("a", "warm") not in w.stops
    settle_all(w)
    assert isinstance(w.answers[1], Grant)


def test_unloading_a_member_while_its_partner_loads_is_not_undone() -> None:
    """Review finding 10: the partner's queued load brought the group back."""
    w = grouped(4, t=pair())
    w.acquire(1, "a")
    w.ready("a")
    w.release(1)
    w.run(w.p.unload("u", "a", w.tick()))
    settle_all(w)
    assert (w.state("a"), w.state("b")) == ("unloaded", "unloaded")
    assert w.spawns == [("a", 1), ("b", 1)]


def test_a_rival_serves_what_waited_for_it_before_the_swap() -> None:
    """Review finding 15: a was retired with an older waiter of its own, stopped, and
    loaded again for it before b's turn."""
    w = World(models_max=4, rules={"a": ModelRules(max_concurrency=1), "b": ModelRules(),
                                   "c": ModelRules(), "d": ModelRules()})
    w.run(w.p.set_groups({"s": swap()}, w.now))
    w.load_idle("a")
    w.acquire(1, "a")
    w.acquire(2, "a")  # waits for a's one slot, before b is asked for
    w.acquire(3, "b")
    w.release(1)
    assert isinstance(w.answers[2], Grant)  # served by the a that runs
    w.release(2)
    settle_all(w)
    assert isinstance(w.answers[3], Grant) and w.spawns.count(("a", 2)) == 0


def test_a_swap_waits_for_a_busy_together_partner_of_its_rival() -> None:
    """Review finding 11."""
    w = grouped(4, t=pair(), x=ModelGroup(models=["b", "c"], exclusive=True))
    w.acquire(1, "a")
    settle_all(w)
    w.acquire(2, "c")
    assert w.stops == []  # b is idle, but a, used as one with it, is mid-request
    w.release(1)
    assert {m for m, _ in w.stops} == {"a", "b"}
    settle_all(w)
    assert isinstance(w.answers[2], Grant)


def test_a_reload_applies_new_groups_to_what_runs() -> None:
    """Review finding 8."""
    w = grouped(4)
    w.load_idle("a", "b", "c")
    w.run(w.p.set_groups({"s": swap(), "t": ModelGroup(models=["c", "d"], together=True)},
                         w.tick()))
    assert ("a", "group") in w.stops  # b was used last: it stays
    assert ("d", 1) in w.spawns  # c's partner comes


def test_an_unload_that_drops_a_queued_load_lets_the_next_in_line_go() -> None:
    """Review (pre-existing): an unload of a stopping model dropped its queued load
    (POST /models/load) and answered, without running the rules again: the request
    queued behind that load waited for the next event."""
    w = World(models_max=3)
    w.load_idle("a")
    w.acquire("x", "a")
    w.run(w.p.unload("u1", "a", w.tick()))  # a stopping, its request still running
    w.run(w.p.load("l", "a", w.tick()))  # a load queued behind its stop: the head
    w.acquire(1, "d")  # waits behind that head
    assert ("d", 1) not in w.spawns
    w.run(w.p.unload("u2", "a", w.tick()))  # drops a's load
    assert ("d", 1) in w.spawns
