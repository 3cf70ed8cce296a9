"""What is queued and running now, and its cancel (issue 40, part 2):
`GET /requests?state=running` lists every front's model requests (a worker's too), the
queued with their place; `POST /requests/{id}/cancel` (an admin, or the request's own
key) ends one: a queued request gets 499 `cancelled`, a running one loses its child
connection (the child sees its client leave) and its stream ends with an error event."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    ROOT,
    Call,
    Corral,
    fake_cmd,
    key_files,
    request,
    serving,
    toml_config,
    wait_until,
)

ALICE = {"Authorization": "Bearer alice-secret"}
BOB = {"Authorization": "Bearer bob-secret"}
OPS = {"Authorization": "Bearer ops-secret"}


@pytest.fixture(params=[1, 2], ids=["one-front", "two-workers"])
def served(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Corral]:
    keys = key_files(tmp_path, "alice", "bob", "ops")
    with serving(tmp_path, toml_config(
            {"a": {"cmd": fake_cmd("--tokens-per-s", "20")}, "b": {"cmd": fake_cmd()}},
            models_max=1, http={"workers": request.param},
            keys={"alice": {"key_file": keys["alice"]}, "bob": {"key_file": keys["bob"]},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def running(c: Corral, headers: dict[str, str] = OPS, query: str = "") -> list[dict[str, Any]]:
    status, body, _ = request(c.port, "GET", f"/requests?state=running{query}",
                              headers=headers)
    assert status == 200, body
    return body["data"]


def test_a_queued_and_a_running_request_are_listed_and_cancelled(served: Corral) -> None:
    c = served
    streaming = Call(c.port, "a", "run-a", ALICE, stream=True)
    wait_until(lambda: streaming.lines, 30, "the stream's first event")
    queued = Call(c.port, "b", "wait-b", ALICE)  # models_max = 1, and a is busy: it waits

    now = wait_until(lambda: (r := running(c)) and len(r) == 2 and r, 30, "both listed")
    assert [(r["id"], r["state"], r.get("position")) for r in now] == [
        ("wait-b", "queued", 1), ("run-a", "running", None)]
    assert now[1]["served"] == "a" and now[1]["bytes_out"] > 0 and now[1]["key"] == "alice"
    assert now[0]["waited_s"] >= 0 and now[0]["path"] == "/v1/chat/completions"
    assert [r["id"] for r in running(c, ALICE)] == ["wait-b", "run-a"]  # her own
    assert running(c, BOB) == [] and running(c, OPS, "&model=b")[0]["id"] == "wait-b"
    status, body, _ = request(c.port, "GET", "/requests?state=running&key=alice",
                              headers=BOB)
    assert status == 403, body
    status, body, _ = request(c.port, "GET", "/requests?state=sleeping", headers=OPS)
    assert status == 400 and "state must be done or running" in body["error"]["message"]

    status, body, _ = request(c.port, "POST", "/requests/wait-b/cancel", headers=BOB)
    assert status == 404 and "wait-b" in body["error"]["message"]  # not bob's
    status, body, _ = request(c.port, "POST", "/requests/wait-b/cancel", headers=ALICE)
    assert status == 200 and body == {"id": "wait-b", "cancelled": 1}
    queued.join(30)
    assert queued.status == 499, (queued.status, queued.body)
    assert queued.body["error"]["type"] == "cancelled", queued.body

    port = c.models()["a"]["port"]
    status, body, _ = request(c.port, "POST", "/requests/run-a/cancel", headers=OPS)
    assert status == 200 and body["cancelled"] == 1
    streaming.join(30)
    assert not streaming.is_alive() and streaming.status == 200
    assert any(b"cancelled" in line for line in streaming.lines)  # its error event
    wait_until(lambda: request(port, "GET", "/debug/stats")[1]["cancelled"] == 1, 15,
               "the child to see its client leave")
    wait_until(lambda: running(c) == [], 15, "nothing running")
    status, body, _ = request(c.port, "POST", "/requests/run-a/cancel", headers=OPS)
    assert status == 404 and "queued or running" in body["error"]["message"]

    def recorded() -> dict[str, dict[str, Any]] | None:
        got = {r["id"]: r for r in request(c.port, "GET", "/requests?key=alice",
                                           headers=OPS)[1]["data"]}
        return got if {"run-a", "wait-b"} <= got.keys() else None
    journal = wait_until(recorded, 15, "both in the journal")
    assert journal["wait-b"]["status"] == 499
    assert "cancelled by POST /requests/wait-b/cancel (its own key)" in journal["wait-b"]["error"]
    assert journal["run-a"]["status"] == 200 and "cancelled" in journal["run-a"]["error"]


def test_the_cli_lists_and_cancels(served: Corral, tmp_path: Path) -> None:
    c = served
    streaming = Call(c.port, "a", "cli-a", ALICE, stream=True)
    wait_until(lambda: streaming.lines, 30, "the stream's first event")
    key_file = tmp_path / "ops.key"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(ROOT / "supervisor.py"), *args, "--url",
                               f"http://127.0.0.1:{c.port}", "--api-key-file", str(key_file)],
                              capture_output=True, text=True, timeout=30)
    shown = cli("requests", "--running")
    assert shown.returncode == 0, shown.stderr
    assert "cli-a" in shown.stdout and "running" in shown.stdout
    gone = cli("cancel", "cli-a")
    assert gone.returncode == 0 and "cancelled: cli-a (1)" in gone.stdout, gone.stderr
    streaming.join(30)
    assert not streaming.is_alive()
    missing = cli("cancel", "cli-a")
    assert missing.returncode == 1 and "404" in missing.stderr

