"""Runs of the rules skipped after decisions that leave them nothing to decide
(actors/policy/quiet.py, issue 43). Every policy the tests drive runs the rules anyway
where they would be skipped and asserts they changed nothing (tests/conftest.py); here,
besides, a policy that skips decides what one that never skips does, step by step, and
the three decisions a review found the first version of the skip changing are made."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.config.keys import Tenant
from actors.config.rules import ModelRules
from actors.messages import Grant, Repump, Revoke
from actors.policy import Policy
from actors.policy.quiet import Quiet, fingerprint
from actors.policy.records import Answer, Effect, Later, Spawn

MODELS = "abcd"


def world(quiet: bool, models_max: int = 2) -> Policy:
    p = Policy(models_max, tenants={"": Tenant(name=""),
                                    "k": Tenant(name="k", max_concurrency=1)})
    for m in MODELS:
        p.add_model(m, 0.0, pinned=m == "d", rules=ModelRules(queue_timeout_s=30.0))
    p.quiet.on = quiet
    return p


def decided(effects: list[Effect]) -> list[Any]:
    """What a step decided (all of it: a grant revoked as it is made is a rule of both)."""
    return effects


OPS = st.lists(st.tuples(st.sampled_from(["acquire", "cancel", "release", "ready", "exit"]),
                         st.integers(0, 3), st.sampled_from(["", "", "k"])),
               min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_a_policy_that_skips_decides_what_one_that_never_skips_does(ops: list[Any]) -> None:
    on, off = world(True), world(False)
    tickets: list[int] = []
    now = 0.0
    for n, (op, i, key) in enumerate(ops):
        now += 0.5
        model = MODELS[i]
        steps: list[list[Effect]] = []
        for p in (on, off):
            if op == "acquire":
                steps.append(p.acquire(n, model, now, True, key))
            elif op in ("cancel", "release") and tickets:
                t = tickets[i % len(tickets)]
                steps.append(p.cancel(t, now) if op == "cancel" else p.release(t, now))
            elif op in ("ready", "exit"):
                rec = p.state.models[model]
                steps.append(p.children.instance_ready(model, rec.generation, 1, "h", 1, now)
                             if op == "ready" else
                             p.children.instance_exited(model, rec.generation, 0, "exit", now))
            p.check_invariants()
        if op == "acquire":
            tickets.append(n)
        elif op in ("cancel", "release") and tickets:
            tickets.remove(tickets[i % len(tickets)])
        if steps:
            assert decided(steps[0]) == decided(steps[1]), (op, model, key)
    assert on.state.leases == off.state.leases
    assert list(on.state.queue.waiters) == list(off.state.queue.waiters)


def busy_world() -> tuple[Policy, list[Effect]]:
    """a and b serve, each with a request on it; c's waiter needs one of their slots."""
    p = world(True)
    out: list[Effect] = []
    for m in "ab":
        p.acquire(("hold", m), m, 0.0)
        out += p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, 0.0)
    out += p.acquire(("w", 0), "c", 1.0)
    out += p.acquire(("w", 1), "c", 1.2)  # (a join: no first waiter's leave below)
    for at in (1.5, 1.6):  # (the Later its turn asked for: the held model's withdrawal,
        out += p.repump(at)  # after which a run changes nothing: the rules rest)
    assert any(type(e).__name__ == "Withdraw" for e in out) and p.state.rested
    return p, out


def test_the_bench_s_decisions_skip_the_rules_and_a_grant_kept_idle_is_revoked_as_made() -> None:
    p, _ = busy_world()
    assert p.state.revoking and p.state.rested
    assert p.state.turn is not None and p.state.turn.held  # (c's turn holds one of them)
    free = next(m for m in "ab" if m not in p.state.turn.held)
    skipped = p.quiet.skipped
    out = p.acquire("g", free, 2.0)
    grant = next(e.value for e in out if isinstance(e, Answer))
    assert isinstance(grant, Grant) and grant.shareable
    assert Revoke(grants=((free, grant.generation),)) in out  # as the rules' run would
    assert not p.state.revocable
    p.release("g", 2.5)
    p.acquire(("w", 2), "c", 3.0)  # joins
    p.cancel(("w", 2), 3.5)  # leaves from the middle
    assert p.quiet.skipped == skipped + 3  # (the grant at once ran no rules: none skipped)
    # the first waiter leaving is no quiet decision: c's turn starts from the next one
    p.cancel(("w", 0), 3.7)
    assert p.quiet.skipped == skipped + 3 and p.state.turn is not None
    assert p.state.turn.since == 1.2  # (w1's arrival)
    # a release that leaves a model idle is no quiet decision: it is evicted for c
    out = p.release(("hold", free), 4.0)
    assert p.state.models[free].state.name == "STOPPING", out


def test_a_grant_that_puts_its_key_at_its_limit_runs_the_rules() -> None:
    """The review's first: a grant made at once can put its key at its max_concurrency,
    after which an entry only that key waits in needs no slot, and the one behind it may
    load. A keyed grant is no quiet decision: the next one runs the rules."""
    p, _ = busy_world()
    free = next(m for m in "ab" if p.state.turn is None or m not in p.state.turn.held)
    assert p.state.rested
    p.acquire(("k", 0), free, 2.0, True, "k")
    assert ("k", 0) in p.state.leases and not p.state.rested
    skipped = p.quiet.skipped
    p.acquire(("w", 2), "c", 3.0)  # would join quietly, but the rules have not rested
    assert p.quiet.skipped == skipped and p.state.rested


def test_a_run_that_fills_the_last_slot_is_no_rest() -> None:
    """The review's second: a run of the rules that spawns is no fixed point (claim fills
    the last slot with a pinned model; the refusal of what can never be served waits for
    the next run), so the next decision runs them again."""
    p = world(True, models_max=1)
    p.acquire(("pin", 0), "d", 0.0)  # d, pinned, takes the only slot
    assert not p.state.rested
    out = p.acquire(("w", 0), "a", 0.5)  # a waits behind a pinned model: refused
    assert any(isinstance(e, Answer) and not isinstance(e.value, Grant) for e in out) \
        or ("w", 0) in p.state.queue.waiters
    assert not any(isinstance(e, Spawn) and e.model == "a" for e in out)


def test_the_tests_check_every_skip() -> None:
    assert Quiet.CHECK and world(True).quiet.check


def test_a_grant_made_while_nobody_waits_is_kept() -> None:
    """Nobody waits for a slot: the front may keep the grant idle (a lease), as before."""
    p = world(True)
    p.acquire(("hold", "a"), "a", 0.0)
    p.children.instance_ready("a", p.state.models["a"].generation, 1, "h", 1, 0.0)
    p.repump(0.5)
    out = p.acquire("g", "a", 1.0)
    assert not any(isinstance(e, Revoke) for e in out)
    assert ("a", p.state.models["a"].generation) in p.state.revocable


def levels_world(quiet: bool) -> list[Effect]:
    """The review's: a waiter leaving from the middle of a wait can end a class level,
    which takes the queue's order from ranks (aged) back to arrival, and so who claims a
    free slot: a's entry, here."""
    p = Policy(3, tenants={"": Tenant(name="")}, aging_s=10.0)
    for m in "abc":  # (max_concurrency: no grant is kept idle, nothing revocable)
        p.add_model(m, 0.0, rules=ModelRules(max_concurrency=4))
    p.quiet.on = quiet
    for m in "abc":
        p.acquire(("up", m), m, 0.0)
        p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, 0.0)
    p.release(("up", "a"), 0.5)
    p.release(("up", "b"), 0.5)
    p.unload("ua", "a", 1.0)
    p.unload("ub", "b", 1.0)
    p.acquire("a1", "a", 2.0)
    p.acquire("b1", "b", 3.0)
    p.acquire("a2", "a", 4.0)
    p.cancel("a1", 4.5)  # a's first waiter (4.0) is newer than b's (3.0)
    p.set_tenants({"": Tenant(name="", level=1)}, 10.0, 5.0)  # keyless requests rank 1
    p.acquire("w", "a", 5.5)  # two levels wait: by rank, b's entry goes first
    p.children.instance_exited("a", p.state.models["a"].generation, 0, "stopped", 6.0)
    p.set_tenants({"": Tenant(name="", level=1)}, 10.0, 6.1)  # (b waits for its exit)
    return p.cancel("w", 6.5)  # one level again: by arrival, a's entry loads


def test_a_waiter_that_ends_a_class_level_is_no_quiet_leave() -> None:
    for quiet in (False, True):
        assert any(isinstance(e, Spawn) and e.model == "a" for e in levels_world(quiet))


def test_a_run_that_sets_a_warm_retry_is_no_rest() -> None:
    """The review's: a warm-up with no slot sets when to try again, with no effect; the
    next run asks for a Repump for then, which a skip would have left out."""
    p = Policy(1)
    p.add_model("a", 0.0, pinned=True)  # (a pinned model's grants are not kept idle)
    p.add_model("w", 0.0, rules=ModelRules(warm=True))
    p.acquire("r1", "a", 0.0)
    p.children.instance_ready("a", p.state.models["a"].generation, 1, "h", 1, 1.0)
    assert p.state.warm_after == 1.5 and not p.state.warm_due and not p.state.rested
    p.acquire("r2", "a", 1.1)
    out = p.release("r2", 1.2)
    assert any(isinstance(e, Later) and isinstance(e.message, Repump) for e in out), out


def spent_world(quiet: bool) -> Policy:
    """a's turn is spent, and no turn is had: a stops (its slot comes back by itself, so
    nothing is evicted for its waiters w1 and w2), b, idle, is what their turn holds (its
    last use is the oldest of those up), and the turn is spent at once; c's load, killed
    by a signal, gives back a slot (no turn is had while one is free: turns.py `find`),
    which c, whose entry is ahead of a's, takes again once its backoff ends."""
    p = Policy(3, 0, 60.0)  # (restart intensity 0: one kill opens the breaker)
    for m in "abc":  # (max_concurrency: no grant is kept idle, nothing revocable)
        p.add_model(m, 0.0, rules=ModelRules(max_concurrency=4))
    p.quiet.on = quiet
    for at, m in enumerate("abc", 1):  # (each used once: b's last use before c's)
        p.acquire(m, m, float(at))
        p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, at + 0.1)
        p.release(m, at + 0.2)
    p.unload("ua", "a", 4.0)
    p.unload("uc", "c", 4.0)
    p.children.instance_exited("c", p.state.models["c"].generation, 0, "stopped", 5.0)
    p.acquire("wc", "c", 6.0)
    p.acquire("w1", "a", 7.0)
    p.acquire("w2", "a", 8.0)
    out = p.children.instance_exited("c", p.state.models["c"].generation, -9, "killed", 9.0)
    assert Later(1.0, Repump()) in out  # (its backoff; wc waits on: a kill gets two more tries)
    p.repump(10.0)  # c loads again
    p.repump(11.0)  # (a run that changes nothing: the rules rest)
    p.check_invariants()
    return p


def test_the_first_waiter_of_a_spent_turn_s_entry_leaving_runs_the_rules() -> None:
    """A turn starts from its entry's first waiter (turns.py `since`): with that one gone,
    a's turn is a new one, no longer the one spent, and the rules' next run gives it to a
    (and withdraws b's grants again). A skip would leave that to some later decision."""
    on, off = spent_world(True), spent_world(False)
    for p in (on, off):
        s = p.state
        assert s.turn is None and s.spent is not None and s.spent.model == "a"
        assert s.spent.held == {"b"} and s.spent.since == s.queue.waiters["w1"].queued_at
        assert list(s.queue.entries["a"].waiters) == ["w1", "w2"]
        assert not s.queue.waiters["w1"].key and not s.queue.waiters["w2"].key
        assert [r.state.value for r in s.models.values()] == ["stopping", "loaded", "loading"]
        assert s.rested and not s.revocable and not s.cuts.of  # (but for w1, a quiet leave)
    assert fingerprint(on.state) == fingerprint(off.state)
    spent = off.state.spent
    on.quiet.check = False  # (the twin's effects, not the tests' check, tell a skip)
    skipping, plain = on.cancel("w1", 12.0), off.cancel("w1", 12.0)
    assert (off.state.turn, off.state.spent) != (None, spent)  # (a's turn, anew)
    assert skipping == plain
    assert on.state.turn == off.state.turn
    assert fingerprint(on.state) == fingerprint(off.state)
