"""ctx = "fit" at its edges (issue 44, part 3): a model alone on its device gets only
the context that fits; a row one measurement lacks, or a whole one measurement does not
split, never shrinks the need; the measurement cache knows the context; a waiting fit
model is planned no more often than a fixed one; fit with one figure is refused."""

from __future__ import annotations

from actors.config.model import ModelConfig
from actors.config.rules import ModelRules
from actors.ledger import Breakdown, DeviceUse
from actors.measure import MeasureCache
from actors.policy.context import at_ctx
from tests.test_policy_context import FIT, kv, spawned_ctx
from tests.test_policy_memory import GiB, MemWorld


def test_alone_on_an_empty_device_it_still_gets_only_what_fits() -> None:
    """Nothing else up: the plan at ctx_max is "go" with a "loading anyway" note, and
    choose() takes it: ctx_max (1 + 0.3*32 = 10.6 GiB) on 9 GiB usable, though 28k fits."""
    w = MemWorld({"b": 1.0}, rules={"b": FIT}, measured=False)
    w.run(w.p.children.measured("b", True, kv(512, 0.3), kv(32768, 0.3), 0.0))
    w.report()
    got = spawned_ctx(w, "b1", "b")
    assert got is not None and got <= 27306, f"loaded at {got} context: overshoots 9 GiB"


def test_a_row_only_the_least_measurement_has_is_kept() -> None:
    """A device (or host row) only in `min`: at_ctx drops it, so the need shrinks."""
    low = Breakdown(512, [DeviceUse(kind="device", name="gpu0", model=GiB),
                          DeviceUse(kind="device", name="gpu1", model=GiB)])
    high = Breakdown(32768, [DeviceUse(kind="device", name="gpu0", model=GiB,
                                       context=8 * GiB)])
    got = {r.name for r in at_ctx(low, high, 512).devices}
    assert got == {"gpu0", "gpu1"}, f"rows at 512: {got}"


def test_split_in_max_only_does_not_shrink_the_least() -> None:
    """`min` reports its whole as `model` (no split), `max` splits weights/KV: at the
    min's own context at_ctx gives max's weights alone, less than min measured."""
    low = Breakdown(512, [DeviceUse(kind="device", name="gpu0", model=3 * GiB)])
    high = Breakdown(32768, [DeviceUse(kind="device", name="gpu0", model=2 * GiB,
                                       context=8 * GiB)])
    got = at_ctx(low, high, 512).devices[0].self_bytes
    assert got >= 3 * GiB, f"at 512: {got / GiB:.2f} GiB, measured 3 GiB"


def test_measure_cache_key_depends_on_ctx() -> None:
    """{ctx} stays literal in the cache key: a changed ctx (or ctx_max) reuses the old
    measurement, whose figures are for another context."""
    cmd = ["python", "-m", "actors.fake_model", "--port", "{port}", "--n-ctx", "{ctx}"]
    small = ModelConfig(cmd=cmd, ctx=4096)
    large = ModelConfig(cmd=cmd, ctx=65536)
    assert MeasureCache.key("m", small, ["gpu0"]) != MeasureCache.key("m", large, ["gpu0"])
    fit1 = ModelConfig(cmd=cmd, ctx="fit", ctx_max=8192)
    fit2 = ModelConfig(cmd=cmd, ctx="fit", ctx_max=131072)
    assert MeasureCache.key("m", fit1, ["gpu0"]) != MeasureCache.key("m", fit2, ["gpu0"])


def _count_plans(w: MemWorld, model: str, n: int) -> int:
    from actors.policy.memory import Memory
    calls = [0]
    real = Memory._plan

    def counted(self, rec, *a, **k):  # type: ignore[no-untyped-def]
        if rec.name == model:
            calls[0] += 1
        return real(self, rec, *a, **k)

    Memory._plan = counted  # type: ignore[method-assign]
    try:
        for i in range(n):
            w.acquire(f"{model}-more{i}", model)
    finally:
        Memory._plan = real  # type: ignore[method-assign]
    return calls[0]


def _waiting_on_a_stop(rules: ModelRules) -> MemWorld:
    """a (8 GiB) up and idle; b asked: a is evicted for it, and b waits for a's exit."""
    w = MemWorld({"a": 8.0, "b": 1.0}, rules={"b": rules}, measured=False)
    w.run(w.p.children.measured("a", True, kv(512, 0, 8.0), kv(512, 0, 8.0), 0.0))
    w.run(w.p.children.measured("b", True, kv(512), kv(32768), 0.0))
    w.acquire("a1", "a")
    w.ready("a")
    w.release("a1")
    w.acquire("b1", "b")
    assert [e.model for e in w.evictions()] == ["a"]
    assert w.p.state.models["b"].state.value == "unloaded"
    return w


def test_a_fit_model_waiting_for_a_stop_re_plans_no_more_than_a_fixed_one() -> None:
    """Memory.plan's `waits` memo keys on rec.n_ctx; choose() moves n_ctx through ~10
    values per decision, so the memo never hits: every request for a queued ctx = "fit"
    model costs ~10 full plans where a fixed-context one costs 0."""
    fixed = _count_plans(_waiting_on_a_stop(ModelRules()), "b", 20)
    fit = _count_plans(_waiting_on_a_stop(FIT), "b", 20)
    assert fit <= fixed + 20, f"full plans for 20 requests: fixed {fixed}, fit {fit}"


def test_fit_with_one_figure_is_refused_or_said() -> None:
    """ctx = "fit" with memory_mib (declared: min == max, n_ctx 0) can never be sized:
    it silently always loads with ctx_max. ctx_problem accepts it."""
    from actors.config.context import ctx_problem
    cmd = ["srv", "-c", "{ctx}", "--port", "{port}"]
    m = ModelConfig(cmd=cmd, ctx="fit", ctx_max=32768, memory_mib={"gpu0": 4096})
    assert m.measure_method == "declared"
    assert ctx_problem(m, m.cmd, m.measure_method) is not None, "accepted: fit with one figure"
