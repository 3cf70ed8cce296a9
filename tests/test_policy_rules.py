"""The operating rules of the policy (R-3.6, R-3.7, R-4.9), pure: a fake clock, timers
fired by hand, no threads."""

from __future__ import annotations

import logging

import pytest

from actors.config.rules import ModelRules
from actors.messages import Grant, Refusal, StatusChanged
from actors.policy import Policy
from actors.policy.records import Publish
from tests.test_policy import World


def rules(**kw: object) -> dict[str, ModelRules]:
    return {"a": ModelRules(**kw)}  # type: ignore[arg-type]


# ---------------------------------------------------------------- idle TTL


def test_an_idle_model_is_stopped_after_its_ttl_and_a_used_one_is_not() -> None:
    w = World(rules=rules(ttl_s=10))
    w.load_idle("a")
    last = w.now
    w.now = last + 5
    w.acquire(1, "a")  # used again at +6 (acquire ticks): the first timer finds it busy
    w.now = last + 10
    w.fire_timers()
    assert w.stops == []
    w.release(1)  # idle from +11
    w.now = last + 16
    view = w.p.snapshot(w.now).models[0]
    assert view.expires_in_s == pytest.approx(10 - (16 - 11))  # from the request's end
    w.now = last + 30
    w.fire_timers()
    assert w.stops == [("a", "ttl")]
    assert w.p.state.models["a"].last_eviction.reason == "ttl"


def test_ttl_keeps_one_timer_per_model_however_many_requests() -> None:
    w = World(rules=rules(ttl_s=300))
    w.load_idle("a")
    for t in range(1000):
        w.acquire(t, "a")
        w.release(t)
    assert len(w.timers) == 1


def test_pinned_and_wanted_models_outlive_their_ttl() -> None:
    w = World(rules={"a": ModelRules(ttl_s=1, pinned=True), "b": ModelRules(ttl_s=1)})
    w.load_idle("a", "b")
    w.now += 100
    w.fire_timers()
    assert w.stops == [("b", "ttl")]


# ---------------------------------------------------------------- bounded waiting


def test_queue_max_refuses_at_once_with_retry_after() -> None:
    w = World(rules=rules(queue_max=2))
    w.acquire(1, "a")
    w.acquire(2, "a")
    refusal = w.acquire(3, "a")
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert refusal.retry_after_s == 1.0 and "queue_max 2" in refusal.message
    w.ready("a")
    assert all(isinstance(w.answers[t], Grant) for t in (1, 2))


def test_a_timed_out_waiter_gets_503_and_nothing_is_evicted_for_it() -> None:
    w = World(models_max=1, rules={"b": ModelRules(queue_timeout_s=5)})
    w.load_idle("a")
    w.acquire("busy", "a")  # a is busy: b's request waits for a slot
    w.acquire("b1", "b")
    assert w.stops == [] and "b1" in w.p.state.queue.waiters
    w.now += 5
    w.fire_timers()
    refusal = w.answers["b1"]
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert refusal.retry_after_s == 1.0 and "waited 5.0 s for model 'b'" in refusal.message
    w.release("busy")  # a is idle now, and nobody wants b any more
    assert w.stops == [] and w.p.state.queue.entries == {}


def test_a_waiter_granted_before_its_deadline_is_not_refused() -> None:
    w = World(rules=rules(queue_timeout_s=5))
    w.acquire(1, "a")
    w.ready("a")
    w.now += 10
    w.fire_timers()
    assert isinstance(w.answers[1], Grant)


# ---------------------------------------------------------------- max_concurrency


def test_max_concurrency_queues_for_that_model_only_and_in_order() -> None:
    w = World(models_max=1, rules=rules(max_concurrency=2))
    w.load_idle("a")
    for t in (1, 2, 3, 4):
        w.acquire(t, "a")
    assert [isinstance(w.answers.get(t), Grant) for t in (1, 2, 3, 4)] == [
        True, True, False, False]
    assert w.spawns == [("a", 1)] and w.stops == []  # waiting is not a need for a slot
    w.release(2)
    assert isinstance(w.answers.get(3), Grant) and 4 not in w.answers
    w.acquire(5, "a")  # must not overtake 4
    w.release(1)
    assert isinstance(w.answers.get(4), Grant) and 5 not in w.answers


def test_max_concurrency_applies_to_the_waiters_of_a_load() -> None:
    w = World(rules=rules(max_concurrency=1))
    w.acquire(1, "a")
    w.acquire(2, "a")
    w.ready("a")
    assert isinstance(w.answers[1], Grant) and 2 not in w.answers
    w.release(1)
    assert isinstance(w.answers[2], Grant)


# ---------------------------------------------------------------- swap thrash


def test_a_young_model_is_no_victim_while_an_older_one_is() -> None:
    w = World(models_max=2, rules={m: ModelRules(min_resident_s=30) for m in "abc"})
    w.load_idle("a")
    w.now += 40
    w.load_idle("b")  # b is young, a is old (but b was used last: LRU would pick a anyway)
    w.acquire("x", "a")
    w.release("x")  # now a is the most recently used, b the LRU, but b is young
    w.acquire(1, "c")
    assert w.stops == [("a", "lru")]


def test_when_only_young_models_could_go_the_need_waits_until_one_comes_of_age() -> None:
    w = World(models_max=1, rules={m: ModelRules(min_resident_s=30) for m in "ab"})
    w.load_idle("a")
    ready_at = w.p.state.models["a"].ready_at
    w.acquire(1, "b")
    assert w.stops == []
    w.now = ready_at + 30
    w.fire_timers()  # the Repump the policy asked for
    assert w.stops == [("a", "lru")]


def test_alternating_models_at_models_max_1_swap_at_most_once_per_min_resident() -> None:
    w = World(models_max=1, rules={m: ModelRules(min_resident_s=10) for m in "abc"})
    for i in range(40):  # two agents alternating a and b every 0.5 s, c now and then
        model = "c" if i % 10 == 9 else "ab"[i % 2]
        t = ("req", i)
        w.acquire(t, model)
        for _ in range(3):
            for m, rec in w.p.state.models.items():
                if rec.state.value == "loading":
                    w.ready(m)
                elif rec.state.value == "stopping":
                    w.exited(m)
            w.fire_timers()
        if isinstance(w.answers.get(t), Grant):
            w.release(t)
        w.now += 0.5
    assert len(w.stops) <= 40 * 0.5 / 10 + 1


# ---------------------------------------------------------------- restart permanent


def test_a_permanent_model_restarts_at_once_after_a_crash() -> None:
    w = World(rules=rules(permanent=True))
    w.load_idle("a")
    w.exited("a", rc=-9)
    assert w.state("a") == "loading" and w.spawns[-1] == ("a", 2)


# ---------------------------------------------------------------- leaks and races


def test_the_victim_heap_stays_bounded_while_slots_are_free() -> None:
    w = World(models_max=4)
    w.load_idle("a", "b")
    for t in range(20_000):
        w.run(w.p.acquire(t, "ab"[t % 2], w.now))
        w.run(w.p.release(t, w.now + 0.5))
        w.now += 1
    assert len(w.p.state.victims.heap) <= 2 * len(w.p.state.models) + 8


def test_a_model_re_added_while_its_old_child_stops_keeps_one_record_and_its_slot() -> None:
    w = World(models_max=1, names="a")
    w.load_idle("a")
    w.run(w.p.children.reconfigure({}, ["a"], {}, w.tick())[0])
    assert w.state("a") == "stopping"
    w.run(w.p.children.reconfigure({"a": False}, [], {}, w.tick())[0])
    w.acquire(1, "a")  # waits for the old child: one slot, and it is still taken
    assert w.spawns == [("a", 1)]
    w.exited("a")  # the old exit is not dropped: the slot comes back
    assert w.state("a") == "loading"
    w.ready("a")
    assert isinstance(w.answers[1], Grant) and w.p.state.n_running == 1


def test_status_events_carry_the_backoff() -> None:
    p = Policy(1, restart_intensity=0)
    p.add_model("a", 0.0)
    p.acquire(1, "a", 0.0)
    effects = p.children.instance_exited("a", 1, 1, "exited with status 1", 0.5)
    event = next(e.event for e in effects if isinstance(e, Publish)
                 and isinstance(e.event, StatusChanged))
    assert event.status == "unloaded" and event.failed and event.retry_after_s == 1.0


def test_a_raising_event_subscriber_does_not_take_the_scheduler_down(caplog) -> None:
    from actors.config.model import Config, ModelConfig
    from actors.messages import Event
    from actors.policy.records import Publish as Pub
    from actors.scheduler import Scheduler

    config = Config(models={"a": ModelConfig(cmd=["true"])})
    scheduler = Scheduler(config, on_crash=lambda *_: None)
    seen: list[Event] = []

    def bad(event: Event) -> None:
        raise RuntimeError("the app's bug")

    scheduler.subscribers += [bad, seen.append]
    event = StatusChanged(model="a", status="loading", cause="test")
    with caplog.at_level(logging.ERROR, "corral.scheduler"):
        scheduler._carry_out([Pub(event)])
    assert seen == [event]
    assert "an event subscriber raised" in caplog.text and "the app's bug" in caplog.text


def test_a_load_killed_by_a_signal_gets_its_waiters_two_more_tries() -> None:
    w = World(intensity=10)
    w.acquire(1, "a")
    w.exited("a", rc=-9)  # the OOM killer, or an operator: perhaps not the model's fault
    assert 1 not in w.answers and w.state("a") == "loading" and w.gen("a") == 2
    w.acquire(2, "a")  # joins the second load
    w.exited("a", rc=-9)
    assert 1 not in w.answers and 2 not in w.answers and w.gen("a") == 3
    w.exited("a", rc=-9)
    refusal = w.answers[1]  # its third killed load: answered
    assert isinstance(refusal, Refusal) and "failed to load (attempt 3)" in refusal.message
    assert 2 not in w.answers  # its second: one more try
    w.ready("a")
    assert isinstance(w.answers[2], Grant)


def test_loads_killed_by_signals_keep_the_backoff_at_its_first_step() -> None:
    w = World(intensity=0)
    for i in range(5):
        w.acquire(("r", i), "a")
        w.now = max(w.now, w.p.state.models["a"].breaker.retry_at)
        w.fire_timers()
        w.exited("a", rc=-9)
        assert w.p.state.models["a"].breaker.backoff_s == 1


def test_a_model_removed_and_added_back_never_reuses_a_generation() -> None:
    """Found by the state machine: a lease of the old record matched the new record's
    first generation, so its release would have taken a request off the new child."""
    w = World(models_max=2, names="ab")
    w.load_idle("a")
    w.acquire("old", "a")  # still running when a reload removes a
    w.run(w.p.children.reconfigure({}, ["a"], {}, w.tick())[0])
    w.exited("a")
    assert "a" not in w.p.state.models
    w.run(w.p.children.reconfigure({"a": False}, [], {}, w.tick())[0])
    w.acquire("new", "a")
    w.ready("a")
    assert w.gen("a") == 2 and isinstance(w.answers["new"], Grant)
    w.release("old")  # the old lease: counts for nothing now
    assert w.p.state.models["a"].in_flight == 1


def test_queue_events_say_how_many_wait_and_for_how_long() -> None:
    from actors.messages import QueueChanged

    w = World()
    effects = w.run(w.p.acquire(1, "a", 10.0))
    assert Publish(QueueChanged(model="a", waiting=1, oldest_wait_s=0.0)) in effects
    effects = w.run(w.p.acquire(2, "a", 12.5))
    assert Publish(QueueChanged(model="a", waiting=2, oldest_wait_s=2.5)) in effects
    effects = w.run(w.p.children.instance_ready("a", 1, 100, "x", 1, 13.0))
    assert Publish(QueueChanged(model="a", waiting=0, oldest_wait_s=None)) in effects
    effects = w.run(w.p.acquire(3, "a", 14.0))  # granted at once: nothing queued
    assert not any(isinstance(e, Publish) and isinstance(e.event, QueueChanged)
                   for e in effects)
