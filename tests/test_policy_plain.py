"""The plain paths (actors/policy/plain.py): where a feature applies, each declines before
it changes anything, and the general path decides what it always did. The twins
(tests/test_policy_twins.py) show that where they decide, they decide the same; these
cases are the guards the twins' random worlds seldom or never reach."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from actors.config.keys import Tenant
from actors.config.rules import SESSION, ModelRules
from actors.messages import Grant, Refusal
from actors.policy import Policy
from actors.policy.quiet import fingerprint
from actors.policy.records import Answer


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
