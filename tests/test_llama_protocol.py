"""llama-server's child protocol, spoken by the fake model (R-3.3 `llama`, R-3.4, R-3.6)."""

from __future__ import annotations

from typing import Any

import psutil
import pytest

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


@pytest.mark.parametrize("flags", [(), ("--aiohttp-proxy",)], ids=["front", "aiohttp"])
def test_llama_children_get_a_connection_per_request_others_a_pooled_one(
        corral, flags: tuple[str, ...]) -> None:
    # llama-server holds an HTTP thread per open connection (see router.unpooled)
    c = corral(toml_config({"llama": llama_model(), "plain": {"cmd": fake_cmd()}}), *flags)
    for model in ("llama", "plain") * 3:
        assert chat(c.port, model)[0] == 200
    me = psutil.Process(c.proc.pid)

    def open_to(model: str) -> int:
        port = c.models()[model]["port"]
        return sum(1 for k in me.net_connections("tcp") if k.raddr and k.raddr.port == port
                   and k.status == psutil.CONN_ESTABLISHED)

    assert open_to("plain") == 1  # three requests, one kept-alive connection
    wait_until(lambda: open_to("llama") == 0, what="no connection kept to the llama child")


def test_which_children_are_unpooled() -> None:
    from actors import Config, ModelConfig
    from actors.router import unpooled

    config = Config(models={
        "preset": ModelConfig(cmd=["/opt/llama/llama-server", "--model", "x.gguf"]),
        "protocol": ModelConfig(cmd=["my-wrapper"], health="llama"),
        "other": ModelConfig(cmd=["vllm", "serve"]),
        "lookalike": ModelConfig(cmd=["llama-server-wrapper.sh"])})
    assert unpooled(config) == {"preset", "protocol"}
