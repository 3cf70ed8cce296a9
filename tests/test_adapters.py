"""LoRA adapters as models (issue 41, part 4), through a real corral: with a real
llama-server and tiny adapters made here (scripts/tiny_gguf.py), and with the fake model
as vLLM (`--enable-lora`: its runtime load endpoint)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from bench.support import toml_value
from scripts.tiny_gguf import write_tiny_gguf, write_tiny_lora
from tests.helpers import fake_cmd, key_files, request, wait_until
from tests.test_llama_server import BINARY

VLLM = toml_value(fake_cmd("--enable-lora"))


def ask(port: int, model: str, **extra: Any) -> Any:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                           max_retries=0)
    return client.chat.completions.create(
        model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "hi"}],
        **extra)


# ---------------------------------------------------------------- the config


@pytest.mark.parametrize("models, expected", [
    ({"b": {"cmd": ["x"], "lora_api": "vllm"}, "s": {"base": "b"}},
     "models.b.adapters.s.lora: missing"),
    ({"b": {"cmd": ["x"], "lora_api": "vllm"}, "s": {"base": "b", "lora": "a"},
      "t": {"base": "s", "lora": "a"}}, "models.t.base: 's' is not a model with a child of "
     "its own (an adapter itself)"),
    ({"b": {"cmd": ["x"], "lora_scale": 0.5}}, "models.b.lora_scale: an adapter's; set base"),
    ({"b": {"cmd": ["x"], "lora_api": "vllm"}, "s": {"base": "b", "lora": "a",
                                                      "lora_scale": 0.5}},
     "models.b.adapters.s.scale: vLLM applies an adapter at its own scale"),
    ({"b": {"cmd": ["llama-server", "--lora", "x.gguf"]}, "s": {"base": "b", "lora": "a"}},
     "models.b.cmd: --lora loads adapters that corral cannot tell apart"),
    ({"b": {"cmd": ["llama-server"]}, "s": {"base": "b", "lora": "/a,b.gguf"}},
     "models.b.adapters.s.lora: '/a,b.gguf': llama-server's --lora-scaled cannot take"),
    ({"b": {"cmd": ["x"]}, "s": {"base": "b", "lora": "a"}},
     "models.b.lora_api: corral cannot tell how its server takes LoRA adapters"),
    ({"b": {"cmd": ["x"], "lora_api": "vllm"}, "s": {"base": "nope", "lora": "a"}},
     "models.s.base: 'nope' is not a model with a child of its own (no such model)"),
    ({"b": {"url": "http://a"}, "s": {"base": "b", "lora": "a"}},
     "models.s.base: 'b' is not a model with a child of its own (a remote)"),
    ({"b": {"cmd": ["x"], "lora_api": "vllm"}, "s": {"base": "b", "lora": "a", "ttl_s": 1}},
     "models.s.ttl_s: 's' is an adapter of 'b' (base), served by its children; set this"),
    ({"b": {"cmd": ["llama-server"]}, "s": {"base": "b", "lora": "/nonexistent.gguf"}},
     "models.b.adapters.s.lora: '/nonexistent.gguf' is not a file"),
    ({"b": {"cmd": ["x"], "lora": "a"}}, "models.b.lora: an adapter's; set base"),
    ({"b": {"cmd": ["x"], "lora_api": "vllm", "aliases": ["s"]},
      "s": {"base": "b", "lora": "a"}},
     "models.b.adapters.s: its name is already an alias of model 'b'"),
    ({"b": {"cmd": ["x"], "lora_api": "vllm"}, "s": {"base": "b", "lora": "a",
                                                      "lora_scale": -1}},
     "models.s.lora_scale: Expected `float` >= 0"),
])
def test_an_adapters_bad_keys_are_named(models: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"models": models})
    assert expected in str(info.value)


def test_an_adapter_is_read_into_its_base_and_its_server_gets_them(tmp_path: Path) -> None:
    lora = write_tiny_lora(tmp_path / "a.gguf")
    config = parse_config({"models": {
        "q": {"cmd": ["llama-server", "--port", "{port}"]},
        "q-sql": {"base": "q", "lora": str(lora), "lora_scale": 0.5},
        "v": {"cmd": ["vllm", "serve", "m"], "adapters": {"v-x": {"lora": "org/x"}}}}})
    assert list(config.models) == ["q", "v"]  # an adapter is no model of its own
    assert config.models["q"].argv("q", "h", 7) == [
        "llama-server", "--port", "7", "--lora-scaled", f"{lora}:0"]
    assert config.models["v"].argv("v", "h", 7) == [
        "vllm", "serve", "m", "--enable-lora", "--max-loras", "1"]
    again = parse_config(msgspec.to_builtins(config))  # (read back, as `serve` does)
    assert again.models == config.models


# ---------------------------------------------------------------- vLLM's way (the fake)


def test_an_adapter_is_loaded_into_its_bases_child_at_its_first_request(corral) -> None:
    c = corral(f"""
[models.base]
cmd = {VLLM}
lora_api = "vllm"

[models.sql]
base = "base"
lora = "org/sql-lora"

[models.chat]
base = "base"
lora = "/loras/chat"
""")
    assert ask(c.port, "sql").model == "sql"  # as vLLM answers an adapter: by its name

    def stats() -> dict[str, Any]:
        status, body, _ = request(c.port, "GET", "/debug/stats?model=base")
        assert status == 200, body
        return body  # type: ignore[no-any-return]
    assert stats()["lora_loads"] == 1 and stats()["last_body"]["model"] == "sql"
    assert ask(c.port, "sql").model == "sql" and stats()["lora_loads"] == 1  # once
    assert ask(c.port, "base").model == "base"
    assert ask(c.port, "chat").model == "chat" and stats()["lora_loads"] == 2
    assert c.models()["base"]["loads"] == 1  # no swap: one child all along
    status, body, _ = request(c.port, "GET", "/v1/models/sql")
    assert status == 200 and body["adapter_of"] == "base" and body["lora"] == "org/sql-lora"
    listed = [m["id"] for m in request(c.port, "GET", "/v1/models")[1]["data"]]
    assert listed.index("sql") == listed.index("base") + 1
    # a new child has none: loaded again at its first request
    assert request(c.port, "POST", "/models/unload", {"model": "base"})[0] == 200
    c.wait_state("base", "unloaded")
    assert ask(c.port, "sql").model == "sql" and stats()["lora_loads"] == 1


def test_an_adapter_stays_on_the_copy_that_has_it(corral) -> None:
    c = corral(f"""
[models.base]
cmd = {VLLM}
lora_api = "vllm"
replicas = 2

[models.sql]
base = "base"
lora = "org/sql-lora"
""")
    for _ in range(6):
        assert ask(c.port, "sql").model == "sql"
    wait_until(lambda: len(c.models()["base"]["replicas"]) == 2, 10, "both copies")
    loaded = re.findall(r"adapter 'sql' loaded into", c.log())
    assert len(loaded) == 1, c.log()[-3000:]


def test_a_child_that_cannot_load_an_adapter_is_a_502_that_says_why(corral) -> None:
    c = corral(f"""
[models.base]
cmd = {toml_value(fake_cmd("--enable-lora", "--max-loras", "1"))}
lora_api = "vllm"
adapters = {{ one = {{ lora = "org/one" }}, two = {{ lora = "org/two" }} }}
""")
    assert ask(c.port, "one").model == "one"
    with pytest.raises(openai.APIStatusError) as info:
        ask(c.port, "two")
    assert info.value.status_code == 502
    assert "did not load it: 400" in str(info.value) and "--max-loras" in str(info.value)


# ---------------------------------------------------------------- llama-server's way


@pytest.mark.skipif(BINARY is None, reason="no llama-server here")
def test_a_llama_server_child_serves_its_base_and_each_adapter_without_a_swap(
        corral, tmp_path: Path) -> None:
    base = write_tiny_gguf(tmp_path / "base.gguf", seed=1)
    loras = [write_tiny_lora(tmp_path / f"l{i}.gguf", seed=i) for i in range(2)]
    c = corral(f"""
[models.base]
cmd = {toml_value([BINARY, "-m", str(base), "--host", "{host}", "--port", "{port}", "-c",
                   "256", "--no-warmup"])}

[models.plain]
cmd = {toml_value([BINARY, "-m", str(base), "--host", "{host}", "--port", "{port}", "-c",
                   "256", "--no-warmup"])}

[models.first]
base = "base"
lora = "{loras[0]}"

[models.second]
base = "base"
lora = "{loras[1]}"
lora_scale = 0.8
""")

    def said(model: str) -> str:
        return str(ask(c.port, model, extra_body={"ignore_eos": True}).choices[0]
                   .message.content)
    plain = said("plain")  # the same weights with no adapter at all
    assert said("base") == plain  # its adapters loaded, none applied
    first, second = said("first"), said("second")
    assert len({plain, first, second}) == 3, (plain, first, second)
    assert said("first") == first and said("base") == plain  # back and forth
    assert c.models()["base"]["loads"] == 1  # one child: no swap
    status, body, _ = request(c.port, "GET", "/lora-adapters?model=base")
    assert status == 200 and [a["path"] for a in body] == [str(p) for p in loras]
    assert {a["scale"] for a in body} == {0.0}  # (a request that names none gets none)
    status, body, _ = request(c.port, "POST", "/v1/embeddings", {"model": "first",
                                                                  "input": "x"})
    assert status == 400 and "is an adapter" in body["error"]["message"]
    # a reload that puts an adapter first: the ids each child gives are the ones sent
    third = write_tiny_lora(tmp_path / "l2.gguf", seed=2)
    config = c.log_path.parent / "corral.toml"
    config.write_text(config.read_text().replace(
        '[models.first]', f'[models.third]\nbase = "base"\nlora = "{third}"\n\n'
        '[models.first]'))
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200, body
    assert said("first") == first and said("base") == plain  # old child or new: the same
    wait_until(lambda: request(c.port, "POST", "/v1/chat/completions", {
        "model": "third", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}]})[0] == 200, 30, "the new child")
    assert said("third") not in (plain, first, second)
    assert said("first") == first and said("second") == second


def test_an_adapter_is_a_keys_only_by_its_own_name(corral, tmp_path: Path) -> None:
    keys = key_files(tmp_path, "sql_only", "base_only")
    c = corral(f"""
[keys.sql_only]
key_file = "{keys['sql_only']}"
models = ["sql"]

[keys.base_only]
key_file = "{keys['base_only']}"
models = ["base"]

[models.base]
cmd = {VLLM}
lora_api = "vllm"
adapters.sql = {{ lora = "org/sql-lora" }}
""")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="sql_only-secret",
                           max_retries=0)

    def ask_as(model: str) -> str:
        return str(client.chat.completions.create(
            model=model, max_tokens=2, messages=[{"role": "user", "content": "x"}]).model)
    assert ask_as("sql") == "sql"
    with pytest.raises(openai.PermissionDeniedError):
        ask_as("base")
    assert [m.id for m in client.models.list()] == ["sql"]
    base_only = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1",
                              api_key="base_only-secret", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):  # a fine-tune of its own: not the base's
        base_only.chat.completions.create(model="sql", max_tokens=2,
                                          messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in base_only.models.list()] == ["base"]


def test_an_adapters_home_path_is_read_as_the_child_will_need_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write_tiny_lora(tmp_path / "a.gguf")
    config = parse_config({"models": {"q": {"cmd": ["llama-server"]},
                                      "q-a": {"base": "q", "lora": "~/a.gguf"}}})
    assert config.models["q"].adapters["q-a"].lora == str(tmp_path / "a.gguf")
    assert config.models["q"].argv("q", "h", 1)[-1] == f"{tmp_path / 'a.gguf'}:0"
