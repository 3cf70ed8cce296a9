"""A model's context chosen as it loads (issue 44, part 3: `ctx = "fit"`), in the pure
policy on a 10 GiB device (1 GiB margin): the most that fits beside what is up, within
ctx_min..ctx_max; ctx_min, making room, only when not even that fits; what it gave up
said in the plan."""

from __future__ import annotations

from actors.config.rules import ModelRules
from actors.ledger import Breakdown, DeviceUse
from actors.policy.context import at_ctx, from_slope
from actors.policy.records import Spawn
from tests.test_policy import World
from tests.test_policy_memory import GiB, MemWorld

FIT = ModelRules(ctx_fit=(2048, 32768))


def kv(n_ctx: int, gib_per_1k: float = 0.25, weights_gib: float = 1.0) -> Breakdown:
    """A model of `weights_gib` whose KV cache takes `gib_per_1k` a 1,024 tokens."""
    return Breakdown(n_ctx=n_ctx, devices=[DeviceUse(
        kind="device", name="gpu0", model=int(weights_gib * GiB),
        context=int(gib_per_1k * GiB * n_ctx / 1024))])


def world(a_gib: float) -> MemWorld:
    """`a` (a_gib) up and just used; `b` fits (1 GiB of weights, 0.25 GiB per 1k)."""
    w = MemWorld({"a": a_gib, "b": 1.0}, rules={"b": FIT}, measured=False)
    w.run(w.p.children.measured("a", True, kv(512, 0, a_gib), kv(512, 0, a_gib), 0.0))
    w.run(w.p.children.measured("b", True, kv(512), kv(32768), 0.0))
    w.acquire("a1", "a")
    w.ready("a")
    w.release("a1")
    return w


def spawned_ctx(w: MemWorld, ticket: str, model: str) -> int | None:
    effects = w.run(w.p.acquire(ticket, model, w.tick(), True, ""))
    return next((e.n_ctx for e in effects if isinstance(e, Spawn) and e.model == model), None)


def test_the_line_through_two_measurements() -> None:
    got = at_ctx(kv(512), kv(32768), 8192).devices[0]
    assert got.model == GiB and got.context == 2 * GiB


def test_it_loads_with_the_most_that_fits_beside_what_is_up() -> None:
    w = world(3.0)  # 10 - 1 margin - 3 = 6 GiB free: 1 + 0.25 k/1k <= 6 -> 20480
    assert w.p.plan("b", w.tick()).ctx == 20480
    assert "at 32768 context it would evict a; at 20480 it fits beside them" in \
        w.p.plan("b", w.tick()).ctx_note
    assert spawned_ctx(w, "b1", "b") == 20480
    assert w.p.state.models["a"].state.value == "loaded", "a is not evicted for context"


def test_all_of_it_when_it_fits_and_its_least_when_nothing_does() -> None:
    w = world(0.5)  # 8.5 GiB free: 1 + 8 = 9 at 32k does not fit; 8.5 -> 30720
    assert spawned_ctx(w, "b1", "b") == 30720
    w = world(8.0)  # 1 GiB free: not even 2048 (1.5 GiB) fits: a is evicted for it
    assert "not even 2048 context (ctx_min) fits beside what is up" in \
        w.p.plan("b", w.tick()).ctx_note
    assert spawned_ctx(w, "b1", "b") is None  # (it waits for a to stop first)
    assert [e.model for e in w.evictions()] == ["a"]
    w.exited("a")  # then it loads with the most that fits in the room made: all of it
    w.report()
    w.run(w.p.repump(w.tick()))
    b = w.p.state.models["b"]
    assert b.state.value == "loading" and b.n_ctx == 32768


def test_a_model_measured_by_its_first_load_loads_at_ctx_min_then_reads_the_line() -> None:
    """No figures yet (a llama child's first load is its measurement), its context's cost
    per token known from its probe: the first load takes ctx_min; what it uses there and
    that cost give its figures at ctx_min and ctx_max (its device rows, not its host's)."""
    w = MemWorld({"a": 3.0, "b": 1.0}, rules={"b": FIT}, measured=False)
    w.run(w.p.children.measured("b", False, None, None, 0.0, None, True,
                                per_token=256 * 1024))  # (0.25 GiB per 1k tokens)
    plan = w.p.plan("b", w.tick())
    assert plan.ctx == 2048 and plan.ctx_note == "its first load measures it, at 2048 (ctx_min)"
    rec = w.p.state.models["b"]
    rec.n_ctx = 2048
    used = Breakdown(0, [DeviceUse(kind="device", name="gpu0", model=int(1.5 * GiB)),
                         DeviceUse(kind="host", name="host", model=GiB // 4)])
    low, high = from_slope(rec, used)
    assert (low.n_ctx, high.n_ctx) == (2048, 32768)
    assert low.devices[0].model == int(1.5 * GiB) and low.devices[1] == used.devices[1]
    assert high.devices[0].model == int(1.5 * GiB) + 256 * 1024 * (32768 - 2048)
    assert high.devices[1] == used.devices[1], "the context is on the device"
    rec.ctx_per_token = 0
    assert from_slope(rec, used) == (used, used), "no cost per token: one figure"


def test_a_growth_asked_before_the_first_report_grows_once_it_is_measured() -> None:
    """The long prompt that loaded it (at ctx_min) is refused before its first device
    report: its alternate is made then, unmeasured; once measured, the next refusal
    grows it all the same (the alternate takes the running record's figures)."""
    w = MemWorld({"b": 1.0}, rules={"b": FIT}, measured=False)
    w.run(w.p.children.measured("b", False, None, None, 0.0, None, True,
                                per_token=256 * 1024))
    w.acquire("b1", "b")
    World.ready(w, "b")  # ready; its first device report has not come yet
    b = w.p.state.models["b"]
    assert b.n_ctx == 2048
    # the long prompt that loaded it is refused at once
    w.run(w.p.children.instance_reported("b", b.generation, "context",
                                         {"asked": 10000, "n_ctx": 2048}, w.tick()))
    w.report()  # its first report: b is measured (ctx_min and ctx_max from the slope)
    assert b.memory == "measured" and b.mem_max is not None and b.mem_max.n_ctx == 32768
    w.release("b1")
    # plenty of room (10 GiB - 1 margin - 1 used): another long prompt is refused
    spawns = len(w.spawns)
    w.run(w.p.children.instance_reported("b", b.generation, "context",
                                         {"asked": 10000, "n_ctx": 2048}, w.tick()))
    alt = w.p.state.models["b@next"]
    assert len(w.spawns) > spawns, (
        f"b never grows: its alternate is {alt.memory!r} (n_ctx {alt.n_ctx})")


def test_without_the_early_refusal_it_grows() -> None:
    w = MemWorld({"b": 1.0}, rules={"b": FIT}, measured=False)
    w.run(w.p.children.measured("b", False, None, None, 0.0, None, True,
                                per_token=256 * 1024))
    w.acquire("b1", "b")
    World.ready(w, "b")
    b = w.p.state.models["b"]
    w.report()
    w.release("b1")
    w.run(w.p.children.instance_reported("b", b.generation, "context",
                                         {"asked": 10000, "n_ctx": 2048}, w.tick()))
    assert len(w.spawns) == 2 and w.p.state.models["b@next"].n_ctx > 10000
