"""Downloads through a real corral (issue 25): `POST /models` against a fake Hugging Face
hub on loopback (tests/fake_hub.py), with llama-server's own download child for GGUF
repos (skipped where no llama-server is built) and huggingface_hub's snapshot_download
for the rest. What a user sees: the states and events of llama.cpp's router, the model in
the table once it is there, a cancel that leaves nothing behind, failures that say why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import psutil
import pytest

from bench.support import toml_value
from scripts.tiny_gguf import write_tiny_gguf
from tests.fake_hub import FakeHub
from tests.helpers import SSE, fake_cmd, request, wait_until
from tests.test_llama_server import BINARY

GGUF_REPO = "corral-test/tiny-GGUF"
SNAP_REPO = "corral-test/snap"
needs_llama = pytest.mark.skipif(BINARY is None, reason="no llama-server here: run "
                                 "`bash scripts/llama-server.sh` to build it")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("hub") / "tiny.gguf").read_bytes()


@pytest.fixture
def hub(gguf: bytes, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub.serving({GGUF_REPO: {"tiny-Q4_K_M.gguf": gguf, ".gitattributes": b"*.gguf\n"},
                          SNAP_REPO: {"config.json": b'{"arch": "x"}',
                                      "weights.bin": b"w" * 300_000}}, monkeypatch) as served:
        yield served


def config(tmp_path: Path, extra: str = "") -> str:
    return (f"state_dir = {toml_value(str(tmp_path / 'state'))}\n"
            f"[downloads]\nllama_server = {toml_value(BINARY or 'llama-server')}\n" + extra)


def listed(port: int) -> dict[str, dict]:
    return {m["id"]: m for m in request(port, "GET", "/models")[1]["data"]}


def status(port: int, name: str) -> str | None:
    entry = listed(port).get(name)
    return entry["status"]["value"] if entry else None


def no_download_child() -> bool:
    return not any("LLAMA_SERVER_CHILD_MODE" in (p.info["environ"] or {})
                   or "actors.downloads.hf_child" in " ".join(p.info["cmdline"] or [])
                   for p in psutil.process_iter(["environ", "cmdline"]))


@needs_llama
def test_a_gguf_repo_downloads_joins_the_table_serves_and_stays(corral, hub, tmp_path) -> None:
    c = corral(config(tmp_path))
    sse = SSE(c.port)
    status_code, body, _ = request(c.port, "POST", "/models", {"model": GGUF_REPO})
    assert status_code == 200 and body["status"]["value"] == "downloading", body
    done = sse.wait_for(lambda e: e["type"] in ("download_finished", "download_failed"))
    assert done["type"] == "download_finished" and done["model"] == GGUF_REPO, done
    assert next(e["status"] for e in sse.events
                if e["type"] == "status_change" and e["model"] == GGUF_REPO) == "downloading"
    wait_until(lambda: status(c.port, GGUF_REPO) == "unloaded", what="the model listed")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="none",
                           max_retries=0)
    said = client.chat.completions.create(model=GGUF_REPO, max_tokens=2,
                                          messages=[{"role": "user", "content": "hi"}])
    assert said.model == GGUF_REPO
    assert listed(c.port)[GGUF_REPO]["aliases"] == [f"{GGUF_REPO}:Q4_K_M"]  # llama.cpp's name
    assert client.chat.completions.create(
        model=f"{GGUF_REPO}:Q4_K_M", max_tokens=1,
        messages=[{"role": "user", "content": "hi"}]).model == GGUF_REPO
    assert ("GET", f"/api/models/{GGUF_REPO}/refs", 200) in hub.requests
    c.stop()
    again = corral(config(tmp_path))  # the same state_dir: it is remembered
    assert status(again.port, GGUF_REPO) == "unloaded"


@needs_llama
def test_an_unload_cancels_a_download_and_leaves_nothing_behind(corral, hub, tmp_path,
                                                                gguf) -> None:
    hub.rate = len(gguf) / 20  # about 20 s for the file: long enough to cancel midway
    c = corral(config(tmp_path))
    sse = SSE(c.port)
    assert request(c.port, "POST", "/models", {"model": GGUF_REPO})[0] == 200
    sse.wait_for(lambda e: e["type"] == "status_change" and e["model"] == GGUF_REPO
                 and (e.get("progress") or {}).get("downloaded", 0) > 0, timeout_s=20)
    assert request(c.port, "POST", "/models/unload", {"model": GGUF_REPO})[0] == 200
    failed = sse.wait_for(lambda e: e["type"] == "download_failed")
    assert "cancelled" in failed["error"]
    assert GGUF_REPO not in listed(c.port)
    wait_until(no_download_child, what="the download child gone")
    left = [p for p in (tmp_path / "state" / "models").rglob("*")
            if p.name.endswith(".downloadInProgress")]
    assert left == []


@needs_llama
def test_a_failing_hub_fails_the_download_saying_why(corral, hub, tmp_path) -> None:
    hub.fail = True
    c = corral(config(tmp_path))
    sse = SSE(c.port)
    assert request(c.port, "POST", "/models", {"model": GGUF_REPO})[0] == 200
    failed = sse.wait_for(lambda e: e["type"] == "download_failed", timeout_s=60)
    assert failed["model"] == GGUF_REPO and failed["error"]
    entry = listed(c.port)[GGUF_REPO]
    assert entry["status"]["value"] == "failed" and entry["status"]["error"]
    assert request(c.port, "POST", "/models", {"model": "nobody/missing-GGUF"})[0] == 200
    missing = sse.wait_for(lambda e: e["type"] == "download_failed"
                           and e["model"] == "nobody/missing-GGUF")
    assert "no GGUF file" in missing["error"]  # llama-server calls an empty repo finished


def test_a_snapshot_downloads_with_huggingface_hub_and_is_served(corral, hub,
                                                                 tmp_path) -> None:
    serve = toml_value(fake_cmd("--model", "{path}"))  # {path}: the snapshot folder
    c = corral("models_max = 1\n" + config(tmp_path, f"snapshot_cmd = {serve}\n")
               + "\n[models.busy]\ncmd = " + toml_value(fake_cmd()) + "\n")
    sse = SSE(c.port)
    assert request(c.port, "POST", "/v1/chat/completions", {
        "model": "busy", "messages": [{"role": "user", "content": "hi"}]})[0] == 200
    code, body, _ = request(c.port, "POST", "/models", {"model": SNAP_REPO,
                                                        "format": "snapshot"})
    assert code == 200, body
    done = sse.wait_for(lambda e: e["type"] in ("download_finished", "download_failed"),
                        timeout_s=60)
    assert done["type"] == "download_finished", done
    snapshot = Path(done["path"])
    assert (snapshot / "weights.bin").read_bytes() == b"w" * 300_000
    wait_until(lambda: status(c.port, SNAP_REPO) == "unloaded", what="the snapshot listed")
    assert status(c.port, "busy") == "loaded"  # a download takes no slot, evicts nothing
    answer = request(c.port, "POST", "/v1/chat/completions", {
        "model": SNAP_REPO, "messages": [{"role": "user", "content": "hi"}]})
    assert answer[0] == 200 and answer[1]["model"] == str(snapshot)  # {path} filled in


@pytest.mark.parametrize(("body", "status_code", "says"), [
    ({"model": "not-a-repo"}, 400, "not a Hugging Face repo"),
    ({"model": "busy"}, 400, "not a Hugging Face repo"),
    ({"model": "a/b", "format": "zip"}, 400, "format"),
    ({"model": "a/b", "extra": 1}, 400, "extra"),
    ({"model": "o/r"}, 400, "a model (or an alias"),  # busy's alias: review finding
    ({"model": "a/" + "b" * 300}, 400, "not a Hugging Face repo"),
    ({"model": "../x"}, 400, "not a Hugging Face repo"),
    ({"model": "a/b:../../x"}, 400, "not a Hugging Face repo"),
])
def test_bad_download_requests_say_what_is_wrong(corral, tmp_path, body, status_code,
                                                 says) -> None:
    c = corral(config(tmp_path) + "\n[models.busy]\ncmd = " + toml_value(fake_cmd())
               + '\naliases = ["o/r"]\n')
    code, answer, _ = request(c.port, "POST", "/models", body)
    assert code == status_code and says in answer["error"]["message"], answer


def test_downloads_can_be_turned_off(corral, tmp_path) -> None:
    c = corral(f"state_dir = {toml_value(str(tmp_path / 'state'))}\n"
               "[downloads]\nenabled = false\n")
    code, answer, _ = request(c.port, "POST", "/models", {"model": "a/b"})
    assert code == 403 and "enabled = false" in answer["error"]["message"]
