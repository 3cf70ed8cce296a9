"""Reloading the config of a running corral (R-2.6): GET /models?reload=1 and SIGHUP."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

from tests.helpers import chat, fake_cmd, pid_alive, request, toml_config, wait_until


def write(c: Any, models: dict[str, dict[str, Any]]) -> None:
    path = Path(c.log_path).parent / "corral.toml"
    path.write_text(toml_config(models, models_max=3))


def test_reload_adds_removes_and_keeps_unchanged_children(corral) -> None:
    models = {m: {"cmd": fake_cmd()} for m in "ab"}
    c = corral(toml_config(models, models_max=3))
    for m in "ab":
        assert chat(c.port, m)[0] == 200
    pids = {m: c.models()[m]["pid"] for m in "ab"}
    write(c, {"a": models["a"], "c": {"cmd": fake_cmd(), "aliases": ["see"]}})
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200 and [m["id"] for m in body["data"]] == ["a", "c"]
    wait_until(lambda: not pid_alive(pids["b"]), 10, "b's child to exit")
    assert c.models()["a"]["pid"] == pids["a"]
    assert chat(c.port, "see")[0] == 200  # the new model's alias works at once
    status, body = chat(c.port, "b")
    assert status == 400 and "not found" in body["error"]["message"]
    assert "reload: added ['c'], removed ['b'], changed none" in c.log()


def test_a_busy_changed_model_finishes_its_request_then_restarts(corral) -> None:
    slow = {"cmd": fake_cmd("--tokens-per-s", "40")}
    c = corral(toml_config({"a": slow}, models_max=3))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    result: list[Any] = []
    busy = threading.Thread(target=lambda: result.append(chat(c.port, "a", max_tokens=40)))
    busy.start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "the slow request to start")
    write(c, {"a": {"cmd": fake_cmd("--tokens-per-s", "400")}})
    c.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "SIGHUP: reloaded" in c.log(), 10, "the reload")
    busy.join(10)
    status, body = result[0]
    assert status == 200 and body["usage"]["completion_tokens"] == 40  # not cut off
    wait_until(lambda: not pid_alive(pid), 10, "the old child to exit")
    assert c.models()["a"]["last_eviction"]["reason"] == "reload"
    assert chat(c.port, "a")[0] == 200
    assert "--tokens-per-s 400" in " ".join(c.models()["a"]["status"]["args"])


def test_a_broken_config_is_refused_and_nothing_changes(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, models_max=3))
    assert chat(c.port, "a")[0] == 200
    path = Path(c.log_path).parent / "corral.toml"
    path.write_text(path.read_text() + "\nbogus_key = 1\n")
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 400 and "reload refused, nothing changed" in body["error"]["message"]
    assert "bogus_key" in body["error"]["message"]
    c.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "SIGHUP: reload refused" in c.log(), 10, "the refusal")
    assert c.state("a") == "loaded"
