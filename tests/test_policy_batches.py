"""The batch class in the pure policy (issue 44): a batch's lines alone make room only with
models in their idle window (no request of a class for [batches] idle_s), on every path
that makes room: a capped node, a copy for their demand, the tick's LRU; a shut window
holds up no other entry, and the Repump set for its opening finds it open."""

from __future__ import annotations

from actors.config.keys import BATCH_IDLE_S
from actors.messages import Grant, Repump
from actors.policy.records import Later
from tests.test_policy import World
from tests.test_policy_nodes import NodeWorld
from tests.test_policy_replicas import settle, world


def test_a_batch_line_on_a_capped_node_keeps_a_recently_used_model() -> None:
    w = NodeWorld(1, {"p": ["node_a"], "q": ["node_a"]})
    w.load_idle("p")  # an interactive request used p just now
    p = w.p.state.models["p"]
    assert p.asked_at > 0 and w.now - p.asked_at < 60.0
    w.run(w.p.acquire("line", "q", w.tick(), True, "batch:"))
    assert w.stops == [], f"p, used {w.now - p.asked_at:.0f} s ago, went for a line: {w.stops}"


def test_control_models_max_keeps_it() -> None:
    """The same with models_max = 1 and no nodes: p stays (the window holds)."""
    w = World(1, "pq")
    w.load_idle("p")
    w.run(w.p.acquire("line", "q", w.tick(), True, "batch:"))
    assert w.stops == []


def test_copies_for_batch_lines_in_flight_keep_a_recently_used_model() -> None:
    w = world(models_max=2, others="b", min=1, max=2, target_in_flight=1,
              scale_up_after_s=5.0)
    w.load_idle("b")
    w.acquire("first", "a")
    settle(w)
    w.release("first")
    b = w.p.state.models["b"]
    w.now = 100.0
    w.run(w.p.acquire("ask-b", "b", w.now, True, ""))  # an interactive use of b
    w.run(w.p.release("ask-b", 101.0))
    w.now = 110.0
    for t in ("line1", "line2"):  # the runner's lines_at_once, on copy a
        w.run(w.p.acquire(t, "a", w.now, True, "batch:"))
        assert isinstance(w.answers[t], Grant)
    for now in (116.0, 125.0, 135.0):
        w.now = now
        w.fire_timers()
        w.run(w.p.repump(now))
    assert w.stops == [], (f"b (asked {w.now - b.asked_at:.0f} s ago, idle_s 60) "
                           f"evicted for a batch's copy: {w.stops}")


def test_an_explicit_load_is_not_wedged_behind_a_batch_line_that_may_not_evict() -> None:
    w = World(1, "abc")
    w.load_idle("a")  # a, used by a request of a class just now
    w.run(w.p.acquire("line", "b", w.tick(), True, "batch:"))  # waits for a's window
    assert w.stops == []
    w.run(w.p.load("admin", "c", w.tick()))  # POST /models/load c: may evict a (LRU)
    assert w.stops == [("a", "lru")], f"the load of c waits behind the line: {w.stops}"


def test_control_without_the_batch_line_the_load_evicts_at_once() -> None:
    w = World(1, "abc")
    w.load_idle("a")
    w.run(w.p.load("admin", "c", w.tick()))
    assert w.stops == [("a", "lru")]


def test_the_repump_at_the_window_opens_it() -> None:
    a = 4.1000000000000005  # a + 60.0 rounds down: (a + 60.0) - a < 60.0
    due = a + BATCH_IDLE_S
    assert due - a < BATCH_IDLE_S
    w = World(1, "ab")
    w.run(w.p.acquire("ask", "a", 1.0, True, ""))
    w.run(w.p.children.instance_ready("a", w.gen("a"), 100, "x", 1, 2.0))
    w.run(w.p.acquire("ask2", "a", a, True, ""))
    w.run(w.p.release("ask", a))
    w.run(w.p.release("ask2", a))
    assert w.p.state.models["a"].asked_at == a
    effects = w.p.acquire("line", "b", 10.0, True, "batch:")
    assert [e.delay_s for e in effects if isinstance(e, Later)] == [due - 10.0]
    w.now = due
    effects = w.run(w.p.repump(due))  # the timer, on time
    again = [e.delay_s for e in effects if isinstance(e, Later) and e.message == Repump()]
    assert w.stops == [("a", "lru")] and not again, \
        f"the window is still shut at its own wake: stops {w.stops}, Later {again}"
