"""What a model is, in /v1/models (issue 39, part 5): `context_length`, `modalities`,
`capabilities` and `metadata` from the config, or read from a llama child's /props once
it is loaded and remembered across restarts; `unlisted` models served but not listed;
aliases listed as entries with `include_aliases`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from tests.helpers import chat, fake_cmd, request, toml_config, wait_until


def listed(port: int, path: str = "/v1/models") -> dict[str, dict[str, Any]]:
    status, body, _ = request(port, "GET", path)
    assert status == 200, body
    return {e["id"]: e for e in body["data"]}


def config(tmp_path: Path, **top: Any) -> str:
    return toml_config({
        "llm": {"cmd": fake_cmd("--llama-protocol", "--n-ctx", "8192", "--vision"),
                "health": "llama", "aliases": ["llm-latest"]},
        "told": {"cmd": fake_cmd("--llama-protocol"), "health": "llama",
                 "context_length": 32768, "modalities": ["text", "audio"],
                 "capabilities": ["chat", "tools"],
                 "metadata": {"name": "Told", "tags": ["a", "b"]}},
        "embed": {"cmd": fake_cmd("--embedding")},
        "hidden": {"cmd": fake_cmd(), "unlisted": True}},
        state_dir=str(tmp_path / "state"), models_max=4, **top)


def test_the_config_says_what_a_model_is(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path))
    seen = listed(c.port)
    told = seen["told"]
    assert (told["context_length"], told["modalities"], told["capabilities"]) == (
        32768, ["text", "audio"], ["chat", "tools"])
    assert told["metadata"] == {"name": "Told", "tags": ["a", "b"]}
    assert seen["embed"]["capabilities"] == ["embedding"]  # its argv says so
    assert seen["embed"]["modalities"] == ["text"] and seen["embed"]["context_length"] is None
    assert "metadata" not in seen["embed"]


def test_a_llama_childs_props_fill_it_in_and_are_remembered(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path))
    assert listed(c.port)["llm"]["context_length"] is None  # not loaded yet: not known
    assert chat(c.port, "llm")[0] == 200
    llm = wait_until(lambda: (e := listed(c.port)["llm"])["context_length"] and e,
                     what="the child's /props read")
    assert llm["context_length"] == 8192 and llm["modalities"] == ["text", "image"]
    assert chat(c.port, "told")[0] == 200  # the config wins over what its child says
    wait_until(lambda: "told" in (tmp_path / "state" / "model-cards.json").read_text()
               if (tmp_path / "state" / "model-cards.json").exists() else False,
               what="the told model's card saved")
    assert listed(c.port)["told"]["context_length"] == 32768
    c.stop(keep_home=True)
    again = corral(config(tmp_path))  # a restart: unloaded, and still known
    llm = listed(again.port)["llm"]
    assert llm["status"]["value"] == "unloaded" and llm["context_length"] == 8192


def test_a_changed_command_forgets_what_its_old_child_said(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path))
    assert chat(c.port, "llm")[0] == 200
    wait_until(lambda: listed(c.port)["llm"]["context_length"], what="the card read")
    c.stop(keep_home=True)
    changed = config(tmp_path).replace('"8192"', '"2048"')
    again = corral(changed)
    assert listed(again.port)["llm"]["context_length"] is None  # another child now


def test_an_unlisted_model_is_served_but_not_listed(corral, tmp_path: Path) -> None:
    c = corral(config(tmp_path))
    assert "hidden" not in listed(c.port)
    assert "hidden" in listed(c.port, "/models")  # corral's own listing shows it
    assert chat(c.port, "hidden")[0] == 200
    sdk = openai.OpenAI(api_key="none", base_url=f"{c.url}/v1", max_retries=0)
    assert "hidden" not in [m.id for m in sdk.models.list().data]


def test_aliases_are_listed_as_entries_when_asked(corral, tmp_path: Path) -> None:
    plain = corral(config(tmp_path))
    assert "llm-latest" not in listed(plain.port)
    plain.stop()
    c = corral(config(tmp_path, include_aliases=True))
    seen = listed(c.port)
    assert seen["llm-latest"]["alias_of"] == "llm"
    assert seen["llm-latest"]["status"] == seen["llm"]["status"]
    assert "alias_of" not in seen["llm"]
    assert "llm-latest" not in listed(c.port, "/models")


def test_a_wrong_card_value_is_refused_saying_where() -> None:
    for key, value, said in (("modalities", ["video"], "models.m.modalities"),
                             ("capabilities", ["chat", 1], "models.m.capabilities"),
                             ("context_length", 0, "models.m.context_length"),
                             ("metadata", [1], "models.m.metadata"),
                             ("unlisted", "yes", "models.m.unlisted")):
        with pytest.raises(ConfigError, match=said.replace(".", r"\.")):
            parse_config({"models": {"m": {"cmd": ["x"], key: value}}}, "c.toml")
