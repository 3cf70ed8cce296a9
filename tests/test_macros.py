"""`${NAME}` and `${env.NAME}` in a config's strings (actors/config/macros.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from tests.helpers import Corral, chat
from tests.test_config import check_config, write


def test_macros_and_the_environment_fill_every_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_TEST_MODELS", "/srv/models")
    config = parse_config({
        "macros": {"models": "${env.CORRAL_TEST_MODELS}", "gguf": "${models}/q.gguf",
                   "ctx": 8192},
        "models": {"q": {"cmd": ["llama-server", "-m", "${gguf}", "-c", "${ctx}"],
                         "env": {"HOME": "${env.CORRAL_TEST_MODELS}", "LITERAL": "$${HOME}"},
                         "aliases": ["${ctx}"]}}}, "c.toml")
    q = config.models["q"]
    assert q.cmd == ["llama-server", "-m", "/srv/models/q.gguf", "-c", "8192"]
    assert q.env == {"HOME": "/srv/models", "LITERAL": "${HOME}"}
    assert q.aliases == ["8192"]  # (a number macro is text, where text is asked for)


@pytest.mark.parametrize("data, expected", [
    ({"models": {"q": {"cmd": ["${nope}"]}}},
     "c.toml: models.q.cmd[0]: ${nope} is not a macro (in [macros]: none;"),
    ({"macros": {"a": "1"}, "models": {"q": {"cmd": ["x"], "aliases": ["${b}"]}}},
     "models.q.aliases[0]: ${b} is not a macro (in [macros]: a;"),
    ({"models": {"q": {"cmd": ["${env.CORRAL_TEST_UNSET}"]}}},
     "models.q.cmd[0]: ${env.CORRAL_TEST_UNSET}: the environment has no"),
    ({"macros": {"9x": "a"}}, "c.toml: macros.9x: a macro's name is letters"),
    ({"macros": {"x": ["a"]}}, "c.toml: macros.x: Expected a string or a number, got list"),
    ({"macros": {"x": True}}, "c.toml: macros.x: Expected a string or a number, got bool"),
    ({"macros": "a"}, "c.toml: macros: Expected a table of names, got str"),
    ({"macros": {"b": "${a}", "a": "1"}}, "c.toml: macros.b: ${a} is not a macro"),
    ({"macros": {"p": 1}, "port": "${p}"}, "c.toml: port: Expected `int`, got `str`"),
])
def test_a_name_that_is_no_macro_is_an_error_naming_its_key(
        data: dict[str, Any], expected: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORRAL_TEST_UNSET", raising=False)
    with pytest.raises(ConfigError) as e:
        parse_config({"models": {"m": {"cmd": ["x"]}}, **data}, "c.toml")
    assert expected in str(e.value)


def test_check_config_and_serve_fill_them(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_TEST_PYTHON", sys.executable)
    text = ('[macros]\nfake = "-m actors.fake_model --host {host} --port {port}"\n'
            'tokens = 3\n'
            '[models.m]\ncmd = ["${env.CORRAL_TEST_PYTHON}", "-m", "actors.fake_model", '
            '"--host", "{host}", "--port", "{port}", "--model", "${name}"]\n')
    result = check_config(write(tmp_path, text))
    assert result.returncode == 2 and "models.m.cmd[8]: ${name} is not a macro" in result.stderr
    text = text.replace('tokens = 3\n', 'tokens = 3\nname = "from-a-macro"\n')
    assert check_config(write(tmp_path, text)).returncode == 0
    with Corral(text) as c:
        status, body = chat(c.port, "m")
        assert status == 200, body
        assert body["model"] == "from-a-macro"  # (the fake child answers with its --model)


def test_a_literal_survives_serves_own_settings() -> None:
    """`serve --port 0` writes the config it read back with its settings and reads it again:
    a `$${` made `${` by the first reading is not a macro the second time."""
    text = ('[models.m]\ncmd = ["' + sys.executable + '", "-m", "actors.fake_model", '
            '"--host", "{host}", "--port", "{port}", "--model", "lit-$${@:2}"]\n')
    with Corral(text) as c:
        status, body = chat(c.port, "m")
        assert status == 200 and body["model"] == "lit-${@:2}", body
