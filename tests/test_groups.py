"""Model groups through a real corral (issue 25): configs written by hand, requests from
the `openai` SDK, fake children. The rules themselves are tested purely in
test_policy_groups.py; here, that they reach the children, the events and the answers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from actors.config.load import load_config
from actors.config.model import ConfigError
from bench.support import toml_value
from tests.helpers import SSE, fake_cmd, request, wait_until

FAKE = toml_value(fake_cmd())
SLOW = toml_value(fake_cmd("--tokens-per-s", "20"))


def sdk(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                         max_retries=0)


def ask(port: int, model: str, tokens: int = 2) -> str:
    said = sdk(port).chat.completions.create(
        model=model, max_tokens=tokens, messages=[{"role": "user", "content": "hi"}])
    return said.model


def test_an_exclusive_group_swaps_its_members_without_cutting_a_request(corral) -> None:
    c = corral(f"""
models_max = 4

[models.coder]
cmd = {SLOW}

[models.writer]
cmd = {FAKE}

[models.embedder]
cmd = {FAKE}

[groups.big]
models = ["coder", "writer"]
exclusive = true
""")
    sse = SSE(c.port)
    assert ask(c.port, "embedder") == "embedder"
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(ask, c.port, "coder", 40)  # 2 s of tokens
        wait_until(lambda: c.models()["coder"]["in_flight"] == 1, 60, "coder busy")
        other = pool.submit(ask, c.port, "writer")
        assert long.result(30) == "coder"  # finished whole: the swap waited for it
        assert other.result(30) == "writer"
    models = c.models()
    assert models["coder"]["status"]["value"] == "unloaded"
    assert models["writer"]["status"]["value"] == "loaded"
    assert models["embedder"]["status"]["value"] == "loaded"  # outsiders untouched
    gone = sse.wait_for(lambda e: e["type"] == "eviction" and e["model"] == "coder")
    assert (gone["reason"], gone["for_model"]) == ("group", "writer")
    assert "exclusive group 'big'" in gone["why"]


def test_a_together_group_loads_and_stops_as_one(corral) -> None:
    c = corral(f"""
[models.chat]
cmd = {FAKE}

[models.embed]
cmd = {FAKE}

[groups.rag]
models = ["chat", "embed"]
together = true
""")
    assert ask(c.port, "chat") == "chat"
    c.wait_state("embed", "loaded")
    status, _, _ = request(c.port, "POST", "/models/unload", {"model": "chat"})
    assert status == 200
    c.wait_state("embed", "unloaded")
    assert c.models()["embed"]["last_eviction"]["reason"] == "group"


def test_a_persistent_group_is_not_evicted_for_others(corral) -> None:
    c = corral(f"""
models_max = 2

[models.a]
cmd = {FAKE}

[models.b]
cmd = {FAKE}

[models.other]
cmd = {FAKE}

[groups.keep]
models = ["a", "b"]
persistent = true
""")
    assert ask(c.port, "a") == "a" and ask(c.port, "b") == "b"
    with pytest.raises(openai.InternalServerError) as info:
        ask(c.port, "other")
    assert info.value.status_code == 503 and "persistent members are never" in str(info.value)
    assert c.state("a") == "loaded" and c.state("b") == "loaded"


@pytest.mark.parametrize(("groups", "says"), [
    ('[groups.g]\nmodels = ["m", "nope"]\nexclusive = true\n',
     "groups.g.models[1]: 'nope' is not a model"),
    ('[groups.g]\nmodels = ["m", "n"]\n', "set exclusive, together or persistent"),
    ('[groups.g]\nmodels = ["m", "n"]\nexclusive = true\ntogether = true\n', "contradict"),
    ('[groups.g]\nmodels = ["m", "m2"]\nexclusive = true\n', "is listed twice"),
    ('[groups.t]\nmodels = ["m", "n"]\ntogether = true\n[groups.u]\nmodels = ["n", "o"]\n'
     'together = true\n[groups.x]\nmodels = ["m", "o"]\nexclusive = true\n',
     "groups.x: ['m', 'o'] are exclusive (one at a time) and load together"),
    ('[groups.t]\nmodels = ["m", "n", "o"]\ntogether = true\n',
     "load together, more than models_max (2)"),
    ('[virtual.m2]\nmodels = ["n"]\n', "virtual.m2: 'm2' is already the name or an alias"),
    ('[virtual.v]\nmodels = ["m", "ghost"]\n', "virtual.v.models[1]: 'ghost' is not a model"),
    ('[virtual.v]\nmodels = ["m"]\npick = "best"\n', "virtual.v.pick"),
])
def test_bad_groups_and_virtual_models_are_named(tmp_path: Path, groups: str,
                                                 says: str) -> None:
    path = tmp_path / "corral.toml"
    path.write_text('models_max = 2\n[models.m]\ncmd = ["x"]\naliases = ["m2"]\n'
                    '[models.n]\ncmd = ["y"]\n[models.o]\ncmd = ["z"]\n' + groups)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize("kind", ["exclusive", "together"])
def test_a_pinned_member_of_an_exclusive_or_together_group_is_refused(tmp_path: Path,
                                                                      kind: str) -> None:
    path = tmp_path / "corral.toml"
    path.write_text('[models.m]\ncmd = ["x"]\npinned = true\n[models.n]\ncmd = ["y"]\n'
                    f'[groups.g]\nmodels = ["m", "n"]\n{kind} = true\n')
    with pytest.raises(ConfigError, match="'m' is pinned"):
        load_config(path)
