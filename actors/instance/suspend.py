"""How a child is suspended and woken (corral's suspended tier, issue 23): the blocking
calls that carry out a model's `suspend` key (actors/config/suspend.py) on a
ModelInstance's helper thread. A suspended child keeps its process and gives its devices
back, its memory moved to host RAM by whatever its method does; a wake brings it back.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable

import psutil

from ..config.suspend import Step, Suspend, SuspendCommands
from . import childcall

PLACEHOLDER = re.compile(r"\{(pid|port|model)\}")
ANSWER_MAX = 1 << 20
"""A child's answer to a suspend step's request longer than this fails the step."""

def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and its descendants (0 if it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.Error:
            continue
    return total


def run(how: Suspend, step: Step, *, model: str, host: str, port: int, pid: int,
        timeout_s: float, say: Callable[[str], None], key: str | None = None) -> str | None:
    """Suspend (`sleep`) or wake the child, all within `timeout_s` (a child that answers
    a byte at a time fails at that deadline: review S6); None when it did, else why
    not. `say`: a line for the model's log; `key`: the one the child requires."""
    deadline = time.monotonic() + timeout_s
    if how == "vllm":
        path = "/sleep?level=1" if step == "sleep" else "/wake_up"
        why = _request(host, port, "POST", path, deadline, timeout_s, key)
        if why is not None:
            return why
        return _check_vllm(host, port, step == "sleep", deadline, timeout_s, key)
    assert isinstance(how, SuspendCommands)
    target = how.sleep_http if step == "sleep" else how.wake_http
    if target is not None:
        method, path = target.split(" ", 1)
        return _request(host, port, method, path, deadline, timeout_s, key)
    argv = how.sleep if step == "sleep" else how.wake
    assert argv is not None
    values = {"pid": str(pid), "port": str(port), "model": model}
    argv = [PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in argv]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not finish within suspend_timeout_s={timeout_s:g}"
    except OSError as e:
        return f"cannot run {argv[0]}: {e.strerror or e}"
    for line in (done.stdout + done.stderr).splitlines():
        say(f"corral: {step}: {line}")
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()
        return (f"{argv[0]} exited with status {done.returncode}"
                + (f": {last[-1][:200]}" if last else ""))
    return None


def switch(how: Suspend, step: Step, *, model: str, host: str, port: int, pid: int,
           timeout_s: float, say: Callable[[str], None],
           done: Callable[[str | None, int], None], key: str | None = None) -> None:
    """`run`, then `done(failure, grew)`: what the process' resident memory grew by
    (measured for a `sleep` only). On a ModelInstance's helper thread."""
    before = tree_rss(pid) if step == "sleep" else 0
    try:
        failure = run(how, step, model=model, host=host, port=port, pid=pid,
                      timeout_s=timeout_s, say=say, key=key)
    except Exception as e:  # never leave the instance waiting for an answer
        failure = f"{type(e).__name__}: {e}"
    done(failure, max(0, tree_rss(pid) - before) if step == "sleep" and not failure else 0)


def _request(host: str, port: int, method: str, path: str, deadline: float,
             timeout_s: float, key: str | None) -> str | None:
    try:
        status, body = childcall.call(host, port, method, path, deadline=deadline,
                                      max_bytes=ANSWER_MAX, key=key)
    except TimeoutError:
        return f"{method} {path}: no whole answer within suspend_timeout_s={timeout_s:g}"
    except (OSError, ValueError) as e:
        return f"{method} {path}: {type(e).__name__}: {e}"
    if not 200 <= status < 300:
        return f"{method} {path} answered {status}: {body[:300].decode(errors='replace')}"
    return None


def _check_vllm(host: str, port: int, asleep: bool, deadline: float,
                timeout_s: float, key: str | None) -> str | None:
    """vLLM answers /sleep and /wake_up before it is done on some versions: its
    /is_sleeping says whether it is."""
    try:
        _, body = childcall.call(host, port, "GET", "/is_sleeping", deadline=deadline,
                                 max_bytes=ANSWER_MAX, key=key)
        said = json.loads(body or b"{}")
    except TimeoutError:
        return f"GET /is_sleeping: no whole answer within suspend_timeout_s={timeout_s:g}"
    except (OSError, ValueError) as e:
        return f"GET /is_sleeping: {type(e).__name__}: {e}"
    if not isinstance(said, dict) or said.get("is_sleeping") is not asleep:
        return f"GET /is_sleeping said {said!r} after the {'sleep' if asleep else 'wake'}"
    return None
