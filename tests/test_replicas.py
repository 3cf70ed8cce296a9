"""Replicas with real processes (issue 24): a model with two copies behind its one name
spreads its requests over both, keeps a prompt on its copy when routed by prefix, loses
no request when a copy is killed, and gets that copy back."""

from __future__ import annotations

import os
import signal
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.config.load import parse_config
from actors.config.model import ConfigError
from tests.helpers import SSE, chat, fake_cmd, request, toml_config, wait_until

SLOW = fake_cmd("--tokens-per-s", "40")
"""A request of 8 tokens takes 0.2 s: requests sent together overlap."""


def copies(c: Any, n: int = 2) -> list[dict[str, Any]]:
    """The copies of `a`, once `n` of them are loaded."""
    return wait_until(lambda: (r := c.models()["a"].get("replicas")) and sum(
        x["state"] == "loaded" for x in r) == n and r, 30, f"{n} copies of a loaded")


def served(port: int) -> int:
    status, body, _ = request(port, "GET", "/debug/stats")
    assert status == 200, body
    return int(body["started"])


def burst(port: int, n: int, **extra: Any) -> list[tuple[int, Any]]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: chat(port, "a", max_tokens=8, **extra), range(n)))


def test_two_copies_take_one_name_and_a_killed_copy_loses_no_request(corral, tmp_path) -> None:
    c = corral(toml_config({"a": {"cmd": SLOW, "replicas": 2}}, models_max=3))
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    first = copies(c)
    assert [x["name"] for x in first] == ["a", "a@2"]
    assert len({x["pid"] for x in first}) == 2 and len({x["port"] for x in first}) == 2
    answers = burst(c.port, 8)
    assert [s for s, _ in answers] == [200] * 8
    assert all(body["model"] == "a" for _, body in answers)  # the child's {model} is a
    counts = [served(x["port"]) for x in first]
    assert min(counts) >= 2, counts  # both copies served (least loaded)
    assert c.models()["a"]["status"]["value"] == "loaded"
    # A copy killed while requests run on it: they go to the other (not a byte was sent).
    with ThreadPoolExecutor(8) as pool:
        running = [pool.submit(chat, c.port, "a", 8) for _ in range(8)]
        wait_until(lambda: c.models()["a"]["in_flight"] >= 4, 10, "requests in flight")
        os.kill(first[1]["pid"], signal.SIGKILL)
        assert [f.result()[0] for f in running] == [200] * 8
    again = copies(c)  # min 2: the lost copy is replaced
    assert again[1]["pid"] != first[1]["pid"] and again[0]["pid"] == first[0]["pid"]
    change = sse.wait_for(lambda e: e.get("replica") == "a@2" and e.get("status") == "loaded"
                          and e.get("model") == "a", 10)
    assert change["type"] == "status_change"
    sse.close()
    _, text, _ = request(c.port, "GET", "/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    key = ("corral_replica_state", (("model", "a"), ("replica", "a@2"), ("state", "loaded")))
    assert samples[key] == 1.0
    assert len([m for m in c.models() if m.startswith("a")]) == 1  # one model, not two
    status, text, _ = request(c.port, "GET", "/models/logs?model=a@2")
    assert status == 200 and "a@2#" in text, text  # each copy's own log


def test_prefix_routing_keeps_each_prompt_on_one_copy(corral, tmp_path) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd(), "replicas": {
        "min": 2, "route": "prefix", "prefix_bytes": 64}}}))
    assert chat(c.port, "a")[0] == 200
    ports = [x["port"] for x in copies(c)]
    homes = []
    for prompt in range(8):
        messages = [{"role": "system", "content": f"system prompt number {prompt} " * 8},
                    {"role": "user", "content": "hi"}]
        before = [served(p) for p in ports]
        for turn in range(3):
            messages[-1]["content"] = f"turn {turn}"  # past prefix_bytes: the same copy
            assert chat(c.port, "a", messages=messages)[0] == 200
        after = [served(p) for p in ports]
        gained = [b - a for a, b in zip(before, after, strict=True)]
        assert sorted(gained) == [0, 3], gained
        homes.append(gained.index(3))
    assert set(homes) == {0, 1}  # eight prompts: both copies have some


def test_a_copy_is_added_by_demand_and_stopped_when_idle(corral, tmp_path) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20"), "replicas": {
        "max": 2, "target_in_flight": 1, "scale_up_after_s": 0.5,
        "scale_down_idle_s": 1}}}, models_max=3))
    assert chat(c.port, "a")[0] == 200
    copies(c, 1)
    with ThreadPoolExecutor(4) as pool:  # 4 in flight on one copy, each for 0.8 s and more
        running = [pool.submit(chat, c.port, "a", 16) for _ in range(4)]
        copies(c, 2)
        assert [f.result()[0] for f in running] == [200] * 4
    wait_until(lambda: sorted(x["state"] for x in c.models()["a"]["replicas"])
               == ["loaded", "unloaded"], 10, "one copy stopped (scale_down_idle_s)")


def parse(text: str) -> object:
    return parse_config(tomllib.loads(text), "t.toml")


def test_replica_settings_that_cannot_work_are_refused_saying_where(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"models.a.replicas: max \(1\) is below min \(2\)"):
        parse(toml_config({"a": {"cmd": ["x"], "replicas": {"min": 2, "max": 1}}}))
    with pytest.raises(ConfigError, match=r"models\.a\.replicas: its copies are named a@2"):
        parse(toml_config({"a": {"cmd": ["x"], "replicas": 2}, "a@2": {"cmd": ["y"]}}))
    with pytest.raises(ConfigError, match="replicas"):
        parse(toml_config({"a": {"cmd": ["x"], "replicas": {"mni": 2}}}))


def test_every_turn_of_a_conversation_hashes_alike_and_conversations_differ() -> None:
    """The prefix hash (actors/http/affinity.py) is the system prompt and the first user
    message, cut at prefix_bytes: stable as the conversation grows."""
    import json

    from actors.http.affinity import affinity

    def h(messages: list[dict[str, Any]], prefix_bytes: int = 2048) -> int:
        return affinity(json.dumps({"model": "a", "messages": messages}).encode(), prefix_bytes)

    system = {"role": "system", "content": "you are terse. " * 130}  # ~1,950 bytes
    first = [system, {"role": "user", "content": "what is a corral?"}]
    later = [*first, {"role": "assistant", "content": "a pen. " * 20},
             {"role": "user", "content": "and a router?"}]
    assert h(first) == h(later) == h([*later, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": "y"}])
    assert h(first) != h([system, {"role": "user", "content": "what is a swap?"}])
    long = {"role": "system", "content": "z" * 5000}  # past prefix_bytes: one hash for all
    assert h([long, {"role": "user", "content": "p"}]) == h([long, {"role": "user",
                                                                    "content": "q"}])
    assert h([{"role": "user", "content": "no system prompt"}]) == h(
        [{"role": "user", "content": "no system prompt"}, {"role": "assistant", "content": "ok"},
         {"role": "user", "content": "more"}])
    prompt = json.dumps({"model": "a", "prompt": "p" * 100 + "tail"}).encode()
    assert affinity(prompt, 100) == affinity(
        json.dumps({"model": "a", "prompt": "p" * 100 + "other"}).encode(), 100)
    assert affinity(b"not json", 64) == 0 and affinity(b'{"model": "a"}', 64) == 0


def test_a_lone_client_reuses_a_kept_grant_and_overlapping_requests_are_routed(corral,
                                                                               tmp_path) -> None:
    """A copy's grant is kept after its last request (a lease) and joined by the next
    request only while no request is on it: the lone client skips the Scheduler, and
    overlapping requests are still routed among the copies."""
    from tests.test_shares import metric

    c = corral(toml_config({"a": {"cmd": SLOW, "replicas": 2}}, models_max=3,
                           http={"lease_linger_ms": 60_000}))
    assert chat(c.port, "a")[0] == 200
    ports = [x["port"] for x in copies(c)]
    joined = metric(c.port, "corral_requests_joined_total")
    for _ in range(5):
        assert chat(c.port, "a", max_tokens=2)[0] == 200
    assert metric(c.port, "corral_requests_joined_total") == joined + 5
    before = [served(p) for p in ports]
    joined = metric(c.port, "corral_requests_joined_total")
    answers = burst(c.port, 8)
    assert [s for s, _ in answers] == [200] * 8
    gained = [served(p) - b for p, b in zip(ports, before, strict=True)]
    assert sum(gained) == 8 and min(gained) >= 2, gained  # both copies served
    assert metric(c.port, "corral_requests_joined_total") - joined <= 1  # the idle lease
