"""ctx = "fit" models that come and go by config reloads (issue 44, part 3), each found by
a hostile review: one added by a reload grows (its alternate has a config), and one removed
and added back with another cmd grows with the new cmd, not the removed one's."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import chat, pid_alive, request, wait_until
from tests.test_context import GROWS
from tests.test_memory import measured, mem_config, sized


def test_a_fit_model_added_by_a_reload_grows(corral, tmp_path) -> None:
    c = corral(mem_config(tmp_path, {"a": sized(6144)}, http={"lease_linger_ms": 0}))
    path = Path(c.log_path).parent / "corral.toml"
    path.write_text(mem_config(tmp_path, {"a": sized(6144), "b": GROWS},
                               http={"lease_linger_ms": 0}))
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body
    measured(c, "b")
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: c.models()["a"]["memory"]["effective"], 15, "a's use, charged")
    assert chat(c.port, "b")[0] == 200
    assert c.models()["b"]["ctx"] == 8192
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert status == 200, body
    c.wait_state("a", "unloaded")
    had = c.models()["b"]["ctx"]
    pid = c.models()["b"]["pid"]
    long = {"messages": [{"role": "user", "content": "word " * 10000}]}
    status, body = chat(c.port, "b", **long)
    assert status == 400, body
    wait_until(lambda: c.models()["b"].get("ctx", 0) > had
               and c.models()["b"]["pid"] != pid, 20, "b, grown")
    assert "Traceback" not in c.log()


def test_remove_then_readd_a_grown_fit_model(corral, tmp_path) -> None:
    def cfg(models: dict) -> str:
        return mem_config(tmp_path, models, http={"lease_linger_ms": 0})

    c = corral(cfg({"a": sized(6144), "b": GROWS}))
    path = Path(c.log_path).parent / "corral.toml"
    measured(c, "b")
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: c.models()["a"]["memory"]["effective"], 15, "a's use, charged")
    assert chat(c.port, "b")[0] == 200
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    c.wait_state("a", "unloaded")
    pid1 = c.models()["b"]["pid"]
    long = {"messages": [{"role": "user", "content": "word " * 10000}]}
    assert chat(c.port, "b", **long)[0] == 400
    wait_until(lambda: c.models()["b"]["pid"] != pid1 and c.models()["b"].get("ctx", 0) > 8192,
               30, "b, grown")
    pid2 = c.models()["b"]["pid"]
    path.write_text(cfg({"a": sized(6144)}))
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body
    wait_until(lambda: not pid_alive(pid1) and not pid_alive(pid2), 15, "b's children gone")
    # b comes back with a different cmd (a marker arg)
    grows2 = {**GROWS, "cmd": GROWS["cmd"] + ["--load-delay", "0.01"]}
    path.write_text(cfg({"a": sized(6144), "b": grows2}))
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body
    measured(c, "b")
    assert chat(c.port, "a")[0] == 200
    wait_until(lambda: c.models()["a"]["memory"]["effective"], 15, "a's use, charged")
    assert chat(c.port, "b")[0] == 200
    request(c.port, "POST", "/models/unload", {"model": "a"})
    c.wait_state("a", "unloaded")
    pid3 = c.models()["b"]["pid"]
    assert chat(c.port, "b", **long)[0] == 400
    wait_until(lambda: c.models()["b"]["pid"] != pid3, 30, "b, grown again")
    spawned = [line for line in c.log().splitlines() if "spawned b" in line]
    assert "--load-delay 0.01" in spawned[-1], spawned[-1]
