"""The plain paths (actors/policy/plain.py): where a feature applies, each declines before
it changes anything, and the general path decides what it always did. The twins
(tests/test_policy_twins.py) show that where they decide, they decide the same; these
cases are the guards the twins' random worlds seldom or never reach, the last seven a
hostile review's (each guard or step they cover, removed, failed none of the others):
a policy with its plain paths and one without decide alike, effect for effect, and hold
the same state, compared deep."""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import random
import types
from collections.abc import Callable

import msgspec
import pytest

from actors.config.keys import Tenant
from actors.config.rules import SESSION, ModelGroup, ModelRules, Replicas
from actors.messages import Grant, Refusal
from actors.policy import Policy
from actors.policy.order import ClassOrder
from actors.policy.plain import Plain
from actors.policy.quiet import fingerprint
from actors.policy.records import Answer, Effect


def loading(rules: ModelRules | None = None, preempt: bool = False) -> Policy:
    """`a` loads for one keyless waiter; `b` serves one request."""
    p = Policy(2, tenants={"": Tenant(name="")}, preempt=preempt)
    for m in "ab":
        p.add_model(m, 0.0, rules=rules or ModelRules(queue_timeout_s=30.0))
    p.acquire("w0", "a", 1.0)
    p.acquire("b0", "b", 1.0)
    p.children.instance_ready("b", p.state.models["b"].generation, 1, "h", 2, 1.1)
    return p


def test_the_plain_paths_decide_the_usual_requests() -> None:
    p = loading()
    assert p.plain.queue("w1", "a", 2.0, True, False, 0) is not None
    assert p.state.queue.waiters["w1"].model == "a"
    out = p.plain.grant("g", "b", 2.0)
    assert out is not None and isinstance(out[0], Answer) and isinstance(out[0].value, Grant)
    assert p.plain.release("g", 2.5, False, 0.0) is not None and "g" not in p.state.leases


def session_waits(p: Policy) -> Policy:
    p.acquire("w0s", "a", 1.5, affinity=SESSION + 2)  # (an entry with a session's order)
    return p


GUARDS: dict[str, tuple[Callable[[], Policy], bool, int]] = {
    "autoload off": (loading, False, 0),  # (the model, autoload, the prompt's hash)
    "a session's prompt": (loading, True, SESSION + 1),
    "behind a session's": (lambda: session_waits(loading()), True, 0),
    "cuts on": (lambda: loading(preempt=True), True, 0),
    "a full queue": (lambda: loading(ModelRules(queue_timeout_s=30.0, queue_max=1)), True, 0),
}


@pytest.mark.parametrize("case", sorted(GUARDS))
def test_a_queued_request_a_feature_applies_to_is_the_general_path_s(case: str) -> None:
    make, autoload, affinity = GUARDS[case]
    p = make()
    before = (fingerprint(p.state), list(p.state.queue.waiters), p.state.stats.granted)
    assert p.plain.queue("w1", "a", 2.0, autoload, False, affinity) is None
    assert (fingerprint(p.state), list(p.state.queue.waiters), p.state.stats.granted) == before
    out = p.acquire("w1", "a", 2.0, autoload, affinity=affinity)
    if case == "a full queue":  # the general path refuses it
        assert isinstance(out[0], Answer) and isinstance(out[0].value, Refusal)
        assert out[0].value.status == 503 and "queue_max 1" in out[0].value.message
    else:  # and queues the others (a model on its way is worth a wait without autoload)
        assert list(p.state.queue.entries["a"].waiters)[-1] == "w1"


def test_a_request_for_a_model_that_backs_off_is_the_general_path_s() -> None:
    """The general path refuses one whose patience the backoff outlasts (step 5 of
    `acquire`): the plain path declines every request while the breaker is open."""
    p = Policy(2, tenants={"": Tenant(name="")})
    p.add_model("a", 0.0, rules=ModelRules(queue_timeout_s=30.0))
    rec, now = p.state.models["a"], 1.0
    while not rec.breaker.is_open(now):  # (the first failures retry at once)
        p.acquire(("w", now), "a", now)
        p.children.instance_exited("a", rec.generation, 1, "crashed", now)
        now += 0.1
    p.acquire("w", "a", now)  # (waits out the backoff: its patience is longer)
    assert "a" in p.state.queue.entries and rec.breaker.is_open(now)
    before = (fingerprint(p.state), list(p.state.queue.waiters))
    assert p.plain.queue("w2", "a", now, True, False, 0) is None
    assert (fingerprint(p.state), list(p.state.queue.waiters)) == before
    p.acquire("w2", "a", now)
    assert list(p.state.queue.entries["a"].waiters) == ["w", "w2"]


# ------------------------------------------------------------ a hostile review's cases

def state_of(p: Policy) -> object:
    """Everything a policy holds, deep (but the plain paths themselves and the classes'
    order, a cache of the queue's): what a decision may have changed."""
    seen: set[int] = set()

    def walk(x: object) -> object:
        if x is None or isinstance(x, (bool, int, float, str, bytes, enum.Enum)):
            return x
        if isinstance(x, (types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                          logging.Logger, type, Plain, ClassOrder)):
            return "-"
        if isinstance(x, (msgspec.Struct, itertools.count, random.Random)):
            return repr(x) if not isinstance(x, random.Random) else hash(x.getstate())
        if id(x) in seen:
            return ("seen", type(x).__name__)
        seen.add(id(x))
        if isinstance(x, dict):
            return tuple((walk(k), walk(v)) for k, v in x.items())
        if isinstance(x, (list, tuple, collections.deque)):
            return tuple(walk(v) for v in x)
        if isinstance(x, (set, frozenset)):
            return tuple(sorted(repr(walk(v)) for v in x))
        fields = dict(getattr(x, "__dict__", {}))
        for cls in type(x).__mro__:
            fields.update({s: getattr(x, s) for s in getattr(cls, "__slots__", ())
                           if hasattr(x, s)})
        return (type(x).__name__, tuple((k, walk(v)) for k, v in fields.items()))
    return walk(p)


def pair(make: Callable[[], Policy]) -> tuple[Policy, Policy]:
    """Two policies made alike, the second without its plain paths."""
    on, off = make(), make()
    off.plain.grant = off.plain.queue = lambda *a, **k: None  # type: ignore[method-assign]
    off.plain.release = lambda *a, **k: None  # type: ignore[method-assign]
    return on, off


def same(ps: tuple[Policy, Policy], call: Callable[[Policy], list[Effect]]) -> list[Effect]:
    on, off = ps
    a, b = call(on), call(off)
    assert a == b
    assert state_of(on) == state_of(off)
    return a


def serving(p: Policy, m: str, now: float, n: int = 2, tickets: str = "") -> None:
    """`m` serves `n` keyless requests (tickets m0, m1, ..., or `tickets`0, ...)."""
    p.acquire(f"{tickets or m}0", m, now)
    p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, now + 0.1)
    for i in range(1, n):
        p.acquire(f"{tickets or m}{i}", m, now + 0.2)


def test_a_shared_release_moves_the_model_s_last_use_as_the_general_path_does() -> None:
    ps = pair(lambda: Policy(2))
    for p in ps:
        p.add_model("a", 0.0)
        serving(p, "a", 0.0, 3)
    same(ps, lambda p: p.release("a1", 5.0, shared=True))
    same(ps, lambda p: p.release("a2", 6.0, idle_s=0.5))


def test_a_remote_model_after_shutdown_is_refused_not_granted() -> None:
    ps = pair(lambda: Policy(2))
    for p in ps:
        p.add_model("r", 0.0, rules=ModelRules(remote=True))
        p.acquire("r0", "r", 0.0)
        p.shutdown(1.0)
    out = same(ps, lambda p: p.acquire("r1", "r", 2.0))
    assert isinstance(out[0], Answer) and isinstance(out[0].value, Refusal)


def test_with_prefetch_on_the_general_path_decides() -> None:
    ps = pair(lambda: Policy(2, prefetch=True))
    for p in ps:
        p.add_model("a", 0.0)
        p.add_model("b", 0.0)
        serving(p, "a", 0.0)
    same(ps, lambda p: p.acquire("a9", "a", 1.0))
    same(ps, lambda p: p.release("a1", 2.0))


def test_a_together_partner_s_release_counts_for_both() -> None:
    ps = pair(lambda: Policy(3))
    for p in ps:
        for m in "cd":
            p.add_model(m, 0.0)
        p.set_groups({"t": ModelGroup(models=["c", "d"], together=True)}, 0.0)
        p.acquire("c0", "c", 0.0)
        for m in "cd":
            p.children.instance_ready(m, p.state.models[m].generation, 1, "h", 1, 0.1)
        p.acquire("c1", "c", 0.2)
    same(ps, lambda p: p.release("c1", 5.0))


def test_a_lease_of_a_crashed_child_does_not_count_on_its_successor() -> None:
    ps = pair(lambda: Policy(2))
    for p in ps:
        p.add_model("a", 0.0)
        serving(p, "a", 0.0)
        p.children.instance_exited("a", p.state.models["a"].generation, 1, "crash", 1.0)
        serving(p, "a", 40.0, tickets="n")  # (its next child, two requests on it)
    same(ps, lambda p: p.release("a1", 41.0))


def test_a_child_retiring_for_a_reload_takes_no_more_requests() -> None:
    ps = pair(lambda: Policy(2))
    for p in ps:
        p.add_model("a", 0.0)
        serving(p, "a", 0.0)
        p.children.reconfigure({}, [], {"a": ModelRules(make_before_break=False,
                                                         min_resident_s=1.0)}, 1.0)
        assert p.state.models["a"].retiring and not p.state.groups.alternates
    same(ps, lambda p: p.acquire("x", "a", 2.0))


def test_a_request_queued_for_a_model_with_copies_may_want_one_more() -> None:
    copies = Replicas(min=1, max=2, target_in_flight=1, scale_up_after_s=1.0)
    ps = pair(lambda: Policy(3))
    for p in ps:
        p.add_model("a", 0.0, rules=ModelRules(queue_timeout_s=30.0, replicas=copies))
        p.acquire("w0", "a", 0.0)
        p.acquire("w1", "a", 0.1)
    same(ps, lambda p: p.acquire("w2", "a", 5.0))


def test_a_request_during_a_reload_s_handover_goes_where_the_general_path_sends_it() -> None:
    ps = pair(lambda: Policy(3))
    for p in ps:
        p.add_model("b", 0.0)
        serving(p, "b", 0.0)
        p.children.reconfigure({}, [], {"b": ModelRules(min_resident_s=1.0)}, 1.0)
        assert p.state.groups.alternates  # (its newcomer loads beside it)
    same(ps, lambda p: p.acquire("x", "b", 1.5))
    for p in ps:
        p.children.instance_ready("b@next", 2, 2, "h", 2, 2.0)
    out = same(ps, lambda p: p.acquire("y", "b", 2.5))
    assert isinstance(out[0], Answer) and isinstance(out[0].value, Grant)
