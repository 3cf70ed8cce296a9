"""Suspend or stop, by cost (issue 45): an eviction suspends a model only while its round
trip through host RAM is expected to be cheaper than a stop and a cold load later
(policy/costs.py), with the times measured kept across restarts (swap_times.py).

The pure rule first, then the policy driven synchronously (test_policy_suspend's world),
then real corral processes with fake children.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.config import ConfigError, ModelConfig
from actors.config.load import parse_config
from actors.config.reload import same_child
from actors.config.rules import ModelRules
from actors.messages import SwapTimes
from actors.policy.breaker import Breaker
from actors.policy.costs import learned, weigh
from actors.policy.records import ModelRecord
from actors.swap_times import Keeper, digest
from tests.helpers import SSE, chat, fake_cmd, toml_config, wait_until
from tests.test_policy_suspend import TierWorld

GiB = 1024**3
BY_COST = ModelRules(suspend=True, suspend_by_cost=True)


# -------------------------------------------------------------------- the rule


@pytest.mark.parametrize(("times", "cheaper", "words"), [
    (SwapTimes(), True, "no cold load measured yet"),
    (SwapTimes(cold_s=3.0), True, "about 2.0 s (guessed from its 2048 MiB at 2 GiB/s each way)"),
    (SwapTimes(cold_s=1.5), False, "would take about 2.0 s"),
    (SwapTimes(cold_s=1.5, suspend_s=0.2, wake_s=0.3), True, "about 0.5 s (measured)"),
    (SwapTimes(cold_s=1.5, suspend_s=0.2), True, "about 1.2 s (measured in part"),
    (SwapTimes(cold_s=0.4, suspend_s=0.2, wake_s=0.3), False, "a cold load 0.4 s"),
])
def test_a_suspend_is_chosen_while_its_round_trip_is_cheaper(times: SwapTimes, cheaper: bool,
                                                             words: str) -> None:
    chose, why = weigh(times, 2 * GiB)
    assert chose is cheaper and words in why, why


def test_times_are_running_means_weighing_the_newest_half() -> None:
    t = learned(SwapTimes(), cold_s=4.0)
    assert t == SwapTimes(cold_s=4.0)
    t = learned(t, cold_s=2.0, wake_s=1.0)
    assert t == SwapTimes(cold_s=3.0, wake_s=1.0)


# -------------------------------------------------------------------- the policy


def load_slowly(w: TierWorld, model: str, seconds: float) -> None:
    """Load `model` whose child takes `seconds` to get ready, use it once, and let go."""
    t = ("load", model, w.now)
    w.acquire(t, model)
    w.now += seconds - 1  # (ready() ticks one more)
    w.ready(model)
    w.release(t)


def test_a_model_whose_round_trip_costs_more_than_a_cold_load_is_stopped() -> None:
    w = TierWorld({"a": 5, "b": 5}, rules={"a": BY_COST, "b": BY_COST})
    load_slowly(w, "a", 2)
    w.acquire("t", "b")
    last = w.evictions()[-1]
    assert (last.model, last.action) == ("a", "stop")
    assert last.why is not None and "would take about 5.0 s (guessed from its 5120 MiB" in \
        last.why and "a cold load 2.0 s" in last.why, last.why
    assert w.state("a") == "stopping"


def test_what_a_suspend_took_decides_the_next_eviction() -> None:
    """A slow cold load (20 s) makes the guessed round trip (5 s) worth it; the suspend
    then takes 30 s, and the next eviction of the same model stops it."""
    w = TierWorld({"a": 5, "b": 5}, rules={"a": BY_COST, "b": BY_COST})
    load_slowly(w, "a", 20)
    w.acquire("t", "b")
    first = w.evictions()[-1]
    assert (first.model, first.action) == ("a", "suspend")
    assert first.why is not None and "a cold load 20.0 s" in first.why, first.why
    w.now += 29
    w.suspended("a")
    assert w.p.state.models["a"].times.suspend_s == 30.0
    w.report()
    w.ready("b")
    w.release("t")
    w.acquire("u", "a")  # a's wake makes b go (host RAM holds a's copy: no room for b's)
    assert w.state("b") == "stopping"
    w.exited("b")
    w.report()
    w.woken("a")
    w.release("u")
    assert w.state("a") == "loaded"
    w.report()
    w.acquire("v", "b")
    last = w.evictions()[-1]
    assert (last.model, last.action) == ("a", "stop"), w.evictions()
    assert last.why is not None and "(measured)" in last.why and "a cold load 20.0 s" in \
        last.why, last.why


def test_a_guess_that_chose_a_stop_is_put_to_the_test_once() -> None:
    """A stop measures nothing: were the guess to decide each time, a model it wrongly
    stops (a vLLM child's held memory is mostly KV cache it does not copy) would never be
    suspended. Its next eviction suspends it once; then what that took decides (a
    review's finding)."""
    w = TierWorld({"a": 5, "b": 5}, rules={"a": BY_COST, "b": ModelRules()})
    load_slowly(w, "a", 3)
    w.acquire("t1", "b")  # a's guessed 5 s against its 3 s cold load: a stop
    assert w.evictions()[-1].action == "stop"
    w.exited("a")
    w.report()
    w.ready("b")
    w.release("t1")
    w.acquire("t2", "a")  # b (no suspend method) makes room
    w.exited("b")
    w.report()
    w.now += 2
    w.ready("a")
    w.release("t2")
    w.acquire("t3", "b")  # the guess again: put to the test
    tested = w.evictions()[-1]
    assert tested.action == "suspend", tested
    assert tested.why is not None and "suspended all the same, once, to measure it" in \
        tested.why, tested.why
    w.suspended("a")
    w.report()
    w.ready("b")
    w.release("t3")
    w.acquire("t4", "a")  # its wake
    w.exited("b")
    w.report()
    w.woken("a")
    w.release("t4")
    w.report()
    times = w.p.state.models["a"].times
    assert None not in (times.suspend_s, times.wake_s, times.cold_s), times
    w.acquire("t5", "b")  # now what was measured decides
    last = w.evictions()[-1]
    assert last.why is not None and "(measured)" in last.why, last.why
    assert last.action == ("suspend" if times.suspend_s + times.wake_s < times.cold_s
                           else "stop"), (last, times)


def test_a_reload_that_restarts_a_model_starts_its_times_afresh() -> None:
    w = TierWorld({"a": 5, "b": 5}, rules={"a": BY_COST, "b": BY_COST})
    load_slowly(w, "a", 20)
    assert w.p.state.models["a"].times.cold_s == 20.0
    w.run(w.p.children.reconfigure({}, [], {"a": BY_COST}, w.tick())[0])
    assert w.p.state.models["a"].times == SwapTimes(), "a new command: new times"


def test_a_time_past_a_day_is_kept_as_a_day() -> None:
    assert learned(SwapTimes(), suspend_s=90_000.0).suspend_s == 86_400.0
    assert learned(SwapTimes(), wake_s=-1.0).wake_s == 0.0


def test_suspend_when_always_suspends_whatever_it_costs() -> None:
    w = TierWorld({"a": 5, "b": 5})  # (the policy's default: suspend_by_cost off)
    load_slowly(w, "a", 1)
    w.acquire("t", "b")
    assert w.evictions()[-1].action == "suspend"


# -------------------------------------------------------------------- corral processes

GPU = [{"name": "gpu0", "kind": "simulated", "total_mib": 4096}]


def config(state: Path, **models: dict[str, Any]) -> str:
    return toml_config(models, devices=GPU, models_max=2, memory_margin_mib=64,
                       state_dir=str(state), device_poll_s=0.2)


def slow_sleeper() -> dict[str, Any]:
    """600 MiB that load in a second and suspend in a fraction of one: worth suspending."""
    return {"cmd": fake_cmd("--device-mib", "600", "--sleep-mode", "--wake-s", "0.1",
                            "--load-delay", "1.0"), "suspend": "vllm"}


def quick_sleeper() -> dict[str, Any]:
    """3.5 GiB that load at once: the guessed round trip (3.5 s) is not worth it, however
    busy the machine that starts it."""
    return {"cmd": fake_cmd("--device-mib", "3584", "--sleep-mode"), "suspend": "vllm",
            "suspend_when": "cheaper"}


def measured(c: Any, *models: str) -> None:
    for m in models:
        wait_until(lambda m=m: c.models()[m]["memory"]["status"] == "measured", 30,
                   f"{m} to be measured")


def test_each_model_is_suspended_or_stopped_by_what_it_costs_and_remembers_it(
        corral, tmp_path: Path) -> None:
    state = tmp_path / "state"
    c = corral(config(state, slow=slow_sleeper(), quick=quick_sleeper()))
    measured(c, "slow", "quick")
    sse = SSE(c.port)
    assert chat(c.port, "slow")[0] == 200
    assert chat(c.port, "quick")[0] == 200  # slow makes room: worth a suspend
    first = sse.wait_for(lambda e: e["type"] == "eviction")
    assert (first["model"], first["action"]) == ("slow", "suspend"), first
    assert "a suspend and wake take about" in first["why"], first
    wait_until(lambda: c.models()["slow"]["status"].get("phase") == "suspended", 30,
               "slow to be suspended")
    assert chat(c.port, "slow")[0] == 200  # a wake; quick makes room: not worth it
    second = sse.wait_for(lambda e: e["type"] == "eviction" and e["model"] == "quick")
    assert second["action"] == "stop" and "would take about 3.5 s (guessed" in second["why"]
    sse.close()
    times = c.models()["slow"]["swap_times"]
    assert times["cold_s"] > 1.0 and times["suspend_s"] > 0 and times["wake_s"] >= 0.1, times
    c.stop()
    kept = json.loads((state / "swap-times.json").read_text())
    assert kept["slow"]["times"] == times and kept["quick"]["times"]["cold_s"] > 0
    again = corral(config(state, slow=slow_sleeper(), quick=quick_sleeper()))
    assert again.models()["slow"]["swap_times"] == times, "remembered across a restart"
    changed = {**slow_sleeper(), "cmd": [*slow_sleeper()["cmd"], "--tokens-per-s", "99"]}
    again.stop()
    third = corral(config(state, slow=changed, quick=quick_sleeper()))
    assert third.models()["slow"]["swap_times"] == {
        "cold_s": None, "suspend_s": None, "wake_s": None}, "its command changed"


def test_a_damaged_swap_times_file_is_set_aside_and_a_bad_entry_dropped_alone(
        corral, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "swap-times.json").write_text("[1, 2")
    c = corral(config(state, slow=slow_sleeper()))
    assert c.models()["slow"]["swap_times"]["cold_s"] is None
    assert [p.name for p in state.glob("swap-times.json.bad-*")], list(state.iterdir())
    assert "not a swap times file" in c.log()
    c.stop()
    good = digest(parse_config({"models": {"slow": slow_sleeper()}}).models["slow"])
    (state / "swap-times.json").write_text(json.dumps({
        "slow": {"digest": good, "times": {"cold_s": 2.5, "suspend_s": 0.2, "wake_s": 0.1}},
        "gone": {"digest": "x", "times": {"cold_s": -1}}}))
    again = corral(config(state, slow=slow_sleeper()))
    assert again.models()["slow"]["swap_times"] == {"cold_s": 2.5, "suspend_s": 0.2,
                                                    "wake_s": 0.1}
    assert "the swap times of 'gone' are dropped" in again.log()


def keeper(tmp_path: Path) -> tuple[Keeper, dict[str, ModelRecord], dict[str, ModelConfig]]:
    configs = {"m": ModelConfig(cmd=["x", "{port}"], suspend="vllm")}
    models = {"m": ModelRecord("m", BY_COST, Breaker(3, 60.0))}
    return Keeper(tmp_path, models, lambda rec: rec, configs), models, configs


def test_a_save_that_fails_is_said_once_not_at_every_tick(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "ro").mkdir()
    k, models, configs = keeper(tmp_path / "ro" / "file-not-dir")
    (tmp_path / "ro" / "file-not-dir").write_text("a file where the folder should be")
    models["m"].times = SwapTimes(cold_s=1.0)
    for _ in range(3):
        k.save(configs)
    assert len([r for r in caplog.records if "could not save" in r.message]) == 1
    models["m"].times = SwapTimes(cold_s=2.0)
    k.save(configs)  # (what changed is tried again)
    assert len([r for r in caplog.records if "could not save" in r.message]) == 2


def test_times_are_saved_and_restored_by_the_commands_digest(tmp_path: Path) -> None:
    k, models, configs = keeper(tmp_path)
    models["m"].times = SwapTimes(cold_s=1.5, wake_s=0.2)
    k.save(configs)
    _, models2, _ = keeper(tmp_path)
    assert models2["m"].times == SwapTimes(cold_s=1.5, wake_s=0.2)
    changed = {"m": ModelConfig(cmd=["y", "{port}"], suspend="vllm")}
    models3 = {"m": ModelRecord("m", BY_COST, Breaker(3, 60.0))}
    Keeper(tmp_path, models3, lambda rec: rec, changed)
    assert models3["m"].times == SwapTimes(), "another command: no times"


def test_a_reload_of_suspend_when_or_ttl_suspend_s_keeps_the_child() -> None:
    """Only the policy reads them: a reload that changes them restarts nothing."""
    old = ModelConfig(cmd=["x", "{port}"], suspend="vllm")
    for new in (msgspec.structs.replace(old, suspend_when="always"),
                msgspec.structs.replace(old, ttl_suspend_s=30.0)):
        assert same_child(old, new), new
    assert not same_child(old, msgspec.structs.replace(old, cmd=["y", "{port}"]))


def test_suspend_when_without_a_suspend_method_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"models\.m\.suspend_when: the model has no"):
        parse_config({"models": {"m": {"cmd": ["x"], "suspend_when": "always"}}})
