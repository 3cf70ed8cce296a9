"""`ctx = "fit"` over a real llama-server child (issue 44, part 3), host memory counted
(no GPU here). A context probe reads what the model's context costs per token off
llama.cpp's load log (at 512 and 1,024: its KV cache, 512 bytes a token, and its compute
buffer's growth); the first load goes at ctx_min and is measured; its figures at
ctx_max follow from the two; a prompt past its context is refused by the child, whose
log line makes it grow beside itself to the most that fits (here ctx_max). Skips
without the binary (`bash scripts/llama-server.sh`)."""

from __future__ import annotations

import re
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
    said = re.search(r"m: its context costs (\d+) bytes per token", c.log())
    assert said is not None, c.log()
    per_token = int(said[1])  # its KV cache's, and the compute buffer's growth (the mask)
    assert PER_TOKEN <= per_token <= 8 * PER_TOKEN, per_token
    assert chat(c.port, "m")[0] == 200
    assert c.models()["m"]["ctx"] == 512
    status, props, _ = request(c.port, "GET", "/props?model=m")
    assert status == 200 and props["default_generation_settings"]["n_ctx"] == 512, props
    memory = wait_until(lambda: (m := c.models()["m"]["memory"])["status"] == "measured" and m,
                        30, "its first load, measured")
    low, high = memory["min"], memory["max"]
    assert (low["n_ctx"], high["n_ctx"]) == (512, 4096), memory
    grew = sum(d["model"] for d in high["devices"]) - sum(d["model"] for d in low["devices"])
    assert grew == per_token * (4096 - 512), memory
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


def fit_config(tmp_path: Path, cmd: list[str], ctx_min: int = 512, ctx_max: int = 4096,
               **top: object) -> str:
    return toml_config({"m": {"cmd": cmd, "health": "llama", "ctx": "fit",
                              "ctx_min": ctx_min, "ctx_max": ctx_max}},
                       account_host=True, memory_margin_mib=1024, device_poll_s=0.2,
                       state_dir=str(tmp_path / "state"), http={"lease_linger_ms": 0}, **top)


def args(gguf: Path, *more: str) -> list[str]:
    assert BINARY is not None
    return [BINARY, "-m", str(gguf), "-c", "{ctx}", *more, "--no-warmup", "--host", "{host}",
            "--port", "{port}"]


def test_with_parallel_slots_it_grows_only_to_what_holds_the_prompt_in_a_slot(
        corral, tmp_path: Path) -> None:
    """`-np 2`: each slot has half the context (llama-server's refusal says the slot's).
    1,625 tokens past 512 a slot: ctx_max 2048 (1,024 a slot) would hold it no better,
    so it is not grown; with ctx_max 4096 it grows to 4096, and the prompt fits a slot."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", context=8192)
    long = {"messages": [{"role": "user", "content": "the " * 400}]}  # (1,625 tokens)
    for ctx_max, grows in ((2048, False), (4096, True)):
        (home := tmp_path / str(ctx_max)).mkdir()
        c = corral(fit_config(home, args(gguf, "-np", "2"), ctx_min=1024, ctx_max=ctx_max))
        assert chat(c.port, "m")[0] == 200
        wait_until(lambda c=c: c.models()["m"]["memory"]["status"] == "measured", 30,
                   "measured")
        pid = c.models()["m"]["pid"]
        assert chat(c.port, "m", **long)[0] == 400
        if not grows:
            wait_until(lambda c=c: "not grown" in c.log(), 15, "the refusal, seen")
            assert "(512 a slot) and ctx_max 2048" in c.log()
            assert c.models()["m"]["pid"] == pid
            continue
        wait_until(lambda c=c, pid=pid: c.models()["m"].get("ctx") == 4096
                   and c.models()["m"]["pid"] != pid, 60, "m, grown")
        assert chat(c.port, "m", **long)[0] == 200


def test_a_probe_of_a_quiet_llama_server_reads_its_log_all_the_same(
        corral, tmp_path: Path) -> None:
    """`--log-disable` (and `--no-mmap`, `--mlock`) are the model's, not its probe's: the
    probe reads llama.cpp's log and ends once the model is loaded, not at its deadline,
    and the measure queue behind it is not held."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", context=8192)
    c = corral(fit_config(tmp_path, args(gguf, "--log-disable", "--no-mmap", "--mlock"),
                          measure_timeout_s=25))
    wait_until(lambda: c.models()["m"]["memory"]["status"] == "at_load", 15, "the probe")
    assert "m: its context costs" in c.log() and "not read" not in c.log()


def test_a_probe_that_failed_is_run_again_at_the_next_start(corral, tmp_path: Path) -> None:
    """Its first run fails (a wrapper that exits 1 once: a port taken, a slow disk): the
    model is measured at ctx_min by its first load, and none of it is cached; the next
    start probes again, reads the cost, and the model is then fitted to ctx_max."""
    gguf = write_tiny_gguf(tmp_path / "m.gguf", context=8192)
    marker = tmp_path / "failed-once"
    wrapper = tmp_path / "llama-server"  # (named so: a llama child)
    wrapper.write_text(f"#!/bin/sh\nif [ \"$CORRAL_ROLE\" = measure ] && [ ! -e {marker} ]; "
                       f"then\n  touch {marker}; echo 'no luck' >&2; exit 1\nfi\n"
                       f"exec {BINARY} \"$@\"\n")
    wrapper.chmod(0o755)
    config = fit_config(tmp_path, [str(wrapper), *args(gguf, "-np", "1")[1:]])
    c = corral(config)
    wait_until(lambda: c.models()["m"]["memory"]["status"] == "at_load", 30, "the probe")
    assert "its context's cost was not read" in c.log() and "measuring m failed" not in c.log()
    assert chat(c.port, "m")[0] == 200 and c.models()["m"]["ctx"] == 512
    wait_until(lambda: c.models()["m"]["memory"]["status"] == "measured", 30, "measured")
    c.stop()
    again = corral(config)
    wait_until(lambda: again.models()["m"]["memory"]["status"] == "at_load", 30, "probed")
    assert "m: its context costs" in again.log()
    assert chat(again.port, "m")[0] == 200
    wait_until(lambda: again.models()["m"]["memory"]["status"] == "measured", 30, "measured")
    status, plan, _ = request(again.port, "POST", "/models/unload", {"model": "m"})
    again.wait_state("m", "unloaded")
    status, plan, _ = request(again.port, "GET", "/models/plan?model=m")
    assert status == 200 and plan["ctx"] == 4096, plan
