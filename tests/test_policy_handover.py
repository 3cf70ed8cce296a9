"""Make-before-break reloads (issue 24), pure: a running model whose config changed keeps
serving while the new config loads beside it in its alternate (`NAME@next`); requests move
to the new child once it is ready, and the old drains and stops. With no slot or memory for
both, or `make_before_break = false`, the old stops first, and its event says why."""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from actors.config.rules import ModelRules, Replicas, replica_name
from actors.messages import Grant, StatusChanged
from actors.policy.records import Publish
from tests.test_policy import World, drain
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


def handed_over(w: World) -> None:
    """`a` loaded, reloaded, and its new child in a@next serving in its place."""
    w.load_idle("a")
    reload(w, "a")
    w.ready("a@next")
    w.exited("a")


def test_the_next_reload_loads_in_the_config_record_beside_the_alternate() -> None:
    w = World(models_max=3)
    handed_over(w)
    reload(w, "a")  # the alternate serves: the new config loads as `a` again
    assert w.spawns[-1] == ("a", w.gen("a@next") + 1)
    assert w.p.state.models["a@next"].state.value == "loaded"
    w.ready("a")
    assert w.stops[-1] == ("a@next", "reload")
    w.exited("a@next")
    grant = w.acquire("t", "a")
    assert isinstance(grant, Grant) and grant.instance == "" and grant.generation == w.gen("a")


def test_after_a_handover_the_model_loads_in_its_current_record() -> None:
    """The alternate is the copy's current record once its child took over: an unload
    stops it, and the next request loads the model there again (with the newest config,
    which both records carry)."""
    w = World(models_max=3)
    handed_over(w)
    w.run(w.p.unload("u", "a", w.tick()))
    assert w.stops[-1] == ("a@next", "manual")
    w.exited("a@next")
    assert w.acquire("t", "a") is None
    assert w.spawns[-1] == ("a@next", 3)
    w.ready("a@next")
    grant = w.answers["t"]
    assert isinstance(grant, Grant) and grant.instance == "a@next" and grant.generation == 3
    assert w.state("a") == "unloaded"


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
    w.load_idle("a")
    w.report()
    reload(w, "a")  # the figures are measured again: 5 GiB beside 5 GiB of 9 usable
    w.run(w.p.children.measured("a", True, need(5), need(5), w.tick()))
    assert w.stops == [("a", "reload")] and "a@next" not in dict(w.spawns)
    small = MemWorld({"a": 3, "b": 2})
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
    handed_over(w)
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



# ---------------------------------------------------------------- state machine


class HandoverMachine(RuleBasedStateMachine):
    """Random requests, releases, readies, crashes, time, unloads and reloads that change,
    remove and add back models (some with max_concurrency and TTLs), 2-4 slots. After every
    step the invariants hold (views.check), a copy has at most one child that takes new
    requests unless a handover is under way, and a request for a model whose current
    child has room is granted at once (unless another model's turn holds it); at the
    end every request has been answered."""

    @initialize(slots=st.integers(2, 4), limit=st.sampled_from([0, 1, 2]))
    def setup(self, slots: int, limit: int) -> None:
        self.limit = limit
        self.w = World(models_max=slots, rules={n: self.rules_for(0.0) for n in "abcd"})
        self.open: list[object] = []
        self.n = 0

    def rules_for(self, ttl_s: float) -> ModelRules:
        return ModelRules(ttl_s=ttl_s, max_concurrency=self.limit, queue_timeout_s=30.0)

    def live(self) -> list[str]:
        return [m for m in "abcd" if (r := self.w.p.state.models.get(m)) and not r.removed]

    @rule(model=st.sampled_from("abcd"))
    def acquire(self, model: str) -> None:
        self.n += 1
        rec = self.w.p.state.find(model)
        current = self.w.p.state.groups.current(rec) if rec is not None else None
        room = (current is not None and self.w.p.state.has_room(current)
                and self.w.p.state.queue.entry(model) is None
                and not self.w.p.state.held(current))  # (another's turn: turns.py)
        answer = self.w.acquire(self.n, model)
        if room:
            assert isinstance(answer, Grant), answer
        self.open.append(self.n)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 99))
    def release(self, i: int) -> None:
        t = self.open.pop(i % len(self.open))
        if t in self.w.p.state.leases:
            self.w.release(t)
        elif t in self.w.p.state.queue.waiters:
            self.w.cancel(t)

    @rule(i=st.integers(0, 9))
    def ready(self, i: int) -> None:
        loading = [m for m, r in self.w.p.state.models.items() if r.state.value == "loading"]
        if loading:
            self.w.ready(loading[i % len(loading)])

    @rule(i=st.integers(0, 9), rc=st.sampled_from([0, 1, -9]))
    def exit(self, i: int, rc: int) -> None:
        running = [m for m, r in self.w.p.state.models.items() if r.state.is_running]
        if running:
            m = running[i % len(running)]
            self.w.exited(m, 0 if self.w.p.state.models[m].state.value == "stopping" else rc)

    @rule(models=st.sets(st.sampled_from("abcd"), min_size=1), ttl=st.sampled_from([0.0, 5.0]))
    def reload(self, models: set[str], ttl: float) -> None:
        changed = {m: self.rules_for(ttl) for m in sorted(models) if m in self.live()}
        self.w.run(self.w.p.children.reconfigure({}, [], changed, self.w.tick())[0])

    @rule(model=st.sampled_from("abcd"))
    def remove_or_add_back(self, model: str) -> None:
        p = self.w.p
        if model in self.live():
            self.w.run(p.children.reconfigure({}, [model], {}, self.w.tick())[0])
        else:
            self.w.run(p.children.reconfigure({model: self.rules_for(0.0)}, [], {},
                                              self.w.tick())[0])

    @rule(model=st.sampled_from("abcd"))
    def unload(self, model: str) -> None:
        if model in self.live():
            self.n += 1
            self.w.run(self.w.p.unload(("u", self.n), model, self.w.tick()))

    @rule(dt=st.sampled_from([1.0, 6.0, 31.0]))
    def time(self, dt: float) -> None:
        self.w.now += dt
        self.w.fire_timers()

    @invariant()
    def one_child_takes_requests_per_copy(self) -> None:
        if not hasattr(self, "w"):
            return
        state = self.w.p.state
        for config, alt in state.groups.alternates.items():
            rec = state.models.get(config)
            pair = [r for r in (rec, alt) if r is not None]
            open_ = [r for r in pair if r.state.is_serving and not r.retiring]
            assert len(open_) <= 1 or any(r.takes_over for r in pair), \
                f"{config}: two children take requests: {[r.name for r in open_]}"

    def teardown(self) -> None:
        if hasattr(self, "w"):
            drain(self.w, self.open, rounds=300, time_step_s=5.0)


TestHandovers = HandoverMachine.TestCase
TestHandovers.settings = settings(max_examples=int(os.environ.get(
    "CORRAL_STATEFUL_EXAMPLES", "100")), stateful_step_count=80, deadline=None)


# ---------------------------------------------------------------- found by review


def test_a_failed_newcomer_refuses_nobody_who_waits_for_the_old_child() -> None:
    w = World(models_max=4, names="ab", rules={"a": ModelRules(max_concurrency=1),
                                                "b": ModelRules()})
    w.load_idle("a")
    w.acquire("t1", "a")
    w.acquire("t2", "a")  # waits for a's one slot
    reload(w, "a", rules=ModelRules(max_concurrency=1, ttl_s=7.0))
    w.exited("a@next", rc=1)
    assert "t2" not in w.answers, "the old child still serves it"
    w.release("t1")
    assert isinstance(w.answers["t2"], Grant)


def test_a_failed_newcomer_of_a_permanent_model_leaves_no_load_queued() -> None:
    w = World(models_max=2, names="ab", rules={"a": ModelRules(permanent=True, ttl_s=10.0),
                                                "b": ModelRules()})
    w.load_idle("a")
    reload(w, "a", rules=ModelRules(permanent=True, ttl_s=10.0, queue_timeout_s=1.0))
    w.exited("a@next", rc=1)
    assert "a" not in w.p.state.queue.entries  # the old child serves: no restart is due
    w.now += 100
    w.fire_timers()
    assert w.stops[-1] == ("a", "ttl")  # idle, so its TTL runs


def test_an_old_child_idle_while_its_successor_loads_is_stopped_not_suspended() -> None:
    from tests.test_policy_suspend import TierWorld

    rules = ModelRules(suspend=True, ttl_suspend_s=10)
    w = TierWorld({"a": 2}, models_max=3, rules={"a": rules}, memory=False)
    w.load_idle("a")
    reload(w, "a", rules=ModelRules(suspend=True, ttl_suspend_s=10, queue_max=5))
    w.now += 20
    w.fire_timers()  # a's idle TTL while a@next loads: it would be left suspended
    assert w.p.state.models["a"].state.value == "stopping"
    w.ready("a@next")
    assert w.p.state.groups.current(w.p.state.models["a"]).name == "a@next"
    assert isinstance(w.acquire("t", "a"), Grant)


def test_a_cached_wait_is_given_again_only_for_the_same_rules_and_figures() -> None:
    """A plan that waits for memory coming back is given again while its inputs are the
    same values; rules of another value (not merely another object: a freed object's id
    may be a new one's) make a new plan."""
    w = MemWorld({"a": 6, "c": 6})
    w.load_idle("a")
    w.report()
    w.run(w.p.unload("u", "a", w.tick()))  # a stops: its 6 GiB are coming back
    memory, rec = w.p.state.memory, w.p.state.models["c"]
    first = memory.plan(rec, w.p.state.models, [], set())
    assert first.verdict == "wait" and first.fits_once_freed
    rec.rules = ModelRules(**{f: getattr(rec.rules, f) for f in rec.rules.__struct_fields__})
    assert memory.plan(rec, w.p.state.models, [], set()) is first  # equal rules: cached
    rec.rules = ModelRules(ttl_s=60.0)
    again = memory.plan(rec, w.p.state.models, [], set())
    assert again is not first and again.verdict == "wait"
