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

from actors.config.keys import Tenant
from actors.config.rules import ModelRules
from actors.messages import Cut, Grant, Refusal, Repump, TtlDue, WaitDue
from actors.policy import Policy
from actors.policy.plans import decide
from actors.policy.records import Answer, Effect, Later, Preempt
from actors.runtime.bridge import ThreadReply

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
                    out += self.p.tiers.ttl_due(model, gen, self.now)
        return out

    def tick(self) -> float:
        self.now += 1.0
        return self.now

    def acquire(self, ticket: object, key: str, cuttable: bool = True) -> object:
        self.run(self.p.acquire(ticket, "m", self.tick(), True, key, cuttable=cuttable))
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
    assert waiter.queued_at == 2.0 and waiter.again and not waiter.cuttable, (
        "it came at 2 and waits again aged from then, not to be cut again")
    assert list(w.p.state.queue.entries["m"].lanes["batch"]) == ["b1", "later"]
    w.release("b0")
    assert isinstance(w.answers["b1"], Grant), "before the batch request that came after"
    assert "later" in w.p.state.queue.waiters


def test_with_aging_a_request_that_has_run_long_is_not_cut() -> None:
    w = World(slots=1)
    w.p.state.queue.aging_s = 1.0
    full_of_batch(w, 1)  # came and granted at 1
    w.now = 20.0  # once waiting again it would rank 1 + 19 + 1: above an interactive 10
    assert w.acquire("i", "inter") is None
    assert w.cuts == [], "the longer it ran, the more work a cut would lose"


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


def test_with_aging_no_cut_is_asked_for_a_slot_an_aged_waiter_would_take() -> None:
    """Review finding: cuts compared class levels, but a freed slot goes to the waiter
    that ranks highest, its age counted (priority_aging_s): a batch request was cut for an
    interactive waiter and the slot went to an aged batch waiter."""
    w = World(slots=1)
    w.run(w.p.set_tenants(TENANTS, 0.0, 1.0))
    w.p.state.queue.aging_s = 1.0
    full_of_batch(w, 1)  # b0 granted at 1
    assert w.acquire("b-old", "batch2") is None  # waits from 2
    w.now = 30.0  # b-old ranks 1 + 28; an interactive one ranks 10 when it comes
    assert w.acquire("i", "inter") is None
    assert w.cuts == [], "the slot would go to b-old first: a cut would only lose work"
    w.release("b0")
    assert isinstance(w.answers["b-old"], Grant)
    assert w.cuts == [], "b-old waited 29 s for its grant: it would rank first again"
    w.release("b-old")
    assert isinstance(w.answers["i"], Grant)
    assert w.acquire("b1", "batch") is None
    w.release("i")  # b1 granted after a wait of 1 s: it ranks 1 + 2 as i2 comes
    w.acquire("i2", "inter")
    assert w.cuts == ["b1"]
    w.requeue("b1")
    assert isinstance(w.answers["i2"], Grant), "the slot went to the waiter it was cut for"


def test_a_draining_model_cuts_every_lower_request_for_one_waiter() -> None:
    """A model retiring for a reload has no room (state.has_room) whatever its in_flight,
    so Preemption.ask cuts though the model is below its max_concurrency, and the freed
    slot never reaches the waiter: it still waits, so each Requeue asks for one more cut,
    until every batch request is cut for one interactive waiter."""
    w = World(slots=4)
    full_of_batch(w, 3)  # 3 of 4: below max_concurrency
    w.run(w.p.children.reconfigure({}, [], {"m": ModelRules(
        max_concurrency=4, make_before_break=False)}, w.tick())[0])
    assert w.p.state.models["m"].retiring
    assert w.acquire("i", "inter") is None
    done: list[object] = []
    while len(done) < len(w.cuts):  # the front cuts each as asked
        t = w.cuts[len(done)]
        w.requeue(t)
        done.append(t)
    assert len(w.cuts) <= 1, (f"one waiter, {len(w.cuts)} cuts of a model below its "
                              f"max_concurrency: {w.cuts}")


def test_a_cut_sent_to_a_request_that_cannot_be_cut_blocks_the_waiter_s_cut() -> None:
    """An embedding lease (Supervisor.lease: a ThreadReply; lease_async: a LoopReply with
    no on_cut) is granted a Slot like any request; its Cut is dropped and no NotCut comes,
    so the slot stays `asked` until the lease ends, and the waiter's cut is never asked of
    the batch request that could give it."""
    w = World()
    lease = ThreadReply()  # an embedding's lease: it comes not cuttable
    assert isinstance(w.acquire(lease, "", cuttable=False), Grant)
    full_of_batch(w, 1)
    w.acquire("i", "inter")
    for t in w.cuts:
        if isinstance(t, ThreadReply):
            t.send(Cut())  # what scheduler.py does with a Preempt: dropped, no answer
    assert "b0" in w.cuts or isinstance(w.answers.get("i"), Grant), (
        f"cuts asked {w.cuts}: the lease's Cut went nowhere, and the batch request "
        "that could be cut never is")


def test_a_request_cut_as_corral_shuts_down_is_answered() -> None:
    """Preemption.requeue queues the cut request whatever the state: after shutdown()
    has refused every waiter, one whose Requeue comes later waits in a queue nothing
    serves any more (no answer; forever with queue_timeout_s = 0) instead of a 503."""
    w = World()
    full_of_batch(w)
    w.acquire("i", "inter")
    assert w.cuts == ["b1"]
    w.run(w.p.shutdown(w.tick()))  # the Cut is on its way to the front meanwhile
    w.requeue("b1")
    assert "b1" in w.answers, "the cut request waits in the queue of a stopped corral"


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
                limit=st.sampled_from([0, 1]), aging_s=st.sampled_from([0.0, 0.0, 2.0, 20.0]))
    def setup(self, slots: int, timeout: float, limit: int, aging_s: float) -> None:
        tenants = {name: Tenant(name=name, level=level, priority=f"level{level}",
                                max_concurrency=limit if name == "high" else 0)
                   for name, level in LEVELS.items()}
        self.w = World(slots=slots, queue_timeout_s=timeout, tenants=tenants)
        self.p = self.w.p
        self.p.state.queue.aging_s = aging_s
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

    @rule(target=tickets, model=st.sampled_from("mn"), key=st.sampled_from(list(LEVELS)),
          cuttable=st.sampled_from([True, True, False]))
    def acquire(self, model: str, key: str, cuttable: bool) -> int:
        self.n += 1
        plan = self.p.plan(model, self.w.tick(), key)
        effects = self.p.acquire(self.n, model, self.w.now, True, key, cuttable=cuttable)
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
        state = self.p.state
        for name, rec in state.models.items():
            entry = state.queue.entry(name)
            if (entry is None or not rec.state.is_serving or rec.retiring
                    or rec.in_flight < rec.rules.max_concurrency):
                continue
            skip = [k for k in entry.lanes if k and state.tenants.at_limit(k)]
            cuts = copy.deepcopy(state.cuts)  # (wanted marks what it returns asked)
            wanted = cuts.wanted(name, rec.generation, entry, state.queue, skip, self.w.now)
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


def test_a_waiter_gets_one_cut_whichever_copy_of_its_model_it_is_on() -> None:
    """Issue 24: copies of one model are asked for cuts as one model; a waiter's cut on
    one copy is not asked again on the other."""
    from actors.config.rules import Replicas

    w = World(slots=1)
    replicas = Replicas(min=2, max=2)
    p = w.p = Policy(4, tenants=TENANTS, preempt=True)
    for name, group in (("m", ""), ("m@2", "m")):
        p.add_model(name, 0.0, rules=ModelRules(max_concurrency=1, replicas=replicas,
                                                group=group))
    w.run(p.load(None, "m", 0.0))
    for name in ("m", "m@2"):
        while p.state.models[name].state.value != "loading":
            w.run(p.repump(w.tick()))
        w.run(p.children.instance_ready(name, p.state.models[name].generation, 100, "x", 1,
                                        w.tick()))
    full_of_batch(w)
    assert {p.state.leases[t][0] for t in ("b0", "b1")} == {"m", "m@2"}
    w.acquire("i1", "inter")
    assert len(w.cuts) == 1, "one waiter, one cut, not one on each copy"
    w.acquire("i2", "inter")
    assert sorted(w.cuts) == ["b0", "b1"]
    for t in ("b0", "b1"):
        w.requeue(t)
    assert isinstance(w.answers["i1"], Grant) and isinstance(w.answers["i2"], Grant)
    grants = [w.answers[t] for t in ("i1", "i2")]
    assert sorted(g.instance for g in grants if isinstance(g, Grant)) == ["", "m@2"]


def test_waiters_left_when_a_child_comes_back_ask_for_their_cuts() -> None:
    """Found by the machine: m crashed and came back; its waiters were served up to its
    max_concurrency (with aging, lower classes first), and the higher class waiter left
    asked for no cut: only a new request's coming asked for them."""
    m = CutMachine()
    m.setup(slots=3, timeout=0.0, limit=0, aging_s=2.0)
    m.crash_and_back(model="m")
    m.acquire(cuttable=False, key="low", model="m")
    m.acquire(cuttable=True, key="low", model="m")
    m.crash_and_back(model="n")
    m.time_passes(dt=4.0)
    for key in ("", "low2", "mid"):
        m.acquire(cuttable=True, key=key, model="m")
    m.crash_and_back(model="m")
    m.nothing_unasked()
    m.teardown()


def test_a_cut_out_ranks_among_the_waiters_once_it_comes_back() -> None:
    """Found by the machine: with aging, a request asked to be cut comes back ranked from
    when it first came; a second waiter whose rank is below that gains nothing from a
    second cut (the freed slot would go to the request cut first). Asked one by one, the
    policy saw this; counted again afterwards, the asked cut's rank was forgotten and a
    second cut was wanted."""
    m = CutMachine()
    m.setup(slots=3, timeout=0.0, limit=0, aging_s=2.0)
    m.crash_and_back(model="m")
    m.acquire(cuttable=False, key="low", model="m")
    m.answer_cut(cut=False, i=1)
    m.crash_and_back(model="n")
    m.time_passes(dt=0.5)
    m.time_passes(dt=0.5)
    m.acquire(cuttable=True, key="low", model="m")
    for _ in range(3):
        m.crash_and_back(model="n")
    m.time_passes(dt=0.5)
    m.time_passes(dt=0.5)
    for key in ("", "", "low2"):
        m.acquire(cuttable=True, key=key, model="m")
    m.answer_cut(cut=False, i=0)
    m.acquire(cuttable=True, key="mid", model="m")
    m.crash_and_back(model="m")
    m.crash_and_back(model="m")
    m.answer_cut(cut=True, i=0)
    m.acquire(cuttable=True, key="mid", model="m")
    m.nothing_unasked()
    m.teardown()
