"""Make-before-break reloads (issue 24), pure: a running model whose config changed keeps
serving while the new config loads beside it in its alternate (`NAME@next`); requests move
to the new child once it is ready, and the old drains and stops. With no slot or memory for
both, or `make_before_break = false`, the old stops first, and its event says why."""

from __future__ import annotations

from actors.config import ModelRules
from actors.messages import Grant, StatusChanged
from actors.policy.records import Publish
from actors.rules import Replicas, replica_name
from tests.test_policy import World
from tests.test_policy_memory import MemWorld, need

NEW = ModelRules(ttl_s=0.0)
"""The rules a reload gives: what changed is the child's config, which the policy never
sees (the Scheduler sends the new rules as `changed`)."""


def reload(w: World, *names: str, rules: ModelRules = NEW) -> list[str]:
    effects, restarted = w.p.children.reconfigure({}, [], {n: rules for n in names}, w.tick())
    w.run(effects)
    return restarted


def causes(w: World) -> list[str]:
    return [e.event.cause for e in w.last if isinstance(e, Publish)
            and isinstance(e.event, StatusChanged)]


class Recorded(World):
    def run(self, effects):  # type: ignore[no-untyped-def]
        self.last = effects
        return super().run(effects)


def test_the_old_child_serves_until_the_new_config_is_ready_then_drains() -> None:
    w = Recorded(models_max=3)
    w.load_idle("a")
    w.acquire("busy", "a")
    old = w.gen("a")
    assert reload(w, "a") == ["a"]
    assert w.spawns[-1] == ("a@next", old + 1) and w.stops == []
    assert "make-before-break" in causes(w)[0]
    # While the new child loads, requests go to the old one: nobody waits.
    grant = w.acquire("meanwhile", "a")
    assert isinstance(grant, Grant) and grant.generation == old and grant.instance == ""
    view = w.p.snapshot().models[0]
    assert view.state == "loaded" and view.generation == old
    w.ready("a@next")
    grant = w.acquire("after", "a")
    assert isinstance(grant, Grant) and grant.model == "a" and grant.instance == "a@next"
    assert grant.generation == old + 1
    assert w.stops == [], "the old child drains its two requests first"
    w.release("busy")
    w.release("meanwhile")
    assert w.stops == [("a", "reload")]
    w.exited("a")
    view = w.p.snapshot().models[0]
    assert view.state == "loaded" and view.generation == old + 1 and view.in_flight == 1
    assert view.last_eviction is not None and view.last_eviction.reason == "reload"
    assert [m.name for m in w.p.snapshot().models] == ["a", "b", "c", "d"]


def test_the_next_reload_loads_in_the_config_record_beside_the_alternate() -> None:
    w = World(models_max=3)
    w.load_idle("a")
    reload(w, "a")
    w.ready("a@next")
    w.exited("a")
    reload(w, "a")  # the alternate serves: the new config loads as `a` again
    assert w.spawns[-1] == ("a", w.gen("a@next") + 1)
    assert w.p.state.models["a@next"].state.value == "loaded"
    w.ready("a")
    assert w.stops[-1] == ("a@next", "reload")
    w.exited("a@next")
    grant = w.acquire("t", "a")
    assert isinstance(grant, Grant) and grant.instance == "" and grant.generation == w.gen("a")


def test_once_the_alternate_is_gone_the_model_loads_in_its_own_record() -> None:
    w = World(models_max=3)
    w.load_idle("a")
    reload(w, "a")
    w.ready("a@next")
    w.exited("a")
    w.run(w.p.unload("u", "a", w.tick()))
    assert w.stops[-1] == ("a@next", "manual")
    w.exited("a@next")
    assert w.acquire("t", "a") is None
    assert w.spawns[-1][0] == "a", "an alternate is never a load's target"


def test_with_no_free_slot_the_old_child_stops_first_and_says_why() -> None:
    w = Recorded(models_max=2)
    w.load_idle("a", "b")
    reload(w, "a")
    assert w.stops == [("a", "reload")] and ("a@next", 2) not in w.spawns
    assert any("no free slot (models_max 2)" in c and "stops before" in c for c in causes(w))


def test_make_before_break_off_stops_the_old_child_first() -> None:
    w = World(models_max=3)
    w.load_idle("a")
    reload(w, "a", rules=ModelRules(make_before_break=False))
    assert w.stops == [("a", "reload")] and len(w.spawns) == 1


def test_with_no_memory_for_both_the_old_child_stops_first() -> None:
    w = MemWorld({"a": 5, "b": 2})
    w.sizes["a@next"] = 5
    w.load_idle("a")
    w.report()
    reload(w, "a")  # the figures are measured again: 5 GiB beside 5 GiB of 9 usable
    w.run(w.p.children.measured("a", True, need(5), need(5), w.tick()))
    assert w.stops == [("a", "reload")] and "a@next" not in dict(w.spawns)
    small = MemWorld({"a": 3, "b": 2})
    small.sizes["a@next"] = 3
    small.load_idle("a")
    small.report()
    reload(small, "a")
    assert small.stops == [] and "a@next" not in dict(small.spawns), "waits for its figures"
    small.run(small.p.children.measured("a", True, need(3), need(3), small.tick()))
    assert "a@next" in dict(small.spawns) and small.stops == []


def test_a_new_config_that_fails_to_load_leaves_the_old_child_serving() -> None:
    w = Recorded(models_max=3)
    w.load_idle("a")
    old = w.gen("a")
    reload(w, "a")
    w.exited("a@next", 1)
    assert w.stops == [] and w.state("a") == "loaded"
    assert any("did not load" in c and "keeps serving" in c for c in causes(w))
    grant = w.acquire("t", "a")
    assert isinstance(grant, Grant) and grant.generation == old
    w.release("t")
    w.run(w.p.unload("u", "a", w.tick()))
    w.exited("a")
    assert w.acquire("next", "a") is None and w.spawns[-1][0] == "a"  # the new config


def test_removing_a_model_stops_its_alternate_too() -> None:
    w = World(models_max=3)
    w.load_idle("a")
    reload(w, "a")
    w.ready("a@next")
    w.exited("a")
    w.run(w.p.children.reconfigure({}, ["a"], {}, w.tick())[0])
    assert w.stops[-1] == ("a@next", "reload")
    w.exited("a@next")
    assert not {"a", "a@next"} & set(w.p.state.models)


def test_each_copy_of_a_model_hands_over_and_the_model_never_refuses() -> None:
    w = World(models_max=5, names="")
    copies = Replicas(min=2, max=2)
    for i in (1, 2):
        w.p.add_model(replica_name("a", i), 0.0, rules=ModelRules(
            replicas=copies, group="a" if i > 1 else ""))
    w.acquire("first", "a")
    while w.settle():
        pass
    w.release("first")
    rules = {"a": ModelRules(replicas=copies), "a@2": ModelRules(replicas=copies, group="a")}
    w.run(w.p.children.reconfigure({}, [], rules, w.tick())[0])
    assert {m for m, _ in w.spawns[-2:]} == {"a@next", "a@2@next"}
    for t in range(6):  # through the switch, every request is granted at once
        assert isinstance(w.acquire(("r", t), "a"), Grant)
        w.release(("r", t))
        w.settle()
    assert sorted(m for m, _ in w.stops) == ["a", "a@2"]
    view = w.p.snapshot().models[0]
    assert view.replicas is not None
    assert sorted(r.name for r in view.replicas if r.state == "loaded") == [
        "a@2@next", "a@next"]

