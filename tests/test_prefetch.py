"""The next model, loaded before it is asked (issue 44, part 2; policy/prefetch.py): the
pure policy driven synchronously (test_policy_suspend's world), then a corral process.
"""

from __future__ import annotations

import re
import time
from typing import Any

from actors.config.keys import Tenant
from actors.config.rules import SESSION, ModelGroup, ModelRules
from actors.messages import Grant, Prefetched, Refusal
from actors.policy.prefetch import FOLLOW_S
from actors.policy.records import Spawn
from tests.helpers import SSE, chat, fake_cmd, request, toml_config
from tests.test_policy import World
from tests.test_policy_suspend import TierWorld


def world(models_max: int = 3) -> TierWorld:
    w = TierWorld({"a": 1, "b": 1, "c": 1}, models_max=models_max)
    w.p.prefetch.on = True
    return w


def ask(w: TierWorld, model: str, ticket: object) -> None:
    """One request for `model`, loaded first if it must be, answered and let go."""
    w.acquire(ticket, model)
    if w.state(model) == "loading":
        w.ready(model)
    assert isinstance(w.answers[ticket], Grant), w.answers[ticket]
    w.release(ticket)


def unload(w: TierWorld, model: str) -> None:
    w.run(w.p.unload(("unload", model, w.now), model, w.tick()))
    w.exited(model)
    w.report()


def learn(w: TierWorld, rounds: int = 3, gap: float = 0.0) -> None:
    """An agent that asks b after each answer from a (`gap` s later, and the tick of its
    ask); b is unloaded in between."""
    for i in range(rounds):
        ask(w, "a", ("a", i))
        w.now += gap
        ask(w, "b", ("b", i))
        unload(w, "b")


def prefetches(w: TierWorld) -> list[Prefetched]:
    return [e for e in w.events if isinstance(e, Prefetched)]


def test_the_model_asked_next_is_loaded_after_the_answer_and_serves_at_once() -> None:
    w = world()
    learn(w, 2)
    ask(w, "a", "x")
    assert prefetches(w) == [], "seen twice: not enough to go on"
    ask(w, "b", "y")
    unload(w, "b")
    spawns = len([e for e in w.effects if isinstance(e, Spawn)])
    ask(w, "a", "z")  # b after a: 3 of 3 times
    assert prefetches(w) == [Prefetched(model="b", after="a", odds=1.0, seen=3,
                                        action="load", expected_s=1.0)]
    assert w.state("b") == "loading"
    assert len([e for e in w.effects if isinstance(e, Spawn)]) == spawns + 1
    assert w.p.snapshot(w.now).prefetches == {"loaded": 1}
    w.ready("b")
    w.acquire("t", "b")
    assert isinstance(w.answers["t"], Grant), "served at once by the prefetched child"
    assert w.p.snapshot(w.now).prefetches == {"loaded": 1, "used": 1}


def test_a_wrong_guess_is_the_first_victim_and_counts_as_wasted() -> None:
    w = world(models_max=2)
    learn(w)
    ask(w, "a", "x")
    assert w.state("b") == "loading"
    w.ready("b")  # nobody asked for it
    w.acquire("t", "c")  # c needs a slot: b goes, not a (used more recently)
    assert w.evictions()[-1].model == "b", w.evictions()
    w.exited("b")
    w.report()
    w.ready("c")
    w.release("t")
    ask(w, "a", "y")
    assert w.p.snapshot(w.now).prefetches.get("wasted") == 1


def test_a_model_used_since_the_next_one_is_expected_stays_and_a_request_goes_first() -> None:
    w = world(models_max=2)
    learn(w, gap=100)  # b comes 100 s after a's answer
    ask(w, "c", "c")  # a and c hold both slots; c was used 2 s before a's answer ends
    ask(w, "a", "x")
    assert prefetches(w) == [] and w.state("b") == "unloaded" and w.state("c") == "loaded"
    w2 = world(models_max=3)
    learn(w2)
    w2.acquire("wait", "c")  # c's load, not yet ready: a request waits
    ask(w2, "a", "x")
    assert prefetches(w2) == [], "a request waits: nothing is taken ahead of it"


def test_a_model_idle_longer_than_the_next_ones_wait_gives_its_slot_once_gone() -> None:
    w = world(models_max=2)
    learn(w, gap=100)
    ask(w, "c", "c")
    w.now += 150  # c idle past b's expected wait
    ask(w, "a", "x")
    gone = w.evictions()[-1]
    assert (gone.model, gone.reason, gone.for_model) == ("c", "prefetch", "b")
    assert w.state("b") == "unloaded", "c's slot: once c is gone"
    assert prefetches(w) == [] and not w.p.snapshot(w.now).prefetches, "said as it loads"
    w.exited("c")
    w.report()
    assert w.state("b") == "loading" and w.p.state.prefetched.keys() == {"b"}
    assert prefetches(w) == [Prefetched(model="b", after="a", odds=1.0, seen=3, action="load",
                                        expected_s=101.0, evicts=["c"])]
    w.ready("b")
    w.acquire("t", "b")
    assert isinstance(w.answers["t"], Grant)
    assert w.p.snapshot(w.now).prefetches == {"loaded": 1, "used": 1}


def test_a_request_that_comes_while_the_victim_stops_takes_its_slot() -> None:
    w = world(models_max=2)
    learn(w, gap=100)
    ask(w, "c", "c")
    w.now += 150
    ask(w, "a", "x")
    assert w.evictions()[-1].model == "c"
    w.acquire("t", "c")  # c again, before it is gone
    w.exited("c")
    w.report()
    assert w.state("b") == "unloaded" and not w.p.prefetch.due
    assert not w.p.snapshot(w.now).prefetches, "it never loaded: not counted"
    w.ready("c")
    assert isinstance(w.answers["t"], Grant)


def test_for_memory_only_models_idle_longer_than_its_wait_go_and_it_loads_after() -> None:
    w = TierWorld({"a": 4, "b": 4, "c": 4}, models_max=3)
    w.p.prefetch.on = True
    learn(w, gap=20)
    ask(w, "c", "c")  # a and c: 8 of 10 GiB; b needs 4
    ask(w, "a", "x")
    assert prefetches(w) == [] and w.state("c") == "loaded", "c used 2 s ago: it stays"
    w.now += 30
    ask(w, "a", "y")
    assert w.evictions()[-1].reason == "prefetch" and w.state("a") == "loaded"
    assert w.state("b") == "unloaded", "c's memory: once c has given it back"
    assert w.state("c") == "suspending"
    w.suspended("c")
    w.report()
    assert w.state("b") == "loading" and w.state("c") == "suspended"
    assert [e.evicts for e in prefetches(w)] == [["c"]]


def test_what_comes_long_after_an_answer_follows_nothing() -> None:
    w = world()
    for i in range(3):
        ask(w, "a", ("a", i))
        w.now += FOLLOW_S + 1
        ask(w, "b", ("b", i))
        unload(w, "b")
    ask(w, "a", "x")
    assert prefetches(w) == []
    assert not w.p.prefetch.follows.get("a")


def test_off_by_default() -> None:
    w = TierWorld({"a": 1, "b": 1}, models_max=3)
    for i in range(4):
        ask(w, "a", ("a", i))
        ask(w, "b", ("b", i))
        unload(w, "b")
    ask(w, "a", "x")
    assert prefetches(w) == [] and not w.p.prefetch.follows


# -------------------------------------------------------------------- a review's findings


def serve(w: World, model: str, t: object) -> None:
    """One request, its model settled first (rivals stopped, loads readied)."""
    w.acquire(t, model)
    for _ in range(6):
        if isinstance(w.answers.get(t), Grant):
            break
        w.settle()
    assert isinstance(w.answers[t], Grant), w.answers.get(t)
    w.release(t)


def slots_world(models_max: int = 3, names: str = "abc") -> World:
    """test_policy's World (no memory), prefetch on, "b after a" learned 3 times."""
    w = World(models_max=models_max, names=names)
    w.p.prefetch.on = True
    for i in range(3):
        serve(w, "a", ("a", i))
        serve(w, "b", ("b", i))
        w.run(w.p.unload(("u", i), "b", w.tick()))
        w.settle()
    return w


def test_an_exclusive_rival_is_never_prefetched_beside_its_rival() -> None:
    w = World(models_max=3, names="ab")
    w.p.prefetch.on = True
    w.p.state.teams.replace({"g": ModelGroup(models=["a", "b"], exclusive=True)})
    for i in range(4):
        serve(w, "a", ("a", i))
        serve(w, "b", ("b", i))
    serve(w, "a", "x")
    w.settle()
    assert [m for m in "ab" if w.state(m) != "unloaded"] == ["a"]


def test_a_prefetch_under_way_gives_its_slot_up_before_a_used_model_goes() -> None:
    w = slots_world(models_max=2)
    serve(w, "a", "x")
    assert w.state("b") == "loading"
    w.acquire("t", "c")
    assert w.state("a") == "loaded" and w.state("b") == "stopping", w.stops


def test_a_prefetch_under_way_gives_its_memory_up_to_a_request() -> None:
    w = TierWorld({"a": 4, "b": 4, "c": 4})
    w.p.prefetch.on = True
    learn(w)
    ask(w, "a", "x")
    assert w.state("b") == "loading"
    w.acquire("t", "c")
    assert w.state("b") == "stopping" and w.state("a") == "loaded"


def test_the_plan_says_a_prefetch_only_of_a_model_down_that_the_asker_may_see() -> None:
    w = slots_world()
    assert w.p.plan("a", w.tick()).prefetch == (
        "b, where it fits evicting only models idle over 1 s (asked next 3 of 3 times)")
    assert w.p.plan("a", w.tick(), key="k", shown={"a"}).prefetch is None
    serve(w, "b", "up")
    assert w.p.plan("a", w.tick()).prefetch is None, "b is up: nothing to prefetch"
    w.run(w.p.children.reconfigure({}, ["b"], {}, w.tick())[0])
    w.settle()
    assert w.p.plan("a", w.tick()).prefetch is None, "b is gone"


def test_a_prefetch_that_goes_unused_is_wasted_at_once_and_no_longer_shown() -> None:
    w = world(models_max=2)
    learn(w)
    ask(w, "a", "x")
    w.ready("b")
    unload(w, "b")
    snap = w.p.snapshot(w.now)
    assert next(m for m in snap.models if m.name == "b").prefetched is None
    assert snap.prefetches == {"loaded": 1, "wasted": 1}
    w.run(w.p.load(("load", "b"), "b", w.tick()))  # loaded again, by a person
    w.ready("b")
    w.acquire("t", "b")
    assert w.p.snapshot(w.now).prefetches == {"loaded": 1, "wasted": 1}, "not used"


def test_a_refused_request_is_neither_a_use_nor_followed() -> None:
    w = world()
    w.run(w.p.set_tenants({"": Tenant(name=""), "k": Tenant(name="k", requests_per_min=1)},
                          0.0, w.tick()))
    learn(w)
    ask(w, "a", "x")
    w.ready("b")
    w.run(w.p.acquire("k1", "c", w.tick(), key="k"))
    w.run(w.p.acquire("k2", "b", w.tick(), key="k"))  # over its rate: 429
    assert isinstance(w.answers["k2"], Refusal) and w.answers["k2"].status == 429
    assert "used" not in w.p.snapshot(w.now).prefetches
    assert "b" not in w.p.prefetch.follows.get("c", {})


def test_no_prefetch_while_corral_shuts_down() -> None:
    w = slots_world()
    w.acquire("x", "a")
    w.run(w.p.shutdown(w.tick()))
    spawns = len(w.spawns)
    w.release("x")
    assert w.spawns[spawns:] == []


def test_a_model_a_reload_changed_is_prefetched_again() -> None:
    w = World(models_max=3, names="ab")
    w.p.prefetch.on = True
    serve(w, "b", "b0")
    w.run(w.p.children.reconfigure({}, [], {"b": ModelRules(ttl_s=100)}, w.tick())[0])
    for _ in range(4):
        w.settle()
    for i in range(4):
        serve(w, "a", ("a", i))
        serve(w, "b", ("b", i))
        w.run(w.p.unload(("u", i), "b", w.tick()))
        w.settle()
    serve(w, "a", "x")
    assert any(r.state.value == "loading" for r in w.p.state.models.values()
               if r.group == "b"), {n: r.state.value for n, r in w.p.state.models.items()}


# -------------------------------------------------------------------- a corral process


def test_a_corral_with_prefetch_loads_the_next_model_before_it_is_asked(corral) -> None:
    fake = {"cmd": fake_cmd("--load-delay", "0.5")}
    # (each request is seen: the fake answers at once, and a planner request within
    # lease_linger_ms of the last would join its kept grant, which the Scheduler never sees)
    c = corral(toml_config({"planner": fake, "coder": fake, "other": fake}, models_max=2,
                           prefetch=True, http={"lease_linger_ms": 0}))
    sse = SSE(c.port)

    def unload_coder() -> None:
        status, body, _ = request(c.port, "POST", "/models/unload", {"model": "coder"})
        assert status == 200, body
        c.wait_state("coder", "unloaded")

    for _ in range(3):
        assert chat(c.port, "planner")[0] == 200
        assert chat(c.port, "coder")[0] == 200
        unload_coder()
    assert chat(c.port, "other")[0] == 200  # planner and other hold both slots
    time.sleep(0.5)  # (what is tested: other idle longer than the coder comes after)
    assert chat(c.port, "planner")[0] == 200
    event: dict[str, Any] = sse.wait_for(lambda e: e["type"] == "prefetch")
    assert (event["model"], event["after"], event["odds"], event["action"],
            event["evicts"]) == ("coder", "planner", 1.0, "load", ["other"])
    assert event["expected_s"] < 0.5, event
    gone = sse.wait_for(lambda e: e["type"] == "eviction" and e["model"] == "other")
    assert (gone["model"], gone["reason"], gone["for_model"]) == ("other", "prefetch", "coder")
    c.wait_state("coder", "loaded")
    coder = c.models()["coder"]
    assert coder["prefetched"]["after"] == "planner", coder
    pid = coder["pid"]
    assert chat(c.port, "coder")[0] == 200
    assert c.models()["coder"]["pid"] == pid and "prefetched" not in c.models()["coder"]
    _, text, _ = request(c.port, "GET", "/metrics")
    assert 'corral_prefetches_total{outcome="used"} 1.0' in text, text
    assert re.search(r"prefetch: load of coder after planner \(asked next 3 of 3 times, "
                     r"\d+\.\d s after\); evicts other, idle \d+ s", c.log())
    status, plan, _ = request(c.port, "GET", "/models/plan?model=planner")
    assert status == 200 and "prefetch" not in plan, "the coder is up: nothing to prefetch"
    unload_coder()
    status, plan, _ = request(c.port, "GET", "/models/plan?model=planner")
    assert plan["prefetch"] == ("coder, where it fits evicting only models idle over 0 s "
                                "(asked next 4 of 4 times)"), plan
    sse.close()


def test_two_sessions_under_one_key_are_followed_each_on_its_own() -> None:
    """Two agents (sessions), no keys, their turns interleaved: a1 a2 b1 b2. Followed as
    one stream, a is followed by a and by b alike (no odds to go on); followed each on
    its own session, b follows a every time, and an answer from a prefetches b."""
    def turns(w: TierWorld, rounds: int, sessions: bool) -> None:
        for i in range(rounds):
            for model in ("a", "b"):
                for s in (1, 2):
                    t = (model, s, i)
                    w.run(w.p.acquire(t, model, w.tick(), True, "",
                                      affinity=SESSION + s if sessions else 0))
                    if w.state(model) == "loading":
                        w.ready(model)
            for model in ("a", "b"):
                for s in (1, 2):
                    w.release((model, s, i))
            unload(w, "b")
    alone = world()
    turns(alone, 3, sessions=False)
    assert alone.p.prefetch.likely("a") is None
    w = world()
    turns(w, 3, sessions=True)
    assert w.p.prefetch.likely("a") == ("b", 6, 6)
    ask(w, "a", "next")
    assert [(e.model, e.after) for e in prefetches(w)] == [("b", "a")]
    assert not w.p.prefetch.tickets, "each session's request forgotten at its end"


def test_waits_count_from_the_answer_s_end_not_from_a_kept_grant_s_release() -> None:
    """The front keeps a grant lease_linger_ms after its answer: released 1 s after the
    answer ended, b asked 3 s after the answer: b's wait is 3 s, not 2."""
    w = world()
    for i in range(3):
        w.acquire(("a", i), "a")
        if w.state("a") == "loading":
            w.ready("a")
        w.now += 2
        w.run(w.p.release(("a", i), w.now, idle_s=1.0))  # its answer ended at now - 1
        w.now += 1
        ask(w, "b", ("b", i))  # (its tick: 2 s after the release)
        unload(w, "b")
    assert w.p.prefetch.expected("a", "b") == 3.0
