"""The memory rules of the pure scheduler (R-5.*), driven synchronously with a fake device."""

from __future__ import annotations

import random

import pytest

from actors.config.rules import ModelRules
from actors.ledger import Breakdown, DeviceSample, DeviceUse
from actors.messages import (
    DeviceReport,
    Evicted,
    Grant,
    ModelMemory,
    Refusal,
    Repump,
    Shortfall,
)
from actors.policy.records import (
    Effect,
    Later,
    Learned,
    Measure,
    ModelRecord,
    Publish,
    Spawn,
    Track,
)
from tests.test_policy import World, drain, random_history

GiB = 1024**3


def need(gib: float) -> Breakdown:
    return Breakdown(n_ctx=512, devices=[DeviceUse(kind="device", name="gpu0",
                                                   model=int(gib * GiB))])


class MemWorld(World):
    """A World with a 10 GiB device, a 1 GiB margin, and a monitor played by the test."""

    def __init__(self, sizes: dict[str, float], models_max: int = 0, pinned: str = "",
                 total_gib: float = 10, measured: bool = True,
                 rules: dict[str, ModelRules] | None = None, intensity: int = 3) -> None:
        super().__init__(models_max, "".join(sizes), pinned=pinned)
        old = self.p
        self.p = type(old)(models_max, intensity, 60.0, memory_margin=1 * GiB)
        for n in sizes:
            self.p.add_model(n, 0.0, rules=(rules or {}).get(n, ModelRules(pinned=n in pinned)))
        self.sizes = sizes
        self.total = int(total_gib * GiB)
        self.external = 0
        self.actual: dict[str, int] = {}
        """Model -> bytes its live child really uses (set at spawn, gone at exit)."""
        self.tracked: set[str] = set()
        self.measures: list[Measure] = []
        self.learned: list[Learned] = []
        self.events: list[object] = []
        if measured:
            for n, gib in sizes.items():
                self.run(self.p.children.measured(n, True, need(gib), need(gib), 0.0))
        self.report()

    def run(self, effects: list[Effect]) -> list[Effect]:
        started = []
        for e in effects:
            if isinstance(e, Measure):
                self.measures.append(e)
            elif isinstance(e, Learned):
                self.learned.append(e)
            elif isinstance(e, Publish):
                self.events.append(e.event)
            elif isinstance(e, Spawn):
                # (a reload's new child of a model loads as its alternate: e.serves)
                self.actual[e.model] = int(self.sizes[e.serves or e.model] * GiB)
                started.append(e)
            elif isinstance(e, Track):
                if e.event == "exited":
                    self.tracked.discard(e.model)
                else:
                    self.tracked.add(e.model)
        super().run(effects)
        for e in started:  # the instance reports the child's pid
            self.run(self.p.children.instance_started(e.model, e.generation, 100))
        return effects

    def exited(self, model: str, rc: int = 0) -> None:
        self.actual.pop(model, None)  # the process is gone: its memory is back
        super().exited(model, rc)

    def report(self) -> None:
        used = sum(self.actual.values()) + self.external
        usage = {m: {"gpu0": self.actual.get(m, 0)} for m in self.tracked}
        self.run(self.p.children.devices_reported(DeviceReport(
            devices=[DeviceSample("gpu0", "device", self.total, max(0, self.total - used),
                                  "simulated")],
            managed={"gpu0": sum(u["gpu0"] for u in usage.values())}, usage=usage,
            tracked=sorted(self.tracked), backends=["simulated"]), self.tick()))

    def ready(self, model: str) -> None:
        super().ready(model)
        self.report()

    def settle(self) -> bool:
        moved = super().settle()
        self.report()
        return moved

    def settle_model(self, model: str, rec: ModelRecord) -> bool:
        """A measure the queue waits for ends (at the model's size), then as a World."""
        measured = rec.memory in ("unmeasured", "measuring") and model in self.p.state.queue.entries
        if measured:
            size = need(self.sizes[model])
            self.run(self.p.children.measured(model, True, size, size, self.tick()))
        return super().settle_model(model, rec) or measured

    def evictions(self) -> list[Evicted]:
        return [e for e in self.events if isinstance(e, Evicted)]


def test_two_4gib_models_coexist_and_a_third_evicts_the_lru_for_memory() -> None:
    w = MemWorld({"a": 4, "b": 4, "c": 4})
    w.load_idle("a", "b")
    assert w.state("a") == w.state("b") == "loaded" and w.stops == []
    w.acquire("t", "c")
    assert w.stops == [("a", "memory")] and w.state("c") == "unloaded"
    assert w.evictions()[-1] == Evicted(model="a", reason="memory", for_model="c", devices=[
        Shortfall(device="gpu0", needed=4 * GiB, available=2 * GiB, margin=1 * GiB)])
    w.exited("a")
    assert w.state("c") == "unloaded", "a's memory counts until a report no longer sees it"
    w.report()
    assert w.state("c") == "loading"
    w.ready("c")
    assert isinstance(w.answers["t"], Grant)
    assert w.p.state.ledger.held == {"b": {"gpu0": 4 * GiB}, "c": {"gpu0": 4 * GiB}}


def test_outside_usage_found_by_calibration_changes_the_decision() -> None:
    w = MemWorld({"a": 4, "b": 4})
    w.external = 3 * GiB
    w.report()
    assert w.p.state.ledger.devices["gpu0"].external == 3 * GiB
    w.load_idle("a")
    w.acquire("t", "b")  # 10 - 3 - 4 = 3 available, 1 kept: 4 does not fit
    assert w.stops == [("a", "memory")]
    w.external = 0
    w.report()
    assert w.p.state.ledger.devices["gpu0"].external == 0


def test_a_model_too_big_alone_still_loads() -> None:
    w = MemWorld({"big": 12})
    w.acquire("t", "big")
    assert w.state("big") == "loading"


def test_busy_models_make_the_newcomer_wait_and_the_first_idle_one_goes() -> None:
    w = MemWorld({"a": 4, "b": 4, "c": 4})
    w.load_idle("a", "b")
    w.acquire("ta", "a")
    w.acquire("tb", "b")
    w.acquire("tc", "c")
    assert w.stops == [] and w.state("c") == "unloaded"
    w.release("tb")
    assert w.stops == [("b", "memory")]


def test_pinned_holders_refuse_a_model_that_cannot_fit_instead_of_waiting() -> None:
    w = MemWorld({"a": 4, "b": 4, "c": 4}, pinned="ab")
    w.load_idle("a", "b")
    answer = w.acquire("t", "c")
    assert isinstance(answer, Refusal) and answer.status == 503
    assert "pinned" in answer.message and "3072 MiB on gpu0" in answer.message
    assert w.p.state.queue.entries == {}


def test_the_head_waits_for_its_measurement_and_asks_for_it_first() -> None:
    w = MemWorld({"a": 4, "b": 4}, measured=False)
    w.run(w.p.children.start_measuring())
    assert w.measures == [Measure("a", False), Measure("b", False)]
    w.acquire("t", "b")
    assert w.state("b") == "unloaded" and w.measures[-1] == Measure("b", True)
    w.acquire("t2", "b")
    assert w.measures.count(Measure("b", True)) == 1, "asked once, not on every pump"
    w.run(w.p.children.measure_started("b"))
    assert w.p.state.models["b"].memory == "measuring"
    w.run(w.p.children.measured("b", True, need(4), need(4), w.tick()))
    assert w.state("b") == "loading"
    assert any(isinstance(e, ModelMemory) and e.memory.status == "measured" for e in w.events)


def test_a_failed_measurement_lifts_the_limits_and_the_running_child_is_its_figure() -> None:
    """Issue 12: the retry after a failed measurement started a second copy of a model
    already serving; now the running child is sampled instead."""
    w = MemWorld({"a": 6}, measured=False)
    w.run(w.p.children.measure_started("a"))
    w.run(w.p.children.measured("a", False, None, None, w.tick()))
    assert w.p.state.models["a"].memory == "failed"
    w.load_idle("a")  # its ready brings a device report: 6 GiB
    assert w.measures == [], "no measure child for a model that runs"
    rec = w.p.state.models["a"]
    assert rec.memory == "measured" and rec.mem_max.devices[0].self_bytes == 6 * GiB
    assert any(isinstance(e, Learned) and e.model == "a" for e in w.learned)


def test_a_probe_is_a_load_measured_by_its_running_child() -> None:
    """Issue 12: a probe ran beside the rules, booked as external use, and evicted an
    idle model although the probed one fitted."""
    w = MemWorld({"y": 4, "p": 4}, models_max=2)
    w.load_idle("y")
    w.run(w.p.children.measured("p", False, None, None, w.tick(), at_load=True))
    assert w.p.state.models["p"].memory == "at_load"
    w.acquire(1, "p")
    assert w.stops == [] and w.spawns[-1][0] == "p"  # a load like any other: fits, no eviction
    w.acquire(2, "y")
    assert isinstance(w.answers[2], Grant)
    w.ready("p")
    rec = w.p.state.models["p"]
    assert rec.memory == "measured" and rec.mem_max.devices[0].self_bytes == 4 * GiB
    assert w.stops == []
    assert w.p.state.ledger.held == {"y": {"gpu0": 4 * GiB}, "p": {"gpu0": 4 * GiB}}


def test_a_probe_load_is_alone_on_every_device() -> None:
    w = MemWorld({"a": 2, "p": 2})
    w.run(w.p.children.measured("p", False, None, None, w.tick(), at_load=True))
    w.acquire(1, "p")
    w.acquire(2, "a")  # p's devices are not known until it is charged: a waits
    assert [s[0] for s in w.spawns] == ["p"]
    w.ready("p")
    assert [s[0] for s in w.spawns] == ["p", "a"]


def test_real_usage_replaces_the_reservation_once_ready() -> None:
    w = MemWorld({"a": 4, "b": 4, "c": 4})
    w.sizes["a"] = 1  # measured at 4 GiB, really uses 1
    w.load_idle("a")
    assert w.p.state.ledger.held["a"] == {"gpu0": 1 * GiB}
    assert w.p.state.models["a"].mem_effective is not None
    w.load_idle("b", "c")  # 1 + 4 + 4 = 9 = 10 - margin
    assert w.stops == [] and {w.state(m) for m in "abc"} == {"loaded"}


def test_a_crashed_model_stops_holding_once_a_report_no_longer_tracks_it() -> None:
    w = MemWorld({"a": 6, "b": 6})
    w.load_idle("a")
    w.exited("a", rc=-9)
    assert w.state("a") == "unloaded" and w.p.state.models["a"].failed
    assert "a" in w.p.state.ledger.held
    w.acquire("t", "b")
    assert w.state("b") == "unloaded", "waits: a's memory may still be in use"
    w.report()
    assert w.state("b") == "loading" and "a" not in w.p.state.ledger.held


@pytest.mark.parametrize("seed", range(20))
def test_random_histories_with_memory_keep_invariants_and_never_wedge(seed: int) -> None:
    rng = random.Random(seed)
    sizes = {m: rng.choice([1, 2, 3, 4, 6, 12]) for m in "abcd"}
    w = MemWorld(sizes, models_max=rng.choice([0, 2, 3]), measured=rng.random() < 0.5)

    def report(step: int) -> None:
        w.external = rng.choice([0, 0, 1, 3]) * GiB
        w.report()

    def measure(step: int) -> None:
        m = rng.choice("abcd")
        if w.p.state.models[m].memory in ("unmeasured", "measuring"):
            ok = rng.random() < 0.8
            w.run(w.p.children.measured(m, ok, need(sizes[m]) if ok else None,
                               need(sizes[m]) if ok else None, w.tick()))

    open_tickets = random_history(
        w, rng, {"acquire": 0.3, "release": 0.15, "cancel": 0.05, "ready": 0.15, "exit": 0.13,
                 "report": 0.1, "measure": 0.12},
        more={"report": report, "measure": measure}, exit_codes=(0, -9))
    drain(w, open_tickets, rounds=300)  # measures end, children answer or exit

def test_a_sleeping_model_gives_its_memory_back_and_holds_again_when_woken() -> None:
    w = MemWorld({"a": 4, "b": 4, "c": 4})
    w.load_idle("a", "b")
    w.run(w.p.children.instance_reported("a", w.gen("a"), "sleeping", {}, w.tick()))
    w.actual["a"] = GiB // 2  # what a sleeping llama-server keeps: its CUDA context
    w.report()
    assert w.state("a") == "sleeping" and w.p.state.ledger.held["a"] == {"gpu0": GiB // 2}
    w.load_idle("c")  # fits in what a gave back: nothing evicted
    assert w.stops == []
    w.run(w.p.children.instance_reported("a", w.gen("a"), "awake", {}, w.tick()))
    assert w.state("a") == "loaded" and w.p.state.ledger.held["a"] == {"gpu0": 4 * GiB}


def minmax(min_gib: float, max_gib: float) -> tuple[Breakdown, Breakdown]:
    return need(min_gib), need(max_gib)


def test_two_loads_never_run_at_once_on_one_device_and_a_load_holds_its_max() -> None:
    """Issue 12: 24 GiB, margin 1 GiB, two models with min 8 / max 18 GiB were started
    together (really 36 GiB) while the ledger said 8 + 8 held, 8 GiB available."""
    w = MemWorld({"a": 18, "b": 18}, total_gib=24, measured=False)
    for m in "ab":
        w.run(w.p.children.measured(m, True, *minmax(8, 18), 0.0))
    w.acquire(1, "a")
    w.acquire(2, "b")
    assert [s[0] for s in w.spawns] == ["a"], "b must wait for a's load to be charged"
    assert w.p.state.ledger.held["a"] == {"gpu0": 18 * GiB}  # loading: its max
    w.ready("a")  # ready, and the report at ready charges its real use (18 GiB)
    assert [s[0] for s in w.spawns] == ["a"], "18 + 18 GiB do not fit in 24 - 1"
    w.release(1)  # a is idle now: it goes for b
    assert w.stops == [("a", "memory")]


def test_a_load_still_growing_is_not_judged_as_free_memory() -> None:
    """Issue 12: `a` loading and really using 18 GiB (6 free), the ledger said 16 GiB
    available and admitted `c` (8 GiB + margin)."""
    w = MemWorld({"a": 18, "c": 8}, total_gib=24, measured=False)
    w.run(w.p.children.measured("a", True, *minmax(8, 18), 0.0))
    w.run(w.p.children.measured("c", True, *minmax(8, 8), 0.0))
    w.acquire(1, "a")
    w.report()  # a's child is loading, at 18 GiB already
    w.acquire(2, "c")
    assert [s[0] for s in w.spawns] == ["a"]


def test_use_above_a_hold_is_held() -> None:
    w = MemWorld({"a": 4, "b": 4}, total_gib=10)
    w.load_idle("a")
    w.actual["a"] = 7 * GiB  # grew after its one effective sample
    w.report()
    assert w.p.state.ledger.held["a"] == {"gpu0": 7 * GiB}
    w.acquire(1, "b")  # 7 + 4 > 10 - 1: a must go first
    assert w.stops == [("a", "memory")]


def test_loads_on_other_devices_may_run_together() -> None:
    w = MemWorld({"a": 4, "b": 4}, total_gib=10, measured=False)
    w.run(w.p.children.measured("a", True, need(4), need(4), 0.0))
    other = Breakdown(n_ctx=512, devices=[DeviceUse(kind="device", name="gpu1",
                                                    model=4 * GiB)])
    w.run(w.p.children.measured("b", True, other, other, 0.0))
    w.acquire(1, "a")
    w.acquire(2, "b")
    assert sorted(s[0] for s in w.spawns) == ["a", "b"]


def test_a_load_without_figures_has_its_device_to_itself() -> None:
    w = MemWorld({"f": 6, "b": 6}, measured=False)
    w.run(w.p.children.measured("f", False, None, None, w.tick(), error="x"))
    w.run(w.p.children.measured("b", True, need(6), need(6), w.tick()))
    w.acquire(1, "f")
    w.acquire(2, "b")
    assert [s[0] for s in w.spawns] == ["f"]


def test_a_report_sampled_before_ready_does_not_charge_a_half_done_load() -> None:
    """Found by a review: a poll that sampled the child mid-load but arrived after its
    ready replaced the reservation with the partial figure."""
    from tests.test_policy import World

    w = MemWorld({"a": 8, "b": 6})
    w.acquire(1, "a")
    World.ready(w, "a")  # ready, without the report the monitor takes at ready
    w.actual["a"] = 2 * GiB  # the poll sampled it half loaded ...
    w.run(w.p.children.devices_reported(DeviceReport(
        devices=[DeviceSample("gpu0", "device", w.total, w.total - 2 * GiB, "simulated")],
        managed={"gpu0": 2 * GiB}, usage={"a": {"gpu0": 2 * GiB}}, tracked=["a"],
        backends=["simulated"], ready=[]), w.tick()))  # ... before the monitor knew
    assert w.p.state.models["a"].awaiting_usage  # not charged yet
    w.actual["a"] = 8 * GiB
    w.acquire(2, "b")
    assert [s[0] for s in w.spawns] == ["a"]  # b waits for the report at a's ready


def test_a_memory_victim_too_young_to_go_is_evicted_once_it_comes_of_age() -> None:
    """A review's finding: a memory plan leaves out idle models younger than their
    min_resident_s and set no timer, so the waiter for their memory waited for an
    unrelated event. Now the rules run again when the first comes of age."""
    w = MemWorld({"a": 6, "c": 6}, rules={"c": ModelRules(min_resident_s=10.0)})
    w.acquire("c1", "c")
    w.ready("c")
    w.release("c1")
    w.acquire("a1", "a")  # c is young: a waits for its memory
    assert w.stops == [] and w.state("a") == "unloaded"
    repumps = [(due, m) for due, m in w.timers if isinstance(m, Repump)]
    assert repumps and min(due for due, _ in repumps) <= w.p.state.models["c"].ready_at + 10.0
    w.now = max(due for due, _ in repumps)
    w.fire_timers()
    assert w.stops == [("c", "memory")], "c, come of age, is evicted without another event"


def test_a_batch_line_that_fits_still_times_the_first_idle_window() -> None:
    """Listing the victims for a batch's lines alone sets the Repump for the first idle
    window to open. The victims are listed when a plan reads them (most fit as things
    are, and read none), but a batch's are listed at once: the timer is set either way."""
    r = ModelRules(devices=["gpu0"])
    w = MemWorld({"a": 2, "b": 2}, rules={"a": r, "b": r})
    w.load_idle("a")  # used by a request of a class just now: its window is shut
    now = w.tick()
    effects = w.p.acquire("line", "b", now, True, "batch:")
    assert any(isinstance(e, Spawn) and e.model == "b" for e in effects), effects
    timers = [e for e in effects if isinstance(e, Later) and isinstance(e.message, Repump)]
    assert len(timers) == 1, effects
    assert w.p.state.wake_at == pytest.approx(now + timers[0].delay_s)
