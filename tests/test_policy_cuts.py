"""Cutting a lower class's request for a higher class's waiter (`priority_preempt`,
policy/cuts.py), in the pure policy: which request is cut, that one is cut at most once,
that a request whose answer has begun is passed over, and where a cut request waits."""

from __future__ import annotations

import copy
import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from actors.config import ModelRules
from actors.keys import Tenant
from actors.messages import Grant, Refusal, Repump, TtlDue, WaitDue
from actors.policy import Policy
from actors.policy.plans import decide
from actors.policy.records import Answer, Effect, Later, Preempt

BATCH, INTERACTIVE = 1, 10
TENANTS = {"": Tenant(name=""),
           "batch": Tenant(name="batch", level=BATCH, priority="batch"),
           "batch2": Tenant(name="batch2", level=BATCH, priority="batch"),
           "inter": Tenant(name="inter", level=INTERACTIVE, priority="interactive")}


class World:
    def __init__(self, slots: int = 2, preempt: bool = True, queue_timeout_s: float = 0.0,
                 tenants: dict[str, Tenant] | None = None) -> None:
        self.p = Policy(2, tenants=tenants or TENANTS, preempt=preempt)
        self.p.add_model("m", 0.0, rules=ModelRules(max_concurrency=slots,
                                                    queue_timeout_s=queue_timeout_s))
        self.now = 0.0
        self.answers: dict[object, object] = {}
        self.cuts: list[object] = []
        """Tickets the policy asked to cut, in order."""
        self.later: list[tuple[float, object]] = []
        """(due, message) of the timers not yet fired."""
        self.run(self.p.load(None, "m", 0.0))
        rec = self.p.state.models["m"]
        self.run(self.p.children.instance_ready("m", rec.generation, 100, "x", 1, 0.0))

    def run(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Answer) and e.ticket is not None:
                self.answers[e.ticket] = e.value
            elif isinstance(e, Preempt):
                self.cuts.append(e.ticket)
            elif isinstance(e, Later):
                self.later.append((self.now + e.delay_s, e.message))
        self.p.check_invariants()

    def fire(self) -> list[Effect]:
        """The effects of every timer due by now."""
        due = sorted((t for t in self.later if t[0] <= self.now), key=lambda t: t[0])
        self.later = [t for t in self.later if t[0] > self.now]
        out: list[Effect] = []
        for _, message in due:
            match message:
                case WaitDue(ticket=ticket):
                    out += self.p.wait_due(ticket, self.now)
                case Repump():
                    out += self.p.repump(self.now)
                case TtlDue(model=model, generation=gen):
                    out += self.p.ttl_due(model, gen, self.now)
        return out

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def acquire(self, ticket: object, key: str) -> object:
        self.run(self.p.acquire(ticket, "m", self.tick(), True, key))
        return self.answers.get(ticket)

    def requeue(self, ticket: object) -> None:
        self.answers.pop(ticket)
        self.run(self.p.cuts.requeue(ticket, self.tick()))

    def release(self, ticket: object) -> None:
        self.run(self.p.release(ticket, self.tick()))


def full_of_batch(w: World, n: int = 2) -> None:
    for i in range(n):
        assert isinstance(w.acquire(f"b{i}", "batch"), Grant)


def test_a_higher_class_waiter_cuts_the_most_recent_lower_class_request() -> None:
    w = World()
    full_of_batch(w)
    assert w.acquire("i", "inter") is None, "no slot: it waits"
    assert w.cuts == ["b1"], "the most recently granted batch request: the least work lost"
    w.requeue("b1")
    assert isinstance(w.answers["i"], Grant), "the slot went to the waiter it was cut for"
    assert "b1" in w.p.state.queue.waiters and "b1" not in w.p.state.leases
    assert w.p.state.stats.cuts == {("m", "batch"): 1}


def test_a_cut_request_waits_first_in_its_lane_and_keeps_its_age() -> None:
    w = World()
    full_of_batch(w)
    assert w.acquire("later", "batch") is None
    w.acquire("i", "inter")
    w.requeue("b1")
    waiter = w.p.state.queue.waiters["b1"]
    assert waiter.queued_at == 2.0 and waiter.cut, "it came at 2 and keeps that age"
    assert list(w.p.state.queue.entries["m"].lanes["batch"]) == ["b1", "later"]
    w.release("b0")
    assert isinstance(w.answers["b1"], Grant), "before the batch request that came after"
    assert "later" in w.p.state.queue.waiters


def test_a_request_is_cut_at_most_once() -> None:
    w = World(slots=1)
    full_of_batch(w, 1)
    w.acquire("i1", "inter")
    assert w.cuts == ["b0"]
    w.requeue("b0")
    w.release("i1")
    assert isinstance(w.answers["b0"], Grant), "granted again"
    w.acquire("i2", "inter")
    assert w.cuts == ["b0"], "not cut a second time: it runs to its end"
    w.release("b0")
    assert isinstance(w.answers["i2"], Grant)


def test_a_request_whose_answer_began_is_passed_over_for_another() -> None:
    w = World()
    full_of_batch(w)
    w.acquire("i", "inter")
    assert w.cuts == ["b1"]
    w.run(w.p.cuts.not_cut("b1", w.tick()))
    assert w.cuts == ["b1", "b0"], "the front said no: the next one is asked"
    w.run(w.p.cuts.not_cut("b0", w.tick()))
    assert w.cuts == ["b1", "b0"], "none left to ask: it waits for an end"
    w.release("b0")
    assert isinstance(w.answers["i"], Grant)


def test_each_waiter_gets_one_cut_and_no_more() -> None:
    w = World(slots=3)
    full_of_batch(w, 3)
    w.acquire("i1", "inter")
    w.acquire("i2", "inter")
    assert w.cuts == ["b2", "b1"], "one each, the most recent first"
    w.requeue("b2")
    assert isinstance(w.answers["i1"], Grant)
    w.acquire("i3", "inter")
    assert w.cuts == ["b2", "b1", "b0"]
    w.requeue("b1")
    w.requeue("b0")
    assert isinstance(w.answers["i2"], Grant) and isinstance(w.answers["i3"], Grant)


def test_no_cut_within_a_class_nor_when_off_nor_for_a_key_at_its_limit() -> None:
    w = World()
    full_of_batch(w)
    w.acquire("b-late", "batch2")
    assert w.cuts == [], "a class does not cut its own"
    off = World(preempt=False)
    full_of_batch(off)
    off.acquire("i", "inter")
    assert off.cuts == [], "priority_preempt is off"
    limited = World(tenants={**TENANTS, "inter": Tenant(name="inter", level=INTERACTIVE,
                                                        max_concurrency=1)})
    limited.acquire("i0", "inter")
    full_of_batch(limited, 1)
    assert limited.acquire("i1", "inter") is None
    assert limited.cuts == [], "a waiter held by its own key's limit would gain no slot"


def test_a_cut_then_a_natural_end_leaves_nothing_behind() -> None:
    w = World()
    full_of_batch(w)
    w.acquire("i", "inter")
    w.release("b0")  # a slot comes free before the cut is done
    assert isinstance(w.answers["i"], Grant)
    w.release("b1")  # ... and the cut request ended meanwhile: its Requeue never comes
    w.release("i")
    assert w.p.state.cuts.of == {} and w.p.state.cuts.slots == {}
    w.run(w.p.cuts.requeue("b1", w.tick()))
    assert "b1" not in w.p.state.queue.waiters, "a late Requeue changes nothing"


def test_a_client_that_leaves_after_its_cut_leaves_the_queue() -> None:
    w = World(queue_timeout_s=5.0)
    full_of_batch(w)
    w.acquire("i", "inter")
    w.requeue("b1")
    assert w.p.state.queue.waiters["b1"].deadline == w.now + 5.0, "a fresh queue_timeout_s"
    w.run(w.p.cancel("b1", w.tick()))
    assert "b1" not in w.p.state.queue.waiters and "b1" not in w.p.state.cuts.of


def test_a_cut_request_of_a_removed_model_is_answered() -> None:
    w = World()
    full_of_batch(w)
    w.acquire("i", "inter")
    w.p.state.models["m"].removed = True
    w.requeue("b1")
    answer = w.answers["b1"]
    assert isinstance(answer, Refusal) and answer.status == 503 and "removed" in answer.message


def test_a_plan_says_which_class_it_would_cut_and_cuts_nothing() -> None:
    w = World()
    full_of_batch(w)
    plan = w.p.plan("m", w.tick(), "inter")
    assert plan.decision == "queue" and plan.cut == ["batch"]
    assert plan.waiting_for is not None and "class batch" in plan.waiting_for
    assert w.p.state.cuts.of["b1"].asked is False, "a plan asks for nothing"
    assert w.p.plan("m", w.now, "batch2").cut == [], "a class cuts none of its own"


def test_a_reload_turns_cuts_on_and_the_waiters_ask_for_them() -> None:
    w = World(preempt=False)
    full_of_batch(w)
    w.acquire("i", "inter")
    assert w.cuts == []
    w.run(w.p.set_tenants(TENANTS, 0.0, w.tick(), preempt=True))
    assert w.cuts == [], "what was granted before cuts were on is not theirs to cut"
    w.release("b0")  # the interactive one takes the slot
    assert isinstance(w.answers["i"], Grant)
    assert isinstance(w.acquire("b2", "batch"), type(None))
    w.release("b1")
    assert isinstance(w.answers["b2"], Grant)
    w.acquire("i2", "inter")
    assert w.cuts == ["b2"], "granted after the reload: it may be cut"


# ---------------------------------------------------------------- a state machine

LEVELS = {"": 0, "low": 1, "low2": 1, "mid": 5, "high": 10}


class CutMachine(RuleBasedStateMachine):
    """Two models at their max_concurrency, keys of three classes, the front answering
    each Cut at random (cut, or its answer had begun), clients ending, leaving and
    timing out, children crashing and coming back. After every step: the plan for a
    request is the decision the policy then makes; a request is asked to be cut only
    while granted, at most once in its life, and only for a waiter of a higher class;
    no cut the waiters want is left unasked. At the end every request has its answer."""

    tickets = Bundle("tickets")

    @initialize(slots=st.sampled_from([1, 2, 3]), timeout=st.sampled_from([0.0, 3.0]),
                limit=st.sampled_from([0, 1]))
    def setup(self, slots: int, timeout: float, limit: int) -> None:
        tenants = {name: Tenant(name=name, level=level, priority=f"level{level}",
                                max_concurrency=limit if name == "high" else 0)
                   for name, level in LEVELS.items()}
        self.w = World(slots=slots, queue_timeout_s=timeout, tenants=tenants)
        self.p = self.w.p
        self.p.add_model("n", 0.0, rules=ModelRules(max_concurrency=1))
        self.w.run(self.p.load(None, "n", self.w.tick()))
        self.w.run(self.p.children.instance_ready("n", 1, 101, "x", 1, self.w.now))
        self.n = 0
        self.all: list[int] = []
        self.left: set[int] = set()
        self.ever_cut: list[object] = []
        self.granted: set[object] = set()

    def run(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Preempt):
                assert e.ticket in self.p.state.leases, "cut while not granted"
                assert e.ticket not in self.ever_cut, "cut twice"
                self.ever_cut.append(e.ticket)
        self.w.run(effects)

    @rule(target=tickets, model=st.sampled_from("mn"), key=st.sampled_from(list(LEVELS)))
    def acquire(self, model: str, key: str) -> int:
        self.n += 1
        plan = self.p.plan(model, self.w.tick(), key)
        effects = self.p.acquire(self.n, model, self.w.now, True, key)
        assert plan.decision == decide(effects, self.n, model), (plan, effects)
        assert len(plan.cut) == sum(isinstance(e, Preempt) for e in effects)
        self.run(effects)
        self.all.append(self.n)
        return self.n

    @rule(i=st.integers(0, 7), cut=st.booleans())
    def answer_cut(self, i: int, cut: bool) -> None:
        asked = [t for t in self.ever_cut if t in self.p.state.leases
                 and (s := self.p.state.cuts.of.get(t)) is not None and s.asked]
        if asked:
            t = asked[i % len(asked)]
            if cut:
                self.w.answers.pop(t)
                self.run(self.p.cuts.requeue(t, self.w.tick()))
            else:
                self.run(self.p.cuts.not_cut(t, self.w.tick()))

    @rule(t=consumes(tickets))
    def release(self, t: int) -> None:
        if not isinstance(self.w.answers.get(t), Grant):
            self.left.add(t)  # a release before the grant is a cancel
        self.run(self.p.release(t, self.w.tick()))

    @rule(dt=st.sampled_from([0.5, 4.0]))
    def time_passes(self, dt: float) -> None:
        self.w.now += dt
        self.run(self.w.fire())

    @rule(model=st.sampled_from("mn"))
    def crash_and_back(self, model: str) -> None:
        gen = self.p.state.models[model].generation
        self.run(self.p.children.instance_exited(model, gen, -9, "killed", self.w.tick()))
        rec = self.p.state.models[model]
        if rec.state.value == "loading":
            self.run(self.p.children.instance_ready(model, rec.generation, 100, "x", 1,
                                                    self.w.tick()))

    @invariant()
    def nothing_unasked(self) -> None:
        state = copy.deepcopy(self.p.state)
        for name, rec in state.models.items():
            entry = state.queue.entry(name)
            if entry is None or state.has_room(rec) or not rec.state.is_serving:
                continue
            skip = [k for k in entry.lanes if k and state.tenants.at_limit(k)]
            wanted = state.cuts.wanted(name, rec.generation, entry, state.queue.waiters, skip)
            assert not wanted, f"{name}: cuts wanted and not asked: {wanted}"
        for t in self.ever_cut:
            slot = self.p.state.cuts.of.get(t)
            assert slot is None or slot.asked or slot.cut

    def teardown(self) -> None:
        if not hasattr(self, "w"):
            return
        for _ in range(50):  # clients finish, children come and go, until all is answered
            for t in [t for t in self.all if t in self.p.state.leases]:
                self.run(self.p.release(t, self.w.tick()))
            if not self.p.state.queue.waiters:
                break
            self.w.now += 5.0  # backoffs end, queue timeouts run out
            self.run(self.w.fire())
            for name, rec in self.p.state.models.items():
                if rec.state.value == "loading":
                    self.run(self.p.children.instance_ready(name, rec.generation, 100, "x",
                                                            1, self.w.tick()))
                elif rec.state.value == "stopping":
                    self.run(self.p.children.instance_exited(name, rec.generation, 0, "",
                                                             self.w.tick()))
        unanswered = [t for t in self.all if t not in self.w.answers and t not in self.left]
        assert not unanswered, f"never answered: {unanswered}"


CutMachine.TestCase.settings = settings(max_examples=int(os.environ.get("CORRAL_CUT_EXAMPLES",
                                                                       "200")),
                                        stateful_step_count=60,
                                        deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
test_cut_state_machine = CutMachine.TestCase
