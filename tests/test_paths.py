"""Where a name becomes a path (review S2): no model name, alias, download name or config
value makes a path that leaves its own folder, and corral's clean-ups delete only what
corral made. The review's case first: a model named `..` with keep_prompt_cache had its
cache folder in state_dir itself, and its spawn emptied and removed every folder beside
`prompt-cache` (the downloads registry went, and an unrelated folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.config.paths import PLAIN, folder_name
from actors.instance import prompt_cache
from tests.helpers import Corral, chat, fake_cmd, toml_config, wait_until

LLAMA_FAKE = {"cmd": fake_cmd("--llama-protocol"), "health": "llama",
              "keep_prompt_cache": True}


def precious(state: Path) -> dict[str, str]:
    """Files corral did not make, beside and inside where its caches go."""
    files = {"models/corral-downloads.json": "{}", "notes/a.txt": "precious",
             "key-budgets.json": '{"saved_at": 0, "keys": {}}', "12345": "a pid-like name",
             "prompt-cache/mine.txt": "not corral's"}
    for name, text in files.items():
        (state / name).parent.mkdir(parents=True, exist_ok=True)
        (state / name).write_text(text)
    return files


def intact(state: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        assert (state / name).is_file() and (state / name).read_text() == text, (
            f"{name} was deleted or changed; state_dir holds "
            f"{sorted(str(p.relative_to(state)) for p in state.rglob('*'))}")


@given(st.text(max_size=300))
def test_any_name_has_one_folder_inside_its_parent(name: str) -> None:
    folder = folder_name(name)
    assert folder not in ("", ".", "..") and not folder.startswith(".")
    assert "/" not in folder and "\0" not in folder and len(folder.encode()) <= 255
    assert (Path("/root") / folder).parent == Path("/root")
    assert (folder == name) == bool(PLAIN.fullmatch(name))


@given(st.text(max_size=80), st.text(max_size=80))
def test_two_names_never_share_a_folder(a: str, b: str) -> None:
    assert (folder_name(a) == folder_name(b)) == (a == b)


def test_plain_names_are_their_own_folders_and_others_are_tagged() -> None:
    assert folder_name("llama-3.1-8b") == "llama-3.1-8b"
    assert folder_name("models--owner--repo.v2") == "models--owner--repo.v2"
    for name in ("..", ".", "", "org/model", "a\0b", ".hidden", "x" * 300, "caf\u00e9"):
        folder = folder_name(name)
        assert "~" in folder and folder != name, (name, folder)
    assert folder_name("org/model").startswith("org_model~")


def test_a_cache_folder_stays_in_the_cache_root_and_cleans_only_its_own(
        tmp_path: Path) -> None:
    state = tmp_path / "state"
    files = precious(state)
    root = state / "prompt-cache"
    for name in ("..", ".", "../..", "a/../../..", "/etc", ""):
        here = prompt_cache.folder(root, name, "0123456789abcdef")
        assert here.resolve().parent.parent == root.resolve(), (name, here)
    intact(state, files)
    base = prompt_cache.folder(root, "m", "0123456789abcdef").parent
    foreign = base / "fedcba9876543210"  # a digest's name, but corral did not make it
    foreign.mkdir()
    (foreign / "slot0.bin").write_text("someone else's")
    shared = prompt_cache.folder(root, "m", "1111111111111111")  # corral's, with a stranger
    (shared / "slot0.bin").write_text("a slot")
    (shared / "notes.txt").write_text("not corral's")
    prompt_cache.folder(root, "m", "2222222222222222")  # a new digest: drop the old ones
    assert not (base / "0123456789abcdef").exists(), "corral's own old folder is dropped"
    assert (foreign / "slot0.bin").read_text() == "someone else's"
    assert not (shared / "slot0.bin").exists() and (shared / "notes.txt").is_file()
    prompt_cache.prune(root, 0)
    assert (foreign / "slot0.bin").is_file(), "prune deletes only slots in corral's folders"
    intact(state, files)


@pytest.mark.parametrize("name", [".", "..", "a/..", "../b", "/abs", "org//model", "a\0b",
                                  "tab\there", " padded", "c1\x85", "rtl\u202eedoc",
                                  "line\u2028sep", "zero\u200bwidth"])
def test_a_name_that_reads_as_a_path_is_refused(name: str) -> None:
    for data, key in (({"models": {name: {"cmd": ["x"]}}}, f"models.{name!r}"),
                      ({"models": {"m": {"cmd": ["x"], "aliases": [name]}}},
                       "models.m.aliases"),
                      ({"models": {"m": {"cmd": ["x"]}},
                        "virtual": {name: {"models": ["m"]}}}, f"virtual.{name!r}")):
        with pytest.raises(ConfigError) as e:
            parse_config(data, "c.toml")
        assert key in str(e.value), e.value
    assert parse_config({"models": {"org/model-1.5": {"cmd": ["x"]}}}, "c.toml")


@pytest.mark.parametrize("device", [".", "..", ".hidden"])
def test_a_device_name_that_is_no_folder_of_its_own_is_refused(device: str) -> None:
    """A simulated device's ledger is STATE/sim-ledger/<device>, whose dead pids' files
    corral deletes: `..` would have listed state_dir itself."""
    with pytest.raises(ConfigError, match=r"devices\[0\]\.name"):
        parse_config({"devices": [{"name": device, "kind": "simulated", "total_mib": 1}],
                      "models": {"m": {"cmd": ["x"]}}}, "c.toml")


def test_a_model_named_dotdot_through_serve_deletes_nothing(tmp_path: Path) -> None:
    """The review's pc_dotdot.py: corral refuses the name, saying which, and state_dir
    keeps every file. (Before, corral started, and the model's first spawn removed the
    downloads registry, `notes` and `prompt-cache` from state_dir.)"""
    state = tmp_path / "state"
    files = precious(state)
    try:
        c = Corral(toml_config({"..": LLAMA_FAKE}, state_dir=str(state)), home=tmp_path)
    except RuntimeError as e:  # it did not start: its log says why
        refused = str(e)
    else:
        with c:
            chat(c.port, "..")  # its first spawn
        refused = ""
    intact(state, files)
    assert "models.'..'" in refused and "may not be empty, '.' or '..'" in refused, (
        f"corral served a model named '..': {refused}")


def test_a_model_named_like_a_path_keeps_its_cache_inside_the_cache_root(
        tmp_path: Path) -> None:
    """`org/x` is a legal model name: its cache folder is one folder inside
    STATE/prompt-cache, and its spawns leave everything else in state_dir alone."""
    state = tmp_path / "state"
    files = precious(state)
    with Corral(toml_config({"org/x": LLAMA_FAKE}, state_dir=str(state)),
                home=tmp_path) as c:
        assert chat(c.port, "org/x")[0] == 200
        wait_until(lambda: "--slot-save-path" in c.log(), 10, "the spawn's line")
        saved = c.log().split("--slot-save-path ", 1)[1].split()[0]
        assert Path(saved).parent.parent == state / "prompt-cache"
        assert Path(saved).parent.name == folder_name("org/x")
        assert (Path(saved) / prompt_cache.MARKER).is_file()
    intact(state, files)
