"""The Files and Batch APIs (issue 44, part 1), through the official openai SDK and
raw HTTP: a batch's lines run below every class, grouped by model; their answers land
in an output file, their failures in an error file; a restart goes on where it was."""

from __future__ import annotations

import io
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.helpers import ROOT, Corral, fake_cmd, key_files, request, toml_config, wait_until

ADMIN = "ops-secret"


def batch_input(lines: list[tuple[str, str]], url: str = "/v1/chat/completions") -> bytes:
    """A batch's JSONL: one chat per (custom_id, model)."""
    return b"".join(json.dumps({
        "custom_id": cid, "method": "POST", "url": url,
        "body": {"model": model, "max_tokens": 3,
                 "messages": [{"role": "user", "content": cid}]}}).encode() + b"\n"
        for cid, model in lines)


def client(c: Corral, key: str = ADMIN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key=key, max_retries=0)


def finished(oa: openai.OpenAI, batch_id: str, timeout_s: float = 60) -> Any:
    return wait_until(lambda: (b := oa.batches.retrieve(batch_id)).status in (
        "completed", "failed", "expired", "cancelled") and b, timeout_s,
        f"batch {batch_id} to finish")


def results(oa: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in oa.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    home = tmp_path_factory.mktemp("batches")
    keys = key_files(home, "alice", "bob", "ops")
    c = Corral(toml_config(
        {"a": {"cmd": fake_cmd()}, "b": {"cmd": fake_cmd()}, "c": {"cmd": fake_cmd()}},
        models_max=2, batches={"lines_at_once": 3},
        keys={"alice": {"key_file": keys["alice"], "models": ["a", "b"]},
              "bob": {"key_file": keys["bob"]},
              "ops": {"key_file": keys["ops"], "admin": True}}), home=home)
    c.key = ADMIN
    try:
        yield c
    finally:
        c.stop()


def test_a_batch_through_the_openai_sdk_answers_every_line_once(served: Corral) -> None:
    oa = client(served, "alice-secret")
    lines = [(f"r{i}", "ab"[i % 2]) for i in range(10)]
    f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(lines))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                          completion_window="24h", metadata={"job": "nightly"})
    assert b.status in ("validating", "in_progress") and b.metadata == {"job": "nightly"}
    done = finished(oa, b.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 10 and done.request_counts.completed == 10
    assert done.request_counts.failed == 0 and done.error_file_id is None
    out = results(oa, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(cid for cid, _ in lines)
    for args in ((), (done.id,)):  # `corral batches`, all of alice's and this one
        cli = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "batches", *args,
                              "--url", served.url], capture_output=True, text=True, timeout=30,
                             env={**os.environ, "CORRAL_API_KEY": "alice-secret"})
        assert cli.returncode == 0, cli.stderr
        row = next(line for line in cli.stdout.splitlines() if line.startswith(done.id))
        assert row.split()[1:5] == ["completed", "10", "0", "10"], cli.stdout
    assert "lines per model: a 5, b 5" in cli.stdout, cli.stdout
    for r in out:
        assert r["response"]["status_code"] == 200 and r["error"] is None
        assert r["response"]["body"]["choices"], r
        assert r["response"]["request_id"]
    # each line's record is in the journal, asked as the batch class of its key
    status, body, _ = request(served.port, "GET", f"/requests/{out[0]['response']['request_id']}",
                              headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200 and body["data"][0]["key"] == "batch:alice", body


def test_lines_group_by_model_so_one_load_serves_them(served: Corral) -> None:
    """Interleaved lines for a and c run model by model: the journal shows all of one
    model's lines before the next model's."""
    oa = client(served)
    lines = [(f"g{i}", "ac"[i % 2]) for i in range(12)]
    f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(lines))), purpose="batch")
    done = finished(oa, oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h").id)
    assert done.status == "completed" and done.request_counts.completed == 12
    status, body, _ = request(served.port, "GET", "/requests?key=batch:ops&limit=12",
                              headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200, body
    order = [r["model"] for r in reversed(body["data"])]
    assert len(order) == 12
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert switches == 1, order


def test_an_input_at_fault_fails_the_batch_naming_each_line(served: Corral) -> None:
    oa = client(served)
    data = (batch_input([("x", "a")]) + b"not json\n"
            + batch_input([("x", "a")]) + batch_input([("y", "a")], url="/v1/embeddings"))
    f = oa.files.create(file=("bad.jsonl", io.BytesIO(data)), purpose="batch")
    b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                          completion_window="24h")
    assert b.status == "failed"
    assert b.errors is not None
    faults = {(e.line, e.code) for e in b.errors.data}
    assert faults == {(2, "invalid_json_line"), (3, "duplicate_custom_id"),
                      (4, "mismatched_endpoint")}, b.errors
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                          completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        oa.batches.create(input_file_id="file-000000000000000000000000",
                          endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        oa.files.create(file=("x.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")


def test_a_key_sees_its_own_and_a_line_it_may_not_send_fails_alone(served: Corral) -> None:
    alice, bob = client(served, "alice-secret"), client(served, "bob-secret")
    f = alice.files.create(file=("in.jsonl", io.BytesIO(batch_input(
        [("ok", "a"), ("no", "c")]))), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(f.id)
    done = finished(alice, alice.batches.create(input_file_id=f.id,
                                                endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 1)
    errors = results(alice, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["no"]
    assert errors[0]["response"]["status_code"] == 403
    assert "may not use model 'c'" in json.dumps(errors[0]["response"]["body"])
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(done.id)
    # its lines are in the journal, for it (not for bob)
    status, body, _ = request(served.port, "GET", "/requests?key=batch:alice",
                              headers={"Authorization": "Bearer alice-secret"})
    assert status == 200 and "a" in {r.get("model") for r in body["data"]}, body
    assert "key 'batch:alice' may not use model 'c'" in {r.get("error") for r in body["data"]}
    status, body, _ = request(served.port, "GET", "/requests?key=batch:alice",
                              headers={"Authorization": "Bearer bob-secret"})
    assert status == 403, body
    assert done.id not in {b.id for b in bob.batches.list()}
    assert done.id in {b.id for b in client(served).batches.list(limit=100)}


def test_no_client_may_send_as_the_batch_runner(served: Corral) -> None:
    for value in ("guess alice", "", "x"):
        status, body, _ = request(served.port, "POST", "/v1/chat/completions",
                                  {"model": "a", "messages": []},
                                  headers={"Authorization": "Bearer bob-secret",
                                           "X-Corral-Batch": value})
        assert status == 403 and "X-Corral-Batch" in body["error"]["message"], body


def test_cancel_ends_a_batch_and_keeps_what_was_answered(tmp_path: Path) -> None:
    with Corral(toml_config({"slow": {"cmd": fake_cmd("--tokens-per-s", "4")}},
                            batches={"lines_at_once": 1}), home=tmp_path) as c:
        oa = client(c, "none")
        f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(
            [(f"s{i}", "slow") for i in range(20)]))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        wait_until(lambda: oa.batches.retrieve(b.id).request_counts.completed >= 1, 30,
                   "a line answered")
        cancelling = oa.batches.cancel(b.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = finished(oa, b.id)
        assert done.status == "cancelled" and done.cancelled_at is not None
        out = results(oa, done.output_file_id)
        assert 1 <= len(out) < 20 and len(out) == done.request_counts.completed


def test_a_restart_goes_on_where_the_batch_was(tmp_path: Path) -> None:
    """Lines answered before a stop are not sent again; the rest are, after it."""
    config = toml_config({"slow": {"cmd": fake_cmd("--tokens-per-s", "6")}},
                         batches={"lines_at_once": 2}, state_dir=str(tmp_path / "state"))
    c = Corral(config, home=tmp_path)
    try:
        oa = client(c, "none")
        f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(
            [(f"t{i}", "slow") for i in range(12)]))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        wait_until(lambda: oa.batches.retrieve(b.id).request_counts.completed >= 3, 30,
                   "three lines answered")
    finally:
        c.stop()
    kept = (tmp_path / "state" / "batches" / f"{b.id}.out.jsonl").read_text().splitlines()
    before = {json.loads(line)["custom_id"] for line in kept}
    assert 3 <= len(before) < 12
    with Corral(config, home=tmp_path) as again:
        oa = client(again, "none")
        done = finished(oa, b.id)
        assert done.status == "completed" and done.request_counts.completed == 12
        ids = [r["custom_id"] for r in results(oa, done.output_file_id)]
        assert sorted(ids) == sorted(f"t{i}" for i in range(12)), ids
        assert "goes on: " in again.log()


def test_every_batches_key_through_corral_serve(tmp_path: Path) -> None:
    """keep_days prunes at start, max_file_mib and max_lines refuse, enabled = false
    answers 404 naming itself; a bad value is refused naming its key."""
    state = tmp_path / "state"
    old = state / "batches"
    (old / "files").mkdir(parents=True)
    (old / "batch_old.json").write_text(json.dumps({
        "id": "batch_old", "endpoint": "/v1/chat/completions", "input_file_id": "file-x",
        "created_at": int(time.time()) - 3 * 86400, "status": "completed"}))
    with Corral(toml_config({"a": {"cmd": fake_cmd()}}, state_dir=str(state), batches={
            "keep_days": 1, "max_file_mib": 0.001, "max_lines": 2}), home=tmp_path) as c:
        assert not (old / "batch_old.json").exists()
        oa = client(c, "none")
        with pytest.raises(openai.APIStatusError, match=r"batches\.max_file_mib") as e:
            oa.files.create(file=("big.jsonl", io.BytesIO(b"x" * 2000)), purpose="batch")
        assert e.value.status_code == 413
        f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(
            [("1", "a"), ("2", "a"), ("3", "a")]))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        assert b.status == "failed" and b.errors is not None
        assert "batches.max_lines" in b.errors.data[0].message
    (tmp_path / "off").mkdir()
    with Corral(toml_config({"a": {"cmd": fake_cmd()}}, batches={"enabled": False}),
                home=tmp_path / "off") as c:
        status, body, _ = request(c.port, "GET", "/v1/batches")
        assert status == 404 and "[batches] enabled = false" in body["error"]["message"]
    bad = tmp_path / "bad.toml"
    bad.write_text(toml_config({"a": {"cmd": fake_cmd()}}, batches={"lines_at_once": 0}))
    run = subprocess.run([sys.executable, str(ROOT / "supervisor.py"), "check-config",
                          str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "lines_at_once" in run.stdout + run.stderr, run


BAD = [sys.executable, "-c", "import sys; sys.exit(3)"]
"""A child that fails to load, every time."""


def test_a_model_that_never_loads_rests_its_lines_while_the_others_run(
        tmp_path: Path) -> None:
    """corral's own 503 for a line's model, again and again: its lines rest while the
    batch's other lines and later batches run; at expiry they go to the error file."""
    config = toml_config({"bad": {"cmd": BAD}, "good": {"cmd": fake_cmd()}},
                         state_dir=str(tmp_path / "state"), batches={"lines_at_once": 1})
    with Corral(config, home=tmp_path) as c:
        oa = client(c, "none")
        fa = oa.files.create(file=("a.jsonl", io.BytesIO(batch_input(
            [("x", "bad"), ("y", "good")]))), purpose="batch")
        a = oa.batches.create(input_file_id=fa.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        fb = oa.files.create(file=("b.jsonl", io.BytesIO(batch_input([("z", "good")]))),
                             purpose="batch")
        b = oa.batches.create(input_file_id=fb.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        wait_until(lambda: oa.batches.retrieve(a.id).request_counts.completed == 1, 60,
                   "y answered while x's model rests")
        assert finished(oa, b.id).status == "completed", "a later batch is not held up"
        assert oa.batches.retrieve(a.id).status == "in_progress"
        wait_until(lambda: "its lines rest" in c.log(), 30, "the rest in the log")
    path = tmp_path / "state" / "batches" / f"{a.id}.json"
    saved = json.loads(path.read_text())
    saved["expires_at"] = int(time.time()) - 1  # (24 h, passed)
    path.write_text(json.dumps(saved))
    with Corral(config, home=tmp_path) as c:
        oa = client(c, "none")
        done = finished(oa, a.id)
        assert done.status == "expired" and done.expired_at is not None
        assert [r["custom_id"] for r in results(oa, done.output_file_id)] == ["y"]
        errors = results(oa, done.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
            ("x", "batch_expired")], errors


def test_a_result_cut_short_by_a_crash_is_cut_off_and_its_line_sent_again(
        tmp_path: Path) -> None:
    config = toml_config({"slow": {"cmd": fake_cmd("--tokens-per-s", "6")}},
                         batches={"lines_at_once": 1}, state_dir=str(tmp_path / "state"))
    with Corral(config, home=tmp_path) as c:
        oa = client(c, "none")
        f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(
            [(f"t{i}", "slow") for i in range(6)]))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        wait_until(lambda: oa.batches.retrieve(b.id).request_counts.completed >= 2, 30)
    out = tmp_path / "state" / "batches" / f"{b.id}.out.jsonl"
    with out.open("ab") as half:  # what a kill or a full disk leaves in a write
        half.write(b'{"id": "batch_req_0", "custom_id": "t')
    with Corral(config, home=tmp_path) as again:
        oa = client(again, "none")
        done = finished(oa, b.id)
        lines = oa.files.content(done.output_file_id).text.splitlines()
        ids = sorted(json.loads(line)["custom_id"] for line in lines)
        assert ids == [f"t{i}" for i in range(6)] and done.request_counts.completed == 6


def test_an_upload_cut_short_is_a_400_and_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    (state / "batches" / "files").mkdir(parents=True)
    (state / "batches" / "files" / "left.part").write_bytes(b"a crash's")
    with Corral(toml_config({"a": {"cmd": fake_cmd()}}, state_dir=str(state)),
                home=tmp_path) as c:
        files = state / "batches" / "files"
        assert not (files / "left.part").exists(), "what a crash left goes at start"
        body = (b"--XX\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                b"--XX\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n"
                b"\r\n" + b"x" * 300_000)  # (no closing boundary)
        with socket.create_connection(("127.0.0.1", c.port)) as s:
            s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: multipart/form-data; boundary=XX\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            s.settimeout(30)
            assert s.recv(64).startswith(b"HTTP/1.1 400"), "a malformed form"
        assert list(files.iterdir()) == []


def test_queued_batches_hold_no_input_in_memory(tmp_path: Path) -> None:
    """Lines are read when a batch runs, as places in its file: twelve more batches of a
    17 MiB file waiting their turn cost corral less than the file once."""
    data = b"".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": "slow", "max_tokens": 3,
                 "messages": [{"role": "user", "content": "p" * 1000}]}}).encode() + b"\n"
        for i in range(16_000))
    with Corral(toml_config({"slow": {"cmd": fake_cmd("--tokens-per-s", "2")}},
                            batches={"lines_at_once": 1}), home=tmp_path) as c:
        oa = client(c, "none")
        f = oa.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        proc = psutil.Process(c.proc.pid)

        def batches(n: int) -> None:
            for _ in range(n):
                oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
        batches(12)  # (the first runs: its lines are read; each of the API's threads
        before = proc.memory_info().rss  # reads the file once: the allocator's high water)
        batches(24)
        grown = proc.memory_info().rss - before
        print(f"{grown / 2**20:.1f} MiB for 24 more")
        assert grown < len(data) / 4, f"{grown / 2**20:.0f} MiB for 24 queued batches"


def test_the_model_up_goes_first_and_the_batch_tells_its_eta(tmp_path: Path) -> None:
    """y is up, x is not: y's lines run first (no load), then x's (one: idle_s 0 lets it
    evict y at once); while it runs, the batch has an ETA, and none once done."""
    with Corral(toml_config({"x": {"cmd": fake_cmd("--tokens-per-s", "40")},
                             "y": {"cmd": fake_cmd("--tokens-per-s", "40")}},
                            models_max=1, batches={"lines_at_once": 1, "idle_s": 0}),
                home=tmp_path) as c:
        status, _, _ = request(c.port, "POST", "/v1/chat/completions",
                               {"model": "y", "max_tokens": 1, "messages": []})
        assert status == 200
        oa = client(c, "none")
        f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(
            [(f"l{i}", "xy"[i % 2]) for i in range(16)]))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        eta = wait_until(lambda: oa.batches.retrieve(b.id).model_extra.get("eta_s"), 30,
                         "an ETA")
        assert 0 < eta < 60, eta
        done = finished(oa, b.id)
        assert done.status == "completed" and done.model_extra.get("eta_s") is None
        status, body, _ = request(c.port, "GET", "/requests?key=batch:&limit=16")
        order = [r["model"] for r in reversed(body["data"])]
        assert order == ["y"] * 8 + ["x"] * 8, order
        loads = {m["id"]: m["loads"] for m in request(c.port, "GET", "/models")[1]["data"]}
        assert loads == {"x": 1, "y": 1}, loads


def test_an_interactive_request_cuts_a_running_line(tmp_path: Path) -> None:
    """priority_preempt: the one slot of m runs a batch's line; a request of a class
    cuts it, and the line waits again and is answered once, after."""
    with Corral(toml_config({"m": {"cmd": fake_cmd("--tokens-per-s", "4"),
                                   "max_concurrency": 1}},
                            priority_preempt=True, batches={"lines_at_once": 1}),
                home=tmp_path) as c:
        oa = client(c, "none")
        f = oa.files.create(file=("in.jsonl", io.BytesIO(batch_input(
            [(f"c{i}", "m") for i in range(3)]))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
        wait_until(lambda: any(m["in_flight"] for m in request(
            c.port, "GET", "/models")[1]["data"]), 30, "a line running")
        status, _, _ = request(c.port, "POST", "/v1/chat/completions",
                               {"model": "m", "max_tokens": 1, "messages": []})
        assert status == 200
        done = finished(oa, b.id)
        assert done.status == "completed" and done.request_counts.completed == 3
        assert sorted(r["custom_id"] for r in results(oa, done.output_file_id)) == \
            ["c0", "c1", "c2"]
        status, body, _ = request(c.port, "GET", "/requests?key=batch:&limit=20")
        assert any(r.get("cut") for r in body["data"]), body["data"]
