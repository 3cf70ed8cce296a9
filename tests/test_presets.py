"""llama.cpp presets and models dirs, parsed without a llama-server binary (R-2.4)."""

from __future__ import annotations

from pathlib import Path

import pytest

from actors.config.model import ConfigError
from actors.config.presets import LlamaArgs, load_models_dir, load_preset_file, parse_ini

# A slice of `llama-server --help`, in its exact layout (common_arg::to_string).
HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
-c,    --ctx-size N                     size of the prompt context (default: 0, 0 = loaded from model)
                                        (env: LLAMA_ARG_CTX_SIZE)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
                                        (env: LLAMA_ARG_FLASH_ATTN)
--warmup, --no-warmup                   whether to perform warmup with an empty run (default: enabled)
--mmproj-auto, --no-mmproj, --no-mmproj-auto
                                        whether to use multimodal projector file (if available), useful when
                                        using -hf (default: enabled)
                                        (env: LLAMA_ARG_MMPROJ_AUTO)
-m,    --model FNAME                    model path to load
                                        (env: LLAMA_ARG_MODEL)
-mm,   --mmproj FILE                    path to a multimodal projector file
                                        (env: LLAMA_ARG_MMPROJ)
-a,    --alias STRING                   set model name aliases, comma-separated (to be used by API)
                                        (env: LLAMA_ARG_ALIAS)
--port PORT                             port to listen (default: 8080)
                                        (env: LLAMA_ARG_PORT)
--no-perf-extra                         an ordinary flag that happens to start with no-
--sleep-idle-seconds SECONDS            number of seconds of idleness after which the server will sleep
"""  # noqa: E501


@pytest.fixture
def table() -> LlamaArgs:
    return LlamaArgs.from_help(HELP)


def test_help_parsing_finds_names_values_negations_and_env(table) -> None:
    model = table.by_key["m"]
    assert model is table.by_key["model"] is table.by_key["LLAMA_ARG_MODEL"]
    assert model.flag == "--model" and model.takes_value
    warmup = table.by_key["no-warmup"]
    assert warmup.names == ("--warmup",) and warmup.negatives == ("--no-warmup",)
    assert not warmup.takes_value
    mmproj_auto = table.by_key["LLAMA_ARG_MMPROJ_AUTO"]  # env on the third help line
    assert mmproj_auto.negatives == ("--no-mmproj", "--no-mmproj-auto")
    assert table.by_key["no-perf-extra"].names == ("--no-perf-extra",)
    assert table.by_key["fa"].takes_value and table.by_key["h"].names[-1] == "--usage"
    assert table.by_key["stop-timeout"].preset_only


def test_the_global_section_cascades_and_values_become_arguments(tmp_path, table) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text("""\
version = 1
; a comment
[*]
c = 4096            # trailing comment
no-warmup = true
LLAMA_ARG_FLASH_ATTN = on

[chat:q4_k_m]
model = /m/chat.gguf
c = 8192
alias = chat, assistant
stop-timeout = 3
warmup = off
port = 9999

[embed]
m = /m/embed.gguf
mmproj-auto = false
""")
    presets = load_preset_file(ini, table)
    assert list(presets) == ["chat:Q4_K_M", "embed"]  # quantization tags canonical
    chat = presets["chat:Q4_K_M"]
    assert chat.args() == ["--ctx-size", "8192", "--no-warmup", "--flash-attn", "on",
                           "--model", "/m/chat.gguf"]  # port is the router's to set
    assert chat.get("LLAMA_ARG_ALIAS") == "chat, assistant" and chat.get("stop-timeout") == "3"
    assert presets["embed"].args() == ["--ctx-size", "4096", "--no-warmup", "--flash-attn",
                                       "on", "--model", "/m/embed.gguf", "--no-mmproj-auto"]


def test_keys_before_any_section_are_a_model_named_default(tmp_path, table) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text("model = /m/x.gguf\n")
    assert list(load_preset_file(ini, table)) == ["default"]


@pytest.mark.parametrize(("text", "message"), [
    ("[m]\nctx = 1\n", "p.ini: [m]: ctx: not a llama-server argument"),
    ("[*]\nbogus = 1\n", "p.ini: [*]: bogus: not a llama-server argument"),
    ("[m]\njust words\n", "p.ini: line 2: expected `key = value` or `[section]`"),
    ("[m\nmodel = x\n", "p.ini: line 1: a section header is `[name]`"),
])
def test_preset_errors_name_the_file_section_and_key(tmp_path, table, text, message) -> None:
    ini = tmp_path / "p.ini"
    ini.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_preset_file(ini, table)
    assert str(err.value).startswith(str(tmp_path)) and message in str(err.value)


def test_ini_values_end_at_a_comment_character() -> None:
    assert parse_ini("[a]\nk = v ; c\nj=w#x\n", "f") == {"a": {"k": "v", "j": "w"}}


def test_models_dir_lists_files_and_folders(tmp_path: Path, table) -> None:
    for name in ("solo.gguf", "mmproj-solo.gguf", "mtp-solo.gguf", "notes.txt",
                 "big/big-00002-of-00002.gguf", "big/big-00001-of-00002.gguf",
                 "vision/model.gguf", "vision/mmproj-model.gguf", "empty/readme.md"):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    presets = load_models_dir(tmp_path, table)
    assert sorted(presets) == ["big", "solo", "vision"]
    assert presets["big"].get("LLAMA_ARG_MODEL") == str(tmp_path / "big/big-00001-of-00002.gguf")
    assert presets["vision"].args() == ["--model", str(tmp_path / "vision/model.gguf"),
                                        "--mmproj", str(tmp_path / "vision/mmproj-model.gguf")]
    with pytest.raises(ConfigError, match="does not exist or is not a directory"):
        load_models_dir(tmp_path / "nope", table)
