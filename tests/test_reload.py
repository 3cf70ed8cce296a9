"""Reloading the config of a running corral (R-2.6): GET /models?reload=1 and SIGHUP."""

from __future__ import annotations

import http.client
import signal
import threading
from pathlib import Path
from typing import Any

from tests.helpers import SSE, chat, fake_cmd, pid_alive, request, toml_config, wait_until


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


# ---------------------------------------------------------------- make-before-break (issue 24)


def served(port: int) -> int:
    status, body, _ = request(port, "GET", "/debug/stats")
    assert status == 200, body
    return int(body["started"])


def test_a_changed_model_under_load_keeps_serving_while_its_new_config_loads(corral) -> None:
    from tests.test_shares import Load

    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "100")}}, models_max=3))
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    old = c.models()["a"]
    load = Load(c.port, "a", 2, 10, 0.05)  # 0.1 s requests, back to back
    try:
        write(c, {"a": {"cmd": fake_cmd("--tokens-per-s", "101", "--load-delay", "2")}})
        c.proc.send_signal(signal.SIGHUP)
        sse.wait_for(lambda e: "make-before-break" in (e.get("cause") or ""), 15)
        before = served(old["port"])
        counts, stop = [before], threading.Event()

        def count_old() -> None:  # (read as it goes: once a@next is ready, the old child
            while not stop.wait(0.05):  # drains and exits, a busy machine's reader late)
                try:
                    counts.append(served(old["port"]))
                except (OSError, http.client.HTTPException):
                    return  # (it is gone: its port may be another's soon)
        counter = threading.Thread(target=count_old)
        counter.start()
        try:
            ready = sse.wait_for(lambda e: (e.get("cause") or "").startswith("ready, pid ")
                                 and e["cause"] != f"ready, pid {old['pid']}", 30)
        finally:
            stop.set()
            counter.join()
        during = max(counts) - before  # the old child's answers while a@next loaded
        wait_until(lambda: not pid_alive(old["pid"]), 30, "the old child to drain and exit")
    finally:
        statuses = load.join()
        sse.close()
    assert statuses and set(statuses) == {200}, "no request failed or was cut by the reload"
    assert during > 0, "the old child served while the new config loaded"
    assert ready["model"] == "a" and ready["status"] == "loaded"
    now = c.models()["a"]
    assert now["pid"] != old["pid"] and now["status"]["value"] == "loaded"
    assert "--tokens-per-s 101" in " ".join(now["status"]["args"])
    assert now["last_eviction"]["reason"] == "reload"
    assert chat(c.port, "a")[0] == 200
    assert "a@next" not in [m["id"] for m in request(c.port, "GET", "/models")[1]["data"]]


def test_with_no_room_for_both_the_old_child_stops_first_and_the_event_says_so(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, models_max=1))
    sse = SSE(c.port)
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    Path(c.log_path).parent.joinpath("corral.toml").write_text(
        toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "101")}}, models_max=1))
    c.proc.send_signal(signal.SIGHUP)
    said = sse.wait_for(lambda e: "stops before the new config loads" in (e.get("cause") or ""))
    sse.close()
    assert "no free slot (models_max 1)" in said["cause"]
    wait_until(lambda: not pid_alive(pid), 10, "the old child to stop")
    assert chat(c.port, "a")[0] == 200 and c.models()["a"]["pid"] != pid


def test_a_reload_that_changes_only_replicas_keeps_the_children(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd(), "replicas": {"min": 2, "max": 2}}},
                           models_max=3))
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: sum(r["state"] == "loaded" for r in c.models()["a"]["replicas"]) == 2,
               30, "two copies loaded")
    pids = [r["pid"] for r in c.models()["a"]["replicas"]]
    write(c, {"a": {"cmd": fake_cmd(), "replicas": {"min": 1, "max": 3}}})
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body
    copies = c.models()["a"]["replicas"]
    assert [r["pid"] for r in copies[:2]] == pids and len(copies) == 3
    assert all(pid_alive(p) for p in pids)


def test_a_model_named_like_another_model_s_alternate_is_refused() -> None:
    import tomllib

    import pytest

    from actors.config.load import parse_config
    from actors.config.model import ConfigError

    with pytest.raises(ConfigError, match=r"models\.a@next: the name is where a reload"):
        parse_config(tomllib.loads(toml_config({"a": {"cmd": ["x"]}, "a@next": {"cmd": ["y"]}})),
                     "t.toml")
