"""A model's `stop_cmd` (a container's `docker stop`): run to stop a ready child before
its signals, with {model}, {port} and {pid} filled; the child has stop_timeout_s to go,
then SIGTERM and SIGKILL as ever."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from tests.helpers import Corral, chat, fake_cmd, pid_alive, request, toml_config, wait_until

STOPPER = ("import os, signal, sys; open(sys.argv[1], 'w').write(' '.join(sys.argv[2:])); "
           "os.kill(int(sys.argv[3]), signal.SIGKILL)")


def test_stop_cmd_stops_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    said = tmp_path / "said"
    config = toml_config({"m": {"cmd": fake_cmd("--ignore-sigterm"), "stop_timeout_s": 60,
                                "stop_cmd": [sys.executable, "-c", STOPPER, str(said),
                                             "{model}", "{pid}", "{port}"]}})
    with Corral(config) as c:
        assert chat(c.port, "m")[0] == 200
        entry = c.models()["m"]
        pid = request(entry["port"], "GET", "/debug/stats")[1]["pid"]
        began = time.monotonic()
        assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
        c.wait_state("m", "unloaded")
        assert time.monotonic() - began < 30  # (its stop_timeout_s is 60: stop_cmd did it)
        assert said.read_text() == f"m {pid} {entry['port']}"
        assert not pid_alive(pid)
        assert "stopping m#1 (manual): stop_cmd, SIGTERM after 60 s, SIGKILL after 2 s" in c.log()


def test_a_stop_cmd_that_does_nothing_is_followed_by_the_signals(tmp_path: Path) -> None:
    config = toml_config({"m": {"cmd": fake_cmd("--ignore-sigterm"), "stop_timeout_s": 0.5,
                                "stop_cmd": [sys.executable, "-c", "import time; "
                                             "time.sleep(600)"]}})
    with Corral(config) as c:
        assert chat(c.port, "m")[0] == 200
        assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
        c.wait_state("m", "unloaded", 30)
        assert "ignored stop_cmd for 0.5 s; SIGTERM" in c.log()
        wait_until(lambda: "ignored SIGTERM for 2 s; SIGKILL" in c.log(), 10, "the SIGKILL")
        # the stop_cmd that outlasted its step was ended with it, not left behind
        assert not [p for p in psutil.Process(c.proc.pid).children(recursive=True)
                    if "time.sleep(600)" in " ".join(p.cmdline())]


def test_what_a_stop_cmd_leaves_running_is_ended_and_one_that_cannot_run_waits_for_nothing(
        tmp_path: Path) -> None:
    marker = f"corral-stop-cmd-{tmp_path.name}"
    config = toml_config({
        "m": {"cmd": fake_cmd(), "stop_timeout_s": 30,  # (SIGTERM ends it: the leftover)
              "stop_cmd": ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(301)' "
                           f"{marker} & kill {{pid}}"]},
        "n": {"cmd": fake_cmd(), "stop_timeout_s": 30, "stop_cmd": ["/nonexistent/stop"]}})
    with Corral(config) as c:
        for model in ("m", "n"):
            assert chat(c.port, model)[0] == 200
        began = time.monotonic()
        for model in ("m", "n"):
            assert request(c.port, "POST", "/models/unload", {"model": model})[0] == 200
            c.wait_state(model, "unloaded", 20)
        assert time.monotonic() - began < 20  # (neither waited its 30 s)
        assert "stop_cmd ['/nonexistent/stop'] cannot run (no such program); SIGTERM now" \
            in c.log()

        def left() -> list[psutil.Process]:
            return [p for p in psutil.process_iter(["cmdline"])
                    if marker in " ".join(p.info["cmdline"] or [])]
        wait_until(lambda: not left(), 10, "the stop_cmd's leftover to be ended")


@pytest.mark.parametrize("model, expected", [
    ({"stop_cmd": ["docker", "stop", "{host}"]},
     "models.m.stop_cmd[2]: unknown placeholder {host}; use {model}, {port} or {pid}"),
    ({"stop_cmd": []}, "models.m.stop_cmd: Expected `array` of length >= 1"),
])
def test_a_bad_stop_cmd_is_named(model: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"cluster": {"nodes": ["n1"]}, "models": {"m": {"cmd": ["x"], **model}}},
                     "c.toml")
    assert expected in str(e.value)
