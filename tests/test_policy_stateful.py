"""A Hypothesis state machine over the pure policy: random requests, releases, cancels,
loads, unloads, spawns, readiness, exits, sleeps, reloads, device reports, measurements
and the passing of time (TTL, queue timeouts, backoffs), with every operating rule drawn
at random per model. After every step the policy's invariants hold (views.check: never
over models_max, in_flight = live leases, the victim heap bounded, ...), every answer is
the first for its ticket, and a load never overcommits the memory margin unless the
model is alone. At the end, with the children answering and the clients finishing,
every request has had exactly one answer.

Requests come with keys (issue 22) of random classes (whose waiters may cut the requests
of lower classes: priority_preempt, answered by the front at random), concurrency limits, rates and
token budgets, and the queue ages them at a random pace. Before every request the plan
for it (GET /models/plan) is taken, and must be the decision the policy then makes; the
quotas are exact both ways: a request is taken only while its key's window has room,
and refused for its quota only when it has none (the test keeps its own windows).

CI runs 150 machines of up to 100 steps (about 13,000 steps in all); the environment
variable CORRAL_STATEFUL_EXAMPLES sets the number of machines.
"""

from __future__ import annotations

import os
from collections import Counter, deque
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from actors.config.keys import BATCH, Tenant, batch_tenant
from actors.config.rules import ModelRules
from actors.lifecycle import ModelState
from actors.messages import Grant, Refusal
from actors.policy.plans import decide
from actors.policy.records import Answer, Effect, Preempt, Spawn
from actors.policy.tenants import WINDOW_S
from tests.test_placement import GpuWorld
from tests.test_policy import drain
from tests.test_policy_keys import token_window
from tests.test_policy_memory import GiB, MemWorld, need

S = ModelState
NAMES = "abcd"
KEYS = ("", "k1", "k2", "k3")
ASKERS = (*KEYS, "batch:k1", "batch:")
"""Who asks: no key, a key, or a batch's lines (issue 44: below every class)."""

tenant_rules = st.tuples(st.sampled_from([0, 1, 10]), st.sampled_from([0, 0, 1, 2]),
                         st.sampled_from([0, 0, 2, 5]), st.sampled_from([0, 0, 20]))
"""A key's (level, max_concurrency, requests_per_min, tokens_per_min)."""

model_rules = st.builds(
    ModelRules,
    pinned=st.sampled_from([False, False, False, True]),
    ttl_s=st.sampled_from([0.0, 0.0, 2.0, 10.0]),
    queue_max=st.sampled_from([0, 0, 1, 3]),
    queue_timeout_s=st.sampled_from([0.0, 0.0, 1.0, 5.0]),
    max_concurrency=st.sampled_from([0, 0, 1, 2]),
    min_resident_s=st.sampled_from([0.0, 0.0, 3.0]),
    permanent=st.sampled_from([False, False, False, True]))


class StrictWorld(MemWorld):
    """A MemWorld that asserts the step-wise properties as effects come out."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.answered: dict[object, int] = {}
        self.asked_cuts: list[object] = []
        """Tickets the policy asked to cut (priority_preempt), in order."""
        self.unreported = False
        """A child grew, or one outside the limits started, since the last device report
        (the policy cannot know yet)."""
        super().__init__(*args, **kw)

    def report(self) -> None:
        self.unreported = False
        super().report()

    def run(self, effects: list[Effect]) -> list[Effect]:
        for e in effects:
            if isinstance(e, Answer) and e.ticket is not None:
                self.answered[e.ticket] = self.answered.get(e.ticket, 0) + 1
                assert self.answered[e.ticket] == 1, f"{e.ticket!r} answered twice"
            elif isinstance(e, Preempt):
                assert e.ticket in self.p.state.leases, f"{e.ticket!r} cut, not granted"
                assert e.ticket not in self.asked_cuts, f"{e.ticket!r} cut twice"
                self.asked_cuts.append(e.ticket)
        super().run(effects)
        for e in effects:
            if isinstance(e, Spawn):
                rec = self.p.state.models[e.model]
                # Alone: no other model holds memory (one whose measurement failed is
                # outside the limits, R-5.2, and holds none).
                others = [r for r in self.p.state.models.values()
                          if r is not rec and r.name in self.p.state.ledger.held]
                if rec.memory == "measured" and others and not self.unreported:
                    # What the children really use (a new one runs at its max), against
                    # what must stay free: the grant must have been right.
                    used = sum(self.actual.values()) + self.external
                    assert used <= self.total - self.p.state.ledger.margin, (
                        f"{e.model} spawned: {used / GiB:.2f} GiB really in use on a "
                        f"{self.total / GiB:.0f} GiB device with a "
                        f"{self.p.state.ledger.margin / GiB:.0f} GiB margin; "
                        f"held {self.p.state.ledger.held}")
                if rec.memory != "measured":  # outside the limits: what it uses is
                    self.unreported = True    # known from the next report on
        return effects


class PolicyMachine(RuleBasedStateMachine):
    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.w: StrictWorld
        self.next_ticket = 0
        self.requests: list[int] = []
        self.cancelled: set[int] = set()
        """Clients that left: a request that left while queued gets no answer."""
        self.taken: list[tuple[float, str]] = []
        self.spent: list[tuple[float, str, int]] = []
        """The test's own windows: requests taken, tokens spent, per key."""

    @initialize(models_max=st.sampled_from([0, 1, 2, 3]),
                sizes=st.lists(st.sampled_from([1, 2, 3, 4, 6, 12]), min_size=4, max_size=4),
                rules=st.lists(model_rules, min_size=4, max_size=4),
                measured=st.booleans(), intensity=st.sampled_from([0, 1, 3]),
                keys=st.lists(tenant_rules, min_size=3, max_size=3),
                aging_s=st.sampled_from([0.0, 5.0, 30.0]), preempt=st.booleans(),
                prefetch=st.booleans())
    def setup(self, models_max: int, sizes: list[int], rules: list[ModelRules],
              measured: bool, intensity: int, keys: list[tuple[int, int, int, int]],
              aging_s: float, preempt: bool, prefetch: bool = False) -> None:
        self.sizes = dict(zip(NAMES, sizes, strict=True))
        self.w = StrictWorld(self.sizes, models_max=models_max, measured=False,
                             rules=dict(zip(NAMES, rules, strict=True)), intensity=intensity)
        self.tenants = {"": Tenant(name="")} | {
            name: Tenant(name=name, level=level, priority=f"level{level}",
                         max_concurrency=mc, requests_per_min=rpm, tokens_per_min=tpm)
            for name, (level, mc, rpm, tpm) in zip(KEYS[1:], keys, strict=True)}
        self.w.p.state.tenants.replace(self.tenants)
        self.w.p.state.queue.aging_s = aging_s
        self.w.p.state.cuts.on = preempt
        if prefetch:  # (its loads and evictions: the same invariants) each model is
            # followed by the next one, asked at once after its answer, as if learned
            self.w.p.prefetch.on = True
            for m, after in zip(NAMES, NAMES[1:] + NAMES[0], strict=True):
                self.w.p.prefetch.follows[m] = Counter({after: 5})
                self.w.p.prefetch.gaps[(m, after)] = deque([0.0])
        if measured:  # a model runs at its max; its min is at the smallest context
            for m, size in self.sizes.items():
                self.w.run(self.w.p.children.measured(m, True, need(size / 2), need(size), 0.0))

    def _models(self, state: ModelState) -> list[str]:
        return [m for m, r in self.w.p.state.models.items() if r.state is state]

    @rule(target=tickets, model=st.sampled_from(NAMES), autoload=st.booleans(),
          key=st.sampled_from(ASKERS))
    def acquire(self, model: str, autoload: bool, key: str) -> int:
        self.next_ticket += 1
        t = self.next_ticket
        self.requests.append(t)
        now = self.w.now
        plan = self.w.p.plan(model, now, key, autoload)
        effects = self.w.p.acquire(t, model, now, autoload, key, cuttable=True)
        assert plan.decision == decide(effects, t, model), (plan, effects)
        answer = next((e.value for e in effects if isinstance(e, Answer) and e.ticket == t),
                      None)
        if isinstance(answer, Grant):
            assert (plan.generation, plan.port) == (answer.generation, answer.port)
        elif isinstance(answer, Refusal):
            assert (plan.status, plan.message) == (answer.status, answer.message)
        spawn = next((e for e in effects if isinstance(e, Spawn) and e.model == model), None)
        if spawn is not None:
            assert plan.devices == spawn.devices
        self.w.run(effects)
        self._check_quota(key, now, answer)
        return t

    def _check_quota(self, key: str, now: float, answer: object) -> None:
        """Exact both ways: taken only with room in the window, 429 only without."""
        rules = self.tenants.get(key) or batch_tenant(self.tenants[key.removeprefix(BATCH)], key)
        since = now - WINDOW_S
        taken = sum(1 for when, k in self.taken if k == key and when > since)
        spent = [(when, n) for when, k, n in self.spent if k == key]
        tokens_full, free_at = (token_window(spent, rules.tokens_per_min, now)
                                if rules.tokens_per_min else (False, now))
        requests_full = bool(rules.requests_per_min and taken >= rules.requests_per_min)
        full = requests_full or tokens_full
        if isinstance(answer, Refusal) and answer.status == 429:
            assert full, f"key {key!r} refused with room: {taken} requests, {spent} tokens"
            if not requests_full:  # (the requests' wait is told first)
                assert answer.retry_after_s == pytest.approx(free_at - now, abs=1e-6)
        elif not (isinstance(answer, Refusal)):
            assert not full, f"key {key!r} taken over its quota: {taken} req, {spent} tok"
            self.taken.append((now, key))

    @rule(t=consumes(tickets), shared=st.booleans(), tokens=st.sampled_from([0, 5, 30, 90]))
    def release(self, t: int, shared: bool, tokens: int) -> None:
        if t not in self.w.answered:
            self.cancelled.add(t)  # a release before the grant is a cancel
        lease = self.w.p.state.leases.get(t)
        if lease is not None and tokens:
            self.spent.append((self.w.now, lease[2], tokens))
        self.w.run(self.w.p.release(t, self.w.now, shared, tokens=tokens))

    @rule(t=tickets, tokens=st.sampled_from([1, 12, 45]))
    def spend(self, t: int, tokens: int) -> None:
        """A stream charged as it goes (the front's Spend)."""
        lease = self.w.p.state.leases.get(t)
        if lease is not None:
            self.spent.append((self.w.now, lease[2], tokens))
        self.w.p.spend(t, tokens, self.w.now)

    @rule(i=st.integers(0, 5), cut=st.booleans())
    def answer_cut(self, i: int, cut: bool) -> None:
        """The front answers a Cut: the request gave its slot back and waits again, or
        its answer had begun."""
        asked = [t for t in self.w.asked_cuts if t in self.w.p.state.leases]
        if not asked:
            return
        t = asked[i % len(asked)]
        if cut:
            self.w.answered[t] -= 1  # it waits again: one more answer is its due
            del self.w.answers[t]
            self.w.run(self.w.p.cuts.requeue(t, self.w.now))
        else:
            self.w.run(self.w.p.cuts.not_cut(t, self.w.now))

    @rule(t=consumes(tickets))
    def cancel(self, t: int) -> None:
        self.cancelled.add(t)
        self.w.run(self.w.p.cancel(t, self.w.now))

    @rule(i=st.integers(0, 3))
    def ready(self, i: int) -> None:
        loading = self._models(S.LOADING)
        if loading:
            self.w.ready(loading[i % len(loading)])

    @rule(i=st.integers(0, 3), rc=st.sampled_from([0, 1, -9]))
    def exit(self, i: int, rc: int) -> None:
        running = [m for m, r in self.w.p.state.models.items() if r.state.is_running]
        if running:
            self.w.exited(running[i % len(running)], rc)

    @rule(model=st.sampled_from(NAMES), what=st.sampled_from(["sleeping", "awake"]))
    def llama_report(self, model: str, what: str) -> None:
        rec = self.w.p.state.models.get(model)
        if rec is not None:
            self.w.run(self.w.p.children.instance_reported(model, rec.generation, what, {},
                                                           self.w.now))

    @rule(model=st.sampled_from(NAMES), unload=st.booleans())
    def manage(self, model: str, unload: bool) -> None:
        self.next_ticket += 1
        p = self.w.p
        call = p.unload if unload else p.load
        self.w.run(call(("manage", self.next_ticket), model, self.w.now))

    @rule(model=st.sampled_from(NAMES), rules=model_rules, remove=st.booleans())
    def reload(self, model: str, rules: ModelRules, remove: bool) -> None:
        p = self.w.p
        rec = p.state.models.get(model)
        if rec is None or rec.removed:
            effects, _ = p.children.reconfigure({model: rules}, [], {}, self.w.now)
        elif remove:
            effects, _ = p.children.reconfigure({}, [model], {}, self.w.now)
        else:
            effects, _ = p.children.reconfigure({}, [], {model: rules}, self.w.now)
        self.w.run(effects)

    @rule(dt=st.sampled_from([0.1, 0.5, 1.0, 3.0, 12.0]))
    def time_passes(self, dt: float) -> None:
        self.w.now += dt
        self.w.fire_timers()

    @rule(i=st.integers(0, 3))
    def grow(self, i: int) -> None:
        """A running child uses 1 GiB more than it did (a context filling up), if the
        device has it (a real allocation past the device fails: no report shows less than
        nothing free, which would hide what others use)."""
        running = [m for m in self.w.actual if self.w.p.state.models[m].state.is_running]
        if running and sum(self.w.actual.values()) + self.w.external + GiB <= self.w.total:
            self.w.actual[running[i % len(running)]] += GiB
            self.w.unreported = True

    @rule(external=st.sampled_from([0, 0, 1, 3]))
    def device_report(self, external: int) -> None:
        """Something outside corral takes memory: what is free at most (as `grow`)."""
        self.w.external = min(external * GiB, max(
            self.w.external, self.w.total - sum(self.w.actual.values())))
        self.w.report()

    @rule(model=st.sampled_from(NAMES), outcome=st.sampled_from(["ok", "failed", "at_load"]))
    def measured(self, model: str, outcome: str) -> None:
        rec = self.w.p.state.models.get(model)
        if rec is not None and rec.memory in ("unmeasured", "measuring"):
            size, ok = self.sizes[model], outcome == "ok"
            self.w.run(self.w.p.children.measured(model, ok, need(size / 2) if ok else None,
                                         need(size) if ok else None, self.w.now,
                                         at_load=outcome == "at_load"))

    @precondition(lambda self: hasattr(self, "w"))
    @invariant()
    def consistent(self) -> None:
        self.w.p.check_invariants()

    def teardown(self) -> None:
        if not hasattr(self, "w"):
            return
        # measures end, children answer or exit, clients finish
        drain(self.w, self.requests, rounds=500, time_step_s=5)
        unanswered = [t for t in self.requests
                      if t not in self.w.answered and t not in self.cancelled]
        assert not unanswered, f"requests never answered: {unanswered}"


PolicyMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CORRAL_STATEFUL_EXAMPLES", "150")),
    stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_policy_state_machine = PolicyMachine.TestCase


# ---------------------------------------------------------------- placement on 1-3 GPUs


class PlacedWorld(GpuWorld):
    """A GpuWorld whose every spawn is checked: on each GPU the model was placed on, what
    the other children really use plus the new one's measured need stays within
    total - margin, unless no other model holds memory (alone) or a growth is not
    reported yet. Children may use more than measured (`overuse`): only the rule of one
    load per device at a time keeps the next grant from counting on memory they take."""

    def run(self, effects: list[Effect]) -> list[Effect]:
        super().run(effects)
        for e in effects:
            if isinstance(e, Spawn) and not self.unreported:
                rec = self.p.state.models[e.model]
                others = [n for n in self.p.state.ledger.held if n != e.model]
                if rec.memory != "measured" or not others:
                    continue
                for device in e.devices or ["gpu0"]:
                    # the new child at what it was measured to need (its overuse is not
                    # knowable yet), the others at what they really use
                    used = self.used(device) - self.overuse.get(e.model, 0)
                    assert used <= 9 * GiB, (
                        f"{e.model} placed on {e.devices}: {used / GiB:.2f} GiB in use "
                        f"on {device}; held {self.p.state.ledger.held}")
        return effects


class PlacementMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.w: PlacedWorld
        self.next_ticket = 0
        self.open: list[int] = []

    @initialize(n_gpus=st.integers(1, 3),
                sizes=st.lists(st.sampled_from([1, 2, 4, 6, 8]), min_size=4, max_size=4),
                per=st.lists(st.sampled_from([1, 1, 1, 2]), min_size=4, max_size=4),
                allowed=st.lists(st.sampled_from([None, None, ["gpu0"], ["gpu1", "gpu2"]]),
                                 min_size=4, max_size=4),
                overuse=st.lists(st.sampled_from([0, 0, 1, 2]), min_size=4, max_size=4))
    def setup(self, n_gpus: int, sizes: list[int], per: list[int],
              allowed: list[list[str] | None], overuse: list[int]) -> None:
        gpus = tuple(f"gpu{i}" for i in range(n_gpus))
        rules = {}
        for name, k, devs in zip(NAMES, per, allowed, strict=True):
            devs = [d for d in devs if d in gpus] if devs else None
            k = min(k, len(devs) if devs else n_gpus)
            rules[name] = ModelRules(devices=devs or None, devices_per_instance=k)
        self.w = PlacedWorld(dict(zip(NAMES, sizes, strict=True)), rules=rules, gpus=gpus)
        # children that use more than measured: only what is seen protects the margin
        self.w.overuse = {m: g * GiB for m, g in zip(NAMES, overuse, strict=True)}

    @rule(model=st.sampled_from(NAMES))
    def acquire(self, model: str) -> None:
        self.next_ticket += 1
        self.open.append(self.next_ticket)
        self.w.run(self.w.p.acquire(self.next_ticket, model, self.w.now))

    @rule(i=st.integers(0, 50), cancel=st.booleans())
    def finish(self, i: int, cancel: bool) -> None:
        if self.open:
            t = self.open.pop(i % len(self.open))
            call = self.w.p.cancel if cancel else self.w.p.release
            self.w.run(call(t, self.w.now))

    @rule(i=st.integers(0, 3))
    def ready(self, i: int) -> None:
        loading = [m for m, r in self.w.p.state.models.items() if r.state is S.LOADING]
        if loading:
            self.w.ready(loading[i % len(loading)])

    @rule(i=st.integers(0, 3), rc=st.sampled_from([0, -9]))
    def exit(self, i: int, rc: int) -> None:
        running = [m for m, r in self.w.p.state.models.items() if r.state.is_running]
        if running:
            self.w.exited(running[i % len(running)], rc)

    @rule(i=st.integers(0, 3))
    def grow(self, i: int) -> None:
        running = sorted(self.w.actual)
        if running:
            use = self.w.actual[running[i % len(running)]]
            for d in use:
                use[d] += GiB // 2
            self.w.unreported = True

    @rule(external=st.sampled_from([0, 0, 1]))
    def report(self, external: int) -> None:
        self.w.external = external * GiB
        self.w.report()

    @rule(dt=st.sampled_from([0.5, 5.0]))
    def time_passes(self, dt: float) -> None:
        self.w.now += dt
        self.w.fire_timers()

    @invariant()
    def pruned_plans_are_the_plans(self) -> None:
        """The memory plan weighs only the places that may win (memory.py `bound`): it
        must choose what weighing every place chooses."""
        if self.w is None:
            return
        state = self.w.p.state
        victims = state.victims.ranked(state.models, self.w.now, state.resident_until)
        for rec in state.models.values():
            if rec.state is not S.UNLOADED:
                continue
            plans = [state.memory.plan(rec, state.models, victims, set(), exhaustive=full)
                     for full in (False, True)]
            pruned, every = ((p.verdict, p.devices, [v.name for v, _ in p.evict])
                             for p in plans)
            assert pruned == every, (rec.name, pruned, every)


PlacementMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("CORRAL_STATEFUL_EXAMPLES", "150")) // 3,
    stateful_step_count=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_placement_state_machine = PlacementMachine.TestCase


def test_a_batch_line_waiting_for_a_slot_a_pinned_model_holds_is_refused() -> None:
    """Found by the machine: a batch line for b waited for the only slot while a was
    running; a reload pinned a; the line, whose idle window rule skipped the refusal of
    every pinned-out entry, was never answered."""
    m = PolicyMachine()
    m.setup(models_max=1, sizes=[1, 1, 1, 1], rules=[ModelRules()] * 4, measured=False,
            intensity=0, keys=[(0, 0, 0, 0)] * 3, aging_s=0.0, preempt=False)
    m.acquire(autoload=True, key="", model="a")
    for _ in range(8):
        m.time_passes(dt=0.1)
    m.acquire(autoload=True, key="batch:k1", model="b")
    for _ in range(3):
        m.time_passes(dt=0.1)
    m.reload(model="a", remove=False, rules=ModelRules(pinned=True))
    m.consistent()
    m.teardown()
