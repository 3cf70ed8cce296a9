"""The operating rules with real children (the fake model server): a crash breaker that
heals itself, idle TTL, bounded waiting, per-model concurrency, liveness."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tests.helpers import (
    SSE,
    chat,
    fails_first,
    fake_cmd,
    pid_alive,
    request,
    toml_config,
    wait_until,
)


def post(port: int, model: str, max_tokens: int = 4) -> tuple[int, Any, dict[str, str]]:
    return request(port, "POST", "/v1/chat/completions",
                   {"model": model, "max_tokens": max_tokens, "messages": []})


def in_background(fn: Any, *args: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    return t, out


def test_a_crash_loop_backs_off_then_heals_without_anyone_loading_it(
        corral, tmp_path: Path) -> None:
    # The first 3 starts fail; then it is a working fake model.
    c = corral(toml_config({"a": {"cmd": fails_first(3, tmp_path / "starts")}},
                           restart_intensity=1))
    sse = SSE(c.port)
    for attempt in (1, 2):  # each failed load answers its waiter once
        status, body, headers = post(c.port, "a")
        assert status == 503 and "retry-after" in headers
        assert f"failed to load (attempt {attempt})" in body["error"]["message"]
    # 2 failures > restart_intensity 1: a 1 s backoff; this request waits it out, and
    # its load (the third start) fails too, opening a 2 s backoff ...
    status, body, _ = post(c.port, "a")
    assert status == 503 and "attempt 3" in body["error"]["message"]
    assert c.models()["a"]["status"]["retry_after_s"] > 0
    # ... which the next request waits out; the half-open load succeeds.
    status, body, _ = post(c.port, "a")
    assert status == 200, body
    status_ = c.models()["a"]["status"]
    assert status_["value"] == "loaded" and "failed" not in status_
    backoffs = [e["retry_after_s"] for e in sse.events if e.get("retry_after_s")]
    assert len(backoffs) == 2 and backoffs[0] <= 1 < backoffs[1] <= 2
    assert "no load for 1 s" in c.log() and "no load for 2 s" in c.log()


def test_an_idle_model_is_stopped_after_its_ttl_and_reloads_on_demand(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd(), "ttl_s": 2}, "b": {"cmd": fake_cmd()}}))
    assert chat(c.port, "a")[0] == 200
    a = c.models()["a"]  # read before b loads: on a busy machine that may outlast the TTL
    pid, expires = a["pid"], a["status"]["expires_in_s"]
    assert 0 <= expires <= 2
    assert chat(c.port, "b")[0] == 200
    assert "expires_in_s" not in c.models()["b"]["status"]  # no ttl_s: never
    wait_until(lambda: not pid_alive(pid), 10, "a's child to exit after its TTL")
    gone = c.wait_state("a", "unloaded")
    assert gone["last_eviction"]["reason"] == "ttl" and "failed" not in gone["status"]
    assert c.state("b") == "loaded"
    assert chat(c.port, "a")[0] == 200 and c.models()["a"]["pid"] != pid


def test_queue_timeout_answers_503_and_evicts_nothing_for_the_leaver(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20")},
                            "b": {"cmd": fake_cmd(), "queue_timeout_s": 0.3}}, models_max=1))
    assert chat(c.port, "a")[0] == 200
    busy, slow = in_background(chat, c.port, "a", 30)  # 1.5 s: a cannot be evicted
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "a busy")
    status, body, headers = post(c.port, "b")
    assert status == 503 and headers["retry-after"] == "1"
    assert "waited 0.3 s for model 'b' (queue_timeout_s)" in body["error"]["message"]
    busy.join(10)
    assert slow[0][0] == 200
    assert c.state("a") == "loaded" and c.models()["a"]["last_eviction"] is None
    assert c.models()["b"]["loads"] == 0


def test_max_concurrency_and_queue_max(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20"),
                                  "max_concurrency": 1, "queue_max": 1}}))
    assert chat(c.port, "a")[0] == 200
    sse = SSE(c.port)
    first, out1 = in_background(chat, c.port, "a", 20)  # 1 s
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, 5, "the first in flight")
    second, out2 = in_background(chat, c.port, "a", 1)
    wait_until(lambda: c.models()["a"]["waiting"] == 1, 5, "the second to wait")
    assert c.models()["a"]["in_flight"] == 1 and c.models()["a"]["oldest_wait_s"] >= 0
    assert c.models()["a"]["queue_position"] == 0
    sse.wait_for(lambda e: e.get("type") == "queue" and e["model"] == "a"
                 and e["waiting"] == 1)
    status, body, headers = post(c.port, "a")  # over queue_max
    assert status == 503 and headers["retry-after"] == "1"
    assert "queue_max 1" in body["error"]["message"]
    for t in (first, second):
        t.join(10)
    assert out1[0][0] == 200 and out2[0][0] == 200
    assert c.models()["a"]["loads"] == 1  # waiting for concurrency never loads another


def test_a_child_that_stops_answering_health_is_stopped_and_reloaded(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--wedge-after-requests", "1")}},
                           liveness_interval_s=0.2, liveness_failures=2))
    assert chat(c.port, "a")[0] == 200  # from now on its /health hangs
    pid = c.models()["a"]["pid"]
    wait_until(lambda: not pid_alive(pid), 10, "the wedged child to be stopped")
    stopped = c.wait_state("a", "failed")
    assert stopped["last_eviction"]["reason"] == "unhealthy"
    assert "2 liveness checks failed in a row" in c.log()
    assert "/health did not answer within 0.2 s" in c.log()
    assert chat(c.port, "a")[0] == 200 and c.models()["a"]["pid"] != pid


def test_first_byte_timeouts_count_as_failed_liveness_checks(corral) -> None:
    """A child that takes requests but never answers: 504s, and after liveness_failures of
    them the child is stopped (its /health answering does not save it)."""
    c = corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "1"),
                                  "first_byte_timeout_s": 0.3}},
                           liveness_interval_s=0, liveness_failures=2))
    assert request(c.port, "POST", "/models/load", {"model": "a"})[0] == 200
    pid = c.wait_state("a", "loaded")["pid"]
    for _ in range(2):
        status, body, _ = post(c.port, "a", max_tokens=50)  # 50 s of tokens: never in time
        assert status == 504 and "first_byte_timeout_s" in body["error"]["message"]
    wait_until(lambda: not pid_alive(pid), 10, "the child to be stopped")
    assert c.wait_state("a", "failed")["last_eviction"]["reason"] == "unhealthy"
