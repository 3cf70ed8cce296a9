"""Prompt caches that survive a swap (issue 23, `keep_prompt_cache`), over real
llama-server children: saved before corral stops a child, restored after its next ready
and before its first request, dropped when they might not match the model."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.instance import prompt_cache
from scripts.tiny_gguf import write_tiny_gguf
from tests.helpers import request, toml_config, wait_until
from tests.test_llama_server import BINARY

pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no llama-server here: run `bash scripts/llama-server.sh` "
    "(or set LLAMA_SERVER) to build it")

PROMPT = "Remember this: " + "the quick brown fox jumps over the lazy dog. " * 4


def llama(model: Path) -> dict[str, Any]:
    assert BINARY is not None
    return {"cmd": [BINARY, "-m", str(model), "--host", "{host}", "--port", "{port}",
                    "-c", "512", "-np", "1", "-t", "1", "--no-warmup"],
            "health": "llama", "keep_prompt_cache": True}


def setup(tmp: Path, corral: Any) -> tuple[Any, Path]:
    for seed, name in ((1, "a"), (2, "b")):
        write_tiny_gguf(tmp / f"{name}.gguf", seed=seed)
    state = tmp / "state"
    c = corral(toml_config({"a": llama(tmp / "a.gguf"), "b": llama(tmp / "b.gguf")},
                           models_max=1, state_dir=str(state)))
    return c, state / "prompt-cache" / "a"


def turn(port: int, model: str) -> dict[str, Any]:
    status, body, _ = request(port, "POST", "/v1/chat/completions", {
        "model": model, "max_tokens": 2, "ignore_eos": True,
        "messages": [{"role": "user", "content": PROMPT}]})
    assert status == 200, body
    return body  # type: ignore[no-any-return]


def test_an_evicted_childs_slots_come_back_before_its_first_request(corral,
                                                                     tmp_path) -> None:
    c, cache = setup(tmp_path, corral)
    first = turn(c.port, "a")
    assert first["timings"]["cache_n"] == 0
    turn(c.port, "b")  # a is evicted: its slot is saved first
    files = list(cache.rglob("slot0.bin"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    pid_before = c.models()["a"]["pid"]
    again = turn(c.port, "a")  # a new child, its slot restored before this request
    assert c.models()["a"]["pid"] != pid_before
    prompt_n = first["usage"]["prompt_tokens"]
    assert again["timings"]["cache_n"] >= prompt_n - 2, (
        "the new child reused the restored prompt (its own count)", again["timings"])
    assert "prompt tokens restored" in c.log() and "prompt tokens saved" in c.log()


def test_a_cache_that_might_not_match_the_model_is_dropped_not_used(corral,
                                                                     tmp_path) -> None:
    c, cache = setup(tmp_path, corral)
    turn(c.port, "a")
    turn(c.port, "b")
    old = {p.parent.name for p in cache.rglob("slot0.bin")}
    assert len(old) == 1
    before = (tmp_path / "a.gguf").stat().st_mtime_ns
    write_tiny_gguf(tmp_path / "a.gguf", seed=7)  # another model under the same name
    os.utime(tmp_path / "a.gguf", ns=(before + 10**9, before + 10**9))  # any file system
    again = turn(c.port, "a")
    assert again["timings"]["cache_n"] == 0, "a stale cache was restored"
    assert not (cache / old.pop()).exists(), "the old digest's folder is gone"


def test_a_failed_restore_only_costs_the_cache(corral, tmp_path) -> None:
    c, cache = setup(tmp_path, corral)
    turn(c.port, "a")
    turn(c.port, "b")
    (slot,) = cache.rglob("slot0.bin")
    slot.write_bytes(b"not a slot file")
    again = turn(c.port, "a")
    assert again["timings"]["cache_n"] == 0
    assert not slot.exists(), "a file llama-server refused is dropped"
    assert "not restored" in c.log()


def test_prune_drops_the_oldest_files_first(tmp_path) -> None:
    for i, name in enumerate(("old", "mid", "new")):
        path = tmp_path / "m" / name / "slot0.bin"
        path.parent.mkdir(parents=True)
        (path.parent / prompt_cache.MARKER).touch()  # corral's own folder
        path.write_bytes(b"x" * 1000)
        os.utime(path, ns=(i * 10**9, i * 10**9))
    prompt_cache.prune(tmp_path, 2500)
    assert sorted(p.parent.name for p in tmp_path.rglob("slot*.bin")) == ["mid", "new"]


def test_keep_prompt_cache_is_for_llama_server_children_only() -> None:
    with pytest.raises(ConfigError, match=r"models\.m\.keep_prompt_cache: only for llama-server"):
        parse_config({"models": {"m": {"cmd": [sys.executable], "keep_prompt_cache": True}}},
                     "c.toml")


def test_a_reload_that_changed_only_a_rule_keeps_the_cache(corral, tmp_path) -> None:
    c, _ = setup(tmp_path, corral)
    turn(c.port, "a")
    models = {"a": {**llama(tmp_path / "a.gguf"), "stop_timeout_s": 7},
              "b": llama(tmp_path / "b.gguf")}
    (Path(c.log_path).parent / "corral.toml").write_text(toml_config(
        models, models_max=1, state_dir=str(tmp_path / "state")))
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body
    wait_until(lambda: c.models()["a"]["status"]["value"] == "unloaded", 10,
               "a to restart for its new rules")
    again = turn(c.port, "a")
    assert again["timings"]["cache_n"] > 0, "its cache came back after the restart"
