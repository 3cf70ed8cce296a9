"""The suspended tier with real processes (issue 23): fake children with vLLM's sleep
endpoints on a simulated 1 GiB device, each using 600 MiB of it, so two never fit
together. An eviction suspends one (its process kept, its host copy really allocated),
a request wakes it in place, and every way out (host RAM short, a failed suspend, an
unload) stops the child for good."""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.config.suspend import SuspendCommands
from actors.instance import prompt_cache
from actors.instance import suspend as steps
from tests.helpers import SSE, chat, fake_cmd, pid_alive, request, toml_config, wait_until

MiB = 1024**2
GPU = [{"name": "gpu0", "kind": "simulated", "total_mib": 1024}]
SLEEPY = fake_cmd("--device-mib", "600", "--sleep-mode", "--wake-s", "0.2",
                  "--load-delay", "1.0")


def config(tmp: Path, models: dict[str, dict[str, Any]], **top: Any) -> str:
    settings: dict[str, Any] = {"models_max": 2, "memory_margin_mib": 64,
                                "state_dir": str(tmp / "state"), "device_poll_s": 0.2, **top}
    return toml_config(models, devices=GPU, **settings)


def sleepy(**keys: Any) -> dict[str, Any]:
    """A model that suspends at every eviction host RAM allows: these tests are of the
    steps; whether a suspend pays is test_suspend_cost's."""
    return {"cmd": SLEEPY, "suspend": "vllm", "suspend_when": "always", **keys}


def measured(c: Any, *models: str) -> None:
    for m in models:
        wait_until(lambda m=m: c.models()[m]["memory"]["status"] == "measured", 60,
                   f"{m} to be measured")


def metric(port: int, name: str) -> float:
    _, text, _ = request(port, "GET", "/metrics")
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == name)


def stats(port: int) -> dict[str, Any]:
    status, body, _ = request(port, "GET", "/debug/stats")
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def test_an_eviction_suspends_and_a_request_wakes_the_same_child(corral, tmp_path) -> None:
    c = corral(config(tmp_path, {"a": sleepy(), "b": sleepy()}))
    measured(c, "a", "b")
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    a = c.models()["a"]
    assert chat(c.port, "b")[0] == 200
    eviction = sse.wait_for(lambda e: e["type"] == "eviction")
    assert (eviction["model"], eviction["reason"], eviction["action"]) == ("a", "memory",
                                                                          "suspend")
    asleep = c.models()["a"]
    assert asleep["status"]["value"] == "sleeping" and asleep["status"]["phase"] == "suspended"
    assert asleep["pid"] == a["pid"] and pid_alive(a["pid"])
    # its host copy is real: what the child's resident memory grew by, about 600 MiB
    assert 500 * MiB < asleep["status"]["host_bytes"] < 700 * MiB
    assert stats(a["port"])["sleeps"] == 1
    assert chat(c.port, "a")[0] == 200, "a request wakes it"
    woken = c.models()["a"]
    assert woken["status"]["value"] == "loaded" and woken["pid"] == a["pid"]
    assert stats(a["port"])["wakes"] == 1
    assert c.models()["b"]["status"].get("phase") == "suspended", "b went to the host for a"
    assert sse.statuses("a")[-3:] == ["sleeping", "loading", "loaded"]
    joined = metric(c.port, "corral_requests_joined_total")
    assert chat(c.port, "a")[0] == 200 and chat(c.port, "a")[0] == 200
    assert metric(c.port, "corral_requests_joined_total") > joined, \
        "the woken child's grant is kept and joined again, as before its suspend"
    _, text, _ = request(c.port, "GET", "/metrics")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("corral_model_suspends_total", (("model", "a"),))] == 1
    assert samples[("corral_model_wakes_total", (("model", "a"),))] == 1
    assert samples[("corral_models_suspended", ())] == 1
    sse.close()


def test_without_host_room_the_victim_is_stopped_saying_why(corral, tmp_path) -> None:
    c = corral(config(tmp_path, {"a": sleepy(), "b": sleepy()},
                      host_memory_margin_mib=100_000_000))
    measured(c, "a", "b")
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    assert chat(c.port, "b")[0] == 200
    eviction = sse.wait_for(lambda e: e["type"] == "eviction")
    assert eviction["action"] == "stop" and "host memory" in eviction["why"]
    wait_until(lambda: not pid_alive(pid), 10, "a's child to be gone")
    sse.close()


def test_a_failed_suspend_stops_the_child_and_the_newcomer_still_loads(corral,
                                                                       tmp_path) -> None:
    broken = {"sleep_http": "POST /no-such-path", "wake_http": "POST /wake_up"}
    c = corral(config(tmp_path, {"a": sleepy(suspend=broken), "b": sleepy()}))
    measured(c, "a", "b")
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    assert chat(c.port, "b")[0] == 200
    failed = sse.wait_for(lambda e: e["type"] == "eviction" and e["reason"] == "suspend_failed")
    assert failed["model"] == "a" and "404" in failed["why"]
    wait_until(lambda: not pid_alive(pid), 10, "a's child to be gone")
    assert c.state("b") == "loaded"
    sse.close()


def test_suspend_by_commands_with_placeholders_and_unload_of_a_suspended_model(
        corral, tmp_path) -> None:
    post = ("import sys, urllib.request; urllib.request.urlopen(urllib.request.Request("
            "'http://127.0.0.1:' + sys.argv[1] + sys.argv[2], method='POST'), timeout=30)")
    commands = {"sleep": [sys.executable, "-c", post, "{port}", "/sleep?level=1"],
                "wake": [sys.executable, "-c", post, "{port}", "/wake_up"]}
    c = corral(config(tmp_path, {"a": sleepy(suspend=commands), "b": sleepy()}))
    measured(c, "a", "b")
    assert chat(c.port, "a")[0] == 200
    a = c.models()["a"]
    assert chat(c.port, "b")[0] == 200
    assert c.models()["a"]["status"].get("phase") == "suspended"
    assert stats(a["port"])["sleeps"] == 1
    assert chat(c.port, "a")[0] == 200
    assert stats(a["port"])["wakes"] == 1
    b = c.models()["b"]
    assert b["status"].get("phase") == "suspended"
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "b"})
    assert status == 200, body
    c.wait_state("b", "unloaded")
    assert not pid_alive(b["pid"])


def test_ttl_suspends_an_idle_model_then_stops_it(corral, tmp_path) -> None:
    c = corral(config(tmp_path, {"a": sleepy(ttl_suspend_s=0.5, ttl_s=2.0)}))
    measured(c, "a")
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    sse.wait_for(lambda e: e["type"] == "eviction" and e["action"] == "suspend")
    wait_until(lambda: c.models()["a"]["status"].get("phase") == "suspended", 10,
               "a to be suspended")
    stop = sse.wait_for(lambda e: e["type"] == "eviction" and e["action"] == "stop", 15)
    assert stop["reason"] == "ttl"
    c.wait_state("a", "unloaded")
    assert not pid_alive(pid)
    sse.close()


def test_a_bad_suspend_config_is_refused_naming_the_key(tmp_path) -> None:
    for suspend, words in (({"sleep": ["x"]}, "sleep and wake"),
                           ({"sleep_http": "SLEEP /x", "wake_http": "POST /y"},
                            "METHOD /path"),
                           ({"sleep": ["x"], "wake": ["y"], "sleep_http": "POST /x"},
                            "one pair"),
                           ("cuda", "not a method")):
        data = {"models": {"m": {"cmd": ["x"], "suspend": suspend}}}
        with pytest.raises(ConfigError, match=words) as e:
            parse_config(data, "c.toml")
        assert "models.m.suspend" in str(e.value)
    with pytest.raises(ConfigError, match="ttl_suspend_s"):
        parse_config({"models": {"m": {"cmd": ["x"], "ttl_suspend_s": 5}}}, "c.toml")


def test_a_warm_model_loads_alone_gives_way_and_comes_back(corral, tmp_path) -> None:
    small = {"cmd": fake_cmd("--device-mib", "300"), "warm": True}
    big = {"cmd": fake_cmd("--device-mib", "800")}
    c = corral(config(tmp_path, {"small": small, "big": big}))
    c.wait_state("small", "loaded")  # no request asked for it
    sse = SSE(c.port)
    assert chat(c.port, "big")[0] == 200
    eviction = sse.wait_for(lambda e: e["type"] == "eviction")
    assert (eviction["model"], eviction["reason"]) == ("small", "memory")
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "big"})
    assert status == 200, body
    c.wait_state("small", "loaded")  # the big one left: it is back
    sse.close()


@pytest.mark.parametrize("step", ["sleep", "wake"])
def test_a_trickled_answer_fails_its_step_at_suspend_timeout_s(corral, tmp_path,
                                                                step: str) -> None:
    """Review S6: the timeout bounded each socket read, so a child that answered a byte a
    second kept its model suspending (or waking) for as long as it trickled. Now the
    whole step ends at suspend_timeout_s: the child is stopped, and the model's request
    goes to a cold load of a new child."""
    trickler = sleepy(cmd=[*SLEEPY, "--trickle", step], suspend_timeout_s=2, ttl_suspend_s=0.5)
    c = corral(config(tmp_path, {"t": trickler}))
    measured(c, "t")
    sse = SSE(c.port)
    assert chat(c.port, "t")[0] == 200
    pid = c.models()["t"]["pid"]
    failed = {"sleep": "suspend_failed", "wake": "wake_failed"}[step]
    if step == "wake":
        wait_until(lambda: c.models()["t"]["status"].get("phase") == "suspended", 10,
                   "t to be suspended")
        status, body, _ = request(c.port, "POST", "/v1/chat/completions", {  # it wakes t
            "model": "t", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            timeout_s=20)
        assert status == 200, body
    eviction = sse.wait_for(lambda e: e["type"] == "eviction" and e["reason"] == failed, 10)
    assert "suspend_timeout_s=2" in eviction["why"], eviction
    wait_until(lambda: not pid_alive(pid), 10, "the trickling child to be gone")
    if step == "sleep":
        assert chat(c.port, "t")[0] == 200
    assert c.models()["t"]["pid"] not in (None, pid)
    sse.close()


class Trickler:
    """A raw child on a thread: it answers every request with `head` at once, then with
    `body`, `size` bytes at a time every `every_s` (review S6's drip.py), until its
    client leaves."""

    def __init__(self, head: bytes, body: bytes, size: int = 1, every_s: float = 0.2) -> None:
        self.head, self.body, self.size, self.every_s = head, body, size, every_s
        self.stop = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._answer, args=(conn,), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                while b"\r\n\r\n" not in conn.recv(65536):
                    pass
                conn.sendall(self.head)
                for at in range(0, len(self.body), self.size):
                    if self.stop.wait(self.every_s):
                        return
                    conn.sendall(self.body[at:at + self.size])
            except OSError:
                return  # the client left

    def close(self) -> None:
        self.stop.set()
        self.server.close()
        for thread in self.threads:
            thread.join(5)


def test_a_step_whose_answer_head_trickles_ends_at_the_deadline() -> None:
    """Review S6, as drip.py did it: a status line, then one header byte at a time."""
    child = Trickler(b"HTTP/1.1 200 OK\r\n", b"X-Slow: 1\r\n" * 100)
    how = SuspendCommands(sleep_http="POST /sleep", wake_http="POST /wake")
    try:
        for step in ("sleep", "wake"):
            start = time.monotonic()
            why = steps.run(how, step, model="m", host="127.0.0.1", port=child.port,
                              pid=1, timeout_s=1.0, say=lambda _: None)
            took = time.monotonic() - start
            assert why is not None and "within suspend_timeout_s=1" in why, why
            assert took < 2.5, f"the {step} took {took:.1f} s with suspend_timeout_s 1"
    finally:
        child.close()


def test_a_prompt_cache_step_ends_by_its_deadline_and_reads_a_bounded_answer(
        tmp_path: Path) -> None:
    """Review S6: prompt_cache._call read with a per-read timeout and took the whole body,
    however long. A trickled GET /slots now ends the save at its timeout, and an endless
    one fails once it is over prompt_cache.ANSWER_MAX."""
    here = tmp_path / "m" / "0123456789abcdef"
    here.mkdir(parents=True)
    (here / "slot0.bin").write_bytes(b"x")
    endless = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000000\r\n\r\n"
    cases = [(Trickler(endless, b" " * 1000), 1.0, "no answer within 1 s"),
             (Trickler(endless, b" " * (64 << 20), 1 << 20, 0.0), 30.0, "over")]
    for child, timeout_s, says in cases:
        said: list[str] = []
        try:
            start = time.monotonic()
            saved = prompt_cache.save("127.0.0.1", child.port, here, tmp_path, 1 << 30,
                                      timeout_s, said.append)
            restored = prompt_cache.restore("127.0.0.1", child.port, here, timeout_s,
                                            said.append)
            took = time.monotonic() - start
        finally:
            child.close()
        assert (saved, restored) == (0, 0) and len(said) == 2, said
        assert all(says in line for line in said), said
        assert took < 2 * timeout_s + 1.5, f"save and restore took {took:.1f} s"
