"""The suspended tier of the pure policy (issue 23), driven synchronously: a world that
plays the children (their device and host memory), the DeviceMonitor (device and host
samples) and the timers. Unit tests, then a Hypothesis state machine with suspends,
wakes and their failures interleaved with requests, crashes, unloads and TTLs.

A child here allocates its whole size on its device when spawned; suspended, it keeps
RESIDUAL there and its size in host RAM; woken, it has its size on the device again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.config.rules import ModelRules
from actors.ledger import Breakdown, DeviceSample, DeviceUse
from actors.messages import (
    DeviceReport,
    Evicted,
    Grant,
    Refusal,
    Repump,
    StatusChanged,
    TtlDue,
    WaitDue,
)
from actors.policy import Policy
from actors.policy.plans import decide
from actors.policy.records import (
    Answer,
    Effect,
    Later,
    Publish,
    Spawn,
    Stop,
    Suspend,
    Track,
    Wake,
)

GiB = 1024**3
MARGIN = 1 * GiB
RESIDUAL = GiB // 4
SUSPEND = ModelRules(suspend=True)


def need(gib: float) -> Breakdown:
    return Breakdown(n_ctx=512, devices=[DeviceUse(kind="device", name="gpu0",
                                                   model=int(gib * GiB))])


@dataclass
class Child:
    generation: int
    phase: str
    """loading, ready, suspending, suspended, waking, stopping."""
    device: int
    host: int = 0


class TierWorld:
    """A Policy with one 10 GiB device and 8 GiB of host RAM (1 GiB margins), and the
    children, monitor and timers it talks to, played by the test."""

    def __init__(self, sizes: dict[str, float], models_max: int = 0, *,
                 rules: dict[str, ModelRules] | None = None, suspended_max: int = 0,
                 host_gib: float = 8, memory: bool = True) -> None:
        self.p = Policy(models_max, 3, 60.0, memory_margin=MARGIN if memory else 0,
                        host_margin=MARGIN, suspended_max=suspended_max)
        for name in sizes:
            self.p.add_model(name, 0.0, rules=(rules or {}).get(name, SUSPEND))
        self.sizes = sizes
        self.now = 0.0
        self.total, self.host_total = 10 * GiB, int(host_gib * GiB)
        self.host_external = 0
        self.children: dict[str, Child] = {}
        self.tracked: set[str] = set()
        self.seen_suspended: set[str] = set()
        self.answers: dict[object, object] = {}
        self.events: list[object] = []
        self.effects: list[Effect] = []
        self.timers: list[tuple[float, object]] = []
        if memory:
            for name, gib in sizes.items():
                self.run(self.p.children.measured(name, True, need(gib), need(gib), 0.0))
        self.report()

    # ---------------------------------------------------------------- the shell

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def run(self, effects: list[Effect]) -> None:
        for e in effects:
            self.effects.append(e)
            match e:
                case Answer(ticket=ticket, value=value):
                    assert ticket not in self.answers, f"two answers for {ticket!r}"
                    self.answers[ticket] = value
                case Publish(event=event):
                    self.events.append(event)
                case Spawn(model=model, generation=gen, serves=serves):
                    assert model not in self.children, f"{model}: spawned twice"
                    self.children[model] = Child(gen, "loading",  # (a@next serves a)
                                                 int(self.sizes[serves or model] * GiB))
                case Stop(model=model):
                    self.children[model].phase = "stopping"
                case Suspend(model=model, generation=gen):
                    child = self.children[model]
                    assert child.phase == "ready" and child.generation == gen, \
                        f"{model}: suspended while {child.phase}"
                    child.phase = "suspending"
                case Wake(model=model, generation=gen):
                    child = self.children[model]
                    assert child.phase == "suspended" and child.generation == gen, \
                        f"{model}: woken while {child.phase}"
                    child.phase = "waking"
                case Track(model=model, event=event):
                    if event == "exited":
                        self.tracked.discard(model)
                        self.seen_suspended.discard(model)
                    elif event == "suspended":
                        self.seen_suspended.add(model)
                    else:
                        self.tracked.add(model)
                        self.seen_suspended.discard(model)
                case Later(delay_s=delay, message=message):
                    self.timers.append((self.now + delay, message))
        self.p.check_invariants()

    def report(self) -> None:
        usage = {m: {"gpu0": c.device} for m, c in self.children.items() if m in self.tracked}
        used = sum(c.device for c in self.children.values())
        host_used = sum(c.host for c in self.children.values()) + self.host_external
        self.run(self.p.children.devices_reported(DeviceReport(
            devices=[DeviceSample("gpu0", "device", self.total, max(0, self.total - used),
                                  "simulated"),
                     DeviceSample("host", "host", self.host_total,
                                  max(0, self.host_total - host_used), "host")],
            managed={"gpu0": sum(u["gpu0"] for u in usage.values())}, usage=usage,
            tracked=sorted(self.tracked), backends=["simulated", "host"],
            suspended=sorted(self.seen_suspended)), self.tick()))

    def fire_timers(self) -> None:
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

    # ---------------------------------------------------------------- the children

    def acquire(self, ticket: object, model: str) -> object:
        self.run(self.p.acquire(ticket, model, self.tick()))
        return self.answers.get(ticket)

    def release(self, ticket: object) -> None:
        self.run(self.p.release(ticket, self.tick()))

    def ready(self, model: str) -> None:
        child = self.children[model]
        assert child.phase == "loading"
        child.phase = "ready"
        self.run(self.p.children.instance_started(model, child.generation, 100))
        self.run(self.p.children.instance_ready(model, child.generation, 100, "x", 1,
                                                self.tick()))
        self.report()

    def suspended(self, model: str, ok: bool = True) -> None:
        child = self.children[model]
        assert child.phase == "suspending"
        if ok:
            child.phase, child.host, child.device = "suspended", child.device, RESIDUAL
        else:
            child.phase = "ready"
        self.run(self.p.tiers.suspended(model, child.generation, ok, "" if ok else "boom",
                                        child.host, self.tick()))

    def woken(self, model: str, ok: bool = True) -> None:
        child = self.children[model]
        assert child.phase == "waking"
        if ok:
            child.phase, child.host = "ready", 0
            child.device = int(self.sizes[self.p.state.models[model].group] * GiB)
        else:
            child.phase = "suspended"
        self.run(self.p.tiers.woken(model, child.generation, ok, "" if ok else "boom",
                                    self.tick()))

    def exited(self, model: str, rc: int = 0) -> None:
        child = self.children.pop(model)
        self.run(self.p.children.instance_exited(model, child.generation, rc, f"rc {rc}",
                                                 self.tick()))

    def load_idle(self, *models: str) -> None:
        for m in models:
            t = ("warm", m, self.now)
            self.acquire(t, m)
            if self.state(m) == "loading":
                self.ready(m)
            assert isinstance(self.answers[t], Grant), self.answers[t]
            self.release(t)

    def swap_out(self, old: str, new: str) -> None:
        """`old` loaded and used, then suspended for `new`, which serves one request and
        is idle again."""
        self.load_idle(old)
        self.acquire(("swap", new), new)
        self.suspended(old)
        self.report()
        self.ready(new)
        self.release(("swap", new))

    def state(self, model: str) -> str:
        return self.p.state.models[model].state.value

    def evictions(self) -> list[Evicted]:
        return [e for e in self.events if isinstance(e, Evicted)]


# -------------------------------------------------------------------- unit tests


def test_an_lru_eviction_suspends_and_the_newcomer_loads_once_the_devices_are_seen_free() -> None:
    w = TierWorld({"a": 5, "b": 5})
    w.load_idle("a")
    w.acquire("t", "b")
    assert w.state("a") == "suspending" and w.state("b") == "unloaded"
    last = w.evictions()[-1]
    assert (last.model, last.reason, last.action, last.for_model) == ("a", "memory", "suspend",
                                                                       "b")
    w.suspended("a")
    assert w.state("a") == "suspended"
    assert w.state("b") == "unloaded", "a's devices count until a report sees them free"
    w.report()
    assert w.state("b") == "loading"
    assert w.p.state.ledger.held["a"] == {"gpu0": RESIDUAL}
    w.ready("b")
    assert isinstance(w.answers["t"], Grant)
    view = next(v for v in w.p.snapshot(w.now).models if v.name == "a")
    assert (view.state, view.phase, view.host_bytes) == ("sleeping", "suspended", 5 * GiB)


def test_a_request_wakes_a_suspended_model_in_place_and_makes_room_as_a_load_does() -> None:
    w = TierWorld({"a": 5, "b": 5}, host_gib=16)
    w.swap_out("a", "b")
    gen = w.children["a"].generation
    w.acquire("t2", "a")
    assert w.state("b") == "suspending", "b is idle: it goes to the host for a"
    assert w.state("a") == "suspended"
    w.suspended("b")
    w.report()
    assert w.state("a") == "waking"
    assert not any(isinstance(e, Spawn) and e.model == "a" for e in w.effects[-5:])
    w.woken("a")
    grant = w.answers["t2"]
    assert isinstance(grant, Grant) and grant.generation == gen, "the same child, woken"
    statuses = [e.status for e in w.events if isinstance(e, StatusChanged) and e.model == "a"]
    assert statuses[-3:] == ["sleeping", "loading", "loaded"]
    assert sum(w.p.state.stats.wake_time["a"].counts) == 1


def test_without_host_room_the_victim_is_stopped_and_the_event_says_why() -> None:
    w = TierWorld({"a": 5, "b": 5}, host_gib=5.5)  # 4.5 GiB room: a's 5 GiB do not fit
    w.load_idle("a")
    w.acquire("t", "b")
    assert w.state("a") == "stopping"
    last = w.evictions()[-1]
    assert last.action == "stop" and last.why is not None and "host memory" in last.why


def test_at_suspended_max_the_least_recently_used_suspended_model_is_stopped() -> None:
    w = TierWorld({"a": 3, "b": 3, "c": 3}, models_max=1, suspended_max=1)
    w.swap_out("a", "b")
    w.acquire("t2", "c")
    assert (w.state("a"), w.state("b")) == ("stopping", "suspending")
    reasons = [(e.model, e.reason, e.action) for e in w.evictions()[-2:]]
    assert reasons == [("a", "suspended_max", "stop"), ("b", "lru", "suspend")]


def test_models_max_counts_resident_models_only() -> None:
    w = TierWorld({"a": 3, "b": 3}, models_max=1)
    w.load_idle("a")
    w.acquire("t", "b")
    assert w.state("a") == "suspending" and w.state("b") == "unloaded", \
        "a holds its slot until its suspend is done"
    w.suspended("a")
    assert w.state("b") == "loading"
    assert w.p.state.n_running == 1 and w.p.state.n_suspended == 1
    snapshot = w.p.snapshot(w.now)
    assert (snapshot.running, snapshot.suspended) == (1, 1)


@pytest.mark.parametrize("step", ["suspend", "wake"])
def test_a_failed_suspend_or_wake_stops_the_child_and_a_woken_request_loads_cold(
        step: str) -> None:
    w = TierWorld({"a": 5, "b": 5}, host_gib=16)
    w.load_idle("a")
    w.acquire("t1", "b")
    if step == "suspend":
        w.suspended("a", ok=False)
        assert w.state("a") == "stopping"
        assert w.evictions()[-1].reason == "suspend_failed"
        assert len(w.p.state.models["a"].breaker.failures) == 1
        return
    w.suspended("a")
    w.report()
    w.ready("b")
    w.release("t1")
    w.acquire("t2", "a")
    w.suspended("b")
    w.report()
    w.woken("a", ok=False)
    assert w.state("a") == "stopping" and "t2" not in w.answers, "it waits for a load"
    assert w.evictions()[-1].reason == "wake_failed"
    w.exited("a")
    w.report()
    assert w.state("a") == "loading", "loaded anew for the request that waited"
    w.ready("a")
    assert isinstance(w.answers["t2"], Grant)


def test_a_model_that_no_longer_fits_where_it_slept_is_stopped_and_loaded_anew() -> None:
    pinned = ModelRules(pinned=True)
    w = TierWorld({"a": 5, "p": 5}, rules={"a": SUSPEND, "p": pinned})
    w.load_idle("a")
    w.acquire("t1", "p")
    w.suspended("a")
    w.report()
    w.ready("p")
    w.release("t1")
    w.acquire("t2", "a")
    assert w.state("a") == "stopping" and w.evictions()[-1].reason == "wake_elsewhere"
    w.exited("a")
    w.report()
    assert isinstance(w.answers["t2"], Refusal), "then the load's plan refuses it: pinned"


def test_ttl_suspends_first_then_stops() -> None:
    rules = ModelRules(suspend=True, ttl_suspend_s=5.0, ttl_s=20.0)
    w = TierWorld({"a": 3}, rules={"a": rules})
    w.load_idle("a")
    w.now += 5
    w.fire_timers()
    assert w.state("a") == "suspending" and w.evictions()[-1].reason == "ttl"
    w.suspended("a")
    w.now += 10
    w.fire_timers()
    assert w.state("a") == "suspended"
    w.now += 10
    w.fire_timers()
    assert w.state("a") == "stopping"
    assert w.evictions()[-1].action == "stop"


def test_a_host_that_runs_short_stops_suspended_models_least_recently_used_first() -> None:
    w = TierWorld({"a": 2, "b": 2, "c": 7}, host_gib=8)
    w.load_idle("a", "b")
    w.acquire("t", "c")
    for m in ("a", "b"):
        if w.state(m) == "suspending":
            w.suspended(m)
    w.report()
    suspended = [m for m in "ab" if w.state(m) == "suspended"]
    assert suspended, "one at least went to the host for c"
    w.host_external = 5 * GiB  # something else takes host RAM
    w.report()
    assert w.state(suspended[0]) == "stopping"
    assert w.evictions()[-1].reason == "host_memory"


def test_without_memory_accounting_a_slot_eviction_suspends_and_a_request_wakes() -> None:
    w = TierWorld({"a": 3, "b": 3}, models_max=1, memory=False)
    w.load_idle("a")
    w.acquire("t1", "b")
    w.suspended("a")
    w.ready("b")
    w.release("t1")
    w.acquire("t2", "a")
    w.suspended("b")
    assert w.state("a") == "waking"
    w.woken("a")
    assert isinstance(w.answers["t2"], Grant)


def test_unload_stops_a_suspended_model_and_load_wakes_one() -> None:
    w = TierWorld({"a": 3, "b": 3}, models_max=1)
    w.swap_out("a", "b")
    w.run(w.p.load("L", "a", w.tick()))
    assert w.state("b") == "suspending"
    w.suspended("b")
    w.report()
    assert w.state("a") == "waking"
    w.run(w.p.unload("U", "b", w.tick()))
    assert w.state("b") == "stopping"


def test_a_suspended_child_that_crashes_is_unloaded_failed_and_its_host_copy_freed() -> None:
    w = TierWorld({"a": 3, "b": 3}, models_max=1)
    w.load_idle("a")
    w.acquire("t1", "b")
    w.suspended("a")
    w.report()  # its host copy is in the figures now
    w.exited("a", rc=1)
    rec = w.p.state.models["a"]
    assert rec.state.value == "unloaded" and rec.failed and rec.host_bytes == 0
    assert w.p.state.host.freeing == {"a": (None, 3 * GiB)}
    w.report()
    assert w.p.state.host.freeing == {}


def test_a_warm_model_comes_back_when_the_big_one_leaves_and_never_evicts() -> None:
    warm = ModelRules(warm=True)
    w = TierWorld({"small": 3, "big": 8}, rules={"small": warm, "big": ModelRules()})
    assert w.state("small") == "loading", "room at once: it loads with no request"
    w.ready("small")
    assert w.p.state.models["small"].last_used == 0.0, "the first victim"
    w.acquire("t", "big")
    assert w.state("small") == "stopping", "a request takes its place"
    w.exited("small")
    w.report()
    w.ready("big")
    w.release("t")
    w.report()
    assert w.state("small") == "unloaded", "no room: it never evicts for itself"
    w.run(w.p.unload("U", "big", w.tick()))
    w.exited("big")
    w.report()
    assert w.state("small") == "loading", "the big one left: it comes back"


def test_a_warm_load_gives_way_to_a_request_that_needs_its_place() -> None:
    warm = ModelRules(warm=True)
    w = TierWorld({"small": 3, "other": 3}, models_max=1,
                  rules={"small": warm, "other": ModelRules()})
    assert w.state("small") == "loading"
    w.acquire("t", "other")
    assert w.state("small") == "stopping"
    assert w.evictions()[-1].reason == "warm"
    w.exited("small")
    assert w.state("other") == "loading"
    w.ready("other")
    assert isinstance(w.answers["t"], Grant)
    assert w.state("small") == "unloaded", "models_max is full: it waits"


def test_a_suspended_warm_model_is_woken_when_there_is_room() -> None:
    warm = ModelRules(warm=True, suspend=True)
    w = TierWorld({"small": 3, "big": 8}, host_gib=16,
                  rules={"small": warm, "big": ModelRules()})
    w.ready("small")
    w.acquire("t", "big")
    assert w.state("small") == "suspending"
    w.suspended("small")
    w.report()
    w.ready("big")
    w.release("t")
    w.run(w.p.unload("U", "big", w.tick()))
    w.exited("big")
    w.report()
    assert w.state("small") == "waking"
    w.woken("small")
    assert w.state("small") == "loaded"


# -------------------------------------------------------------------- the state machine


class TierMachine(RuleBasedStateMachine):
    """Requests, releases, loads, suspends and wakes that succeed or fail, crashes,
    unloads, device and host reports, and TTL timers; every request's plan is the decision
    then made. After every step: the policy's
    invariants; the device never holds more than its total less the margin, nor the
    host more than its RAM less the margin (its outside use is fixed); every Suspend
    is for an awake child and every Wake for a suspended one (TierWorld.run)."""

    def __init__(self) -> None:
        super().__init__()
        self.w: TierWorld | None = None
        self.open: list[int] = []
        self.asked: list[int] = []
        self.n = 0

    @rule(models_max=st.sampled_from([0, 1, 2]), suspended_max=st.sampled_from([0, 1, 2]),
          ttl=st.sampled_from([(0.0, 0.0), (3.0, 0.0), (3.0, 8.0), (0.0, 8.0)]),
          host_gib=st.sampled_from([4.0, 8.0, 16.0]), memory=st.booleans(),
          plain=st.sampled_from(["", "c"]), warm=st.sampled_from(["", "a", "ab"]))
    @precondition(lambda self: self.w is None)
    def start(self, models_max: int, suspended_max: int, ttl: tuple[float, float],
              host_gib: float, memory: bool, plain: str, warm: str) -> None:
        suspend_s, ttl_s = ttl
        rules = {m: ModelRules(suspend=m not in plain, ttl_suspend_s=suspend_s if m not in
                               plain else 0.0, ttl_s=ttl_s, warm=m in warm) for m in "abc"}
        self.w = TierWorld({"a": 3, "b": 4, "c": 5}, models_max, rules=rules,
                           suspended_max=suspended_max, host_gib=host_gib, memory=memory)

    @rule(model=st.sampled_from("abc"))
    @precondition(lambda self: self.w is not None)
    def acquire(self, model: str) -> None:
        assert self.w is not None
        self.n += 1
        self.open.append(self.n)
        self.asked.append(self.n)
        w = self.w
        w.now += 1.0
        planned = w.p.plan(model, w.now)  # GET /models/plan: what acquire then decides
        effects = w.p.acquire(self.n, model, w.now)
        w.run(effects)
        assert planned.decision == decide(effects, self.n, model), (planned, effects)

    @rule(i=st.integers(0, 50))
    @precondition(lambda self: self.w is not None and self.open)
    def release(self, i: int) -> None:
        assert self.w is not None
        ticket = self.open.pop(i % len(self.open))
        if ticket not in self.w.answers:
            self.asked.remove(ticket)  # a cancel: its client left, nobody is answered
        self.w.release(ticket)

    @rule(model=st.sampled_from("abc"), ok=st.sampled_from([True, True, True, False]))
    @precondition(lambda self: self.w is not None)
    def child_moves(self, model: str, ok: bool) -> None:
        """The child of `model` finishes what it was doing: a load, a stop, a suspend
        or a wake (which may fail)."""
        assert self.w is not None
        child = self.w.children.get(model)
        if child is None:
            return
        if child.phase == "loading":
            self.w.ready(model)
        elif child.phase == "stopping":
            self.w.exited(model)
        elif child.phase == "suspending":
            self.w.suspended(model, ok)
        elif child.phase == "waking":
            self.w.woken(model, ok)

    @rule(model=st.sampled_from("abc"))
    @precondition(lambda self: self.w is not None)
    def crash(self, model: str) -> None:
        assert self.w is not None
        if model in self.w.children:
            self.w.exited(model, rc=1)

    @rule(model=st.sampled_from("abc"), load=st.booleans())
    @precondition(lambda self: self.w is not None)
    def manage(self, model: str, load: bool) -> None:
        assert self.w is not None
        self.n += 1
        call = self.w.p.load if load else self.w.p.unload
        self.w.run(call(("m", self.n), model, self.w.tick()))

    @rule(seconds=st.sampled_from([1.0, 3.0, 10.0]))
    @precondition(lambda self: self.w is not None)
    def time_passes(self, seconds: float) -> None:
        assert self.w is not None
        self.w.now += seconds
        self.w.fire_timers()
        self.w.report()

    @invariant()
    def memory_holds(self) -> None:
        w = self.w
        if w is None:
            return
        device = sum(c.device for c in w.children.values())
        host = sum(c.host for c in w.children.values())
        if w.p.state.memory_on:
            assert device <= w.total - MARGIN, f"device over its margin: {device / GiB} GiB"
        assert host <= w.host_total - MARGIN, f"host over its margin: {host / GiB} GiB"

    def teardown(self) -> None:
        """Every client finishes, every child does what it was told: every request has
        its answer."""
        w = self.w
        if w is None:
            return
        for _ in range(60):
            for ticket in [t for t in self.open if t in w.answers]:
                self.open.remove(ticket)
                if isinstance(w.answers[ticket], Grant):
                    w.release(ticket)
            for model in list(w.children):
                self.child_moves(model, True)
            w.now += 30
            w.fire_timers()
            w.report()
        unanswered = [t for t in self.asked if t not in w.answers]
        assert not unanswered, f"requests never answered: {unanswered}"


TierMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CORRAL_TIER_EXAMPLES", "150")), stateful_step_count=60,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestTierMachine = TierMachine.TestCase


def test_the_plan_of_a_request_for_a_suspended_model_is_a_wake_that_suspends_the_other() -> None:
    w = TierWorld({"a": 5, "b": 5}, host_gib=16)
    w.swap_out("a", "b")
    plan = w.p.plan("a", w.tick())
    assert plan.decision == "load" and plan.wake and plan.devices == ["gpu0"]
    assert [(e.model, e.action) for e in plan.evict] == [("b", "suspend")]
    w.acquire("t2", "a")
    assert w.state("b") == "suspending", "the plan was the decision"
