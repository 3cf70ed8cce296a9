"""Shared grants (actors/shares.py): overlapping requests for a busy model join one grant
instead of each asking the Scheduler; the Scheduler withdraws it when the model must stop
taking requests, and that must hold under continuous load."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from tests.helpers import chat, fake_cmd, request, toml_config, wait_until


def metric(port: int, name: str) -> float:
    status, text, _ = request(port, "GET", "/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


class Load:
    """`n` threads sending slow requests to `model` back to back until stopped."""

    def __init__(self, port: int, model: str, n: int, max_tokens: int,
                 stagger_s: float) -> None:
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(port, model, max_tokens))
                        for _ in range(n)]
        for t in self.threads:  # staggered, so that their requests overlap
            t.start()
            self.stop.wait(stagger_s)

    def _run(self, port: int, model: str, max_tokens: int) -> None:
        while not self.stop.is_set():
            self.statuses.append(chat(port, model, max_tokens=max_tokens)[0])

    def join(self) -> list[int]:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        return self.statuses


def test_overlapping_requests_join_one_grant_and_are_all_counted(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "40")}}))
    assert chat(c.port, "a")[0] == 200
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(chat(c.port, "a", 40)[0]))
               for _ in range(3)]
    threads[0].start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "the first request granted")
    for t in threads[1:]:
        t.start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 3, 5, "three requests in flight")
    for t in threads:
        t.join(10)
    assert results == [200, 200, 200]
    assert c.models()["a"]["in_flight"] == 0
    assert metric(c.port, "corral_requests_granted_total") == 4
    assert metric(c.port, "corral_requests_joined_total") == 2  # 2 joined the first's grant


def test_a_reload_restarts_a_model_that_is_never_idle(corral) -> None:
    """Without the withdrawal, requests would keep joining the old grant and the changed
    model would never drain."""
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "100")}}, models_max=3))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    load = Load(c.port, "a", 3, 20, 0.07)  # 0.2 s requests, 3 clients: always one running
    try:
        wait_until(lambda: metric(c.port, "corral_requests_joined_total") > 3, 10,
                   "requests joining grants")
        Path(c.log_path).parent.joinpath("corral.toml").write_text(toml_config(
            {"a": {"cmd": fake_cmd("--tokens-per-s", "101")}}, models_max=3))
        c.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: c.models()["a"]["pid"] not in (None, pid), 15,
                   "the changed model to restart while its load goes on")
    finally:
        statuses = load.join()
    assert statuses and set(statuses) == {200}
    assert c.models()["a"]["last_eviction"]["reason"] == "reload"


def test_a_request_after_a_manual_unload_goes_to_the_next_instance(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20")}}))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    slow: list[Any] = []
    busy = threading.Thread(target=lambda: slow.append(chat(c.port, "a", 100)))
    busy.start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "the slow request to run")
    status, _, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert status == 200
    # The grant of the stopping child was withdrawn before the unload was answered,
    # so this request queues for the next child instead of joining the old one.
    assert chat(c.port, "a")[0] == 200
    new_pid = c.models()["a"]["pid"]
    assert new_pid is not None and new_pid != pid
    busy.join(10)
    assert slow  # answered one way or the other (the fake child finishes it on SIGTERM)
