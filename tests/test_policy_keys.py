"""Keys in the pure policy (issue 22): quotas, a key's max_concurrency, priority classes
with aging, and the fair share between keys of one class. Synchronous, a fake clock."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config.keys import BATCH_IDLE_S, Tenant
from actors.config.rules import ModelRules
from actors.messages import Grant, Refusal
from actors.policy import Policy
from actors.policy.records import Answer, Effect, Later, Spawn

BATCH, INTERACTIVE = 1, 10


class World:
    def __init__(self, tenants: dict[str, Tenant], models: str = "ab", models_max: int = 2,
                 aging_s: float = 0.0, max_concurrency: int = 0) -> None:
        self.p = Policy(models_max, tenants={"": Tenant(name=""), **tenants}, aging_s=aging_s)
        for m in models:
            self.p.add_model(m, 0.0, rules=ModelRules(max_concurrency=max_concurrency))
        self.now = 0.0
        self.answers: dict[object, object] = {}
        self.order: list[object] = []
        """Tickets in the order they were granted."""

    def run(self, effects: list[Effect]) -> None:
        for e in effects:
            if isinstance(e, Answer):
                self.answers[e.ticket] = e.value
                if isinstance(e.value, Grant):
                    self.order.append(e.ticket)
            elif isinstance(e, Spawn):
                pass
        self.p.check_invariants()

    def acquire(self, ticket: object, model: str, key: str = "", at: float | None = None,
                ) -> object:
        self.now = self.now + 1.0 if at is None else at
        self.run(self.p.acquire(ticket, model, self.now, True, key))
        return self.answers.get(ticket)

    def release(self, ticket: object, tokens: int = 0, at: float | None = None) -> None:
        self.now = self.now + 1.0 if at is None else at
        self.run(self.p.release(ticket, self.now, tokens=tokens))

    def ready(self, model: str) -> None:
        rec = self.p.state.models[model]
        self.run(self.p.children.instance_ready(model, rec.generation, 100, "x", 1, self.now))

    def serving(self, model: str) -> None:
        """Load `model` and leave it idle."""
        self.acquire(("warm", model), model)
        self.ready(model)
        self.release(("warm", model))
        self.order.clear()


def test_requests_per_min_is_exact_and_says_when_to_come_back() -> None:
    w = World({"k": Tenant(name="k", requests_per_min=3)})
    w.serving("a")
    for i in range(3):
        assert isinstance(w.acquire(i, "a", "k", at=10.0 + i), Grant)
        w.release(i, at=10.5 + i)
    refused = w.acquire("over", "a", "k", at=30.0)
    assert isinstance(refused, Refusal) and refused.status == 429
    assert refused.retry_after_s == pytest.approx(40.0)  # the first leaves the window at 70
    assert "requests_per_min 3" in refused.message and "key 'k'" in refused.message
    assert w.p.state.queue.waiters == {}, "a refused request is not queued"
    assert isinstance(w.acquire("late", "a", "k", at=70.0), Grant)
    assert w.p.state.stats.key_refusals == {("k", "requests_per_min"): 1}
    # another key, and no key, are not limited by k's budget
    assert isinstance(w.acquire("free", "a", "", at=70.5), Grant)


def test_tokens_per_min_counts_what_releases_report() -> None:
    w = World({"k": Tenant(name="k", tokens_per_min=100)})
    w.serving("a")
    w.acquire(1, "a", "k", at=10.0)
    w.release(1, tokens=60, at=11.0)
    assert isinstance(w.acquire(2, "a", "k", at=12.0), Grant)  # 60 < 100: one more may go
    w.release(2, tokens=50, at=13.0)
    refused = w.acquire(3, "a", "k", at=20.0)
    assert isinstance(refused, Refusal) and refused.status == 429
    # 110 used; below 100 once the 60 of t=11 leave the window, at 71
    assert refused.retry_after_s == pytest.approx(51.0)
    assert "tokens_per_min 100" in refused.message
    assert isinstance(w.acquire(4, "a", "k", at=71.0), Grant)


def test_a_key_at_its_max_concurrency_waits_without_holding_up_others() -> None:
    w = World({"k": Tenant(name="k", max_concurrency=2)})
    w.serving("a")
    assert isinstance(w.acquire(1, "a", "k"), Grant)
    assert isinstance(w.acquire(2, "a", "k"), Grant)
    assert w.acquire(3, "a", "k") is None, "third of k waits"
    assert isinstance(w.acquire("other", "a", ""), Grant), "another key is not held up"
    w.release(1)
    assert isinstance(w.answers[3], Grant)
    assert not w.p.state.queue.entries


def test_a_higher_class_is_served_first_fifo_within_it() -> None:
    w = World({"batch": Tenant(name="batch", level=BATCH),
               "inter": Tenant(name="inter", level=INTERACTIVE)}, max_concurrency=1)
    w.serving("a")
    w.acquire("busy", "a", "batch")
    for t in ("b1", "b2"):
        w.acquire(t, "a", "batch")
    for t in ("i1", "i2"):
        w.acquire(t, "a", "inter")
    for t in ("busy", "i1", "i2", "b1"):
        w.release(t)
    assert w.order == ["busy", "i1", "i2", "b1", "b2"]


def test_aging_serves_a_long_waiting_lower_class_before_fresh_higher_ones() -> None:
    w = World({"batch": Tenant(name="batch", level=BATCH),
               "inter": Tenant(name="inter", level=INTERACTIVE)}, max_concurrency=1,
              aging_s=10.0)
    w.serving("a")
    w.acquire("busy", "a", "inter", at=0.0)
    w.acquire("old-batch", "a", "batch", at=0.0)
    w.acquire("new-inter", "a", "inter", at=85.0)
    # at t=100: batch ranks 1 + 100/10 = 11, the interactive one 10 + 15/10 = 11.5
    w.release("busy", at=100.0)
    assert w.order[-1] == "new-inter"
    w.acquire("newer-inter", "a", "inter", at=100.0)
    # at t=101: batch 11.1, the fresh interactive 10.1: the batch request goes
    w.release("new-inter", at=101.0)
    assert w.order[-1] == "old-batch"


def test_keys_of_one_class_share_turns_and_a_latecomer_claims_no_backlog() -> None:
    keys = {k: Tenant(name=k, level=BATCH) for k in ("x", "y", "z")}
    w = World(keys, max_concurrency=1)
    w.serving("a")
    w.acquire("busy", "a", "x")
    for i in range(6):
        w.acquire(("x", i), "a", "x")
    for i in range(6):
        w.acquire(("y", i), "a", "y")
    served: list[object] = []
    for _ in range(4):
        w.release(w.order[-1])
        served.append(w.order[-1])
    assert [t[0] for t in served] == ["x", "y", "x", "y"], served  # turns, oldest first
    for i in range(4):
        w.acquire(("z", i), "a", "z")  # starts level with the least served, not at 0
    for _ in range(6):
        w.release(w.order[-1])
        served.append(w.order[-1])
    later = [t[0] for t in served[4:]]
    assert sorted(later[:3]) == ["x", "y", "z"] and sorted(later[3:]) == ["x", "y", "z"]


def test_the_entry_of_a_higher_class_claims_the_free_slot_first() -> None:
    w = World({"batch": Tenant(name="batch", level=BATCH),
               "inter": Tenant(name="inter", level=INTERACTIVE)}, models="abc",
              models_max=1)
    w.serving("a")
    w.acquire("hold", "a", "")
    w.acquire("b1", "b", "batch")  # came first
    w.acquire("c1", "c", "inter")
    w.release("hold")  # a is idle: it goes, for c's entry, not b's
    assert w.p.state.models["a"].state.value == "stopping"
    assert w.p.state.models["a"].last_eviction.for_model == "c"
    rec = w.p.state.models["a"]
    w.run(w.p.children.instance_exited("a", rec.generation, 0, "rc 0", w.now + 1))
    assert w.p.state.models["c"].state.value == "loading"
    assert w.p.state.models["b"].state.value == "unloaded"


def test_a_limited_key_gets_grants_the_front_does_not_share() -> None:
    w = World({"k": Tenant(name="k", requests_per_min=100), "free": Tenant(name="free")})
    w.serving("a")
    limited = w.acquire(1, "a", "k")
    free = w.acquire(2, "a", "free")
    assert isinstance(limited, Grant) and not limited.shareable
    assert isinstance(free, Grant) and free.shareable


def test_usage_of_the_keys_that_stay_survives_a_reload() -> None:
    w = World({"k": Tenant(name="k", requests_per_min=1), "gone": Tenant(name="gone")})
    w.serving("a")
    w.acquire(1, "a", "k", at=10.0)
    w.acquire(2, "a", "gone", at=10.0)
    w.p.state.tenants.replace({"": Tenant(name=""), "k": Tenant(name="k", requests_per_min=1)})
    assert w.p.state.tenants.usage["gone"].in_flight == 1, "kept while its request runs"
    w.release(2, at=11.0)
    w.p.state.tenants.replace({"": Tenant(name=""), "k": Tenant(name="k", requests_per_min=1)})
    assert "gone" not in w.p.state.tenants.usage
    refused = w.acquire(3, "a", "k", at=20.0)
    assert isinstance(refused, Refusal) and refused.status == 429


@settings(max_examples=200, deadline=None)
@given(levels=st.lists(st.sampled_from([0, 1, 5, 10]), min_size=10, max_size=160),
       aging_s=st.sampled_from([1.0, 3.0, 10.0]))
def test_no_request_starves_however_higher_classes_keep_coming(levels: list[int],
                                                                aging_s: float) -> None:
    """Two requests arrive and one is served each second, of classes drawn at random, so
    the queue grows. A waiter of level l that found `found` waiting is served within
    found + 2 (10 - l) aging_s + 1 seconds: requests that come later than (10 - l)
    aging_s after it rank below it from their start, and no more than twice that many
    come before."""
    names = {lv: f"c{lv}" for lv in (0, 1, 5, 10)}
    w = World({n: Tenant(name=n, level=lv, priority=n) for lv, n in names.items()},
              aging_s=aging_s, max_concurrency=1)
    w.serving("a")
    w.acquire("busy", "a", at=1.0)
    bound: dict[object, float] = {}
    served: dict[object, float] = {}
    held = "busy"
    for i in range(0, len(levels) - 1, 2):
        now = 2.0 + i // 2
        for j in (i, i + 1):
            found = len(w.p.state.queue.waiters)
            w.acquire(j, "a", names[levels[j]], at=now)
            bound[j] = now + found + 2 * (10 - levels[j]) * aging_s + 1
        w.release(held, at=now + 0.5)
        held = w.order[-1]
        served[held] = w.now
    while w.p.state.queue.waiters:  # the arrivals stop: the rest is served
        w.release(held, at=w.now + 1.0)
        held = w.order[-1]
        served[held] = w.now
    assert len(w.order) == 2 * (len(levels) // 2) + 1
    late = {t: (served[t], bound[t]) for t in bound if served[t] > bound[t]}
    assert not late, f"served past their bounds (at, bound): {late}"


def test_windows_exported_and_restored_keep_their_ages_and_the_time_away() -> None:
    from actors.policy.tenants import Tenants
    rules = {"k": Tenant(name="k", requests_per_min=3, tokens_per_min=100)}
    before = Tenants(rules)
    for at in (100.0, 130.0):
        before.take("k", at)
        before.granted("k")
        before.released("k", 40, at + 1)
    kept = before.export(140.0)
    after = Tenants(rules)
    after.restore(kept, 1000.0, away_s=10.0)  # another clock, 10 s later
    usage = after.usage["k"]
    assert list(usage.taken) == [pytest.approx(950.0), pytest.approx(980.0)]
    assert usage.spent_sum == 80
    over = after.over_quota("k", 1000.0)
    assert over is None  # 2 of 3 requests, 80 of 100 tokens
    after.take("k", 1000.0)
    assert after.over_quota("k", 1000.0) is not None
    assert after.over_quota("k", 1009.5) is not None and after.over_quota("k", 1010.5) is None


def test_a_plan_changes_nothing_in_the_policy_it_copies() -> None:
    import msgspec

    w = World({"k": Tenant(name="k", level=BATCH, requests_per_min=5)}, models="abc",
              models_max=1, max_concurrency=1)
    w.serving("a")
    w.acquire("busy", "a", "k")
    w.acquire("waiting", "a", "k")
    w.acquire("other", "b", "")
    before = msgspec.json.encode(w.p.snapshot(w.now))
    queue = dict(w.p.state.queue.waiters)
    records = dict(w.p.state.models)
    for model in "abc":
        for key in ("", "k"):
            w.p.plan(model, w.now, key)
    assert msgspec.json.encode(w.p.snapshot(w.now)) == before
    assert w.p.state.queue.waiters == queue and all(
        w.p.state.queue.waiters[t] is queue[t] for t in queue)
    assert all(w.p.state.models[m] is records[m] for m in records)
    assert len(w.p.state.tenants.usage["k"].taken) == 2, "a plan takes no request"
    w.p.check_invariants()


def test_a_key_at_its_limit_does_not_take_a_slot_for_a_model_it_waits_for() -> None:
    """Review finding: a waiter whose key is at its max_concurrency made the model load,
    evicting another's idle model, and then held the slot with nobody served."""
    w = World({"k": Tenant(name="k", max_concurrency=1)}, models="abc", models_max=2)
    w.serving("a")
    w.serving("c")
    w.acquire("k1", "a", "k")
    assert w.acquire("k2", "b", "k") is None
    assert {m: r.state.value for m, r in w.p.state.models.items()} == {
        "a": "loaded", "b": "unloaded", "c": "loaded"}, "nothing stops for a blocked key"
    assert isinstance(w.acquire("u", "c", ""), Grant), "c is still there for another"
    w.release("u")
    w.release("k1")  # k may go again: b is loaded for it, the LRU model evicted
    stopping = [m for m, r in w.p.state.models.items() if r.state.value == "stopping"]
    assert stopping == ["a"], stopping  # a's last grant is older than c's
    rec = w.p.state.models["a"]
    w.run(w.p.children.instance_exited("a", rec.generation, 0, "rc 0", w.now + 1))
    w.ready("b")
    assert isinstance(w.answers["k2"], Grant)


def test_a_reload_that_lifts_a_keys_limit_lets_its_waiters_go() -> None:
    w = World({"k": Tenant(name="k", max_concurrency=1)})
    w.serving("a")
    w.acquire("k1", "a", "k")
    assert w.acquire("k2", "a", "k") is None
    w.run(w.p.set_tenants({"": Tenant(name=""), "k": Tenant(name="k")}, 0.0, w.now + 1))
    assert isinstance(w.answers["k2"], Grant)
    w.acquire("k3", "a", "k")
    w.run(w.p.set_tenants({"": Tenant(name="")}, 0.0, w.now + 1))  # k removed: no limit
    assert isinstance(w.answers["k3"], Grant)


# ---------------------------------------------------------------- tokens carried (S5)


def token_window(charges: list[tuple[float, int]], limit: int, now: float,
                 ) -> tuple[bool, float]:
    """The reference for a key's token window, token by token (issue 37, S5): each token
    charged at c enters the window at the earliest when the one `limit` before it left,
    never before c, and leaves WINDOW_S after it entered. (Whether the window is full at
    `now`, and when it next has room: WINDOW_S after the `limit`-th newest entered.)"""
    from actors.policy.tenants import WINDOW_S
    entered: list[float] = []
    for at, tokens in charges:
        for _ in range(tokens):
            before = entered[-limit] + WINDOW_S if len(entered) >= limit else at
            entered.append(max(at, before))
    inside = sum(1 for e in entered if e > now - WINDOW_S)
    return inside >= limit, (entered[-limit] + WINDOW_S if len(entered) >= limit else now)


def test_a_long_answer_is_paid_for_a_minutes_worth_at_a_time() -> None:
    """Issue 37, S5: a key with tokens_per_min 100 got a 2000-token answer and was refused
    for only 60 s, so one such request a minute ran at 20 times its limit. Now the excess
    is carried: the key waits until it is paid for, 20 minutes, told by Retry-After."""
    w = World({"k": Tenant(name="k", tokens_per_min=100)})
    w.serving("a")
    w.acquire(1, "a", "k", at=10.0)
    w.release(1, tokens=2001, at=11.0)  # its answer ended: nothing was cut
    usage = w.p.state.tenants.usage["k"]
    assert (usage.spent_sum, usage.carried) == (100, 1901), "the window holds a minute's worth"
    refused = w.acquire(2, "a", "k", at=12.0)
    assert isinstance(refused, Refusal) and refused.status == 429
    assert refused.retry_after_s == pytest.approx(11.0 + 1200 - 12.0)
    assert "owes 1901 more" in refused.message and "tokens_per_min 100" in refused.message
    for minute in range(1, 20):  # each minute repays 100: the window never holds more
        at = 11.0 + 60 * minute + 0.5
        refused = w.acquire(("m", minute), "a", "k", at=at)
        assert isinstance(refused, Refusal), minute
        assert refused.retry_after_s == pytest.approx(11.0 + 1200 - at)
        assert usage.spent_sum == 100 and usage.carried == 1901 - 100 * minute
    assert isinstance(w.acquire(3, "a", "k", at=11.0 + 1200), Grant)
    assert usage.spent_sum == 1, "the last token of the answer"


def test_a_stream_charged_as_it_goes_holds_back_its_keys_next_request() -> None:
    """What a stream has used so far counts at once (Spend), so the key's next request is
    refused while the first still runs (it is never cut); its release settles the
    charge to the answer's own usage, which may give some back."""
    w = World({"k": Tenant(name="k", tokens_per_min=100)})
    w.serving("a")
    w.acquire(1, "a", "k", at=10.0)
    w.p.spend(1, 60, 11.0)
    assert isinstance(w.acquire(2, "a", "k", at=11.5), Grant), "60 of 100: one more goes"
    w.p.spend(1, 60, 12.0)
    w.p.spend("not a lease", 500, 12.0)  # a stale ticket: nothing to charge
    refused = w.acquire(3, "a", "k", at=12.5)
    assert isinstance(refused, Refusal) and refused.status == 429
    assert 1 in w.p.state.leases, "the stream in flight goes on"
    w.release(1, tokens=-30, at=13.0)  # its usage said 90 where the rule said 120
    usage = w.p.state.tenants.usage["k"]
    assert (usage.spent_sum, usage.carried) == (90, 0)
    assert isinstance(w.acquire(4, "a", "k", at=13.5), Grant)


def test_a_refund_comes_from_the_carry_first_then_the_newest() -> None:
    from actors.policy.tenants import Tenants
    t = Tenants({"k": Tenant(name="k", tokens_per_min=100)})
    t.charge("k", 70, 1.0)
    t.charge("k", 50, 2.0)  # 30 fit, 20 carried
    t.charge("k", -25, 3.0)
    usage = t.usage["k"]
    assert (list(usage.spent), usage.carried, usage.spent_sum) == ([(1.0, 70), (2.0, 25)], 0, 95)
    t.charge("k", -1000, 4.0)
    assert (list(usage.spent), usage.spent_sum) == ([], 0)


@settings(max_examples=300, deadline=None)
@given(limit=st.sampled_from([1, 7, 20, 100]),
       steps=st.lists(st.tuples(st.sampled_from([0.0, 0.5, 7.0, 30.0, 59.0, 61.0, 200.0]),
                                st.integers(0, 250)), min_size=1, max_size=25))
def test_the_token_window_is_the_token_by_token_reference(
        limit: int, steps: list[tuple[float, int]]) -> None:
    """At every step, refused exactly when the reference's window is full, and told to
    come back exactly when it next has room."""
    from actors.policy.tenants import Tenants
    t = Tenants({"k": Tenant(name="k", tokens_per_min=limit)})
    charges: list[tuple[float, int]] = []
    now = 0.0
    for dt, tokens in steps:
        now += dt
        t.charge("k", tokens, now)
        charges.append((now, tokens))
        for later in (now + 30.0, now + 0.25, now):  # a look ahead changes nothing
            probe = copy.deepcopy(t) if later > now else t
            full, free_at = token_window(charges, limit, later)
            over = probe.over_quota("k", later)
            assert (over is not None) == full, (later, charges)
            if over is not None:
                assert over.retry_after_s == pytest.approx(free_at - later, abs=1e-6)
            usage = probe.usage["k"]
            assert usage.spent_sum <= limit or not usage.carried
            assert usage.spent_sum == sum(n for _, n in usage.spent)


def test_a_carry_survives_a_restart() -> None:
    from actors.policy.tenants import Tenants
    rules = {"k": Tenant(name="k", tokens_per_min=100)}
    before = Tenants(rules)
    before.charge("k", 500, 100.0)
    kept = before.export(110.0)
    assert kept["k"].carried == 400
    after = Tenants(rules)
    after.restore(kept, 1000.0, away_s=5.0)
    over = after.over_quota("k", 1000.0)
    assert over is not None  # charged at 985 here: paid for by 985 + 300
    assert over.retry_after_s == pytest.approx(985.0 + 300 - 1000.0)


def test_a_batch_line_waits_below_every_class_however_long_it_waited() -> None:
    """`batch:KEY` (a batch's lines, issue 44) ranks below every class with aging on, and
    its entry claims no slot while another class's entry waits for one."""
    w = World({"low": Tenant(name="low", level=-5)}, models="abc", models_max=1,
              aging_s=1.0, max_concurrency=1)
    w.serving("a")
    w.acquire("busy", "a", "low", at=0.0)
    w.acquire("line", "a", "batch:low", at=0.0)
    w.acquire("late", "a", "", at=10_000.0)
    w.release("busy", at=10_001.0)
    assert w.order == ["busy", "late"], "the interactive request, come 10,000 s later"
    assert w.p.state.tenants.of("batch:low").max_concurrency == 0
    # b's batch line came first; c's request is of a class: c's entry claims the slot
    w.acquire("b-line", "b", "batch:", at=10_002.0)
    w.acquire("c-ask", "c", "", at=10_003.0)
    w.release("late", at=10_004.0)
    w.release("line", at=10_005.0)
    models = w.p.state.models
    assert models["a"].state.value == "stopping"
    assert [why for _, why in models["c"].room] == ["stop a"] and not models["b"].room, \
        "a stops for c, not for b's line"


def test_a_batch_line_makes_room_only_in_the_idle_window_of_the_others() -> None:
    """A model a request of a class used less than BATCH_IDLE_S ago stays for a batch's
    line; a Repump comes when the window opens, and then it goes (issue 44)."""
    w = World({}, models="ab", models_max=1)
    w.serving("a")  # used at t=3
    w.acquire("ask", "a", "", at=100.0)
    w.release("ask", at=101.0)
    effects = w.p.acquire("line", "b", 110.0, True, "batch:")
    w.run(effects)
    models = w.p.state.models
    assert models["a"].state.value == "loaded" and "line" not in w.answers
    later = [e for e in effects if isinstance(e, Later)]
    assert any(abs(e.delay_s - (100.0 + BATCH_IDLE_S - 110.0)) < 1e-6 for e in later), later
    w.run(w.p.repump(100.0 + BATCH_IDLE_S))
    assert models["a"].state.value == "stopping", "the window is open: a goes for the line"
    # a line's own use opens no window: the next batch's model may evict b at once
    assert models["b"].asked_at == 0.0


def test_a_batch_lines_kept_grant_is_no_use_of_a_class() -> None:
    """A front keeps a batch line's grant a while (http.lease_linger_ms): its release,
    with the time kept, leaves the model's last use by a class where it was."""
    w = World({}, models="a", models_max=1)
    w.serving("a")
    asked = w.p.state.models["a"].asked_at
    w.acquire("line", "a", "batch:", at=50.0)
    w.run(w.p.release("line", 52.0, idle_s=1.0))
    assert w.p.state.models["a"].asked_at == asked
    w.acquire("ask", "a", "", at=60.0)
    w.run(w.p.release("ask", 70.0, idle_s=2.0))
    assert w.p.state.models["a"].asked_at == 68.0
