"""Lifecycle hooks through a real corral (issue 25): configs written by hand, real hook
processes, fake children. Each hook appends what it was given to a file, so the test
reads the order they ran in and the placeholders they got."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import psutil
import pytest

from actors.config import ConfigError
from actors.config_load import load_config
from bench.support import toml_value
from tests.helpers import fake_cmd, request, wait_until

FAKE = toml_value(fake_cmd())
NOTE = "import sys; open(sys.argv[1], 'a').write(' '.join(sys.argv[2:]) + chr(10))"


def note(path: Path, *words: str) -> str:
    return toml_value([sys.executable, "-c", NOTE, str(path), *words])


def ask(port: int, model: str) -> str:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0)
    return client.chat.completions.create(
        model=model, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).model


def sleeper(marker: str) -> str:
    """A hook that sleeps a minute, findable by `marker` in its command line."""
    return toml_value([sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"])


def no_process_with(marker: str) -> bool:
    return not any(marker in " ".join(p.info["cmdline"] or [])
                   for p in psutil.process_iter(["cmdline"]))


def test_hooks_run_in_order_with_their_placeholders_and_log(corral, tmp_path: Path) -> None:
    ran = tmp_path / "ran.txt"
    c = corral(f"""
[hooks]                       # every model's, unless its own table sets one
after_exit = {note(ran, "after_exit", "{model}", "{reason}")}

[models.m]
cmd = {FAKE}

[models.m.hooks]              # its own, event by event
before_load = {note(ran, "before_load", "{model}", "[{pid}]")}
after_ready = {note(ran, "after_ready", "{model}", "{pid}", "{port}")}
before_stop = {note(ran, "before_stop", "{model}", "{reason}", "{pid}")}
""")
    assert ask(c.port, "m") == "m"
    pid = c.models()["m"].get("pid")
    assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
    wait_until(lambda: ran.exists() and "after_exit" in ran.read_text(), what="after_exit")
    lines = [line.split() for line in ran.read_text().splitlines()]
    assert [w[0] for w in lines] == ["before_load", "after_ready", "before_stop",
                                     "after_exit"]
    assert lines[0] == ["before_load", "m", "[]"]  # no child yet: no pid
    after_ready = lines[1]
    assert after_ready[1] == "m" and after_ready[2].isdigit() and after_ready[3].isdigit()
    if pid is not None:
        assert int(after_ready[2]) == pid
    assert lines[2][:3] == ["before_stop", "m", "manual"] and lines[2][3] == after_ready[2]
    assert lines[3] == ["after_exit", "m", "manual"]
    def log() -> str:
        return str(request(c.port, "GET", "/models/logs?model=m")[1])

    wait_until(lambda: "corral: hook after_exit done" in log(), what="after_exit's end logged")
    assert "corral: hook before_load:" in log()


def test_a_failing_before_load_fails_the_load_saying_why(corral) -> None:
    fail = toml_value([sys.executable, "-c", "print('no GPU today'); raise SystemExit(3)"])
    c = corral(f"""
[models.m]
cmd = {FAKE}
hooks = {{ before_load = {fail} }}
""")
    with pytest.raises(openai.InternalServerError) as info:
        ask(c.port, "m")
    said = str(info.value)
    assert "before_load hook failed" in said and "exited with status 3: no GPU today" in said
    model = c.models()["m"]
    assert model["status"]["value"] == "unloaded" and model["status"]["failed"]


def test_after_ready_warms_the_child_before_its_first_grant(corral) -> None:
    warm = toml_value([sys.executable, "-c", (
        "import sys, urllib.request, json; urllib.request.urlopen(urllib.request.Request("
        "'http://127.0.0.1:' + sys.argv[1] + '/v1/completions', data=json.dumps("
        "{'prompt': 'warm', 'max_tokens': 1}).encode(), headers={'Content-Type': "
        "'application/json'}), timeout=10).read()"), "{port}"])
    c = corral(f"""
[models.m]
cmd = {FAKE}
hooks = {{ after_ready = {warm} }}
""")
    assert ask(c.port, "m") == "m"
    status, stats, _ = request(c.port, "GET", "/debug/stats?model=m")
    assert status == 200, stats
    assert stats["started"] == 2 and stats["completed"] == 2  # the warm-up, then ours


def test_a_hook_past_its_timeout_is_killed_and_fails_the_load(corral) -> None:
    marker = "corral-hook-sleeper-4711"
    c = corral(f"""
[models.m]
cmd = {FAKE}
hook_timeout_s = 0.5
hooks = {{ before_load = {sleeper(marker)} }}
""")
    with pytest.raises(openai.InternalServerError, match=r"hook_timeout_s=0\.5"):
        ask(c.port, "m")
    wait_until(lambda: no_process_with(marker), what="the hook gone")


def test_a_stop_during_before_load_ends_the_hook_and_starts_no_child(corral) -> None:
    marker = "corral-hook-sleeper-4712"
    c = corral(f"""
[models.m]
cmd = {FAKE}
hooks = {{ before_load = {sleeper(marker)} }}
""")
    assert request(c.port, "POST", "/models/load", {"model": "m"})[0] == 200
    wait_until(lambda: not no_process_with(marker), what="the hook running")
    assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
    c.wait_state("m", "unloaded")
    wait_until(lambda: no_process_with(marker), what="the hook gone")
    assert "pid" not in c.models()["m"] or c.models()["m"].get("pid") is None


def test_an_unknown_hook_placeholder_is_named(tmp_path: Path) -> None:
    path = tmp_path / "corral.toml"
    path.write_text('[models.m]\ncmd = ["x"]\nhooks = { after_ready = ["warm", "{prot}"] }\n')
    with pytest.raises(ConfigError, match=r"models.m.hooks.after_ready\[1\]: unknown "
                                          r"placeholder \{prot\}"):
        load_config(path)
