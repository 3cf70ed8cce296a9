"""llama-server's child protocol, spoken by the fake model (R-3.3 `llama`, R-3.4, R-3.6)."""

from __future__ import annotations

from typing import Any

import psutil

from tests.helpers import SSE, chat, fake_cmd, request, toml_config, wait_until


def llama_model(*knobs: str, **keys: Any) -> dict[str, Any]:
    # health_path points nowhere: readiness can only come from the `ready` line
    return {"cmd": fake_cmd("--llama-protocol", *knobs), "health": "llama",
            "health_path": "/no-such-path", **keys}


def test_readiness_progress_and_info_come_from_the_state_lines(corral) -> None:
    c = corral(toml_config({"m": llama_model("--load-delay", "0.4")}))
    sse = SSE(c.port)
    assert chat(c.port, "m")[0] == 200
    progress = sse.wait_for(lambda e: e.get("progress") is not None)
    assert progress["status"] == "loading" and progress["progress"]["current"] == "text_model"
    loaded = sse.wait_for(lambda e: e.get("status") == "loaded")
    assert loaded["info"] == {"model": "m", "n_ctx": 4096, "fake": True}
    entry = c.models()["m"]
    assert entry["n_ctx"] == 4096 and entry["fake"] is True  # merged as llama.cpp does
    assert entry["id"] == "m" and entry["owned_by"] == "corral"  # ours are kept
    sse.close()


def test_unload_sends_the_exit_command_and_the_child_leaves_with_status_0(corral) -> None:
    c = corral(toml_config({"m": llama_model()}))
    sse = SSE(c.port)
    assert chat(c.port, "m")[0] == 200
    assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
    done = sse.wait_for(lambda e: e.get("status") == "unloaded")
    assert done["exit_code"] == 0
    _, logs, _ = request(c.port, "GET", "/models/logs?model=m")
    assert "fake_model: exit command received, exiting..." in str(logs)
    assert "ignored the exit command" not in c.log()
    sse.close()


def test_a_child_ignoring_the_exit_command_gets_sigterm_after_stop_timeout(corral) -> None:
    c = corral(toml_config({"m": llama_model("--ignore-exit-command", stop_timeout_s=0.3)}))
    assert chat(c.port, "m")[0] == 200
    assert request(c.port, "POST", "/models/unload", {"model": "m"})[0] == 200
    c.wait_state("m", "unloaded")
    assert "m#1 ignored the exit command for 0.3 s; SIGTERM" in c.log()


def test_a_sleeping_child_keeps_its_slot_wakes_on_a_request_and_can_be_evicted(corral) -> None:
    c = corral(toml_config({"m": llama_model("--sleep-idle-s", "0.2"),
                            "other": {"cmd": fake_cmd()}}, models_max=1))
    sse = SSE(c.port)
    assert chat(c.port, "m")[0] == 200
    c.wait_state("m", "sleeping")
    assert c.models()["m"]["pid"] is not None  # still running, still holding the slot
    status, body = chat(c.port, "m", max_tokens=2)
    assert status == 200 and body["choices"][0]["message"]["content"] == "tok0 tok1 "
    wait_until(lambda: sse.statuses("m")[-2:] == ["sleeping", "loaded"] or None, 5,
               "m to wake up")
    c.wait_state("m", "sleeping")
    assert chat(c.port, "other")[0] == 200  # the sleeping model is the LRU victim
    assert c.models()["m"]["last_eviction"]["reason"] == "lru"
    assert sse.statuses("m")[:4] == ["loading", "loaded", "sleeping", "loaded"]
    sse.close()


def test_llama_children_get_a_capped_pool_others_an_uncapped_one(corral) -> None:
    # llama-server holds an HTTP thread per open connection (edge.llama_pool_cap)
    c = corral(toml_config({"llama": llama_model(), "plain": {"cmd": fake_cmd()}}))
    for model in ("llama", "plain") * 3:
        assert chat(c.port, model)[0] == 200
    me = psutil.Process(c.proc.pid)

    def open_to(model: str) -> int:
        port = c.models()[model]["port"]
        return sum(1 for k in me.net_connections("tcp") if k.raddr and k.raddr.port == port
                   and k.status == psutil.CONN_ESTABLISHED)

    assert open_to("plain") == 1  # three requests, one kept-alive connection
    assert open_to("llama") == 1
    # closed by corral before the child's 5 s keep-alive could close it under a request
    wait_until(lambda: open_to("llama") == 0, timeout_s=8, what="the idle connection closed")


def test_llama_pool_cap_follows_the_childs_http_threads() -> None:
    from actors import Config, ModelConfig
    from actors.http.routes import Routes
    from actors.llama import llama_pool_cap

    assert llama_pool_cap(["llama-server", "-m", "x"], cpus=2) == 6  # np auto 4: 8 threads
    assert llama_pool_cap(["llama-server", "-np", "8"], cpus=2) == 10
    assert llama_pool_cap(["llama-server", "--parallel=2", "--threads-http", "3"]) == 1
    assert llama_pool_cap(["llama-server"], cpus=32) == 29  # max(np + 4, cpus - 1)
    config = Config(models={
        "preset": ModelConfig(cmd=["/opt/llama/llama-server", "--model", "x.gguf"]),
        "protocol": ModelConfig(cmd=["my-wrapper"], health="llama"),
        "other": ModelConfig(cmd=["vllm", "serve"]),
        "lookalike": ModelConfig(cmd=["llama-server-wrapper.sh"])})
    caps = {name: route.pool_cap for name, route in Routes.of(config).models.items()}
    assert caps["other"] is None and caps["lookalike"] is None
    assert caps["preset"] is not None and caps["protocol"] is not None
