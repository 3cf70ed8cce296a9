"""Config decoding and `corral check-config`: errors name the file, the key path and the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.config.load import load_config
from actors.config.model import ConfigError
from tests.helpers import ROOT


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "check-config",
                           str(path)], capture_output=True, text=True, timeout=30)


def test_a_good_config_loads_with_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, 'models_max = 1\n[models.m]\ncmd = ["x", "{port}"]\n'))
    assert cfg.host == "127.0.0.1" and cfg.port == 8080 and cfg.models_max == 1
    m = cfg.models["m"]
    assert (m.health_path, m.load_timeout_s, m.stop_timeout_s) == ("/health", 600.0, 10.0)
    result = check_config(write(tmp_path, '[models.m]\ncmd = ["x"]\n'))
    assert result.returncode == 0 and "ok (1 models)" in result.stdout


@pytest.mark.parametrize("text, expected", [
    ('[models.m]\ncmd = "x"\n', "models.m.cmd: Expected `array`, got `str`"),
    ('[models.m]\ncmd = ["x"]\nbogus = 1\n', "models.m: Object contains unknown field `bogus`"),
    ('prot = 1\n', ": Object contains unknown field `prot`"),
    ('[models.m]\ncmd = []\n', "models.m.cmd: missing; set cmd (the child's argv) or url"),
    ('models_max = -1\n', "models_max: Expected `int` >= 0"),
    ('[models.m]\ncmd = ["x"]\nstop_timeout_s = 0\n', "models.m.stop_timeout_s"),
    ('[models.m]\ncmd = ["x", "{prot}"]\n', "models.m.cmd[1]: unknown placeholder {prot}"),
    ('[models.m]\ncmd = ["x"]\naliases = ["n"]\n[models.n]\ncmd = ["y"]\n',
     "models.m.aliases: 'n' is already the name or an alias of model 'n'"),
    ('[models.m\n', "not valid TOML"),
    ('[models.m]\nurl = "ftp://x"\n', "models.m.url: 'ftp://x' must be http://"),
    ('[peers.p]\nurl = "http://x"\nmodels = []\n', "peers.p.models: empty"),
    ('[models.m]\ncmd = ["x"]\n[models.a]\nbase = "m"\nlora = "l"\n',
     "models.m.lora_api: corral cannot tell how its server takes LoRA adapters"),
])
def test_bad_configs_name_file_key_and_problem(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(f"{path}: ")
    assert expected in str(info.value)
    result = check_config(path)
    assert result.returncode == 2
    assert str(path) in result.stderr and expected in result.stderr


def test_missing_file_is_exit_2(tmp_path: Path) -> None:
    result = check_config(tmp_path / "absent.toml")
    assert result.returncode == 2 and "cannot read the config file" in result.stderr


def test_serve_with_a_bad_config_exits_2(tmp_path: Path) -> None:
    path = write(tmp_path, "models_max = 'two'\n")
    result = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "serve", "--config",
                             str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "models_max: Expected `int`, got `str`" in result.stderr


def test_api_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k123\n")
    cfg = load_config(write(tmp_path, f'api_key_file = "{key}"\n'))
    assert cfg.api_key == "k123"


def test_every_corral_subcommand_says_what_it_does_with_an_example() -> None:
    import subprocess
    import sys

    from tests.helpers import ROOT

    for command in ("serve", "check-config", "models", "status", "devices", "load", "unload"):
        out = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), command, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "example" in out.stdout and f"corral {command}" in out.stdout, out.stdout


@pytest.mark.parametrize("text, expected", [
    ('api_key = " k "\n', "api_key: the key contains spaces"),
    ('api_key = "k\\t"\n', "api_key: the key contains spaces"),
])
def test_a_key_with_spaces_is_a_config_error(tmp_path: Path, text: str, expected: str) -> None:
    """R13: such a key passed check-config and then never matched any client's."""
    with pytest.raises(ConfigError, match=expected):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("content, error", [
    ("k123\n", None), ("k123\r\n", None), ("k123", None),
    (" k123\n", "contains spaces"), ("k 123\n", "contains spaces"), ("\n", "is empty"),
])
def test_a_key_files_line_break_is_dropped_and_spaces_refused(
        tmp_path: Path, content: str, error: str | None) -> None:
    key = tmp_path / "key"
    key.write_text(content)
    text = f'api_key_file = "{key}"\n'
    if error is None:
        assert load_config(write(tmp_path, text)).api_key == "k123"
    else:
        with pytest.raises(ConfigError, match=f"api_key_file: {key}.*{error}|{error}"):
            load_config(write(tmp_path, text))
