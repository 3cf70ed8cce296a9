"""`ctx = "fit"` over a real llama-server child (issue 44, part 3), host memory counted
(no GPU here). A context probe reads what the model's context costs per token off
llama.cpp's load log; the first load goes at ctx_min and is measured; its figures at
ctx_max follow from the two; a prompt past its context is refused by the child, whose
log line makes it grow beside itself to the most that fits (here ctx_max). Skips
without the binary (`bash scripts/llama-server.sh`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.tiny_gguf import write_tiny_gguf
from tests.helpers import chat, request, toml_config, wait_until
from tests.test_llama_server import BINARY

pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no llama-server here: run `bash scripts/llama-server.sh`")

PER_TOKEN = 2 * 2 * 4 * 16 * 2
"""The tiny model's KV cache per token: K and V, 2 layers, 4 KV heads of 16, f16."""


def test_a_fit_llama_server_is_probed_loads_small_and_grows(corral, tmp_path: Path) -> None:
    gguf = write_tiny_gguf(tmp_path / "m.gguf", context=8192)
    config = toml_config({"m": {
        "cmd": [BINARY, "-m", str(gguf), "-c", "{ctx}", "-np", "1", "--no-warmup",
                "--host", "{host}", "--port", "{port}"],
        "health": "llama", "ctx": "fit", "ctx_min": 512, "ctx_max": 4096}},
        account_host=True, memory_margin_mib=1024, device_poll_s=0.2,
        state_dir=str(tmp_path / "state"), http={"lease_linger_ms": 0})
    c = corral(config)
    wait_until(lambda: c.models()["m"]["memory"]["status"] == "at_load", 30, "the probe")
    assert f"m: its context costs {PER_TOKEN} bytes per token" in c.log()
    assert chat(c.port, "m")[0] == 200
    assert c.models()["m"]["ctx"] == 512
    status, props, _ = request(c.port, "GET", "/props?model=m")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 512, props
    memory = wait_until(lambda: (m := c.models()["m"]["memory"])["status"] == "measured" and m,
                        30, "its first load, measured")
    low, high = memory["min"], memory["max"]
    assert (low["n_ctx"], high["n_ctx"]) == (512, 4096), memory
    grew = sum(d["model"] for d in high["devices"]) - sum(d["model"] for d in low["devices"])
    assert grew == PER_TOKEN * (4096 - 512), memory
    pid = c.models()["m"]["pid"]
    long = {"messages": [{"role": "user", "content": "the " * 400}]}  # (1,625 tokens)
    status, body = chat(c.port, "m", **long)
    assert status == 400 and body["error"]["type"] == "exceed_context_size_error", body
    wait_until(lambda: c.models()["m"].get("ctx") == 4096 and c.models()["m"]["pid"] != pid,
               60, "m, grown")
    assert "grows from 512 to 4096 context (a request of 1625 tokens" in c.log()
    status, props, _ = request(c.port, "GET", "/props?model=m")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 4096, props
    status, body = chat(c.port, "m", **long)
    assert status == 200, body
    # A restart measures nothing again: both contexts' figures are in the cache, and the
    # first load goes with the most that fits.
    again = corral(config)
    memory = wait_until(lambda: (m := again.models()["m"]["memory"])["status"] != "unmeasured"
                        and m, 30, "the cache, read")
    assert memory["status"] == "measured" and (memory["min"], memory["max"]) == (low, high)
    assert chat(again.port, "m")[0] == 200 and again.models()["m"]["ctx"] == 4096
    assert "its context's cost" not in again.log()
