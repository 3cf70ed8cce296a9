"""Quotas that hold against a hostile key, over real processes (issue 37): a long answer
is paid for in the minutes after it (S5), a stream is charged as it goes and never cut,
an upload costs tokens by its bytes, and a key's plans and listings have an allowance of
their own that is refused before it reaches the Scheduler (S7)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from actors.config.load import parse_config
from actors.config.model import ConfigError
from tests.helpers import chat, fake_cmd, request, toml_config, wait_until
from tests.test_uploads import BOUNDARY, form


def key(tmp_path: Path, name: str, **rules: Any) -> dict[str, Any]:
    path = tmp_path / f"{name}.key"
    path.write_text(f"{name}-secret\n")
    return {"key_file": str(path), **rules}


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {name}-secret"}


def key_row(port: int, name: str) -> dict[str, Any]:
    status, body, _ = request(port, "GET", "/keys", headers=bearer("root"))
    assert status == 200, body
    return next(k for k in body["data"] if k["name"] == name)  # type: ignore[no-any-return]


def test_a_long_answer_keeps_its_key_waiting_until_it_is_paid_for(corral,
                                                                  tmp_path: Path) -> None:
    """S5: with tokens_per_min 100, one 2000-token answer a minute ran at 20 times the
    limit (refused for 60 s only), and an upload counted no tokens at all."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, keys={
        "root": key(tmp_path, "root", admin=True),
        "bob": key(tmp_path, "bob", tokens_per_min=100),
        "carol": key(tmp_path, "carol", tokens_per_min=1_000_000)}))
    status, body = chat(c.port, "a", max_tokens=2000, headers=bearer("bob"))
    assert status == 200 and body["usage"]["completion_tokens"] == 2000, "never cut"
    status, body, headers = request(c.port, "POST", "/v1/chat/completions",
                                    {"model": "a", "max_tokens": 1, "messages": []},
                                    headers=bearer("bob"))
    assert status == 429, body
    assert 1150 < int(headers["retry-after"]) <= 1201, "20 minutes, not one"
    assert "owes 1901 more" in body["error"]["message"]
    bob = key_row(c.port, "bob")
    assert (bob["tokens_last_min"], bob["tokens_carried"]) == (100, 1901)
    # an upload's answer has no usage: its body's bytes / 4 are its prompt
    upload = form([("model", b"a", None), ("file", b"x" * 200_000, "a.wav")])
    status, body, _ = request(c.port, "POST", "/v1/audio/transcriptions", raw=upload,
                              headers={**bearer("carol"), "Content-Type":
                                       f"multipart/form-data; boundary={BOUNDARY}"})
    assert status == 200, body
    carol = wait_until(lambda: (row := key_row(c.port, "carol"))["requests_total"] and row,
                       10, "the upload's count")
    assert carol["prompt_tokens_total"] == len(upload) // 4
    assert carol["tokens_last_min"] == len(upload) // 4


def test_a_stream_is_charged_as_it_goes_and_runs_to_its_end(corral, tmp_path: Path) -> None:
    """S5: a stream's tokens count while it runs, so its key's next request is refused
    before it ends; the stream itself is never cut for it."""
    c = corral(toml_config({"slow": {"cmd": fake_cmd("--tokens-per-s", "100")}}, keys={
        "root": key(tmp_path, "root", admin=True),
        "dan": key(tmp_path, "dan", tokens_per_min=100)}))
    assert chat(c.port, "slow", max_tokens=1, headers=bearer("root"))[0] == 200  # loaded
    events: list[bytes] = []
    ended = threading.Event()

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"model": "slow", "max_tokens": 500, "stream": True,
                 "messages": [{"role": "user", "content": "hi"}]}),
                {**bearer("dan"), "Content-Type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            events.extend(line for line in resp if line.startswith(b"data: {"))
        finally:
            conn.close()
            ended.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    try:
        wait_until(lambda: ended.is_set() or key_row(c.port, "dan")["tokens_last_min"] >= 100,
                   10, "the stream's first 100 tokens")
        status, body = chat(c.port, "slow", max_tokens=1, headers=bearer("dan"))
        assert not ended.is_set(), "charged only at its end (500 tokens take 5 s)"
        assert status == 429 and "tokens_per_min 100" in body["error"]["message"]
    finally:
        reader.join(30)
    assert len(events) == 500, "the stream was not cut"
    dan = wait_until(lambda: (row := key_row(c.port, "dan"))["in_flight"] == 0 and row, 10,
                     "the stream's release")
    assert dan["tokens_last_min"] == 100 and dan["tokens_carried"] > 400


def test_plans_and_listings_have_an_allowance_refused_before_the_scheduler(
        corral, tmp_path: Path) -> None:
    """S7: a member key's plans and listings were outside every quota; 8 threads of
    plans cut another key's throughput tenfold. Now each key has plans_per_min (120 a
    minute unless set; none for an admin key), refused with a pause."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, keys={
        "root": key(tmp_path, "root", admin=True),
        "alice": key(tmp_path, "alice", models=["a"], plans_per_min=3),
        "eve": key(tmp_path, "eve", models=["a"])}))
    for path in ("/models/plan?model=a", "/v1/models", "/v1/models/a"):
        assert request(c.port, "GET", path, headers=bearer("alice"))[0] == 200, path
    started = time.monotonic()
    status, body, headers = request(c.port, "GET", "/models/plan?model=a",
                                    headers=bearer("alice"))
    assert status == 429 and body["error"]["type"] == "rate_limit_error"
    assert "plans_per_min 3" in body["error"]["message"]
    assert time.monotonic() - started >= 0.9, "a refusal comes after a pause"
    assert 55 <= int(headers["retry-after"]) <= 60
    assert request(c.port, "GET", "/props", headers=bearer("alice"))[0] == 429
    assert chat(c.port, "a", headers=bearer("alice"))[0] == 200, "models are another budget"
    assert request(c.port, "GET", "/v1/models", headers=bearer("eve"))[0] == 200, \
        "another key's allowance is its own"
    for _ in range(5):  # an admin key has no allowance unless it sets one
        assert request(c.port, "GET", "/keys", headers=bearer("root"))[0] == 200
    limits = {k["name"]: k["limits"]["plans_per_min"] for k in
              request(c.port, "GET", "/keys", headers=bearer("root"))[1]["data"]}
    assert limits == {"root": 0, "alice": 3, "eve": 120}


@pytest.mark.parametrize(("value", "error"), [
    (-1, "keys.x.plans_per_min"), ("many", "keys.x.plans_per_min"),
    (1.5, "keys.x.plans_per_min")])
def test_a_wrong_plans_per_min_is_refused_naming_it(value: object, error: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config({"keys": {"x": {"key_env": "HOME", "plans_per_min": value}}},
                     "corral.toml")
    assert error in str(e.value) and str(e.value).startswith("corral.toml: ")


def test_a_stream_charged_through_any_front_is_counted_exactly_once(corral,
                                                                     tmp_path: Path) -> None:
    """With http.workers, a stream's charges as it goes cross a worker's channel (Spent)
    as its release does: the key's window ends with exactly what the answers' usage
    said, whichever fronts the streams went through."""
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}, http={"workers": 3}, keys={
        "root": key(tmp_path, "root", admin=True),
        "fay": key(tmp_path, "fay", tokens_per_min=1000)}))  # a charge each 100 tokens
    for _ in range(6):  # on fresh connections: the kernel spreads them over the fronts
        status, body, _ = request(c.port, "POST", "/v1/chat/completions", {
            "model": "a", "stream": True, "max_tokens": 150,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "hi"}]}, headers=bearer("fay"))
        assert status == 200 and str(body).count("data: {") == 151
    fay = wait_until(lambda: (row := key_row(c.port, "fay"))["requests_total"] == 6
                     and row["in_flight"] == 0 and row, 10, "the streams' counts and ends")
    assert (fay["tokens_last_min"], fay["tokens_carried"]) == (6 * 151, 0)
