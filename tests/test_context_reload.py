"""ctx = "fit" models that come and go by config reloads (issue 44, part 3), each found by
a hostile review: one added by a reload grows (its alternate has a config), and one removed
and added back with another cmd grows with the new cmd, not the removed one's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.helpers import chat, pid_alive, request, wait_until
from tests.test_context import GROWS
from tests.test_memory import measured, mem_config, sized

LONG = {"messages": [{"role": "user", "content": "word " * 10000}]}


def config(tmp_path: Path, **models: dict[str, Any]) -> str:
    return mem_config(tmp_path, models, http={"lease_linger_ms": 0})


def reload(c: Any, text: str) -> None:
    (Path(c.log_path).parent / "corral.toml").write_text(text)
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body


def grow(c: Any) -> int:
    """b loads small beside the 6 GiB a; a goes; a prompt past b's context is refused,
    and b grows beside itself; the pid of b's child before it grew."""
    measured(c, "b")
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: c.models()["a"]["memory"]["effective"], 15, "a's use, charged")
    assert chat(c.port, "b")[0] == 200
    assert c.models()["b"]["ctx"] == 8192
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert status == 200, body
    c.wait_state("a", "unloaded")
    pid = c.models()["b"]["pid"]
    status, body = chat(c.port, "b", **LONG)
    assert status == 400, body
    wait_until(lambda: c.models()["b"].get("ctx", 0) > 8192 and c.models()["b"]["pid"] != pid,
               30, "b, grown")
    return int(pid)


def test_a_fit_model_added_by_a_reload_grows(corral, tmp_path) -> None:
    c = corral(config(tmp_path, a=sized(6144)))
    reload(c, config(tmp_path, a=sized(6144), b=GROWS))
    grow(c)
    assert "Traceback" not in c.log()


def test_remove_then_readd_a_grown_fit_model(corral, tmp_path) -> None:
    c = corral(config(tmp_path, a=sized(6144), b=GROWS))
    first = grow(c)
    grown = c.models()["b"]["pid"]
    reload(c, config(tmp_path, a=sized(6144)))
    wait_until(lambda: not pid_alive(first) and not pid_alive(grown), 15, "b's children gone")
    marked = {**GROWS, "cmd": [*GROWS["cmd"], "--load-delay", "0.01"]}  # (another cmd)
    reload(c, config(tmp_path, a=sized(6144), b=marked))
    grow(c)
    spawned = [line for line in c.log().splitlines() if "spawned b" in line]
    assert "--load-delay 0.01" in spawned[-1], spawned[-1]
