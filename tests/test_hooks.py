"""Lifecycle hooks through a real corral (issue 25): configs written by hand, real hook
processes, fake children. Each hook appends what it was given to a file, so the test
reads the order they ran in and the placeholders they got."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import openai
import psutil
import pytest

from actors.config.load import load_config
from actors.config.model import ConfigError
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
    wait_until(lambda: ran.exists() and "after_exit" in ran.read_text(), 60,
               "after_exit")  # (a busy machine: the stop and the hook's start took 10 s)
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


class Told:
    """Records what an instance tells (its own inbox, or the Scheduler)."""

    def __init__(self) -> None:
        self.told: list[object] = []

    def tell(self, message: object) -> None:
        self.told.append(message)


def test_a_killed_hooks_late_end_does_not_touch_the_next_child(tmp_path: Path) -> None:
    """Review: a child crashing while its after_ready hook ran left the hook awaited, and
    the killed hook's late end SIGKILLed the next generation's child as a failed hook.
    A ModelInstance driven directly, its inbox recorded."""
    import os
    import signal

    from actors.childproc import LogRing
    from actors.config.hooks import Hooks
    from actors.config.model import ModelConfig
    from actors.instance.actor import ModelInstance

    inbox = Told()

    class NoTimers:
        def after(self, *args: object) -> None:
            pass

    config = ModelConfig(cmd=fake_cmd(), hooks=Hooks(after_ready=["sleep", "30"]),
                         hook_timeout_s=60)
    inst = ModelInstance("m", config, scheduler=Told(), timers=NoTimers(),  # type: ignore[arg-type]
                         log_ring=LogRing(), on_crash=lambda *_: None)
    inst.hooks.inbox = inbox  # type: ignore[assignment]  # what its hooks tell, recorded
    inst.handle_start(1, config)
    assert inst.child is not None
    inst.become_ready(None)  # the after_ready hook runs
    os.kill(inst.child.pid, signal.SIGKILL)  # the child crashes meanwhile
    wait_until(lambda: inst.child is not None and inst.child._popen.poll() is not None)
    inst.handle_exited(inst.spawn_id)
    inst.handle_start(2, config)  # loaded again for a request that waits
    second = inst.child
    assert second is not None
    try:
        wait_until(lambda: inbox.told, what="the killed hook's end")
        ran = inbox.told.pop(0)
        inst.handle_hook_ran(ran.hook_id, ran.hook, ran.failure)  # type: ignore[attr-defined]
        # a kill of the new child would have set its cause first, in this very call
        assert inst.cause is None and inst.phase.value == "starting"
        assert second._popen.poll() is None
    finally:
        inst.hooks.kill()
        second.signal_group(signal.SIGKILL)
        wait_until(lambda: second._popen.poll() is not None)
        second.reap()


def test_a_hooks_grandchildren_die_with_a_killed_corral(corral) -> None:
    """Review: the death signal reached the hook's `sh` only; its `sleep` outlived a
    SIGKILLed corral. The hook's group leader (hook_shim.py) takes the group down."""
    marker = "corral-hook-grandchild-4713"
    hook = toml_value(["sh", "-c", f"sleep 300 # {marker}"])
    c = corral(f"""
[models.m]
cmd = {FAKE}
hooks = {{ before_load = {hook} }}
""")
    assert request(c.port, "POST", "/models/load", {"model": "m"})[0] == 200
    wait_until(lambda: not no_process_with(marker), what="the hook's sleep running")
    c.proc.kill()
    c.proc.wait(10)
    # (its shim sweeps every process of the machine: on a busy one that takes seconds;
    # the bug left the sleep for its 300 s)
    wait_until(lambda: no_process_with(marker), 30, what="the hook's sleep gone")


def setsid_hook(marker: str, then: str, env: str = "", fast: bool = False) -> str:
    """A hook whose `python` starts its own session (out of the hook's process group) and
    sleeps, findable by `marker`; `then` is the rest of the hook's shell line. `env`
    goes before it (`env -i`: it has no environment, so no marker either). `fast`: a
    `setsid sh` instead, out of the group within milliseconds (a busy machine's python
    can take longer to start than a short hook_timeout_s gives it)."""
    escape = f"import os, time; os.setsid(); time.sleep(300)  # {marker}"
    start = (f"setsid sh -c 'sleep 300; : {marker}'" if fast
             else f"{sys.executable} -c '{escape}'")
    return toml_value(["sh", "-c", f"{env} {start} > /dev/null 2>&1 "
                       f"< /dev/null & sleep 0.5; {then}"])


def left_its_group(marker: str) -> bool:
    """Whether the hook's `python -c ...` with `marker` leads a session of its own (the
    hook's group leader, whose argv holds the marker too, leads one from the start)."""
    for p in psutil.process_iter(["cmdline"]):
        argv = p.info["cmdline"] or []
        try:
            if argv[1:2] == ["-c"] and marker in argv[-1] and os.getsid(p.pid) == p.pid:
                return True
        except OSError:
            continue
    return False


def hooked(corral, hook: str, top: str = ""):
    """A corral whose one model `m` has `hook` (TOML) as its before_load hook."""
    return corral(f"{top}\n[models.m]\ncmd = {FAKE}\nhooks = {{ before_load = {hook} }}\n")


def test_a_hook_that_leaves_its_group_ends_with_it(corral) -> None:
    """S10: a hook's `setsid` process outlived the hook, and corral."""
    marker = "corral-hook-setsid-5120"
    c = hooked(corral, setsid_hook(marker, "echo forked"))
    assert request(c.port, "POST", "/models/load", {"model": "m"})[0] == 200
    c.wait_state("m", "loaded", 60)  # the hook has ended: its load went on (a busy
    # machine: the sweep of what the hook left took over 15 s once)
    wait_until(lambda: no_process_with(marker), 30, "the hook's setsid process gone")


def test_a_hook_that_leaves_its_group_dies_with_a_killed_corral(corral) -> None:
    marker = "corral-hook-setsid-5121"
    c = hooked(corral, setsid_hook(marker, "sleep 300"))
    assert request(c.port, "POST", "/models/load", {"model": "m"})[0] == 200
    wait_until(lambda: left_its_group(marker), what="the setsid process running")
    c.proc.kill()
    c.proc.wait(10)
    wait_until(lambda: no_process_with(marker), 30, "the setsid process gone")


def test_a_hook_killed_by_its_timeout_takes_what_left_its_group(corral) -> None:
    marker = "corral-hook-setsid-5122"
    c = hooked(corral, setsid_hook(marker, "sleep 300", env="env -i", fast=True),
               "hook_timeout_s = 5")
    request(c.port, "POST", "/models/load", {"model": "m"})
    wait_until(lambda: left_its_group(marker), 30, "the setsid process running")
    c.wait_state("m", "failed", 60)
    wait_until(lambda: no_process_with(marker), 30, "the setsid process gone")


def test_what_a_hook_forks_as_it_exits_ends_with_it(corral) -> None:
    """The review of the fix: a hook whose background loop kept forking `setsid env -i`
    processes as it exited left some behind (one sweep saw only those already there)."""
    marker = "sleep 51237"  # (a `sleep` starts fast enough to race the sweep)
    loop = (f"(i=0; while [ $i -lt 400 ]; do setsid env -i {marker} > /dev/null 2>&1 "
            "< /dev/null & i=$((i+1)); sleep 0.002; done) &")
    c = hooked(corral, toml_value(["sh", "-c", f"{loop} sleep 0.3; exit 0"]))
    assert request(c.port, "POST", "/models/load", {"model": "m"})[0] == 200
    c.wait_state("m", "loaded", 60)  # (as above: the sweep on a busy machine)
    wait_until(lambda: no_process_with(marker), 15, "every process the hook forked gone")


def test_a_hook_whose_leader_is_too_slow_to_sweep_still_takes_what_left_its_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy machine's CI run: the group leader (hook_shim.py), told to end a hook that
    had timed out, had not found what left its group within END_GRACE_S; the group's
    SIGKILL then orphaned a `setsid env -i` process that no sweep could find again (no
    mark, no parent chain). A grace of 0 is the slowest leader there is."""
    from actors.childproc import LogRing
    from actors.instance import hooks

    marker = "corral-hook-slow-leader-7341"
    monkeypatch.setattr(hooks, "END_GRACE_S", 0.0)
    argv = ["sh", "-c", f"env -i setsid sh -c 'sleep 300; : {marker}' > /dev/null 2>&1 "
            "< /dev/null & sleep 300"]
    run = hooks.HookRun()
    escaped = threading.Event()

    def watch() -> None:
        wait_until(lambda: left_its_group(marker), 30, "the setsid process running")
        escaped.set()
        run.kill()
    threading.Thread(target=watch, daemon=True).start()
    try:
        failure = run.run("before_load", argv, 60, LogRing())
        assert escaped.is_set() and failure is not None and "stopped" in failure
        wait_until(lambda: no_process_with(marker), 10, "the setsid process gone")
    finally:
        for p in psutil.process_iter(["cmdline"]):
            if marker in " ".join(p.info["cmdline"] or []):
                p.kill()
