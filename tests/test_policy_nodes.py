"""Cluster nodes in the pure policy (issue 19): models_max_per_node without memory
accounting evicts as models_max does, a lost node is a refusal that says so (never a
failed load), and a model's generation never moves backwards, adoption included."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config.rules import ModelRules
from actors.ledger import DeviceSample
from actors.lifecycle import ModelState
from actors.messages import DeviceReport, Grant, Refusal
from actors.policy import Policy
from actors.policy.records import Effect, Spawn, Stop, Wake
from tests.test_policy import World

BOTH = ["node_a", "node_b"]
GiB = 1024**3
S = ModelState


class NodeWorld(World):
    """A cluster without memory accounting: the Scheduler's node facts, by hand."""

    def __init__(self, per_node: int, nodes: dict[str, list[str]], models_max: int = 0,
                 up: tuple[str, ...] = ("node_a", "node_b"), **rules: ModelRules) -> None:
        super().__init__(models_max, "")
        self.p = Policy(models_max, 3, 60.0, models_max_per_node=per_node)
        for name, on in nodes.items():
            self.p.add_model(name, 0.0, rules=rules.get(name, ModelRules(nodes=on)))
        self.placed: dict[str, str | None] = {}
        for node in up:
            self.run(self.p.children.node_changed(node, True, "", self.tick()))

    def run(self, effects: list[Effect]) -> list[Effect]:
        for e in effects:
            if isinstance(e, Spawn):
                self.placed[e.model] = e.node
        return super().run(effects)


def test_the_per_node_cap_evicts_the_nodes_least_recently_used_idle_model() -> None:
    """The issue's case: two models allowed only on node_a, one per node. The second
    evicts the first, loads there, and no refusal or failed load is counted."""
    w = NodeWorld(1, {"p": ["node_a"], "q": ["node_a"]})
    w.load_idle("p")
    assert w.placed["p"] == "node_a"
    assert w.acquire(1, "q") is None
    assert w.stops == [("p", "lru")]
    assert w.p.state.models["p"].last_eviction is not None
    assert w.p.state.models["p"].last_eviction.for_model == "q"
    assert ("q", 1) not in w.spawns  # not before p's child is reaped
    w.exited("p")
    assert w.spawns[-1] == ("q", 1) and w.placed["q"] == "node_a"
    w.ready("q")
    assert isinstance(w.answers[1], Grant)
    for name in "pq":
        rec = w.p.state.models[name]
        assert not rec.failed and rec.breaker.attempt <= 1 and not rec.breaker.failures
    assert w.p.state.stats.refusals == {}


def test_the_cap_takes_the_lru_model_of_the_nodes_and_a_free_node_first() -> None:
    w = NodeWorld(1, {"a": BOTH, "b": BOTH, "c": BOTH})
    w.load_idle("a", "b")
    assert {w.placed["a"], w.placed["b"]} == set(BOTH)  # a free node before an eviction
    w.load_idle("a")  # b is now the least recently used
    w.acquire(1, "c")
    assert w.stops == [("b", "lru")]
    w.exited("b")
    assert w.placed["c"] == w.placed["b"]


def test_a_stopping_child_frees_its_node_and_nothing_more_is_evicted() -> None:
    """While the victim stops, more pumps (a release, another request) stop no one else."""
    w = NodeWorld(2, {"a": ["node_a"], "b": ["node_a"], "c": ["node_a"]})
    w.load_idle("a", "b")
    w.acquire(1, "c")
    assert w.stops == [("a", "lru")]
    w.load_idle("b")
    w.acquire(2, "c")
    assert w.stops == [("a", "lru")]
    w.exited("a")
    assert w.placed["c"] == "node_a"


def test_a_model_too_young_to_go_is_evicted_once_it_has_been_resident_long_enough() -> None:
    w = NodeWorld(1, {"p": ["node_a"], "q": ["node_a"]},
                  p=ModelRules(nodes=["node_a"], min_resident_s=10.0))
    w.load_idle("p")
    w.acquire(1, "q")
    assert w.stops == []  # p is younger than its min_resident_s
    w.now += 10
    w.fire_timers()
    assert w.stops == [("p", "lru")]


def test_a_node_at_its_cap_with_busy_models_makes_requests_wait_and_says_why() -> None:
    rules = ModelRules(nodes=["node_a"], queue_timeout_s=5.0)
    w = NodeWorld(1, {"p": ["node_a"], "q": ["node_a"]}, q=rules)
    w.load_idle("p")
    assert isinstance(w.acquire(1, "p"), Grant)  # p is busy
    assert w.acquire(2, "q") is None
    assert w.stops == []
    w.now += 10
    w.fire_timers()
    refusal = w.answers[2]
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert "node at its cap (models_max_per_node 1)" in refusal.message, refusal.message
    assert not w.p.state.models["q"].failed and not w.p.state.models["q"].breaker.failures


def test_a_node_at_its_cap_with_pinned_models_is_refused_saying_so() -> None:
    w = NodeWorld(1, {"p": ["node_a"], "q": ["node_a"]},
                  p=ModelRules(nodes=["node_a"], pinned=True))
    w.load_idle("p")
    refusal = w.acquire(1, "q")
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert "node at its cap (models_max_per_node 1)" in refusal.message
    assert "pinned" in refusal.message and w.stops == []


def test_a_lost_node_is_a_refusal_that_says_node_lost_not_a_failed_load() -> None:
    """The old message blamed models_max_per_node for a lost node with no cap set, and
    each refusal counted as failed loads until the breaker opened."""
    w = NodeWorld(0, {"m": ["node_a"]}, up=())
    assert w.acquire(1, "m") is None  # not heard of yet: it waits for the first word
    w.run(w.p.children.node_changed("node_a", False, "the agent on node node_a died", w.tick()))
    for ticket in range(1, 6):
        refusal = w.answers.get(ticket) or w.acquire(ticket, "m")
        assert isinstance(refusal, Refusal) and refusal.status == 503
        assert "node lost" in refusal.message and "node_a: the agent on node node_a died" \
            in refusal.message, refusal.message
        assert "models_max_per_node" not in refusal.message
    rec = w.p.state.models["m"]
    assert w.spawns == [] and not rec.failed and not rec.breaker.failures
    assert not rec.breaker.is_open(w.now)
    w.run(w.p.children.node_changed("node_a", True, "", w.tick()))
    w.acquire(9, "m")
    assert w.spawns == [("m", 1)] and w.placed["m"] == "node_a"


def test_a_model_goes_to_a_node_still_up() -> None:
    w = NodeWorld(0, {"m": BOTH})
    w.run(w.p.children.node_changed("node_a", False, "lost", w.tick()))
    w.acquire(1, "m")
    assert w.placed["m"] == "node_b"


def test_a_model_without_nodes_is_not_placed_on_one() -> None:
    w = NodeWorld(1, {"here": []}, here=ModelRules())
    w.acquire(1, "here")
    assert w.placed["here"] is None


# ---------------------------------------------------------------- generations (R12)


def test_the_reviews_adoption_below_the_record_stops_the_child() -> None:
    """R12's reproducer: the node comes back with child #1 after #2 was given out."""
    p = Policy(2, 3, 60.0)
    p.add_model("m", 0.0)
    p.load("t1", "m", 0.0)
    p.children.instance_ready("m", 1, 100, "nodeA", 1, 0.1)
    p.children.instance_exited("m", 1, -1, "node lost: poll failed", 1.0)
    p.load("t2", "m", 1.1)
    p.children.instance_exited("m", 2, 1, "exited with status 1", 1.5)
    effects = p.children.instance_adopted("m", 1, 100, "nodeA", 1, None, 2.0)
    assert [e for e in effects if isinstance(e, Stop)] == [
        Stop("m", 1, "not adopted: its generation 1 is older than the model's 2")]
    assert p.state.models["m"].generation == 2 and p.state.models["m"].state.value == "unloaded"
    spawned = [e.generation for e in p.load("t4", "m", 4.0) if isinstance(e, Spawn)]
    assert spawned == [3]


Step = st.one_of(
    st.tuples(st.just("load")),
    st.tuples(st.just("ready")),
    st.tuples(st.just("exit"), st.integers(-9, 1)),
    st.tuples(st.just("unload")),
    st.tuples(st.just("adopt"), st.integers(0, 12)),
    st.tuples(st.just("seen"), st.integers(0, 12)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(Step, max_size=40))
def test_a_generation_never_moves_backwards_nor_is_given_out_twice(steps: list[tuple]) -> None:
    """Over any history of spawns, exits, unloads, adoptions (of a child numbered from
    0 to 12, as a node may report) and children seen: the record's generation never
    decreases, every spawn takes a number never seen before, and a running record is
    never taken over by an adopted child."""
    p = Policy(2, 100, 60.0)
    p.add_model("m", 0.0)
    rec = p.state.models["m"]
    given_out: set[int] = set()
    now = 0.0
    for step in steps:
        now += 1.0
        before, state = rec.generation, rec.state
        effects: list[Effect] = []
        match step:
            case ("load",):
                effects = p.load(("load", now), "m", now)
            case ("ready",):
                effects = p.children.instance_ready("m", rec.generation, 1, "n", 1, now)
            case ("exit", rc):
                effects = p.children.instance_exited("m", rec.generation, rc, "exit", now)
            case ("unload",):
                effects = p.unload(("unload", now), "m", now)
            case ("adopt", generation):
                effects = p.children.instance_adopted("m", generation, 7, "n", 2, None, now,
                                             node="node_a")
                adopted = rec.generation == generation and rec.state.value == "loaded" \
                    and state.value == "unloaded"
                stopped = [e for e in effects if isinstance(e, Stop)]
                own = state.is_running and generation == before  # its own child: left be
                assert adopted + bool(stopped) + own == 1, (step, effects)
                if adopted:
                    given_out.add(generation)
            case ("seen", generation):
                p.children.instance_seen("m", generation)
                if state.value == "unloaded":
                    given_out.add(generation)
        p.check_invariants()
        assert rec.generation >= before, (step, before, rec.generation)
        for e in effects:
            if isinstance(e, Spawn):
                assert e.generation not in given_out, (step, e.generation, given_out)
                assert e.generation > max(given_out, default=0)
                given_out.add(e.generation)


# ------------------------------------------------------------------ drains (issue 42)


def drain(w: NodeWorld, node: str, on: bool = True) -> object:
    ticket = ("drain", node, w.now)
    w.run(w.p.drain(ticket, node, on, w.tick()))
    return w.answers[ticket]


def test_a_drain_moves_each_model_make_before_break_and_ends_drained() -> None:
    """A model on the drained node loads on the other node while the old child serves;
    once the new one is ready it takes the requests, the old stops at its requests' end,
    and the node is drained; nothing new goes there until it is undrained."""
    w = NodeWorld(0, {"a": BOTH, "b": BOTH})
    w.load_idle("a")
    assert w.placed["a"] == "node_a"
    w.acquire(1, "a")  # a request running on the old child through the move
    view = drain(w, "node_a")
    assert view.state == "draining" and view.moving == ["a"] and view.stays == {}
    assert w.placed["a@next"] == "node_b" and w.state("a@next") == "loading"
    assert w.state("a") == "loaded" and isinstance(w.answers[1], Grant)
    w.acquire(2, "a")  # served by the old child while the new one loads
    assert isinstance(w.answers[2], Grant) and w.answers[2].instance != "a@next"
    w.ready("a@next")
    w.acquire(3, "a")
    assert isinstance(w.answers[3], Grant) and w.answers[3].instance == "a@next"
    assert w.state("a") == "loaded"  # retiring: its requests run to their end
    w.release(1)
    w.release(2)
    assert ("a", "reload") in w.stops or w.state("a") == "stopping"
    w.exited("a")
    assert w.p.drains.view("node_a").state == "drained"
    w.acquire(4, "b")  # a new load: not on the draining node
    assert w.placed["b"] == "node_b"
    assert drain(w, "node_a", False).state == "in_service"


def test_a_model_with_no_other_node_stays_and_the_drain_says_why() -> None:
    w = NodeWorld(0, {"only": ["node_a"], "both": BOTH})
    w.load_idle("only", "both")
    view = drain(w, "node_a")
    assert "only" in view.stays and "no other node" in view.stays["only"]
    assert view.state == "draining" and view.moving == ["both"]
    assert w.state("only") == "loaded" and "only@next" not in w.placed
    w.acquire(1, "only")  # it still serves where it is
    assert isinstance(w.answers[1], Grant)
    w.release(1)
    w.settle()
    w.settle()
    assert w.p.drains.view("node_a").state == "drained"  # only what stays is left
    assert w.state("only") == "loaded"


def test_a_model_not_running_whose_nodes_are_all_drained_is_refused_saying_so() -> None:
    w = NodeWorld(0, {"only": ["node_a"]})
    drain(w, "node_a")
    w.acquire(1, "only")
    refusal = w.answers[1]
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert "drained" in refusal.message and "undrain" in refusal.message
    drain(w, "node_a", False)
    w.acquire(2, "only")
    assert w.placed["only"] == "node_a"


def test_a_model_that_stays_moves_once_another_node_comes_up() -> None:
    w = NodeWorld(0, {"a": BOTH}, up=("node_a",))
    w.load_idle("a")
    assert "a" in drain(w, "node_a").stays
    w.run(w.p.children.node_changed("node_b", True, "", w.tick()))
    assert w.placed.get("a@next") == "node_b"
    assert w.p.drains.view("node_a").moving == ["a"]


def test_a_drain_where_the_other_node_has_no_slot_stops_the_old_child_at_its_end() -> None:
    """Make-before-break only where both fit: node_b is at its cap with a busy model, so
    a's child stops once idle, and its next request waits for room on node_b."""
    w = NodeWorld(1, {"a": BOTH, "z": ["node_b"]})
    w.load_idle("a")
    w.acquire(1, "z")
    w.ready("z")
    assert w.placed["a"] == "node_a" and w.placed["z"] == "node_b"
    view = drain(w, "node_a")
    assert view.moving == ["a"] and "a@next" not in w.placed
    assert w.state("a") == "stopping"  # idle: it stops at once
    w.exited("a")
    assert w.p.drains.view("node_a").state == "drained"
    w.acquire(2, "a")
    assert w.answers.get(2) is None  # waits for node_b's slot
    w.release(1)
    w.settle()
    w.settle()
    assert w.placed["a"] == "node_b" and isinstance(w.answers[2], Grant)


DrainStep = st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from(["a", "b", "only"])),
    st.tuples(st.just("release")),
    st.tuples(st.just("settle")),
    st.tuples(st.sampled_from(["drain", "undrain", "lost", "up"]), st.sampled_from(BOTH)),
)


@settings(max_examples=int(os.environ.get("CORRAL_DRAIN_EXAMPLES", "200")), deadline=None)
@given(st.lists(DrainStep, max_size=40), st.integers(0, 2))
def test_no_child_starts_on_a_draining_node_and_every_drain_ends(steps: list[tuple],
                                                                  per_node: int) -> None:
    """Over any history of requests, drains, undrains and nodes lost and back: no child
    is started on a draining node, every request is answered, and once the children
    settle each draining node is drained, with only models that have nowhere else left
    there."""
    w = NodeWorld(per_node, {"a": BOTH, "b": BOTH, "only": ["node_a"]})
    nodes, granted = w.p.state.nodes, []

    def run(effects: list[Effect]) -> None:
        for e in effects:
            assert not (isinstance(e, Spawn) and e.node in nodes.draining), e

    for i, step in enumerate(steps):
        match step:
            case ("acquire", model):
                run(w.run(w.p.acquire(i, model, w.tick())))
                granted.append(i)
            case ("release",) if granted:
                ticket = granted.pop(0)
                if isinstance(w.answers.get(ticket), Grant):
                    run(w.run(w.p.release(ticket, w.tick())))
                else:
                    run(w.run(w.p.cancel(ticket, w.tick())))
            case ("settle",):
                w.settle()
            case ("drain" | "undrain" as what, node):
                drain(w, node, what == "drain")
            case ("lost" | "up" as what, node):
                run(w.run(w.p.children.node_changed(node, what == "up", "lost", w.tick())))
                for rec in list(w.p.state.models.values()):
                    if what == "lost" and rec.node == node and rec.state.is_running:
                        run(w.run(w.p.children.instance_exited(
                            rec.name, rec.generation, -9, "node lost", w.tick())))
    for _ in range(20):  # every request ends, every child moves on
        for ticket in granted:
            if isinstance(w.answers.get(ticket), Grant):
                run(w.run(w.p.release(ticket, w.tick())))
        granted = [t for t in granted if t not in w.answers]
        w.now += 100.0
        w.fire_timers()
        if not w.settle() and not granted:
            break
    assert not granted, f"never answered: {granted}"
    for node in nodes.draining:
        view = w.p.drains.view(node)
        there = {r.group for r in w.p.state.models.values()
                 if r.node == node and r.state.is_running}
        assert view.state == "drained", view
        assert there <= set(view.stays), (there, view)
        for model in view.stays:
            others = set(w.p.state.models[model].rules.nodes or []) - {node}
            assert not others & (nodes.up - nodes.draining), (model, view, nodes.up)

# ------------------------------------------------------------------ drains: the review's cases


def report_devices(w: NodeWorld, usage: dict[str, int]) -> None:
    """A device report: node_a/gpu0 (the models' use), host RAM plenty."""
    w.run(w.p.children.devices_reported(DeviceReport(
        devices=[DeviceSample("node_a/gpu0", "device", 80 * GiB, 40 * GiB, "simulated"),
                 DeviceSample("host", "host", 64 * GiB, 60 * GiB, "host")],
        managed={"node_a/gpu0": sum(usage.values())},
        usage={m: {"node_a/gpu0": b} for m, b in usage.items()},
        tracked=sorted(usage), backends=["simulated", "host"]), w.tick()))


def test_what_stays_is_said_of_the_children_there_now() -> None:
    w = NodeWorld(0, {"a": BOTH}, up=("node_a",))
    w.load_idle("a")
    assert "a" in drain(w, "node_a").stays
    w.run(w.p.unload(("u",), "a", w.tick()))
    w.exited("a")
    w.run(w.p.children.node_changed("node_b", True, "", w.tick()))
    view = w.p.drains.view("node_a")
    # a runs nowhere, node_b is up and in service: nothing "stays" on node_a
    assert view.stays == {}, view


def suspended_world() -> NodeWorld:
    rules = ModelRules(nodes=BOTH, suspend=True, ttl_suspend_s=5.0)
    w = NodeWorld(0, {"a": BOTH}, a=rules)
    w.load_idle("a")
    assert w.placed["a"] == "node_a"
    report_devices(w, {"a": GiB})
    w.now += 10
    w.fire_timers()
    assert w.state("a") == "suspending"
    w.run(w.p.tiers.suspended("a", w.gen("a"), True, "", 0, w.tick()))
    assert w.state("a") == "suspended"
    return w


def test_a_suspended_child_on_a_draining_node_is_stopped_and_the_drain_ends() -> None:
    w = suspended_world()
    drain(w, "node_a")
    for _ in range(5):
        w.now += 100
        w.fire_timers()
        w.settle()
    view = w.p.drains.view("node_a")
    assert view.state == "drained", (view, w.state("a"))


def test_a_suspended_child_on_a_draining_node_is_never_woken_there() -> None:
    w = suspended_world()
    drain(w, "node_a")
    effects = w.run(w.p.acquire(1, "a", w.tick()))
    woke = [e for e in effects if isinstance(e, Wake)]
    rec = w.p.state.models["a"]
    # the child sleeps on node_a: a wake starts it again there, yet the record says node_b
    assert not (woke and rec.node != "node_a"), (woke, rec.node)


def test_a_moved_models_old_child_back_with_its_node_is_stopped_not_adopted() -> None:
    """node_a (draining) is lost while a's old child is being stopped after its move; its
    agent comes back with that child still running: it is stopped, not adopted beside
    a@next (two children serving one model, and a drain that never ended)."""
    w = NodeWorld(0, {"a": BOTH})
    w.load_idle("a")
    old = w.gen("a")
    drain(w, "node_a")
    w.ready("a@next")
    assert w.state("a") == "stopping"
    w.run(w.p.children.node_changed("node_a", False, "lost", w.tick()))
    w.run(w.p.children.instance_exited("a", old, -9, "node lost", w.tick()))
    w.run(w.p.children.node_changed("node_a", True, "", w.tick()))
    effects = w.run(w.p.children.instance_adopted("a", old, 7, "h", 2, None, w.tick(),
                                                  node="node_a"))
    stopped = [e for e in effects if isinstance(e, Stop)]
    for _ in range(5):
        w.now += 1000
        w.fire_timers()
        w.settle()
    a, nxt = w.p.state.models["a"], w.p.state.models["a@next"]
    assert stopped or not (a.state.is_serving and nxt.state.is_serving), (
        "two serving children", a.state, a.node, a.takes_over, nxt.state, nxt.node)


def test_a_warm_model_with_nodes_is_loaded_on_a_node_with_a_free_slot() -> None:
    """Without memory accounting a warm model was spawned with no node (the head said
    "node lost"): it goes to a node with a free slot."""
    w = NodeWorld(0, {"a": BOTH}, a=ModelRules(nodes=BOTH, warm=True))
    w.run(w.p.repump(w.tick()))
    assert w.state("a") == "loading"
    assert w.placed["a"] is not None, "Spawn(node=None): the head answers 'node lost'"


def test_a_failed_move_leaves_the_model_serving_and_says_why() -> None:
    w = NodeWorld(0, {"a": BOTH})
    w.load_idle("a")
    drain(w, "node_a")
    w.exited("a@next", 1)  # the newcomer's load fails once (OOM, a bad disk...)
    for t in range(10):  # time passes, requests come and go
        w.now += 100
        w.fire_timers()
        w.acquire(("later", t), "a")
        w.release(("later", t))
        w.settle()
    view = w.p.drains.view("node_a")
    assert "move failed" in view.stays["a"] and view.state == "drained", view
    assert w.state("a") == "loaded" and w.p.state.models["a"].node == "node_a"


def test_a_model_that_could_never_load_elsewhere_stays_and_serves() -> None:
    """node_b is up and in service but its only slot is held by a pinned model: a stays
    on node_a and serves (a drain that stopped it left every later request refused)."""
    w = NodeWorld(1, {"a": BOTH, "z": ["node_b"]}, z=ModelRules(nodes=["node_b"], pinned=True))
    w.load_idle("z", "a")
    assert w.placed["a"] == "node_a"
    view = drain(w, "node_a")
    w.settle()
    refusal = w.acquire(1, "a")
    assert isinstance(refusal, Grant) and "pinned" in view.stays["a"], (view, refusal)


def test_an_alternates_child_back_beside_the_serving_record_is_stopped() -> None:
    """The same through the alternate: a@next's stopping child on node_b survives a
    node flap while `a` serves on node_a: it is stopped, not adopted."""
    w = NodeWorld(0, {"a": BOTH})
    w.load_idle("a")
    drain(w, "node_a")
    w.ready("a@next")
    w.exited("a")
    drain(w, "node_a", False)
    drain(w, "node_b")
    w.ready("a")
    gen = w.gen("a@next")
    assert w.state("a@next") == "stopping"
    w.run(w.p.children.node_changed("node_b", False, "lost", w.tick()))
    w.run(w.p.children.instance_exited("a@next", gen, -9, "node lost", w.tick()))
    w.run(w.p.children.node_changed("node_b", True, "", w.tick()))
    effects = w.run(w.p.children.instance_adopted("a@next", gen, 7, "h", 2, None, w.tick(),
                                                  node="node_b"))
    assert [e for e in effects if isinstance(e, Stop)] or not (
        w.p.state.models["a"].state.is_serving and w.p.state.models["a@next"].state.is_serving)


def test_a_move_under_way_is_not_begun_again_when_another_node_comes_or_goes() -> None:
    """A node event clears what was tried (a new chance for failed moves): a move still
    loading was begun again, stopping its newcomer (the Ray test saw it as a "reload
    eviction" of a@next when node_b was lost)."""
    w = NodeWorld(0, {"a": BOTH})
    w.load_idle("a")
    drain(w, "node_a")
    gen = w.gen("a@next")
    w.run(w.p.children.node_changed("node_c", True, "", w.tick()))
    w.run(w.p.children.node_changed("node_c", False, "lost", w.tick()))
    assert w.state("a@next") == "loading" and w.gen("a@next") == gen
    assert not [s for s in w.stops if s[0] == "a@next"]
    w.ready("a@next")
    w.settle()
    assert w.p.drains.view("node_a").state == "drained"


def host_report(w: NodeWorld, free: dict[str | None, int], usage: int = GiB) -> None:
    """A device report with each machine's host RAM (None: the head's own), `free` of
    16 GiB available there; 0 for a machine reads as a lost node's (0 of 0)."""
    hosts = [DeviceSample("host" if n is None else f"{n}/host", "host", 16 * GiB if f else 0,
                          f, "host") for n, f in free.items()]
    w.run(w.p.children.devices_reported(DeviceReport(
        devices=[DeviceSample("node_a/gpu0", "device", 80 * GiB, 40 * GiB, "simulated"),
                 *hosts], managed={"node_a/gpu0": usage}, usage={"a": {"node_a/gpu0": usage}},
        tracked=["a"], backends=["simulated", "host"], suspended=["a"]), w.tick()))


def test_each_machines_host_ram_is_its_own_tier() -> None:
    """Issue 42: a model suspended on node_a counts on node_a's host RAM alone, against
    the margin there: the head's own host running short stops nothing on node_a, nor
    does a lost node's report (0 of 0: no figure); node_a's running short stops it, and
    says where."""
    w = suspended_world()
    w.p.state.host.margin = 2 * GiB
    host_report(w, {None: GiB, "node_a": 8 * GiB, "node_b": 0})
    assert w.state("a") == "suspended", "the head's host RAM is not node_a's"
    assert set(w.p.state.host.available) == {None, "node_a"}
    assert w.p.state.host.short([]) == [None]
    host_report(w, {None: GiB, "node_a": GiB})
    assert w.state("a") == "stopping"
    last = w.p.state.models["a"].last_eviction
    assert last is not None and last.reason == "host_memory", last
    assert "host RAM available on node_a is below" in (last.why or ""), last


def test_a_suspend_is_judged_by_the_host_ram_of_its_node() -> None:
    """A model on node_a with room on node_a's host suspends though the head's host has
    none; with none on node_a it does not, and the reason names the node."""
    rules = ModelRules(nodes=BOTH, suspend=True, ttl_suspend_s=5.0)
    for node_a_free, suspends in ((8 * GiB, True), (GiB, False)):
        w = NodeWorld(0, {"a": BOTH}, a=rules)
        w.p.state.host.margin = 2 * GiB
        w.load_idle("a")
        host_report(w, {None: 0 * GiB + 1, "node_a": node_a_free}, usage=3 * GiB)
        rec = w.p.state.models["a"]
        why = w.p.state.host.why_not(rec, w.p.state.ledger, [])
        assert (why is None) is suspends, why
        if not suspends:
            assert why is not None and "host memory on node node_a" in why
        w.now += 10
        w.fire_timers()
        assert (w.state("a") == "suspending") is suspends, w.state("a")
        if suspends:
            assert w.p.state.host.unseen == {"a": ("node_a", w.p.state.host.unseen["a"][1])}


def test_a_suspended_models_node_is_kept_when_a_request_wakes_it() -> None:
    """(Review of issue 42.) No memory accounting, one model a node: `a` sleeps on
    node_b, node_a comes free; a request for `a` wakes it where it sleeps, and its record
    still says node_b (the node-slot choice is for a load, not a wake)."""
    a_rules = ModelRules(nodes=BOTH, suspend=True, ttl_suspend_s=5.0)
    w = NodeWorld(1, {"z": ["node_a"], "a": BOTH}, a=a_rules)
    w.load_idle("z", "a")
    assert w.placed["a"] == "node_b"
    report_devices(w, {"a": GiB})
    w.now += 10
    w.fire_timers()
    w.run(w.p.tiers.suspended("a", w.gen("a"), True, "", 0, w.tick()))
    w.run(w.p.unload("u", "z", w.tick()))
    w.exited("z")
    effects = w.run(w.p.acquire(1, "a", w.tick()))
    assert [e for e in effects if isinstance(e, Wake)], effects
    assert w.p.state.models["a"].node == "node_b"


def test_what_a_node_frees_is_judged_by_that_nodes_monitor() -> None:
    """(Review of issue 42.) `a`, suspended on node_a, exits: its host copy is coming
    back on node_a until node_a's monitor no longer tracks it, whatever another node's
    tracks (a loads on node_b meanwhile); and a machine whose host was not sampled once
    keeps its last figure rather than becoming unlimited."""
    w = suspended_world()
    host = w.p.state.host
    w.p.state.models["a"].host_bytes = 4 * GiB
    host_report(w, {None: 8 * GiB, "node_a": 8 * GiB})
    w.run(w.p.children.instance_exited("a", w.gen("a"), -9, "gone", w.tick()))
    assert host.freeing == {"a": ("node_a", 4 * GiB)}

    def report(by: dict[str, list[str]], hosts: tuple[str, ...]) -> None:
        w.run(w.p.children.devices_reported(DeviceReport(
            devices=[DeviceSample(f"{n}/host", "host", 16 * GiB, 12 * GiB, "host")
                     for n in hosts], managed={}, usage={},
            tracked=sorted({m for names in by.values() for m in names}), backends=["host"],
            tracked_by=by), w.tick()))
    report({"": [], "node_a": ["a"], "node_b": []}, ("node_a", "node_b"))
    assert host.freeing == {"a": ("node_a", 4 * GiB)}, "node_a still tracks it"
    report({"": [], "node_a": [], "node_b": ["a"]}, ("node_b",))
    assert host.freeing == {}, "node_a no longer tracks it; node_b's copy is another"
    assert host.available["node_a"] == 12 * GiB, "not sampled this time: the last figure"
