"""Placement by fit across GPUs (R-5.9), pure: two simulated 10 GiB GPUs, 1 GiB margin,
children that use exactly their measured need on the devices they were placed on."""

from __future__ import annotations

from actors.config.rules import ModelRules
from actors.ledger import DeviceSample
from actors.messages import DeviceReport, Evicted, Grant
from actors.policy.records import Effect, Publish, Spawn, Track
from tests.test_policy import World
from tests.test_policy_memory import GiB, need

GPUS = ("gpu0", "gpu1")


class GpuWorld(World):
    def __init__(self, sizes: dict[str, float], rules: dict[str, ModelRules] | None = None,
                 models_max: int = 0, gpus: tuple[str, ...] = GPUS) -> None:
        self.gpus = gpus
        self.overuse: dict[str, int] = {}
        """Model -> bytes per device its child really uses beyond its measurement."""
        self.external = 0
        self.unreported = False
        super().__init__(models_max, "".join(sizes))
        self.p = type(self.p)(models_max, 3, 60.0, memory_margin=1 * GiB)
        for n in sizes:
            self.p.add_model(n, 0.0, rules=(rules or {}).get(n, ModelRules()))
        self.sizes = sizes
        self.actual: dict[str, dict[str, int]] = {}
        self.tracked: set[str] = set()
        self.placed: dict[str, list[str] | None] = {}
        self.evicted: list[Evicted] = []
        self.report()
        for n, gib in sizes.items():  # measured on gpu0, as a measure child happens to
            self.run(self.p.children.measured(n, True, need(gib), need(gib), 0.0))

    def run(self, effects: list[Effect]) -> list[Effect]:
        for e in effects:
            if isinstance(e, Spawn):
                self.placed[e.model] = e.devices
                devices = e.devices or ["gpu0"]
                share = int(self.sizes[e.model] * GiB) // len(devices)
                share += self.overuse.get(e.model, 0)
                self.actual[e.model] = {d: share for d in devices}
            elif isinstance(e, Track):
                (self.tracked.add if e.event != "exited" else self.tracked.discard)(e.model)
            elif isinstance(e, Publish) and isinstance(e.event, Evicted):
                self.evicted.append(e.event)
        return super().run(effects)

    def exited(self, model: str, rc: int = 0) -> None:
        self.actual.pop(model, None)
        super().exited(model, rc)

    def used(self, device: str) -> int:
        return sum(u.get(device, 0) for u in self.actual.values()) + self.external

    def report(self) -> None:
        self.unreported = False
        samples = [DeviceSample(d, "device", 10 * GiB, max(0, 10 * GiB - self.used(d)),
                                "simulated") for d in self.gpus]
        usage = {m: dict(self.actual.get(m, {})) for m in self.tracked}
        managed = {d: sum(u.get(d, 0) for u in usage.values()) for d in self.gpus}
        self.run(self.p.children.devices_reported(DeviceReport(
            devices=samples, managed=managed, usage=usage, tracked=sorted(self.tracked),
            backends=["simulated"]), self.tick()))

    def ready(self, model: str) -> None:
        super().ready(model)
        self.report()


def test_a_model_goes_to_the_gpu_where_it_fits_without_evicting() -> None:
    w = GpuWorld({"a": 6, "b": 6})
    w.load_idle("a")
    w.load_idle("b")
    assert w.placed == {"a": ["gpu0"], "b": ["gpu1"]} and w.stops == []
    view = {v.name: v for v in w.p.snapshot(w.now).models}
    assert view["a"].devices == ["gpu0"] and view["b"].devices == ["gpu1"]
    assert w.p.state.ledger.held == {"a": {"gpu0": 6 * GiB}, "b": {"gpu1": 6 * GiB}}


def test_when_every_gpu_is_full_it_evicts_where_the_idle_models_are_least_recent() -> None:
    w = GpuWorld({"a": 6, "b": 6, "c": 6})
    w.load_idle("a", "b")  # a on gpu0, then b on gpu1: a is the least recently used
    w.acquire(1, "c")
    assert w.stops == [("a", "memory")]
    assert w.evicted[-1].devices[0].device == "gpu0"  # the event says where room was made
    w.exited("a")
    w.report()
    assert w.placed["c"] == ["gpu0"]


def test_devices_restricts_where_a_model_may_go() -> None:
    w = GpuWorld({"a": 6, "b": 6}, rules={"b": ModelRules(devices=["gpu0"])})
    w.load_idle("a")  # on gpu0 (both free: the first)
    w.acquire(1, "b")  # may only use gpu0: a must go, although gpu1 is free
    assert w.stops == [("a", "memory")]


def test_ties_go_to_the_most_free_memory() -> None:
    w = GpuWorld({"a": 2, "b": 1, "c": 1})
    w.load_idle("a")  # gpu0: 2 GiB used
    w.load_idle("b")  # gpu1 has more free
    assert w.placed["b"] == ["gpu1"]


def test_a_model_whose_env_pins_its_gpus_is_not_placed() -> None:
    w = GpuWorld({"a": 2}, rules={"a": ModelRules(placeable=False)})
    w.load_idle("a")
    assert w.placed == {"a": None}


def test_a_model_over_two_gpus_is_split_over_both() -> None:
    w = GpuWorld({"a": 12}, rules={"a": ModelRules(devices_per_instance=2)})
    w.acquire(1, "a")
    assert w.placed == {"a": ["gpu0", "gpu1"]}
    assert w.p.state.ledger.held["a"] == {"gpu0": 6 * GiB, "gpu1": 6 * GiB}
    w.ready("a")
    assert isinstance(w.answers[1], Grant)


def test_a_child_is_told_where_it_was_placed() -> None:
    from actors.childproc import placement_env
    from actors.config.load import parse_config

    config = parse_config({"models": {"m": {
        "cmd": ["llama-server", "--device", "{devices}", "--main", "{device}", "{port}"],
        "devices": ["CUDA1", "CUDA2"], "devices_per_instance": 2}}})
    model = config.models["m"]
    assert model.argv("m", "127.0.0.1", 5, devices=["CUDA1", "CUDA2"]) == [
        "llama-server", "--device", "CUDA1,CUDA2", "--main", "CUDA1", "5"]
    assert placement_env(["CUDA1", "CUDA2"]) == {"CORRAL_DEVICES": "CUDA1,CUDA2",
                                                  "CUDA_VISIBLE_DEVICES": "1,2"}
    assert placement_env(["gpu0"]) == {"CORRAL_DEVICES": "gpu0"}  # simulated: no CUDA
    assert config.rules_of(model).devices_per_instance == 2
    pinned = parse_config({"models": {"m": {"cmd": ["x", "{port}"],
                                            "env": {"CUDA_VISIBLE_DEVICES": "0"}}}})
    assert not pinned.rules_of(pinned.models["m"]).placeable


def test_more_devices_per_instance_than_allowed_devices_is_a_config_error() -> None:
    import pytest

    from actors.config.load import parse_config
    from actors.config.model import ConfigError

    with pytest.raises(ConfigError, match=r"models\.m\.devices_per_instance: 3 is more than"):
        parse_config({"models": {"m": {"cmd": ["x", "{port}"], "devices": ["a", "b"],
                                       "devices_per_instance": 3}}})


# ---------------------------------------------------------------- found by a review


def test_a_model_too_big_for_any_gpu_evicts_and_loads_rather_than_wait_forever() -> None:
    w = GpuWorld({"a": 6, "big": 12})
    w.load_idle("a")
    w.acquire(1, "big")
    for _ in range(3):
        w.report()
        w.run(w.p.repump(w.tick()))
    assert w.state("big") == "loading"  # alone on an empty GPU, with a warning


def test_an_idle_model_on_another_gpu_is_evicted_rather_than_wait_for_a_busy_one() -> None:
    w = GpuWorld({"a": 6, "b": 6, "c": 6})
    w.load_idle("a", "b")
    w.acquire("busy", "a")
    w.acquire(1, "c")
    assert w.stops == [("b", "memory")]


def test_a_pinned_model_on_another_gpu_does_not_get_a_model_refused() -> None:
    w = GpuWorld({"a": 6, "big": 12}, rules={"a": ModelRules(pinned=True)})
    w.load_idle("a")
    w.acquire(1, "big")
    assert w.state("big") == "loading" and w.placed["big"] == ["gpu1"]


def test_a_model_whose_gpus_are_not_there_is_refused_not_run_anywhere() -> None:
    from actors.messages import Refusal

    for rules in (ModelRules(devices=["gpu7"]), ModelRules(devices_per_instance=3)):
        w = GpuWorld({"a": 2}, rules={"a": rules})
        answer = w.acquire(1, "a")
        assert isinstance(answer, Refusal) and "cannot be placed" in answer.message
        assert w.spawns == []


def test_loads_placed_on_different_gpus_run_in_parallel() -> None:
    w = GpuWorld({"a": 6, "b": 6})
    w.acquire(1, "a")
    w.acquire(2, "b")
    assert w.placed == {"a": ["gpu0"], "b": ["gpu1"]}


def test_memory_on_its_way_back_is_waited_for_rather_than_evicting_more() -> None:
    """Seen in the demo: with small stopping on gpu0 for large, the next pump evicted
    medium on gpu1 as well."""
    w = GpuWorld({"a": 6, "b": 6, "c": 6})
    w.load_idle("a", "b")
    w.acquire(1, "c")
    assert w.stops == [("a", "memory")]
    w.exited("a")  # reaped; its memory still shows until the next report
    assert w.stops == [("a", "memory")]
    w.report()
    assert w.placed["c"] == ["gpu0"]


def test_a_llama_server_child_on_two_gpus_is_split_as_accounted() -> None:
    from actors.llama import split_args

    argv = ["llama-server", "-m", "x.gguf"]
    assert split_args(argv, ["CUDA0", "CUDA1"], llama=True) == ["--tensor-split", "1,1"]
    assert split_args(argv, ["CUDA0"], llama=True) == []
    assert split_args(argv, ["CUDA0", "CUDA1"], llama=False) == []
    assert split_args([*argv, "-ts", "3,1"], ["CUDA0", "CUDA1"], llama=True) == []


NODE_GPUS = ("node_a/gpu0", "node_a/gpu1", "node_b/gpu0", "node_b/gpu1")


def test_a_cluster_model_goes_only_to_its_nodes_and_never_spans_two() -> None:
    """Devices of Ray nodes are NODE/DEVICE: a model with `nodes` is placed on those nodes'
    GPUs only, one spread over two GPUs stays on one node, and a model without `nodes`
    never lands on a node."""
    w = GpuWorld({"a": 6, "b": 6, "wide": 12, "here": 1},
                 rules={"a": ModelRules(nodes=["node_b"]), "b": ModelRules(nodes=["node_b"]),
                        "wide": ModelRules(nodes=["node_a", "node_b"], devices_per_instance=2),
                        "here": ModelRules()},
                 gpus=(*NODE_GPUS, "gpu9"))
    w.load_idle("a", "b")
    assert {w.placed["a"][0], w.placed["b"][0]} == {"node_b/gpu0", "node_b/gpu1"}
    w.acquire(1, "wide")
    assert w.placed["wide"] == ["node_a/gpu0", "node_a/gpu1"]  # node_b is full: no eviction
    assert w.stops == []
    w.load_idle("here")
    assert w.placed.get("here") in (None, ["gpu9"])


def test_a_device_that_reports_no_memory_takes_nothing() -> None:
    """A lost node's devices are reported with no memory: nothing is placed there, and a
    model that may only run there is refused, saying why (not left waiting)."""
    w = GpuWorld({"a": 6, "b": 6}, rules={"a": ModelRules(nodes=["node_a", "node_b"]),
                                          "b": ModelRules(nodes=["node_b"])},
                 gpus=NODE_GPUS)
    w.p.children.devices_reported(DeviceReport(
        devices=[DeviceSample(d, "device", 0, 0, "cluster") for d in NODE_GPUS[2:]],
        managed={}, usage={}, tracked=[], backends=["cluster"]), w.tick())
    w.acquire(1, "a")
    assert w.placed["a"][0].startswith("node_a/")
    refusal = w.acquire(2, "b")
    assert "none of its nodes (node_b) has a GPU up" in refusal.message


def test_models_max_per_node_fills_other_nodes_then_frees_a_slot_on_one() -> None:
    """At one model per node: b goes to the other node though a's node has a free GPU;
    c then needs a slot and takes it from the least recently used idle model's node."""
    w = GpuWorld({"a": 2, "b": 2, "c": 2},
                 rules={m: ModelRules(nodes=["node_a", "node_b"]) for m in "abc"},
                 gpus=NODE_GPUS)
    w.p = type(w.p)(0, 3, 60.0, memory_margin=1 * GiB, models_max_per_node=1)
    for n in "abc":
        w.p.add_model(n, 0.0, rules=ModelRules(nodes=["node_a", "node_b"]))
    w.report()
    for n in "abc":
        w.run(w.p.children.measured(n, True, need(2), need(2), 0.0))
    w.load_idle("a", "b")
    assert {w.placed["a"][0].split("/")[0], w.placed["b"][0].split("/")[0]} == {
        "node_a", "node_b"}
    w.acquire(1, "c")
    assert w.stops == [("a", "lru")]  # a was used least recently: its node's slot
    w.exited("a")
    w.report()
    assert w.placed["c"][0].split("/")[0] == w.placed["a"][0].split("/")[0]
