"""Every way a model starts by itself, through `corral serve` from a config file (issue 37).

The first device report used to reach the Scheduler before the ModelInstances were
registered: a `warm` model's load then crashed it (`KeyError`), and corral exited 0. Each
start-time path the pure policy can take is run here once through the real start: warm
(loaded at start, woken, re-warmed after the big one leaves), load_on_startup, pinned,
replicas.min > 1, downloads remembered. Adopted children are tests/test_cluster.py's
`test_a_restarted_head_adopts_the_running_children` (Ray, in a private namespace).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers import ROOT, SSE, chat, fake_cmd, request, toml_config, wait_until

QUICK = fake_cmd("--load-delay", "0.3")
SLEEPY = fake_cmd("--load-delay", "0.3", "--sleep-mode", "--wake-s", "0.1")


def spawns(log: str, model: str) -> int:
    return log.count(f"spawned {model}#")


@pytest.mark.parametrize("models_max", [1, 2])
def test_a_warm_model_is_loaded_at_start_with_nothing_asked(corral, models_max: int) -> None:
    """The issue's config as a user wrote it: no devices, so no measuring delays the
    first device report (the crash)."""
    c = corral(toml_config({"small": {"cmd": QUICK, "warm": True}, "big": {"cmd": QUICK}},
                           models_max=models_max))
    c.wait_state("small", "loaded")
    assert c.state("big") == "unloaded"
    assert chat(c.port, "big")[0] == 200
    assert c.proc.poll() is None
    assert "died" not in c.log() and "Traceback" not in c.log()


def test_a_warm_model_evicted_comes_back_once_the_big_one_leaves(corral) -> None:
    c = corral(toml_config({"small": {"cmd": QUICK, "warm": True}, "big": {"cmd": QUICK}},
                           models_max=1))
    c.wait_state("small", "loaded")
    sse = SSE(c.port)
    try:
        assert chat(c.port, "big")[0] == 200
        eviction = sse.wait_for(lambda e: e["type"] == "eviction")
        assert eviction["model"] == "small"
        status, body, _ = request(c.port, "POST", "/models/unload", {"model": "big"})
        assert status == 200, body
        c.wait_state("small", "loaded")  # re-warmed: a second child
        assert spawns(c.log(), "small") == 2
    finally:
        sse.close()


def test_a_warm_model_suspended_is_woken_where_it_slept(corral) -> None:
    c = corral(toml_config({"small": {"cmd": SLEEPY, "warm": True, "suspend": "vllm",
                                      "suspend_when": "always"},
                            "big": {"cmd": QUICK}}, models_max=1, suspended_max=1))
    first = c.wait_state("small", "loaded")
    assert chat(c.port, "big")[0] == 200
    wait_until(lambda: c.models()["small"]["status"].get("phase") == "suspended", 60,
               "small to be suspended")  # (15 s was too short once, every core busy)
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "big"})
    assert status == 200, body
    woken = c.wait_state("small", "loaded")
    assert woken["pid"] == first["pid"]  # the same process: woken, not loaded again
    assert spawns(c.log(), "small") == 1


def test_models_loaded_at_start_pinned_and_replicated(corral) -> None:
    c = corral(toml_config({
        "boot": {"cmd": QUICK, "load_on_startup": True},
        "keep": {"cmd": QUICK, "load_on_startup": True, "pinned": True},
        "many": {"cmd": QUICK, "replicas": {"min": 2, "max": 3}},
        "warm": {"cmd": QUICK, "warm": True},
    }, models_max=6))
    for model in ("boot", "keep", "warm"):
        c.wait_state(model, "loaded")
    assert chat(c.port, "many")[0] == 200  # its copies load together, on demand
    wait_until(lambda: [r["state"] for r in c.models()["many"]["replicas"]].count("loaded")
               == 2, 20, "many's two copies")
    assert "died" not in c.log()


def test_a_remembered_download_is_served_from_the_start(corral, tmp_path: Path) -> None:
    state = tmp_path / "state"
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (state / "models").mkdir(parents=True)
    (state / "models" / "corral-downloads.json").write_text(json.dumps(
        {"org/tiny": {"format": "snapshot", "path": str(snapshot)}}))
    c = corral(toml_config({"other": {"cmd": QUICK}}, state_dir=str(state),
                           downloads={"snapshot_cmd": QUICK}))
    assert "org/tiny" in c.models()
    assert chat(c.port, "org/tiny")[0] == 200


CRASHING = textwrap.dedent("""
    import sys
    import actors.scheduler as scheduler
    import supervisor

    def boom(self, message):
        raise RuntimeError("a bug in the scheduler")

    if sys.argv[1] == "at-start":
        scheduler.Scheduler.attach = lambda self, *a: boom(self, None)
    else:  # the first GET /devices, once corral listens
        handle = scheduler.Scheduler.on_receive
        def on_receive(self, message):
            if type(message).__name__ == "GetDevices":
                boom(self, message)
            handle(self, message)
        scheduler.Scheduler.on_receive = on_receive
    sys.exit(supervisor.main(["serve", "--config", sys.argv[2], "--port", "0"]))
""")


@pytest.mark.parametrize("when", ["at-start", "running"])
def test_an_actor_crash_ends_corral_with_a_failure_status(tmp_path: Path, when: str) -> None:
    """systemd's Restart=on-failure and container runtimes read the exit status."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml_config({"m": {"cmd": QUICK}}, state_dir=str(tmp_path / "state")))
    proc = subprocess.Popen([sys.executable, "-c", CRASHING, when, str(cfg)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if when == "running":
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "listening on" in line, line
            port = int(line.rsplit(":", 1)[1])
            request(port, "GET", "/devices")  # answered or not: the Scheduler dies of it
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]
    died = [line for line in err.splitlines() if "actor scheduler died" in line]
    assert len(died) == 1 and "a bug in the scheduler" in died[0], err[-3000:]
    # stopped as corral stops, not by an error of its own on the way (the review: a
    # crash in the attach made the API's start raise ActorDeadError out of serve)
    assert "ActorDeadError" not in err and "after a crash of scheduler" in err, err[-3000:]
    assert "did not all exit" not in err, err[-3000:]

