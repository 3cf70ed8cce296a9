"""The pure scheduling rules, driven synchronously: no threads, no sleeps, a fake clock."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Sequence

import pytest

from actors.config.rules import ModelRules
from actors.lifecycle import IllegalTransition, ModelState, check_transition
from actors.messages import (
    Grant,
    Refusal,
    Repump,
    StatusChanged,
    TtlDue,
    WaitDue,
    Withdraw,
)
from actors.policy import Policy
from actors.policy.records import Answer, Effect, Later, ModelRecord, Publish, Spawn, Stop


class World:
    """A Policy plus a record of what it asked for, with helpers that play the instances."""

    def __init__(self, models_max: int = 2, names: str = "abcd", intensity: int = 3,
                 pinned: str = "", rules: dict[str, ModelRules] | None = None) -> None:
        self.p = Policy(models_max, intensity, 60.0)
        for n in names:
            self.p.add_model(n, 0.0, rules=(rules or {}).get(n, ModelRules(pinned=n in pinned)))
        self.now = 0.0
        self.answers: dict[object, object] = {}
        self.spawns: list[tuple[str, int]] = []
        self.stops: list[tuple[str, str]] = []
        self.timers: list[tuple[float, object]] = []
        """(due, message) of the Later effects not yet fired."""

    def run(self, effects: list[Effect]) -> list[Effect]:
        for e in effects:
            if isinstance(e, Answer):
                self.answers[e.ticket] = e.value
            elif isinstance(e, Spawn):
                self.spawns.append((e.model, e.generation))
            elif isinstance(e, Stop):
                self.stops.append((e.model, e.reason))
            elif isinstance(e, Later):
                self.timers.append((self.now + e.delay_s, e.message))
        self.p.check_invariants()
        return effects

    def fire_timers(self) -> None:
        """Deliver every timer message due by now, as the Scheduler would."""
        due = sorted((t for t in self.timers if t[0] <= self.now), key=lambda t: t[0])
        self.timers = [t for t in self.timers if t[0] > self.now]
        for _, message in due:
            match message:
                case TtlDue(model=model, generation=gen):
                    self.run(self.p.tiers.ttl_due(model, gen, self.now))
                case WaitDue(ticket=ticket):
                    self.run(self.p.wait_due(ticket, self.now))
                case Repump():
                    self.run(self.p.repump(self.now))

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def acquire(self, ticket: object, model: str, autoload: bool = True) -> object:
        self.run(self.p.acquire(ticket, model, self.tick(), autoload))
        return self.answers.get(ticket)

    def release(self, ticket: object) -> None:
        self.run(self.p.release(ticket, self.tick()))

    def cancel(self, ticket: object) -> None:
        self.run(self.p.cancel(ticket, self.tick()))

    def gen(self, model: str) -> int:
        return self.p.state.models[model].generation

    def ready(self, model: str) -> None:
        self.run(self.p.children.instance_ready(model, self.gen(model), 100, "x", 1, self.tick()))

    def exited(self, model: str, rc: int = 0) -> None:
        self.run(self.p.children.instance_exited(model, self.gen(model), rc, f"rc {rc}",
                                                 self.tick()))

    def state(self, model: str) -> str:
        return self.p.state.models[model].state.value

    def settle(self) -> bool:
        """Every child moves on once (`settle_model`); whether any did."""
        moved = [self.settle_model(m, rec) for m, rec in list(self.p.state.models.items())]
        return any(moved)

    def settle_model(self, model: str, rec: ModelRecord) -> bool:
        """A loading child becomes ready, a stopping one exits; whether it did."""
        if rec.state is ModelState.LOADING:
            self.ready(model)
            return True
        if rec.state is ModelState.STOPPING:
            self.exited(model)
            return True
        return False

    def load_idle(self, *models: str) -> None:
        """Load each model with one request, and release it."""
        for m in models:
            t = ("warm", m, self.now)
            self.acquire(t, m)
            if self.state(m) == "loading":
                self.ready(m)
            assert isinstance(self.answers[t], Grant)
            self.release(t)


def random_history(w: World, rng: random.Random, weights: dict[str, float], *,
                   more: dict[str, Callable[[int], object]] | None = None,
                   exit_codes: Sequence[int], steps: int = 300) -> list[int]:
    """Play `steps` operations on `w`, each drawn from `weights` (name -> chance, tried in
    the order given): "acquire" (the step is the ticket, the model one of abcd),
    "release" and "cancel" (an open ticket), "ready" (a loading model), "exit" (a stopping
    model, or three in ten running ones, with one of `exit_codes`), and the caller's own
    in `more` (name -> op(step)). As in an elif chain, a release or cancel with no ticket
    open passes its step on to the next operation. Returns the tickets still open."""
    open_tickets: list[int] = []

    def acquire(step: int) -> None:
        open_tickets.append(step)
        w.acquire(step, rng.choice("abcd"))

    def finish(call: Callable[[object], None]) -> bool:
        if not open_tickets:
            return False
        call(open_tickets.pop(rng.randrange(len(open_tickets))))
        return True

    def ready(step: int) -> None:
        loading = [m for m, r in w.p.state.models.items() if r.state is ModelState.LOADING]
        if loading:
            w.ready(rng.choice(loading))

    def exits(step: int) -> None:
        running = [m for m, r in w.p.state.models.items() if r.state.is_running]
        if running:
            m = rng.choice(running)
            if w.p.state.models[m].state is ModelState.STOPPING or rng.random() < 0.3:
                w.exited(m, rc=rng.choice(exit_codes))

    ops: dict[str, Callable[[int], object]] = {
        "acquire": acquire, "release": lambda _: finish(w.release),
        "cancel": lambda _: finish(w.cancel), "ready": ready, "exit": exits, **(more or {})}
    limits = list(itertools.accumulate(weights.values()))
    for step in range(steps):
        op = rng.random()
        for limit, name in zip(limits, weights, strict=True):
            if op < limit and ops[name](step) is not False:
                break
    return open_tickets


def drain(w: World, tickets: Iterable[object], *, rounds: int, time_step_s: float = 0.0) -> None:
    """The end of a random history, round after round until nothing moves: the children
    move on (`World.settle`), each of `tickets` granted and still held is released (and,
    with `time_step_s`, time runs on by that much while anything waits, firing the
    timers). Then no request may be left waiting (R-4.8: nothing waits forever)."""
    for _ in range(rounds):
        progressed = w.settle()
        for t in tickets:
            if isinstance(w.answers.get(t), Grant) and t in w.p.state.leases:
                w.release(t)
                progressed = True
        if time_step_s and (w.p.state.queue.waiters or w.timers):
            w.now += time_step_s
            w.fire_timers()
            progressed = True
        if not progressed:
            break
    assert w.p.state.queue.waiters == {}, f"requests never answered: {w.p.state.queue.waiters}"


def test_first_request_spawns_and_is_granted_when_ready() -> None:
    w = World()
    assert w.acquire(1, "a") is None
    assert w.spawns == [("a", 1)]
    assert w.state("a") == "loading"
    w.ready("a")
    grant = w.answers[1]
    assert isinstance(grant, Grant) and grant.model == "a" and grant.generation == 1
    assert w.p.state.models["a"].in_flight == 1


def test_loaded_model_is_granted_at_once_and_counted_in_flight() -> None:
    w = World()
    w.load_idle("a")
    assert isinstance(w.acquire(2, "a"), Grant)
    assert w.p.state.models["a"].in_flight == 1
    w.release(2)
    assert w.p.state.models["a"].in_flight == 0


def test_lru_victim_is_the_least_recently_used_idle_model() -> None:
    w = World(models_max=2)
    w.load_idle("a", "b")
    w.load_idle("a")  # a is now more recent than b
    w.acquire(10, "c")
    assert w.stops == [("b", "lru")]
    assert w.p.state.models["b"].last_eviction is not None
    assert w.p.state.models["b"].last_eviction.for_model == "c"
    assert w.spawns[-1][0] != "c"  # not before b is reaped
    w.exited("b")
    assert w.spawns[-1] == ("c", 1)


def test_busy_model_is_never_evicted_and_the_waiter_gets_it_after_release() -> None:
    w = World(models_max=1)
    w.load_idle("a")
    assert isinstance(w.acquire(1, "a"), Grant)
    assert w.acquire(2, "b") is None
    assert w.stops == []  # a is busy
    w.release(1)
    assert w.stops == [("a", "lru")]
    w.exited("a")
    w.ready("b")
    assert isinstance(w.answers[2], Grant)


def test_n_requests_for_one_missing_model_cause_one_eviction_and_one_load() -> None:
    w = World(models_max=2)
    w.load_idle("a", "b")
    for t in (1, 2, 3):
        w.acquire(t, "c")
    assert len(w.stops) == 1
    assert len(w.p.state.queue.entries) == 1 and len(w.p.state.queue.entries["c"].waiters) == 3
    w.exited(w.stops[0][0])
    assert [s for s in w.spawns if s[0] == "c"] == [("c", 1)]
    w.ready("c")
    assert all(isinstance(w.answers[t], Grant) for t in (1, 2, 3))
    assert w.p.state.models["c"].in_flight == 3


def test_model_wanted_by_the_queue_is_not_a_victim() -> None:
    w = World(models_max=1)
    w.load_idle("a")
    w.acquire(1, "a")  # busy
    w.acquire(2, "b")  # waits for a slot
    w.release(1)       # a idle -> evicted for b
    assert w.stops == [("a", "lru")]
    w.acquire(3, "a")  # a stopping: queues behind b
    assert not isinstance(w.answers.get(3), Grant)  # never proxied into a stopping child
    w.exited("a")
    w.ready("b")
    # b is loaded, but a is wanted; b has a request in flight so nothing is evicted yet
    assert w.stops == [("a", "lru")]
    w.release(2)
    assert w.stops[-1] == ("b", "lru")


def test_pinned_model_is_never_a_victim() -> None:
    w = World(models_max=2, pinned="a")
    w.load_idle("a", "b")
    w.acquire(1, "b")  # b busy
    w.acquire(2, "c")
    assert w.stops == [] and w.answers.get(2) is None  # waits for b, never takes a
    w.release(1)
    assert w.stops == [("b", "lru")]


def test_a_request_no_slot_will_ever_free_for_is_refused_not_left_waiting() -> None:
    w = World(models_max=1, pinned="a")
    w.load_idle("a")
    refusal = w.acquire(1, "b")
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert "held by pinned models (a)" in refusal.message
    assert w.p.state.queue.entries == {} and w.stops == []


def test_queue_heads_claim_in_fifo_order() -> None:
    w = World(models_max=1)
    w.load_idle("a")
    w.acquire(1, "a")
    w.acquire(2, "b")
    w.acquire(3, "c")
    w.acquire(4, "d")
    w.release(1)
    w.exited("a")
    assert [s[0] for s in w.spawns[1:]] == ["b"]
    w.ready("b")
    w.release(2)
    w.exited("b")
    w.ready("c")
    w.release(3)
    w.exited("c")
    assert [s[0] for s in w.spawns[1:]] == ["b", "c", "d"]


def test_cancel_while_queued_leaves_no_entry_and_evicts_nothing() -> None:
    w = World(models_max=1)
    w.load_idle("a")
    w.acquire(1, "a")
    w.acquire(2, "b")
    w.cancel(2)
    assert w.p.state.queue.entries == {} and w.p.state.queue.waiters == {}
    w.release(1)
    assert w.stops == []
    assert w.state("a") == "loaded"


def test_cancel_that_crossed_its_grant_is_a_release() -> None:
    w = World()
    w.load_idle("a")
    w.acquire(1, "a")
    w.cancel(1)
    assert w.p.state.models["a"].in_flight == 0
    assert w.p.state.leases == {}


def test_a_failed_load_answers_its_waiters_once_each_and_the_next_request_retries() -> None:
    w = World(intensity=2)
    w.acquire(1, "a")
    w.acquire(2, "a")
    w.exited("a", rc=1)
    assert w.state("a") == "unloaded" and w.p.state.models["a"].failed
    for t in (1, 2):  # one error each, naming the model, the attempt and the exit
        refusal = w.answers[t]
        assert isinstance(refusal, Refusal) and refusal.status == 503
        assert refusal.message == "model 'a' failed to load (attempt 1): rc 1"
        assert refusal.retry_after_s == 1.0
    assert w.p.state.queue.entries == {}
    assert w.acquire(3, "a") is None and w.state("a") == "loading"  # no backoff yet
    w.ready("a")
    assert isinstance(w.answers[3], Grant) and not w.p.state.models["a"].failed


def test_repeated_failures_back_off_exponentially_then_one_load_heals_it() -> None:
    w = World(intensity=2)
    delays = []
    for attempt in range(1, 7):
        t = ("r", attempt)
        w.acquire(t, "a")
        if w.state("a") != "loading":  # in a backoff: the request waits for its end
            assert t in w.p.state.queue.waiters and w.spawns[-1][1] == attempt - 1
            w.now = w.p.state.models["a"].breaker.retry_at
            w.fire_timers()
        assert w.state("a") == "loading", attempt
        w.exited("a", rc=1)
        delays.append(w.p.state.models["a"].breaker.backoff_s)
    assert delays == [0, 0, 1, 2, 4, 8]  # more than 2 failures in 60 s: 1 s, 2 s, 4 s ...
    w.acquire("healed", "a")
    w.now = w.p.state.models["a"].breaker.retry_at
    w.fire_timers()
    w.ready("a")  # the half-open try succeeds
    assert isinstance(w.answers["healed"], Grant)
    w.release("healed")
    w.exited("a", rc=-9)  # a crash right after: back to the first step, not 16 s
    assert w.p.state.models["a"].breaker.backoff_s == 1


def test_a_request_that_cannot_outwait_a_backoff_gets_503_with_retry_after() -> None:
    w = World(intensity=0, rules={"a": ModelRules(queue_timeout_s=0.5)})
    w.acquire(1, "a")
    w.exited("a", rc=1)  # 1 > 0 failures: a 1 s backoff
    w.run(w.p.acquire(2, "a", w.now + 0.25))
    refusal = w.answers[2]
    assert isinstance(refusal, Refusal) and refusal.status == 503
    assert refusal.retry_after_s == pytest.approx(0.75)
    assert "failed 1 times in 60 s" in refusal.message and "may start in 0.8 s" in refusal.message


def test_a_crash_after_healthy_service_reloads_at_once() -> None:
    w = World(intensity=0)
    w.load_idle("a")
    w.now += 31  # restart_healthy_s 30
    w.exited("a", rc=-9)
    assert w.p.state.models["a"].breaker.backoff_s == 0
    w.acquire(1, "a")
    assert w.state("a") == "loading"


def test_crash_of_a_loaded_model_shows_unloaded_failed_and_the_next_request_reloads() -> None:
    w = World()
    w.load_idle("a")
    effects = w.run(w.p.children.instance_exited("a", 1, -9, "killed by SIGKILL", w.tick()))
    rec = w.p.state.models["a"]
    assert rec.state is ModelState.UNLOADED and rec.failed and rec.exit_code == -9
    event = next(e.event for e in effects if isinstance(e, Publish))
    assert isinstance(event, StatusChanged) and event.status == "unloaded" and event.failed
    assert event.exit == "killed by SIGKILL" and event.exit_code == -9
    view = w.p.snapshot(w.now).models[0]
    assert view.state == "unloaded" and view.failed
    w.acquire(1, "a")
    assert w.state("a") == "loading" and w.gen("a") == 2
    w.ready("a")
    assert isinstance(w.answers[1], Grant) and not w.p.snapshot(w.now).models[0].failed


def test_release_of_a_lease_from_a_dead_generation_does_not_count() -> None:
    w = World()
    w.load_idle("a")
    w.acquire(1, "a")
    w.exited("a", rc=-9)  # crash with 1 in flight
    w.acquire(2, "a")
    w.ready("a")
    assert w.p.state.models["a"].in_flight == 1
    w.release(1)  # from generation 1
    assert w.p.state.models["a"].in_flight == 1


def test_stale_events_are_dropped() -> None:
    w = World()
    w.load_idle("a")
    assert w.p.children.instance_exited("a", 0, -9, "old", 99.0) == []
    assert w.p.children.instance_ready("a", 0, 1, "x", 1, 99.0) == []
    assert w.state("a") == "loaded"


def test_unload_of_a_loading_model_does_not_wedge_its_waiters() -> None:
    w = World()
    w.acquire(1, "a")
    w.run(w.p.unload("U", "a", w.tick()))
    assert w.state("a") == "stopping"
    w.ready("a")  # crossing readiness of the child being stopped: ignored
    assert w.answers.get(1) is None
    w.exited("a", rc=-9)
    assert w.state("a") == "loading" and w.gen("a") == 2  # the waiter's entry reclaimed
    w.ready("a")
    assert isinstance(w.answers[1], Grant)


def test_autoload_off_refuses_a_model_that_is_not_loaded() -> None:
    w = World()
    refusal = w.acquire(1, "a", autoload=False)
    assert isinstance(refusal, Refusal) and refusal.status == 400
    assert "not loaded" in refusal.message


def test_management_errors() -> None:
    w = World()
    w.run(w.p.load("L", "zzz", w.tick()))
    assert isinstance(w.answers["L"], Refusal) and w.answers["L"].status == 404
    w.run(w.p.unload("U", "a", w.tick()))
    assert isinstance(w.answers["U"], Refusal) and w.answers["U"].status == 400
    w.load_idle("a")
    w.run(w.p.load("L2", "a", w.tick()))
    assert isinstance(w.answers["L2"], Refusal) and "already running" in w.answers["L2"].message


def test_shutdown_refuses_waiters_and_stops_everything() -> None:
    w = World(models_max=1)
    w.load_idle("a")
    w.acquire(1, "a")
    w.acquire(2, "b")
    w.run(w.p.shutdown(w.tick()))
    assert isinstance(w.answers[2], Refusal) and w.answers[2].status == 503
    assert w.stops[-1] == ("a", "shutdown")
    assert not w.p.all_stopped
    w.exited("a")
    assert w.p.all_stopped


def test_unlimited_models_max_never_evicts() -> None:
    w = World(models_max=0)
    w.load_idle("a", "b", "c", "d")
    assert w.stops == []
    assert w.p.running_count() == 4


def test_illegal_transition_raises() -> None:
    with pytest.raises(IllegalTransition):
        check_transition("m", ModelState.UNLOADED, ModelState.LOADED)


@pytest.mark.parametrize("seed", range(40))
def test_random_histories_keep_invariants_and_never_wedge(seed: int) -> None:
    """Requests, releases, cancels, crashes, load failures and unloads at random.

    After every step the invariants hold; at the end, with every child answering and
    every client done, every request has been answered (R-4.8: nothing waits forever).
    """
    rng = random.Random(seed)
    w = World(models_max=rng.choice([1, 2, 3]), intensity=1_000)

    def unload(step: int) -> None:
        w.run(w.p.unload(("u", step), rng.choice("abcd"), w.tick()))

    def reload(step: int) -> None:  # a reload that changes some models' config
        changed = {m: False for m in "abcd" if rng.random() < 0.5}
        w.run(w.p.children.reconfigure({}, [], changed, w.tick())[0])

    open_tickets = random_history(
        w, rng, {"acquire": 0.35, "release": 0.2, "cancel": 0.07, "ready": 0.18, "exit": 0.15,
                 "unload": 0.02, "reload": 0.03},
        more={"unload": unload, "reload": reload}, exit_codes=(0, 1, -9))
    drain(w, open_tickets, rounds=200)  # children become ready or finish stopping
    assert all(e.explicit and not e.waiters for e in w.p.state.queue.entries.values())


def test_reload_restarts_a_changed_model_only_after_its_requests_finish() -> None:
    w = World(models_max=2)
    w.load_idle("a", "b")
    w.acquire("busy", "a")
    effects, restarted = w.p.children.reconfigure({"e": False}, [], {"a": False, "c": True},
                                                  w.tick())
    w.run(effects)
    assert restarted == ["a"] and w.stops == [] and "e" in w.p.state.models
    assert w.p.state.models["c"].pinned
    assert w.acquire("new", "a") is None, "no new request goes to the old child"
    w.release("busy")
    assert w.stops == [("a", "reload")]
    w.exited("a")
    assert w.state("a") == "loading"  # the waiter brings it back, with the new config
    w.ready("a")
    grant = w.answers["new"]
    assert isinstance(grant, Grant) and grant.generation == 2


def test_reload_removes_a_model_refusing_its_waiters_and_forgetting_it_once_stopped() -> None:
    w = World(models_max=1)
    w.load_idle("a")
    w.acquire("waits", "b")  # evicts a, waits for the slot
    w.acquire("uses-b-too", "b")
    effects, _ = w.p.children.reconfigure({}, ["b", "a"], {}, w.tick())
    w.run(effects)
    for t in ("waits", "uses-b-too"):
        answer = w.answers[t]
        assert isinstance(answer, Refusal) and "removed by a reload" in answer.message
    assert "b" not in w.p.state.models and "a" in w.p.state.models  # a still has a child to reap
    w.exited("a")
    assert set(w.p.state.models) == {"c", "d"}
    refusal = w.acquire("late", "a")
    assert isinstance(refusal, Refusal) and refusal.status == 400
    assert [v.name for v in w.p.snapshot().models] == ["c", "d"]


def test_a_grant_is_withdrawn_when_its_model_stops_serving_or_is_retired() -> None:
    """The front shares a grant among overlapping requests until told otherwise
    (actors/shares.py): a reload of a busy model and any stop must tell it."""
    w = World(models_max=3)
    w.load_idle("a", "b")
    w.acquire("busy", "a")
    effects = w.run(w.p.children.reconfigure({}, [], {"a": False}, w.tick())[0])
    assert not any(isinstance(e, Withdraw) for e in effects)  # it serves while a@next loads
    gen = w.gen("a")
    effects = w.run(w.p.children.instance_ready("a@next", w.gen("a@next"), 100, "x", 2,
                                                w.tick()))
    assert Withdraw(model="a", generation=gen) in effects  # busy: stale, stops once released
    assert not any(isinstance(e, Stop) for e in effects)
    effects = w.run(w.p.unload("u", "b", w.tick()))
    # A stop is on purpose (what it had is not sent again); a reload's wait is not.
    assert Withdraw(model="b", generation=w.gen("b"), stopping=True) in effects
    w.acquire("x", "c")
    assert not any(isinstance(e, Withdraw) for e in w.run(w.p.children.instance_ready(
        "c", w.gen("c"), 100, "x", 1, w.tick())))  # loading -> loaded withdraws none


def test_releasing_a_shared_grant_counts_the_model_used_until_then() -> None:
    w = World(models_max=2)
    w.load_idle("a", "b")
    w.acquire("t", "a")  # a's grant, shared by the front with later requests
    w.acquire("s", "b")  # b is used after a's grant began ...
    w.release("s")
    w.run(w.p.release("t", w.tick(), shared=True))  # ... but before a's last request ended
    w.acquire("u", "c")
    assert w.stops == [("b", "lru")]
