"""Prefetch's edges (issue 44, part 2), each found by a hostile review: a wait counted
from the answer's end while the front still keeps its grant; a prefetch that waited for
its victim loads only if nothing bars it now (an exclusive rival up meanwhile). One that
waited and never loaded is not counted: test_prefetch.py, a request that comes first."""

from __future__ import annotations

from collections import Counter, deque

from actors.config.rules import ModelGroup, ModelRules
from tests.test_policy_suspend import SUSPEND, TierWorld
from tests.test_prefetch import ask, unload, world


def test_a_b_asked_within_the_linger_counts_from_the_answer_end() -> None:
    w = world()
    for i in range(3):
        w.run(w.p.acquire(("a", i), "a", w.tick()))
        if w.state("a") == "loading":
            w.ready("a")
        w.now += 20.0  # a generates for 20 s; its answer ends now
        end = w.now
        w.now = end + 0.3  # the agent asks b 0.3 s later (inside the 1 s linger)
        w.run(w.p.acquire(("b", i), "b", w.now))
        if w.state("b") == "loading":
            w.ready("b")
        w.now = end + 1.0  # the front lets a's grant go after the linger
        w.run(w.p.release(("a", i), w.now, idle_s=1.0))
        w.release(("b", i))
        unload(w, "b")
    got = w.p.prefetch.expected("a", "b")
    assert abs(got - 0.3) < 1e-9, f"b's expected wait after a's answer: {got} s (0.3 s)"


def settle(w: TierWorld) -> None:
    for _ in range(6):  # the children move on
        for m, child in list(w.children.items()):
            if child.phase == "suspending":
                w.suspended(m)
            elif child.phase == "loading":
                w.ready(m)
            elif child.phase == "stopping":
                w.exited(m)
        w.report()
        w.run(w.p.repump(w.tick()))


def test_a_due_prefetch_never_loads_beside_an_exclusive_rival() -> None:
    w = TierWorld({"a": 4, "b": 2, "c": 4, "r": 2}, models_max=0,
                  rules={"a": SUSPEND, "b": SUSPEND, "c": SUSPEND,
                         "r": ModelRules(warm=True)})
    w.p.state.teams.replace({"g": ModelGroup(models=["b", "r"], exclusive=True)})
    settle(w)
    for m in ("c", "a"):
        w.acquire(m + "0", m)
        settle(w)
        w.release(m + "0")
        settle(w)
    assert w.state("r") != "loaded" and w.state("a") == w.state("c") == "loaded"
    w.p.prefetch.on = True  # as if learned: b is asked right after a's answer
    w.p.prefetch.follows["a"] = Counter({"b": 5})
    w.p.prefetch.gaps[("a", "b")] = deque([0.0])
    w.now += 50
    ask(w, "a", "a1")  # b prefetched: c (idle 50 s) evicted for it, b due
    settle(w)
    up = [m for m in "br" if w.state(m) in ("loading", "loaded")]
    assert len(up) <= 1, f"both members of an exclusive group up: {up}"
