"""Downloads after the hostile review (issue 37): names as the README documents them and
nothing more (S12), a damaged registry set aside while corral starts and reloads (S3),
and bounds on what downloads may take: how many run at once, how big, how much disk they
leave, how many failures stay listed, and DELETE /models (S4). Real corrals, a fake hub
on loopback (tests/fake_hub.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import psutil
import pytest

from actors.config.downloads import DownloadsConfig
from actors.config.load import parse_config
from actors.config.model import ConfigError
from actors.downloads import limits
from actors.downloads.jobs import QUEUED_MAX
from actors.downloads.made import Made
from actors.downloads.registry import Entry, release, repo_problem
from bench.support import toml_value
from tests.fake_hub import FakeHub
from tests.helpers import SSE, chat, fake_cmd, request, toml_config, wait_until

SNAP = "corral-test/snap"
ENDLESS = "corral-test/endless"
WEIGHTS = b"w" * 300_000


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub.serving({SNAP: {"config.json": b"{}", "weights.bin": WEIGHTS},
                          **{f"corral-test/q{i}": {"weights.bin": WEIGHTS} for i in range(3)},
                          ENDLESS: {"config.json": b"{}", "weights.bin": b"w"}},
                         monkeypatch) as served:
        yield served


def config(tmp_path: Path, downloads: str = "", models: str = "") -> str:
    serve = toml_value(fake_cmd("--model", "{path}"))
    return (f"state_dir = {toml_value(str(tmp_path / 'state'))}\n"
            f"[downloads]\nsnapshot_cmd = {serve}\n{downloads}\n"
            f"[models.busy]\ncmd = {toml_value(fake_cmd())}\n{models}")


def registry(tmp_path: Path) -> Path:
    return tmp_path / "state" / "models" / "corral-downloads.json"


def listed(port: int, headers: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    code, body, _ = request(port, "GET", "/models", headers=headers)
    assert code == 200, body
    return {m["id"]: m for m in body["data"]}


def status(port: int, name: str) -> str | None:
    entry = listed(port).get(name)
    return entry["status"]["value"] if entry else None


def download(port: int, name: str) -> tuple[int, Any]:
    code, body, _ = request(port, "POST", "/models", {"model": name, "format": "snapshot"})
    return code, body


def download_children(pid: int) -> list[psutil.Process]:
    """corral's download children that are alive (not yet reaped ones left out)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "actors.downloads.hf_child" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue  # gone, or a zombie until corral reaps it
    return found


def ended(sse: SSE, name: str, timeout_s: float = 60) -> dict[str, Any]:
    return sse.wait_for(lambda e: e["type"] in ("download_finished", "download_failed")
                        and e["model"] == name, timeout_s=timeout_s)


# ------------------------------------------------------------------ S12: names

REFUSED = ["../x", "/etc/passwd", "owner/../../x", "owner/..", "owner/.", ".owner/x",
           "owner/x\x00y", "a" * 97 + "/b", "owner/\uff52\uff45\uff50\uff4f", "\uff4f/\u0663",
           "owner/repo:Q4/../../x", "owner/repo:..", "owner/repo:", "owner/repo:Q\n",
           "owner/repo::Q", "-rf/x", "owner/-h", "owner/x:--help", "owner/.hidden",
           "owner/repo:.Q", "owner/repo:-Q", "owner/" + "b" * 97, "owner/repo:" + "Q" * 65,
           "owner", "a/b/c",
           "a--b/c", "a/b--c", "o/r.", "o/r-", "o./r", "o-/r", "o/r.git", "o/r..s",
           "o/r.git:Q4"]
"""The review's list (S12: fullwidth letters and an Arabic-Indic digit among them), and
names with a part or a tag starting with `-` or `.`, or too long; and what the hub
refuses besides (a second review): `--` or `..` in a part (`a--b/c` and `a/b--c` would
share the folder `models--a--b--c`), a part ending with `-` or `.`, a `.git` at the end."""
ACCEPTED = ["owner/repo", "owner/repo:Q4_K_M", "o-w.n_er/Re_po-1.5", "owner/_x",
            "owner/repo.gits", "owner/r.git.x", "a-b/c-d", "o/r:Q-", "owner/" + "b" * 96,
            "a" * 96 + "/b", "owner/repo:" + "Q" * 64]


def test_download_names_are_what_the_readme_says(corral, hub, tmp_path) -> None:
    assert [n for n in ACCEPTED if repo_problem(n) is not None] == []
    c = corral(config(tmp_path))
    for name in REFUSED:
        code, body = download(c.port, name)
        assert code == 400 and "not a Hugging Face repo" in body["error"]["message"], name
    assert download(c.port, "owner/repo")[0] == 200  # (the hub knows none: it fails)


# ------------------------------------------------------------------ S3: the registry

DAMAGED = {
    "path-is-int": {"a/b": {"format": "snapshot", "path": 5}},
    "alias-is-list": {"a/b": {"format": "gguf", "alias": []}},
    "format-unknown": {"a/b": {"format": "zip", "path": "/x"}},
    "not-a-dict": ["a/b"],
    "not-json": "{nope",
}


def damage(path: Path, content: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content))


def set_aside_lines(log: str, path: Path) -> list[str]:
    return [line for line in log.splitlines() if str(path) in line and "set aside" in line]


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_registry_is_set_aside_and_corral_starts(corral, tmp_path, case) -> None:
    damage(registry(tmp_path), DAMAGED[case])
    c = corral(config(tmp_path))
    assert status(c.port, "busy") == "unloaded" and "a/b" not in listed(c.port)
    assert not registry(tmp_path).exists()
    assert len(list(registry(tmp_path).parent.glob("corral-downloads.json.bad-*"))) == 1
    assert len(set_aside_lines(c.log(), registry(tmp_path))) == 1, c.log()
    assert "Traceback" not in c.log()


def test_an_entry_that_does_not_decode_costs_only_itself(corral, tmp_path) -> None:
    """A second review: one entry of the wrong type set the whole registry aside, and
    every good download was forgotten until POSTed again. The file is set aside (kept
    for a person), the entry named, and a new registry holds the good ones."""
    snapshot = tmp_path / "snapshots" / "good"
    snapshot.mkdir(parents=True)
    damage(registry(tmp_path), {
        "good/one": {"format": "snapshot", "path": str(snapshot)},
        "bad/type": {"format": "snapshot", "path": 5}})
    c = corral(config(tmp_path))
    names = set(listed(c.port))
    assert "good/one" in names and "bad/type" not in names
    said = set_aside_lines(c.log(), registry(tmp_path))
    assert len(said) == 1 and "'bad/type'" in said[0] and "the other 1" in said[0], c.log()
    assert len(list(registry(tmp_path).parent.glob("corral-downloads.json.bad-*"))) == 1
    assert set(json.loads(registry(tmp_path).read_text())) == {"good/one"}
    assert chat(c.port, "good/one")[1]["model"] == str(snapshot)
    c.stop(keep_home=True)
    again = corral(config(tmp_path))  # remembered across a restart, nothing set aside
    assert "good/one" in set(listed(again.port))
    assert set_aside_lines(again.log(), registry(tmp_path)) == []


def test_entries_post_would_refuse_are_skipped_with_one_warning(corral, tmp_path) -> None:
    snapshot = tmp_path / "snapshots" / "good"
    snapshot.mkdir(parents=True)
    damage(registry(tmp_path), {
        " a/b": {"format": "snapshot", "path": "/x"},  # once blamed on "command line"
        "a/b@2": {"format": "snapshot", "path": "/x"},
        "owner/-h": {"format": "snapshot", "path": "/x"},
        "c/d": {"format": "snapshot", "path": "/x", "alias": "../e"},
        "e/f": {"format": "snapshot", "path": "/x/{port}"},
        "good/one": {"format": "snapshot", "path": str(snapshot)}})
    c = corral(config(tmp_path))
    names = set(listed(c.port))
    assert "good/one" in names and not names & {" a/b", "a/b@2", "owner/-h", "c/d", "e/f"}
    said = [line for line in c.log().splitlines() if "skipping 5 entries" in line]
    assert len(said) == 1 and str(registry(tmp_path)) in said[0], c.log()
    assert registry(tmp_path).exists(), "a file with bad entries is not set aside"
    assert chat(c.port, "good/one")[1]["model"] == str(snapshot)  # served: {path}


def test_a_reload_and_a_sighup_meet_a_damaged_registry_calmly(corral, tmp_path) -> None:
    c = corral(config(tmp_path))
    damage(registry(tmp_path), DAMAGED["alias-is-list"])
    code, body, headers = request(c.port, "GET", "/models?reload=1")
    assert code == 200 and headers["content-type"].startswith("application/json"), body
    assert len(set_aside_lines(c.log(), registry(tmp_path))) == 1
    damage(registry(tmp_path), DAMAGED["path-is-int"])
    c.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "SIGHUP: reloaded" in c.log(), what="the SIGHUP reload")
    assert len(set_aside_lines(c.log(), registry(tmp_path))) == 2
    assert "Traceback" not in c.log() and c.proc.poll() is None
    assert status(c.port, "busy") == "unloaded"


# ------------------------------------------------------------------ S4: the bounds

def test_downloads_past_max_concurrent_wait_their_turn(corral, hub, tmp_path) -> None:
    hub.rate = len(WEIGHTS) / 30  # 30 s a download: the first is still going when asked
    c = corral(config(tmp_path, "max_concurrent = 1"))
    names = [f"corral-test/q{i}" for i in range(3)]
    for name in names:
        assert download(c.port, name)[0] == 200
    shown = {n: listed(c.port)[n]["status"] for n in names}
    assert shown[names[0]]["value"] == "downloading"
    assert [shown[n] for n in names[1:]] == [{"value": "queued", "queue_position": 0},
                                             {"value": "queued", "queue_position": 1}]
    assert len(download_children(c.proc.pid)) <= 1
    assert request(c.port, "POST", "/models/unload", {"model": names[0]})[0] == 200
    wait_until(lambda: status(c.port, names[1]) == "downloading", what="the next one started")
    assert listed(c.port)[names[2]]["status"] == {"value": "queued", "queue_position": 0}
    assert request(c.port, "POST", "/models/unload", {"model": names[2]})[0] == 200
    assert names[2] not in listed(c.port)  # a queued one cancelled: never started
    wait_until(lambda: len(download_children(c.proc.pid)) == 1, what="one child")
    assert request(c.port, "POST", "/models/unload", {"model": names[1]})[0] == 200
    wait_until(lambda: not download_children(c.proc.pid), what="no download child")


def test_the_download_queue_is_bounded_too(corral, hub, tmp_path) -> None:
    hub.rate = len(WEIGHTS) / 30
    c = corral(config(tmp_path, "max_concurrent = 1"))
    assert download(c.port, SNAP)[0] == 200
    for i in range(QUEUED_MAX):  # never started: corral stops with them queued
        assert download(c.port, f"nobody/q{i}")[0] == 200
    code, body, headers = request(c.port, "POST", "/models", {"model": "nobody/more",
                                                               "format": "snapshot"})
    assert code == 503 and "100 downloads wait" in body["error"]["message"]
    assert headers["retry-after"] == "60"
    assert len(download_children(c.proc.pid)) <= 1


def test_a_download_over_max_gib_fails_and_leaves_nothing(corral, hub, tmp_path) -> None:
    hub.endless = {"weights.bin"}  # of every repo; the listings say 1 byte for ENDLESS's
    hub.rate = 2_000_000
    c = corral(config(tmp_path, "max_gib = 0.0001"))  # 107 KB
    sse = SSE(c.port)
    assert download(c.port, SNAP)[0] == 200  # listed at 300 KB: refused before it starts
    failed = ended(sse, SNAP)
    assert failed["type"] == "download_failed" and "the hub lists" in failed["error"]
    assert "downloads.max_gib = 0.0001" in failed["error"]
    assert download(c.port, ENDLESS)[0] == 200  # listed small, sends without end
    failed = ended(sse, ENDLESS)
    assert "more than the hub listed" in failed["error"], failed
    entry = listed(c.port)[ENDLESS]["status"]
    assert entry["value"] == "failed" and entry["error"] == failed["error"]
    wait_until(lambda: not download_children(c.proc.pid), what="no download child")
    folder = tmp_path / "state" / "models"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("models--")) == []


def test_no_download_starts_under_the_free_space_floor(corral, hub, tmp_path) -> None:
    c = corral(config(tmp_path, "min_free_gib = 1e9"))
    code, body = download(c.port, SNAP)
    assert code == 507 and "downloads.min_free_gib = 1e+09" in body["error"]["message"]
    assert SNAP not in listed(c.port) and not download_children(c.proc.pid)


def test_the_limits_say_why_a_download_stops() -> None:
    gib, where = limits.GIB, Path("/data")
    both = DownloadsConfig(max_gib=2, min_free_gib=5)
    assert limits.while_running(both, 0, 1 * gib, 100 * gib, where) is None
    assert "the hub lists 3.00 GiB" in str(limits.while_running(both, 0, 3 * gib, 100 * gib,
                                                                where))
    assert "more than the hub listed" in str(limits.while_running(both, 3 * gib, gib,
                                                                  100 * gib, where))
    low = limits.while_running(both, gib // 2, gib, 5 * gib, where)  # 0.5 more leaves 4.5
    assert low is not None and "0.50 GiB more would leave 4.50 GiB free in /data" in low
    during = limits.while_running(DownloadsConfig(), 10 * gib, 0, 4 * gib, where)
    assert during is not None and "that leaves 4.00 GiB free" in during
    assert limits.before_start(DownloadsConfig(min_free_gib=0), 0, where) is None


def test_failed_downloads_are_kept_at_most_keep_failed(corral, hub, tmp_path) -> None:
    c = corral(config(tmp_path, "keep_failed = 2"))
    sse = SSE(c.port)
    for i in range(4):  # one after another: the hub knows none of them
        assert download(c.port, f"nobody/r{i}")[0] == 200
        assert ended(sse, f"nobody/r{i}")["type"] == "download_failed"
    failed = [n for n, m in listed(c.port).items() if m["status"]["value"] == "failed"]
    assert failed == ["nobody/r2", "nobody/r3"]


def test_delete_removes_failed_entries_and_downloaded_models(corral, hub, tmp_path) -> None:
    c = corral(config(tmp_path))
    sse = SSE(c.port)
    assert download(c.port, SNAP)[0] == 200
    assert ended(sse, SNAP)["type"] == "download_finished"
    wait_until(lambda: status(c.port, SNAP) == "unloaded", what="the download listed")
    assert chat(c.port, SNAP)[0] == 200
    code, body, _ = request(c.port, "DELETE", "/models", {"model": SNAP})
    assert code == 409 and "unload it" in body["error"]["message"], body
    assert request(c.port, "POST", "/models/unload", {"model": SNAP})[0] == 200
    wait_until(lambda: status(c.port, SNAP) == "unloaded", what="unloaded")
    code, body, _ = request(c.port, "DELETE", "/models", {"model": SNAP})
    assert code == 200 and body["deleted"].endswith("models--corral-test--snap"), body
    assert SNAP not in listed(c.port) and not Path(body["deleted"]).exists()
    assert SNAP not in json.loads(registry(tmp_path).read_text())
    assert download(c.port, "nobody/gone")[0] == 200
    assert ended(sse, "nobody/gone")["type"] == "download_failed"
    assert request(c.port, "DELETE", "/models", {"model": "nobody/gone"})[0] == 200
    assert "nobody/gone" not in listed(c.port)
    assert request(c.port, "DELETE", "/models", {"model": "nobody/gone"})[0] == 404
    code, body, _ = request(c.port, "DELETE", "/models", {"model": "busy"})
    assert code == 400 and "configured model" in body["error"]["message"]
    hub.rate = len(WEIGHTS) / 30
    assert download(c.port, SNAP)[0] == 200
    assert request(c.port, "DELETE", "/models", {"model": SNAP})[0] == 409  # downloading
    assert request(c.port, "POST", "/models/unload", {"model": SNAP})[0] == 200
    c.stop()
    again = corral(config(tmp_path))
    assert SNAP not in listed(again.port)


def test_only_an_admin_key_may_delete_a_download(corral, tmp_path) -> None:
    keys = {name: {"key_file": str(tmp_path / f"{name}.key"), "admin": name == "root"}
            for name in ("root", "alice")}
    for name in keys:
        (tmp_path / f"{name}.key").write_text(f"{name}-secret\n")
    c = corral(toml_config({"busy": {"cmd": fake_cmd()}}, keys=keys,
                           state_dir=str(tmp_path / "state")))
    body = {"model": "nobody/x"}
    assert request(c.port, "DELETE", "/models", body)[0] == 401
    code, answer, _ = request(c.port, "DELETE", "/models", body,
                              headers={"Authorization": "Bearer alice-secret"})
    assert code == 403 and "admin" in answer["error"]["message"]
    assert request(c.port, "DELETE", "/models", body,
                   headers={"Authorization": "Bearer root-secret"})[0] == 404


@pytest.mark.parametrize(("table", "key"), [
    ("max_concurrent = 0", "downloads.max_concurrent"),
    ("max_gib = 0", "downloads.max_gib"),
    ("min_free_gib = -1", "downloads.min_free_gib"),
    ("keep_failed = -1", "downloads.keep_failed"),
    ('keep_failed = "all"', "downloads.keep_failed"),
])
def test_bad_download_bounds_are_config_errors_naming_the_key(table, key) -> None:
    with pytest.raises(ConfigError) as wrong:
        parse_config(tomllib.loads(f"[downloads]\n{table}\n"), "corral.toml")
    assert str(wrong.value).startswith(f"corral.toml: {key}: "), wrong.value


def test_download_bounds_decode_as_documented() -> None:
    assert msgspec.convert({}, DownloadsConfig) == DownloadsConfig(
        max_concurrent=2, max_gib=None, min_free_gib=5.0, keep_failed=20)


def test_a_member_key_sees_only_the_downloads_it_may_use(corral, hub, tmp_path) -> None:
    """S8: every download entry (name, error) reached every caller's GET /models."""
    keys = {"root": {"key_file": str(tmp_path / "root.key"), "admin": True},
            "alice": {"key_file": str(tmp_path / "alice.key"), "models": ["mine/*"]}}
    for name in keys:
        (tmp_path / f"{name}.key").write_text(f"{name}-secret\n")
    c = corral(toml_config({"busy": {"cmd": fake_cmd()}}, keys=keys,
                           state_dir=str(tmp_path / "state"),
                           downloads={"snapshot_cmd": fake_cmd("--model", "{path}")}))
    root = {"Authorization": "Bearer root-secret"}
    sse = SSE(c.port, headers=root)
    for name in ("secret/repo", "mine/repo"):  # unknown to the hub: both fail, and stay
        code, body, _ = request(c.port, "POST", "/models",
                                {"model": name, "format": "snapshot"}, headers=root)
        assert code == 200, body
        assert ended(sse, name)["type"] == "download_failed"
    assert {"secret/repo", "mine/repo"} <= set(listed(c.port, root))
    alice = listed(c.port, {"Authorization": "Bearer alice-secret"})
    assert "mine/repo" in alice and "secret/repo" not in alice, alice


# ------------------------------------------------------------------ S2: what a clean-up deletes

USER_FILES = {"MY-NOTES.txt": b"not corral's", "blobs/mine.incomplete": b"half of mine"}


def users_cache(tmp_path: Path) -> Path:
    """A Hugging Face cache that holds SNAP already, as the user's own download of its
    config.json left it (huggingface_hub itself, from the hub), and files of the user's."""
    cache = tmp_path / "hf-cache"
    subprocess.run([sys.executable, "-c", "import sys; from huggingface_hub import "
                    "snapshot_download as d; d(sys.argv[1], cache_dir=sys.argv[2], "
                    "allow_patterns=['config.json'])", SNAP, str(cache)],
                   check=True, capture_output=True, timeout=60)
    for name, data in USER_FILES.items():
        (cache / REPO_DIR / name).write_bytes(data)
    return cache


REPO_DIR = "models--corral-test--snap"


def everything(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


def test_delete_leaves_a_folder_corral_did_not_make_and_the_users_files(corral, hub,
                                                                        tmp_path) -> None:
    """The review's S2 again: `[downloads] dir` an existing Hugging Face cache that holds
    the repo; DELETE /models removed the whole repo folder, the user's files in it too."""
    cache = users_cache(tmp_path)
    theirs = everything(cache)
    c = corral(config(tmp_path, f"dir = {toml_value(str(cache))}"))
    sse = SSE(c.port)
    assert download(c.port, SNAP)[0] == 200
    assert ended(sse, SNAP)["type"] == "download_finished"
    wait_until(lambda: status(c.port, SNAP) == "unloaded", what="the download listed")
    added = everything(cache) - theirs
    assert any(p.endswith("/weights.bin") for p in added), added
    code, body, _ = request(c.port, "DELETE", "/models", {"model": SNAP})
    assert code == 200 and body["deleted"] is None, body
    assert "was there before corral downloaded into it" in body["kept"]
    assert body["files_deleted"] == sum(not (cache / p).is_dir() for p in added
                                        if p != "corral-downloads.json"), body
    left = everything(cache)
    assert theirs <= left and not (left - theirs) - {"corral-downloads.json"}, left - theirs
    snapshot = next((cache / REPO_DIR / "snapshots").iterdir())
    assert (snapshot / "config.json").read_bytes() == b"{}"  # theirs, still whole
    for name, data in USER_FILES.items():
        assert (cache / REPO_DIR / name).read_bytes() == data
    assert SNAP not in json.loads((cache / "corral-downloads.json").read_text())


def test_a_download_corral_made_the_folder_of_goes_whole(corral, hub, tmp_path) -> None:
    c = corral(config(tmp_path))
    sse = SSE(c.port)
    assert download(c.port, SNAP)[0] == 200
    assert ended(sse, SNAP)["type"] == "download_finished"
    wait_until(lambda: status(c.port, SNAP) == "unloaded", what="the download listed")
    folder = tmp_path / "state" / "models"
    made = json.loads(registry(tmp_path).read_text())[SNAP]["made"]
    assert made["folder"] is True and f".locks/{REPO_DIR}" in made["dirs"], made
    code, body, _ = request(c.port, "DELETE", "/models", {"model": SNAP})
    assert code == 200 and body["deleted"] == str(folder / REPO_DIR) and body["kept"] is None
    assert not (folder / REPO_DIR).exists() and not (folder / ".locks" / REPO_DIR).exists()


def test_a_cancelled_download_removes_only_its_own_partial_files(corral, hub,
                                                                 tmp_path) -> None:
    """Its clean-up removed every `.incomplete` file in the repo folder, the user's own
    interrupted download's too."""
    cache = users_cache(tmp_path)
    theirs = everything(cache)
    hub.rate = len(WEIGHTS) / 30
    c = corral(config(tmp_path, f"dir = {toml_value(str(cache))}"))
    sse = SSE(c.port)
    assert download(c.port, SNAP)[0] == 200
    wait_until(lambda: any(p.endswith(".incomplete") for p in everything(cache) - theirs),
               what="the download's own partial file")
    assert request(c.port, "POST", "/models/unload", {"model": SNAP})[0] == 200
    assert "cancelled" in ended(sse, SNAP)["error"]
    wait_until(lambda: not download_children(c.proc.pid), what="no download child")
    assert everything(cache) == theirs
    for name, data in USER_FILES.items():
        assert (cache / REPO_DIR / name).read_bytes() == data


def test_an_entry_of_an_older_corral_deletes_only_its_line(corral, tmp_path) -> None:
    """A registry with no record of what a download made (an older corral's): corral
    cannot tell its files from the user's, so DELETE leaves them, and says so."""
    snapshot = tmp_path / "state" / "models" / "models--old--one" / "snapshots" / "c0"
    snapshot.mkdir(parents=True)
    (snapshot / "weights.bin").write_bytes(b"w")
    damage(registry(tmp_path), {"old/one": {"format": "snapshot", "path": str(snapshot)}})
    c = corral(config(tmp_path))
    assert status(c.port, "old/one") == "unloaded"
    code, body, _ = request(c.port, "DELETE", "/models", {"model": "old/one"})
    assert code == 200 and body["deleted"] is None and body["files_deleted"] == 0, body
    assert "cannot tell they are its own" in body["kept"]
    assert (snapshot / "weights.bin").exists() and "old/one" not in listed(c.port)
    assert json.loads(registry(tmp_path).read_text()) == {}
    assert any("old/one" in line and "cannot tell they are its own" in line
               for line in c.log().splitlines()), c.log()


def test_a_record_that_names_files_elsewhere_deletes_nothing_there(corral, tmp_path) -> None:
    """The registry is untrusted: a record naming a path outside the repo's folder
    skips the entry (one warning), and a folder in it that a link leads elsewhere is
    not followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("keep me")
    folder = tmp_path / "state" / "models"
    (folder / "models--a--b").mkdir(parents=True)
    (folder / "models--a--b" / "snap").symlink_to(outside)
    (folder / "models--c--d" / "s").mkdir(parents=True)
    damage(registry(tmp_path), {
        "a/b": {"format": "snapshot", "path": str(folder / "models--a--b" / "snap"),
                "made": {"files": ["models--a--b/snap/victim"]}},
        "c/d": {"format": "snapshot", "path": str(folder / "models--c--d" / "s"),
                "made": {"folder": False, "files": ["models--c--d/../../../outside/victim"]}}})
    c = corral(config(tmp_path))
    said = [line for line in c.log().splitlines() if "skipping 1 entry" in line]
    assert len(said) == 1 and "'c/d'" in said[0] and "outside models--c--d" in said[0]
    assert "a/b" in listed(c.port) and "c/d" not in listed(c.port)
    for name in ("a/b", "c/d"):
        code, body, _ = request(c.port, "DELETE", "/models", {"model": name})
        assert code == 200 and body["files_deleted"] == 0, body
    assert (outside / "victim").read_text() == "keep me"


def test_what_a_download_made_goes_with_the_last_entry_in_its_folder(tmp_path) -> None:
    """Two quantizations of one GGUF repo share its folder: deleting the first hands
    what it made to the second, whose deletion then removes the folder corral made."""
    folder = tmp_path
    (folder / "models--o--r" / "blobs").mkdir(parents=True)
    for name in ("q4", "q8", "shared"):
        (folder / "models--o--r" / "blobs" / name).write_bytes(b"x")
    first = Made(folder=True, files=("models--o--r/blobs/q4", "models--o--r/blobs/shared"),
                 dirs=("models--o--r", "models--o--r/blobs"))
    entries = {"o/r:Q8": Entry(made=Made(files=("models--o--r/blobs/q8",)))}
    gone = release(folder, "o/r:Q4", first, entries)
    assert gone.deleted is None and "stays with 'o/r:Q8'" in str(gone.kept)
    assert len(list((folder / "models--o--r" / "blobs").iterdir())) == 3
    record = entries.pop("o/r:Q8").made
    assert record is not None and record.folder
    assert release(folder, "o/r:Q8", record, entries).deleted == str(folder / "models--o--r")
    assert not (folder / "models--o--r").exists()


def test_a_second_download_into_a_folder_waits_for_the_first(corral, hub, tmp_path) -> None:
    """What a download made is what appeared while it ran: two into one folder at once
    could not tell theirs apart, so the second waits, whatever max_concurrent allows."""
    hub.rate = len(WEIGHTS) / 30
    c = corral(config(tmp_path, "max_concurrent = 4"))
    sse = SSE(c.port)
    assert download(c.port, SNAP)[0] == 200
    assert download(c.port, SNAP + ":Q4")[0] == 200  # (the same repo folder)
    assert listed(c.port)[SNAP + ":Q4"]["status"] == {"value": "queued", "queue_position": 0}
    assert len(download_children(c.proc.pid)) == 1
    assert request(c.port, "POST", "/models/unload", {"model": SNAP})[0] == 200
    assert ended(sse, SNAP + ":Q4")["type"] == "download_failed"  # it ran (the hub has none)


def test_an_entry_whose_name_is_anothers_alias_is_named_in_the_warning(corral,
                                                                       tmp_path) -> None:
    """Registry entries whose name another entry's alias claims were dropped silently."""
    damage(registry(tmp_path), {"o/b": {"format": "snapshot", "path": "/x", "alias": "o/a"},
                                "o/a": {"format": "snapshot", "path": "/x"},
                                "o/c": {"format": "snapshot", "path": "/x"}})
    c = corral(config(tmp_path))
    assert {"o/b", "o/c"} <= set(listed(c.port)) and "o/a" not in listed(c.port)
    said = [line for line in c.log().splitlines() if "skipping" in line]
    assert len(said) == 1 and "'o/a': its name is the alias of 'o/b'" in said[0], c.log()
