"""Replicas (issue 24), pure: a model with copies loads, routes, scales up by demand, scales
down when idle, gives up its extra copies first, and never refuses for capacity while one
copy serves."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.config.model import Config, ModelRules
from actors.config.rules import Replicas, replica_name
from actors.ledger import DeviceSample
from actors.lifecycle import ModelState
from actors.messages import DeviceReport, Grant, Refusal, StatusChanged
from actors.policy import Policy
from actors.policy.records import Effect, Publish, Spawn, Track
from tests.test_policy import World
from tests.test_policy_memory import GiB, need

S = ModelState


def world(models_max: int = 4, others: str = "bc", model: dict[str, Any] | None = None,
          **copies: Any) -> World:
    """Models `others` plus `a` with `replicas = {copies}`, added as the Scheduler adds a
    config's instances."""
    w = World(models_max=models_max, names=others)
    replicas = Replicas(**copies)
    for i in range(1, replicas.most + 1):
        w.p.add_model(replica_name("a", i), 0.0, rules=ModelRules(
            replicas=replicas, group="a" if i > 1 else "", **(model or {})))
    return w


def up(w: World) -> list[str]:
    return [r.name for r in w.p.state.groups.members["a"] if r.state is S.LOADED]


def settle(w: World) -> None:
    while w.settle():
        pass


def granted_into(w: World, ticket: object) -> str:
    """The copy a granted ticket runs on."""
    return w.p.state.leases[ticket][0]


def test_a_config_expands_into_one_instance_per_copy_with_the_models_rules() -> None:
    import msgspec

    config = msgspec.convert({"models": {
        "a": {"cmd": ["x"], "replicas": {"min": 1, "max": 3, "route": "prefix"}},
        "b": {"cmd": ["y"], "replicas": 2}, "c": {"cmd": ["z"]}}}, Config)
    assert list(config.instances()) == ["a", "a@2", "a@3", "b", "b@2", "c"]
    rules = config.rules_of(config.models["a"], "a")
    assert rules.replicas is not None and rules.replicas.route == "prefix"
    assert rules.replicas.most == 3 and rules.group == "a"
    assert config.models["c"].replica_rules is None


def test_min_copies_load_one_after_another_with_generations_of_their_own() -> None:
    w = world(min=2)
    assert isinstance(w.acquire(1, "a"), type(None))  # queued: no copy is up
    assert w.spawns == [("a", 1)]
    w.ready("a")
    assert isinstance(w.answers[1], Grant) and w.answers[1].model == "a"
    assert w.spawns == [("a", 1), ("a@2", 2)]  # min 2: the second once the first is up
    w.ready("a@2")
    assert up(w) == ["a", "a@2"]


def test_least_loaded_spreads_requests_and_every_grant_names_the_model() -> None:
    w = world(min=2)
    w.acquire(0, "a")
    settle(w)
    for t in range(1, 8):
        w.acquire(t, "a")
    into = [granted_into(w, t) for t in range(8)]
    assert sorted(into.count(c) for c in ("a", "a@2")) == [4, 4]
    assert all(isinstance(w.answers[t], Grant) and w.answers[t].model == "a"  # type: ignore[union-attr]
               and w.answers[t].solo for t in range(8))  # type: ignore[union-attr]
    view = w.p.snapshot(w.now).models[-1]
    assert view.name == "a" and view.in_flight == 8 and view.state == "loaded"
    assert [c.name for c in view.replicas or []] == ["a", "a@2"]
    assert [c.in_flight for c in view.replicas or []] == [4, 4]
    assert [v.name for v in w.p.snapshot(w.now).models] == ["b", "c", "a"]


def test_prefix_routing_keeps_a_prompt_on_its_copy_until_the_load_guard() -> None:
    w = world(min=2, route="prefix", prefix_overload=2)
    w.acquire(0, "a")
    settle(w)
    w.release(0)
    homes = {}
    for affinity in range(1, 40):
        w.run(w.p.acquire(("p", affinity), "a", w.tick(), affinity=affinity))
        homes[affinity] = granted_into(w, ("p", affinity))
        w.release(("p", affinity))
    assert set(homes.values()) == {"a", "a@2"}  # the prompts are spread over both copies
    for affinity in range(1, 40):  # and each comes back to its own
        w.run(w.p.acquire(("q", affinity), "a", w.tick(), affinity=affinity))
        assert granted_into(w, ("q", affinity)) == homes[affinity]
        w.release(("q", affinity))
    hot = 1
    sent = []
    for t in range(6):  # one prompt, many at once: its copy takes 2 more than the other
        w.run(w.p.acquire(("h", t), "a", w.tick(), affinity=hot))
        sent.append(granted_into(w, ("h", t)))
    loads = {c: sent.count(c) for c in ("a", "a@2")}
    assert loads[homes[hot]] - loads[next(c for c in loads if c != homes[hot])] <= 3
    assert loads[homes[hot]] > 3


def test_busy_copies_add_one_after_scale_up_after_s() -> None:
    w = world(max=3, target_in_flight=2, scale_up_after_s=5)
    for t in range(3):
        w.acquire(t, "a")
    settle(w)
    w.acquire(3, "a")  # 4 in flight on 1 copy: busy from now
    assert w.spawns == [("a", 1)]
    w.now += 5
    w.fire_timers()
    assert w.spawns == [("a", 1), ("a@2", 2)]
    change = [e.event for e in w.run(w.p.children.instance_ready("a@2", 2, 7, "x", 2, w.tick()))
              if isinstance(e, Publish) and isinstance(e.event, StatusChanged)]
    assert change and change[0].model == "a" and change[0].replica == "a@2"
    assert change[0].status == "loaded" and "replica for 4.0 requests" not in change[0].cause
    assert w.p.state.models["a@2"].last_eviction is None
    # 4 on 2 copies is 2 each: not above target_in_flight, no third
    w.now += 60
    w.fire_timers()
    assert len(w.spawns) == 2


def test_a_queue_that_waits_scale_up_wait_s_adds_a_copy_that_serves_it() -> None:
    w = world(max=2, scale_up_wait_s=2, model={"max_concurrency": 1})
    w.acquire(1, "a")
    settle(w)
    w.acquire(2, "a")  # waits: a is at its max_concurrency
    assert 2 in w.p.state.queue.waiters
    w.now += 2
    w.fire_timers()
    assert w.spawns[-1] == ("a@2", 2)
    w.ready("a@2")
    assert granted_into(w, 2) == "a@2"


def test_an_idle_copy_above_min_goes_after_scale_down_idle_s_and_min_stays() -> None:
    w = world(min=1, max=2, target_in_flight=1, scale_up_after_s=0, scale_down_idle_s=30)
    for t in range(3):
        w.acquire(t, "a")
    settle(w)
    assert up(w) == ["a", "a@2"]
    for t in range(3):
        w.release(t)
    w.now += 31
    w.fire_timers()
    assert len(w.stops) == 1 and w.stops[0][1] == "ttl"
    settle(w)
    w.now += 1000
    w.fire_timers()
    assert len(up(w)) == 1  # min 1: the last copy keeps the model's own ttl_s (none)


def test_a_spare_copy_is_the_first_victim_before_a_less_recently_used_model() -> None:
    w = world(models_max=3, others="bc", max=2, target_in_flight=1, scale_up_after_s=0)
    w.load_idle("b")  # b: used first, the LRU model
    for t in range(3):
        w.acquire(t, "a")
    settle(w)
    assert up(w) == ["a", "a@2"]  # a@2 above min 1: a spare once idle
    for t in range(3):
        w.release(t)
    w.acquire("c1", "c")  # a slot for c: an a copy goes, not b
    assert len(w.stops) == 1 and w.stops[0][0].startswith("a")
    assert w.p.state.models["b"].state is S.LOADED


def test_copies_that_fill_their_min_never_evict_each_other() -> None:
    w = World(models_max=3, names="")
    for model in "xy":  # 4 copies wanted, 3 slots
        for i in (1, 2):
            w.p.add_model(replica_name(model, i), 0.0, rules=ModelRules(
                replicas=Replicas(min=2), group=model if i > 1 else ""))
    w.load_idle("x", "y")
    for _ in range(5):
        settle(w)
        w.now += 10
        w.run(w.p.repump(w.now))
    assert w.stops == [] and len(w.spawns) == 3


def test_a_copy_evicts_a_last_copy_only_if_idle_longer_than_the_demand_lasted() -> None:
    w = world(models_max=2, others="b", max=2, target_in_flight=1, scale_up_after_s=5)
    for t in range(3):
        w.acquire(t, "a")
    settle(w)
    w.acquire(3, "a")  # a busy from now...
    w.load_idle("b")  # ... and b used since: idle for less than a's demand has lasted
    for _ in range(3):
        w.now += 5
        w.fire_timers()
        w.run(w.p.repump(w.now))
        assert w.stops == [] and w.spawns[-1][0] == "b"
    w2 = world(models_max=2, others="b", max=2, target_in_flight=1, scale_up_after_s=5)
    w2.load_idle("b")
    w2.now += 500  # b idle for 500 s before a's demand begins
    for t in range(3):
        w2.acquire(t, "a")
    settle(w2)
    w2.now += 6
    w2.fire_timers()
    assert w2.stops == [("b", "lru")]
    settle(w2)
    assert w2.spawns[-1][0] == "a@2"


def test_a_copy_that_fails_or_dies_refuses_nothing_while_another_serves() -> None:
    w = world(min=2, model={"max_concurrency": 1})
    w.acquire(1, "a")
    settle(w)
    w.acquire(2, "a")
    w.acquire(3, "a")  # both copies busy: 3 waits
    w.exited("a@2", rc=-9)  # a@2 crashes with request 2 on it
    assert not any(isinstance(v, Refusal) for v in w.answers.values())
    w.release(1)
    assert granted_into(w, 3) == "a"
    assert w.spawns[-1][0] == "a@2"  # min 2: replaced
    w.exited("a@2", rc=1)  # its load fails: nobody is refused for it
    assert not any(isinstance(v, Refusal) for v in w.answers.values())


def test_unload_stops_every_copy_and_the_next_request_loads_one() -> None:
    w = world(min=2)
    w.acquire(1, "a")
    settle(w)
    w.release(1)
    w.run(w.p.unload("u", "a", w.tick()))
    assert sorted(s[0] for s in w.stops) == ["a", "a@2"]
    settle(w)
    w.acquire(2, "a")
    assert w.spawns[-1] == ("a", 3)  # past both copies' generations


# ---------------------------------------------------------------- state machine


class CopiesMachine(RuleBasedStateMachine):
    """Random requests, releases, readies, crashes, time and reloads on a model with 1-3
    copies and two others, 3 slots: the invariants hold after every step (views.check: at most
    `max` copies, one generation per child), and no request for the model is refused
    while one of its copies serves."""

    def __init__(self) -> None:
        super().__init__()
        self.w = world(models_max=3, others="bc", min=1, max=3, target_in_flight=1,
                       scale_up_after_s=2, scale_up_wait_s=1, scale_down_idle_s=5,
                       route="prefix", prefix_overload=1)
        self.open: list[object] = []
        self.n = 0

    def copies(self) -> list[Any]:
        return [r for n, r in self.w.p.state.models.items()
                if (n == "a" or r.rules.group == "a") and not r.removed]

    @rule(model=st.sampled_from("aab"), affinity=st.integers(0, 5))
    def acquire(self, model: str, affinity: int) -> None:
        self.n += 1
        serving = any(r.state.is_serving and not r.retiring  # (another's turn: turns.py)
                      and not self.w.p.state.held(r) for r in self.copies())
        self.w.run(self.w.p.acquire(self.n, model, self.w.tick(), affinity=affinity))
        answer = self.w.answers.get(self.n)
        if model == "a" and serving:
            assert isinstance(answer, Grant), answer
        if not isinstance(answer, Refusal):
            self.open.append(self.n)

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 100))
    def release(self, i: int) -> None:
        self.w.release(self.open.pop(i % len(self.open)))

    @rule(i=st.integers(0, 10))
    def ready(self, i: int) -> None:
        loading = [n for n, r in self.w.p.state.models.items() if r.state is S.LOADING]
        if loading:
            self.w.ready(loading[i % len(loading)])

    @rule(i=st.integers(0, 10), rc=st.sampled_from([0, 1, -9]))
    def exit(self, i: int, rc: int) -> None:
        running = [n for n, r in self.w.p.state.models.items() if r.state.is_running]
        if running:
            name = running[i % len(running)]
            self.w.exited(name, rc if self.w.p.state.models[name].state is not S.STOPPING
                          else 0)

    @rule(dt=st.sampled_from([0.5, 3.0, 10.0]))
    def time(self, dt: float) -> None:
        self.w.now += dt
        self.w.fire_timers()

    @rule(most=st.sampled_from([1, 2, 3]))
    def reload(self, most: int) -> None:
        """A reload that sets a's replicas max (1: none), as the Scheduler expands it (a
        change of replicas only: the copies that stay keep their children)."""
        p = self.w.p
        live = [r.name for r in self.copies() if not r.alternate_of]  # the config's
        copies = Replicas(min=1, max=most, target_in_flight=1, scale_up_after_s=2,
                          scale_up_wait_s=1, scale_down_idle_s=5, route="prefix",
                          prefix_overload=1) if most > 1 else None
        names = [replica_name("a", i) for i in range(1, most + 1)]
        added = {n: ModelRules(replicas=copies, group="a") for n in names if n not in live}
        removed = [n for n in live if n not in names]
        changed = ({"a": ModelRules(replicas=copies)}
                   if p.state.models["a"].rules.replicas != copies else {})
        self.w.run(p.children.reconfigure(added, removed, {}, self.w.tick(),
                                          retuned=changed)[0])
        self.most = most

    @rule()
    def reload_child(self) -> None:
        """A reload that changes a's child (its cmd, say): each running copy hands over
        to its alternate where a slot is free, else stops first (handover.py)."""
        p = self.w.p
        changed = {r.name: r.rules for r in self.copies() if not r.alternate_of}
        self.w.run(p.children.reconfigure({}, [], changed, self.w.tick())[0])

    @invariant()
    def copies_within_max(self) -> None:
        running = [r for r in self.copies() if r.state.is_running and not r.alternate_of]
        assert len(running) <= getattr(self, "most", 3)
        assert self.w.p.state.n_running <= 3


TestCopies = CopiesMachine.TestCase
TestCopies.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


def test_copies_spread_over_their_nodes_and_a_lost_nodes_copy_comes_back_elsewhere() -> None:
    from actors.policy import Policy

    w = World(names="")
    w.p = Policy(4, 3, 60.0)
    for i in (1, 2):
        w.p.add_model(replica_name("a", i), 0.0, rules=ModelRules(
            replicas=Replicas(min=2), nodes=["n1", "n2"], group="a" if i > 1 else ""))
    for node in ("n1", "n2"):
        w.run(w.p.children.node_changed(node, True, "", w.tick()))
    w.acquire(1, "a")
    settle(w)
    nodes = {r.name: r.node for r in w.p.state.groups.members["a"]}
    assert nodes == {"a": "n1", "a@2": "n2"}  # the second copy goes where none runs
    w.run(w.p.children.node_changed("n2", False, "agent lost", w.tick()))
    w.exited("a@2", rc=-1)  # the head reports its child gone with the node
    for t in range(2, 6):  # the copy left serves every request meanwhile
        assert isinstance(w.acquire(t, "a"), Grant)
    assert w.spawns[-1][0] == "a@2"
    assert w.p.state.models["a@2"].node == "n1"  # replaced on the node that is up


def test_a_reload_that_gives_or_takes_copies_keeps_one_generation_per_child() -> None:
    """1 -> 3 copies while serving, then 3 -> 1 (a change of replicas only, as the
    Scheduler sends it: `retuned`): the model's own record stays first in its group and
    keeps its child, generations stay unique, and the model goes on as one child."""
    w = world(max=1)  # a: one copy (its rules have replicas, max 1: no group)
    w.acquire(1, "a")
    settle(w)
    gen = w.p.state.models["a"].generation
    three = Replicas(min=3)
    copies = {replica_name("a", i): ModelRules(replicas=three, group="a") for i in (2, 3)}
    w.run(w.p.children.reconfigure(copies, [], {}, w.tick(),
                                   retuned={"a": ModelRules(replicas=three)})[0])
    assert [r.name for r in w.p.state.groups.members["a"]] == ["a", "a@2", "a@3"]
    w.release(1)
    for _ in range(4):
        settle(w)
    assert up(w) == ["a", "a@2", "a@3"] and w.p.state.models["a"].generation == gen
    gens = [r.generation for r in w.p.state.groups.members["a"]]
    assert len(set(gens)) == 3
    w.run(w.p.children.reconfigure({}, ["a@2", "a@3"], {}, w.tick(),
                                   retuned={"a": ModelRules()})[0])
    for _ in range(4):
        settle(w)
    assert "a" not in w.p.state.groups.members and "a" not in w.p.state.groups.active
    assert isinstance(w.acquire(2, "a"), Grant)  # its child never stopped
    assert w.p.state.models["a"].generation == gen


def test_a_warm_model_keeps_min_copies_warm_and_scales_the_rest_down() -> None:
    w = world(min=1, max=3, target_in_flight=1, scale_up_after_s=0, scale_down_idle_s=5,
              model={"warm": True})
    w.run(w.p.repump(w.tick()))
    settle(w)
    assert up(w) == ["a"]  # warm: the model, not every copy
    for t in range(4):
        w.acquire(t, "a")
    for _ in range(4):
        settle(w)
    assert len(up(w)) >= 2
    for t in range(4):
        w.release(t)
    w.now += 100
    w.fire_timers()
    settle(w)
    assert len(up(w)) == 1


def test_prefix_routing_gives_each_copy_its_even_share_of_the_prompts() -> None:
    """Bounded loads: however the hash falls, 16 prompts on 2 copies are 8 and 8, each
    stays on its copy, and a prompt whose copy is gone gets a new home once."""
    w = world(min=2, route="prefix", prefix_overload=100)
    w.acquire(0, "a")
    settle(w)
    homes = {}
    for turn in range(3):
        for prompt in range(1, 17):
            t = (turn, prompt)
            w.run(w.p.acquire(t, "a", w.tick(), affinity=prompt * 7919))
            into = granted_into(w, t)
            assert homes.setdefault(prompt, into) == into, "a prompt stays on its copy"
            w.release(t)
    assert sorted(list(homes.values()).count(c) for c in ("a", "a@2")) == [8, 8]
    w.exited("a@2", rc=-9)
    w.run(w.p.acquire("moved", "a", w.tick(), affinity=next(
        p for p, c in homes.items() if c == "a@2") * 7919))
    assert granted_into(w, "moved") == "a"


class MemoryWorld(World):
    """One 10 GiB GPU on node_b (1 GiB margin), memory accounting on, `sizes` GiB per
    model, and `r` with two copies (`min = 2`) of 3 GiB; device reports by hand, as the
    children's use is."""

    GPU = "node_b/gpu0"

    def __init__(self, sizes: dict[str, int]) -> None:
        super().__init__(0, "")
        self.p = Policy(0, 3, 60.0, memory_margin=1 * GiB)
        self.sizes = {**sizes, "r": 3}
        for n in sizes:
            self.p.add_model(n, 0.0, rules=ModelRules(nodes=["node_b"], ttl_s=0.0))
        for i in (1, 2):
            self.p.add_model(replica_name("r", i), 0.0, rules=ModelRules(
                nodes=["node_b"], replicas=Replicas(min=2), group="r" if i > 1 else ""))
        self.actual: dict[str, int] = {}
        self.tracked: set[str] = set()
        self.run(self.p.children.node_changed("node_b", True, "", self.tick()))
        self.report()
        for n, size in self.sizes.items():
            self.run(self.p.children.measured(n, True, need(size), need(size), 0.0))

    def run(self, effects: list[Effect]) -> list[Effect]:
        started = [e for e in effects if isinstance(e, Spawn)]
        for e in effects:
            if isinstance(e, Spawn):
                self.actual[e.model] = self.sizes[self.p.state.models[e.model].group] * GiB
            elif isinstance(e, Track):
                (self.tracked.add if e.event != "exited" else self.tracked.discard)(e.model)
        super().run(effects)
        for e in started:
            super().run(self.p.children.instance_started(e.model, e.generation, 100))
        return effects

    def exited(self, model: str, rc: int = 0) -> None:
        self.actual.pop(model, None)
        super().exited(model, rc)

    def report(self) -> None:
        used = sum(self.actual.values())
        usage = {m: {self.GPU: self.actual.get(m, 0)} for m in self.tracked}
        self.run(self.p.children.devices_reported(DeviceReport(
            devices=[DeviceSample(self.GPU, "device", 10 * GiB, max(0, 10 * GiB - used),
                                  "cluster")],
            managed={self.GPU: sum(u[self.GPU] for u in usage.values())},
            usage=usage, tracked=sorted(self.tracked), backends=["cluster"]), self.tick()))


def test_a_waiter_is_not_starved_by_copies_that_refill_min() -> None:
    """The review of issue 42 (a livelock of its own): `a` (6 GiB) waits for the room of
    one of r's two idle 3 GiB copies (min 2); the copy evicted for it was added again at
    once into the room made for `a`, which then evicted it again, for ever."""
    w = MemoryWorld({"a": 6})
    w.run(w.p.acquire(1, "r", w.tick()))
    for _ in range(4):
        w.settle()
        w.report()
    w.release(1)
    w.run(w.p.acquire(2, "a", w.tick()))
    for _ in range(20):
        w.settle()
        w.report()
        w.now += 100
        w.fire_timers()
    assert isinstance(w.answers.get(2), Grant), [
        (n, r.state.value, r.generation) for n, r in w.p.state.models.items()]
    assert sum(1 for r in w.p.state.models.values() if r.state.is_running) == 2  # a, one r


def test_a_copy_added_back_while_its_reload_s_newcomer_stops_stays_its_copy() -> None:
    """Found by the machine above: a copy's child reloaded (its newcomer loading), then a
    reload took the copy out (and the newcomer) and the next put it back. The copy's
    own record came back, its newcomer did not; when the copy's old child then stopped,
    the removed newcomer was made the copy's current record, a member of no copy."""
    m = CopiesMachine()
    steps: list[tuple[str, dict[str, Any]]] = [
        ("acquire", {"affinity": 0, "model": "a"}), ("reload_child", {}),
        ("release", {"i": 0}), ("acquire", {"affinity": 0, "model": "a"}),
        ("ready", {"i": 0}), ("reload_child", {}), ("reload_child", {}),
        ("reload", {"most": 1}), ("reload", {"most": 2}), ("release", {"i": 0})]
    for name, kwargs in steps:
        getattr(m, name)(**kwargs)  # (each step checks the invariants)
    assert [r.name for r in m.w.p.state.groups.members["a"]] == ["a", "a@2"]
    m.teardown()
