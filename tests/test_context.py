"""`ctx = "fit"` through `corral serve` (issue 44, part 3): a fake child whose KV cache
takes 256 MiB per 1,024 tokens, beside a 3 GiB model on a 10 GiB simulated device with a
1 GiB margin. It loads with the most context that fits beside (20,480 tokens: 1 GiB of
weights and 5 GiB of cache in the 6 GiB free), its `{ctx}` filled in; the plan says
what that gave up; bad context keys are refused naming the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, chat, fake_cmd, pid_alive, request, wait_until
from tests.test_memory import devices, measured, mem_config, sized

MiB = 1024 * 1024
KV = {"cmd": fake_cmd("--device-mib", "1024", "--ctx-mib-per-1k", "256", "--n-ctx", "{ctx}"),
      "ctx": "fit", "ctx_min": 2048, "ctx_max": 32768}


def test_a_fit_model_loads_with_the_most_context_beside_what_is_up(corral, tmp_path) -> None:
    c = corral(mem_config(tmp_path, {"a": sized(3072), "b": KV},
                          http={"lease_linger_ms": 0}))  # (a is idle once it answered)
    assert chat(c.port, "a")[0] == 200
    measured(c, "b")
    wait_until(lambda: c.models()["a"]["memory"]["effective"], 15, "a's use, charged")
    status, plan, _ = request(c.port, "GET", "/models/plan?model=b")
    assert status == 200 and plan["decision"] == "load" and plan["ctx"] == 20480, plan
    assert plan["ctx_note"] == "at 32768 context it would evict a; at 20480 it fits beside them"
    assert not plan.get("evict"), plan
    assert chat(c.port, "b")[0] == 200
    models = c.models()
    assert models["b"]["ctx"] == 20480 and models["a"]["status"]["value"] == "loaded"
    status, props, _ = request(c.port, "GET", "/props?model=b")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 20480, props
    held = devices(c.port)["gpu0"]["held"]
    assert held["b"] == (1024 + 256 * 20) * MiB, held
    assert "at 20480 context" in c.log()


def test_context_keys_at_fault_are_refused_naming_the_key(tmp_path: Path) -> None:
    for keys, said in (({"ctx": "fit"}, "models.b.ctx_max"),
                       ({"ctx": "fit", "ctx_max": 1024}, "models.b.ctx_min"),
                       ({"ctx": 4096, "cmd": fake_cmd()}, "models.b.ctx"),
                       ({"cmd": fake_cmd("--n-ctx", "{ctx}")}, "models.b.cmd"),
                       ({"ctx": 4096, "ctx_max": 8192}, "models.b.ctx_max"),
                       ({"ctx": "fit", "ctx_max": 8192, "memory_mib": {"gpu0": 1024}},
                        "models.b.ctx")):
        model = {"cmd": KV["cmd"], **keys}
        cfg = tmp_path / "c.toml"
        cfg.write_text(mem_config(tmp_path, {"b": model}))
        run = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "check-config",
                              str(cfg)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 2 and said in run.stderr, (keys, run.stderr)


def test_a_fixed_ctx_is_filled_in(corral, tmp_path) -> None:
    c = corral(mem_config(tmp_path, {"b": {"cmd": KV["cmd"], "ctx": 8192}}))
    assert chat(c.port, "b")[0] == 200
    status, props, _ = request(c.port, "GET", "/props?model=b")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 8192, props
    assert "ctx" not in c.models()["b"]


GROWS = {"cmd": fake_cmd("--device-mib", "1024", "--ctx-mib-per-1k", "256", "--n-ctx", "{ctx}",
                         "--llama-protocol"),
         "health": "llama", "measure": "command", "ctx": "fit", "ctx_min": 2048,
         "ctx_max": 32768}


def test_a_fit_model_grows_beside_itself_once_a_request_needs_more(corral, tmp_path) -> None:
    """b loads with 8,192 context beside a 6 GiB model (3 GiB free); a prompt of 10,000
    tokens is refused by b's child as past its context (as llama-server does, with its
    log line), and there is no room to grow; a goes; the next such prompt is refused
    too, and b reloads beside its old child with the most context that now fits (the
    old one's 3 GiB still held: 6 GiB free, 20,480 tokens), which then stops."""
    c = corral(mem_config(tmp_path, {"a": sized(6144), "b": GROWS},
                          http={"lease_linger_ms": 0}))
    assert chat(c.port, "a")[0] == 200
    measured(c, "b")
    wait_until(lambda: c.models()["a"]["memory"]["effective"], 15, "a's use, charged")
    assert chat(c.port, "b")[0] == 200
    assert c.models()["b"]["ctx"] == 8192
    long = {"messages": [{"role": "user", "content": "word " * 10000}]}
    status, body = chat(c.port, "b", **long)
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error", body
    said = ("not grown (a request of 10000 tokens, more than its 8192 context): no room "
            "beside what is up")
    wait_until(lambda: said in c.log(), 15, "the hit, seen")
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "a"})
    assert status == 200, body
    c.wait_state("a", "unloaded")
    old_pid = c.models()["b"]["pid"]
    status, body = chat(c.port, "b", **long)
    assert status == 400, "this one is refused too: the grown child is not ready yet"
    wait_until(lambda: c.models()["b"].get("ctx") == 20480 and c.models()["b"]["pid"] != old_pid,
               30, "b, grown")
    assert "grows from 8192 to 20480 context (a request of 10000 tokens" in c.log()
    status, body = chat(c.port, "b", **long)
    assert status == 200, body
    wait_until(lambda: not pid_alive(old_pid), 30, "the old child, stopped")
    held = wait_until(lambda: len(h := devices(c.port)["gpu0"]["held"]) == 1 and h, 15,
                      "the old child's memory, given back")
    assert list(held.values()) == [(1024 + 256 * 20) * MiB], held


def test_fit_without_memory_accounting_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(mem_config(tmp_path, {"b": KV}, memory_margin_mib=0))
    run = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "check-config",
                          str(cfg)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "models.b.ctx" in run.stderr \
        and "memory accounting is off" in run.stderr, run.stderr


def test_a_probe_that_reads_no_context_cost_loads_at_ctx_min_and_stays_there(
        corral, tmp_path) -> None:
    """A llama child (measured by its first load) whose context probe fails (the fake
    refuses llama-server's flags): it is measured by its first load all the same, at
    ctx_min, the one context its figures hold for, and loads there again."""
    model = {**GROWS, "measure": "probe"}
    c = corral(mem_config(tmp_path, {"b": model}))
    wait_until(lambda: c.models()["b"]["memory"]["status"] == "at_load", 15, "the probe")
    assert "its context's cost was not read" in c.log()
    assert chat(c.port, "b")[0] == 200
    assert c.models()["b"]["ctx"] == 2048
    wait_until(lambda: c.models()["b"]["memory"]["status"] == "measured", 60, "its load")
    status, body, _ = request(c.port, "POST", "/models/unload", {"model": "b"})
    assert status == 200, body
    c.wait_state("b", "unloaded")
    status, plan, _ = request(c.port, "GET", "/models/plan?model=b")
    assert status == 200 and plan["ctx"] == 2048, plan
