"""End to end through a real corral process and real fake-model children: scheduling."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

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


def three_models(models_max: int = 2, **knobs: list[str]) -> str:
    models = {n: {"cmd": fake_cmd(*knobs.get(n, []))} for n in ("a", "b", "c")}
    return toml_config(models, models_max=models_max)


def test_demo_serves_on_demand_and_evicts_lru(corral) -> None:
    c = corral(None)  # no config: the built-in demo, two simulated 3.5 GiB GPUs
    _, props, _ = request(c.port, "GET", "/props")
    assert props["role"] == "router" and props["max_instances"] == 3
    for model in ("demo-small", "demo-medium", "demo-large"):
        status, body = chat(c.port, model, max_tokens=3)
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 "
    models = c.models()
    small = models["demo-small"]
    # the demo's models can be suspended: small is, unless host RAM is short here
    expected = (("sleeping", "suspended") if small["last_eviction"]["action"] == "suspend"
                else ("unloaded", None))
    assert (small["status"]["value"], small["status"].get("phase")) == expected
    assert models["demo-small"]["last_eviction"]["reason"] == "memory"
    assert models["demo-small"]["last_eviction"]["for_model"] == "demo-large"
    assert {models[m]["status"]["value"] for m in ("demo-medium", "demo-large")} == {"loaded"}
    assert models["demo-medium"]["devices"] == ["demo-gpu1"]
    assert models["demo-large"]["devices"] == ["demo-gpu0"]  # where small was


def test_lru_order_at_models_max(corral) -> None:
    c = corral(three_models(2))
    sse = SSE(c.port)
    for model in ("a", "b", "a", "c"):  # a used after b: b is the LRU when c comes
        assert chat(c.port, model)[0] == 200
    evictions = [e for e in sse.events if e["type"] == "eviction"]
    assert [(e["model"], e["for_model"]) for e in evictions] == [("b", "c")]
    assert c.state("a") == "loaded" and c.state("c") == "loaded" and c.state("b") == "unloaded"
    assert sse.statuses("b") == ["loading", "loaded", "stopping", "unloaded"]


def test_busy_model_is_not_evicted_and_the_other_request_waits(corral) -> None:
    c = corral(three_models(1, a=["--tokens-per-s", "40"]))
    with ThreadPoolExecutor(2) as pool:
        slow = pool.submit(chat, c.port, "a", 20)  # ~0.5 s of tokens
        wait_until(lambda: c.models()["a"]["in_flight"] == 1, what="a in flight")
        other = pool.submit(chat, c.port, "b")
        wait_until(lambda: c.models()["b"]["waiting"] == 1, what="b queued")
        assert c.state("a") == "loaded"  # still serving: not evicted for b
        status, body = slow.result(timeout=30)
        assert status == 200
        assert body["choices"][0]["message"]["content"].count("tok") == 20  # not cut off
        assert other.result(timeout=30)[0] == 200
    assert c.models()["a"]["last_eviction"]["for_model"] == "b"


def test_concurrent_requests_for_one_missing_model_load_it_once(corral) -> None:
    c = corral(three_models(2, c=["--load-delay", "0.3"]))
    assert chat(c.port, "a")[0] == 200
    assert chat(c.port, "b")[0] == 200
    sse = SSE(c.port)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: chat(c.port, "c"), range(3)))
    assert [r[0] for r in results] == [200, 200, 200]
    assert sse.statuses("c").count("loading") == 1
    assert len([e for e in sse.events if e["type"] == "eviction"]) == 1
    assert c.models()["c"]["loads"] == 1


def test_queue_is_fifo(corral) -> None:
    c = corral(three_models(1, a=["--tokens-per-s", "20"]))
    sse = SSE(c.port)
    with ThreadPoolExecutor(3) as pool:
        hold = pool.submit(chat, c.port, "a", 10)
        wait_until(lambda: c.models()["a"]["in_flight"] == 1, what="a in flight")
        first = pool.submit(chat, c.port, "c")
        wait_until(lambda: c.models()["c"]["waiting"] == 1, what="c queued")
        second = pool.submit(chat, c.port, "b")
        wait_until(lambda: c.models()["b"]["waiting"] == 1, what="b queued")
        for f in (hold, first, second):
            assert f.result(timeout=30)[0] == 200
    loads = [e["model"] for e in sse.events
             if e["type"] == "status_change" and e["status"] == "loading"]
    assert loads == ["a", "c", "b"]


def test_client_leaving_the_queue_leaves_no_trace(corral) -> None:
    c = corral(three_models(1, a=["--tokens-per-s", "20"]))
    with ThreadPoolExecutor(1) as pool:
        hold = pool.submit(chat, c.port, "a", 10)
        wait_until(lambda: c.models()["a"]["in_flight"] == 1, what="a in flight")
        conn = http.client.HTTPConnection("127.0.0.1", c.port)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "b"}))
        wait_until(lambda: c.models()["b"]["waiting"] == 1, what="b queued")
        conn.sock.shutdown(2)  # the client goes away while queued
        conn.close()
        wait_until(lambda: c.models()["b"]["waiting"] == 0, what="b to leave the queue")
        assert hold.result(timeout=30)[0] == 200
    models = c.models()
    assert models["b"]["loads"] == 0
    assert models["a"]["status"]["value"] == "loaded"  # nothing evicted for the leaver
    assert models["a"]["last_eviction"] is None


def test_streaming_passes_through_as_it_arrives(corral) -> None:
    c = corral(three_models(2, a=["--tokens-per-s", "10"]))
    assert chat(c.port, "a")[0] == 200  # load it
    child_port = c.models()["a"]["port"]
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("POST", "/v1/chat/completions",
                 body=json.dumps({"model": "a", "stream": True, "max_tokens": 8}))
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    first = resp.readline()
    assert first.startswith(b"data: ") and b"tok0" in first
    # the first token is here while the child is still producing the rest
    _, stats, _ = request(child_port, "GET", "/debug/stats")
    assert stats["completed"] == 1  # only the warm-up request has finished
    rest = resp.read()
    assert rest.count(b"data: ") == 8 and rest.rstrip().endswith(b"data: [DONE]")
    conn.close()


def test_client_disconnect_cancels_upstream_and_frees_the_slot(corral) -> None:
    c = corral(three_models(2, a=["--tokens-per-s", "10"]))
    assert chat(c.port, "a")[0] == 200
    child_port = c.models()["a"]["port"]
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("POST", "/v1/completions",
                 body=json.dumps({"model": "a", "stream": True, "max_tokens": 100}))
    resp = conn.getresponse()
    assert resp.readline().startswith(b"data: ")
    conn.sock.shutdown(2)
    conn.close()
    wait_until(lambda: request(child_port, "GET", "/debug/stats")[1]["cancelled"] == 1,
               what="the child to see the cancel")
    wait_until(lambda: c.models()["a"]["in_flight"] == 0, what="the slot to be released")


def test_every_openai_endpoint_is_proxied_by_model_and_alias(corral) -> None:
    cfg = toml_config({"a": {"cmd": fake_cmd(), "aliases": ["alpha", "first"]}})
    c = corral(cfg)
    paths = ["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses",
             "/v1/messages", "/completion", "/completions", "/chat/completions",
             "/embedding", "/embeddings", "/rerank", "/v1/rerank", "/tokenize",
             "/detokenize", "/infill", "/apply-template", "/v1/audio/speech",
             "/v1/images/generations"]
    for i, path in enumerate(paths):
        name = ("a", "alpha", "first")[i % 3]
        status, body, _ = request(c.port, "POST", path, {"model": name, "input": "x y",
                                                         "content": "x y", "tokens": [1]})
        assert status == 200, (path, body)
        assert "error" not in body
        if body.get("object") == "echo":  # the child got it, as sent (an alias resolved)
            assert body["path"] == path and body["received_model"] == name
    status, body, _ = request(c.port, "GET", "/props?model=alpha")
    assert status == 200 and body["role"] == "model" and body["model_alias"] == "a"
    assert request(c.port, "GET", "/slots?model=a")[0] == 200
    assert c.models()["a"]["aliases"] == ["alpha", "first"]
    assert c.models()["a"]["in_flight"] == 0


def test_sigkill_of_an_idle_child_shows_failed_and_the_next_request_reloads(corral) -> None:
    c = corral(three_models(2))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    os.kill(pid, signal.SIGKILL)
    failed = c.wait_state("a", "failed")
    assert failed["status"]["failed"] is True
    assert failed["status"]["exit_code"] == -signal.SIGKILL
    assert "SIGKILL" in failed["status"]["exit"]
    assert chat(c.port, "a")[0] == 200
    again = c.models()["a"]
    assert again["status"]["value"] == "loaded" and again["loads"] == 2
    assert again["pid"] != pid


def test_sigkill_of_corral_leaves_no_child_alive(corral) -> None:
    c = corral(three_models(3))
    for model in ("a", "b", "c"):
        assert chat(c.port, model)[0] == 200
    pids = [m["pid"] for m in c.models().values()]
    assert all(pid_alive(p) for p in pids)
    c.proc.kill()
    c.proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in pids), 10, "children to die with corral")


def test_a_load_that_fails_answers_its_waiter_and_the_next_request_retries(
        corral, tmp_path: Path) -> None:
    c = corral(toml_config({"a": {"cmd": fails_first(1, tmp_path / "starts")}}))
    sse = SSE(c.port)
    status, body, headers = request(c.port, "POST", "/v1/chat/completions",
                                    {"model": "a", "messages": []})
    assert status == 503 and headers["retry-after"] == "1"  # one error, at once
    assert body["error"]["message"] == (
        "model 'a' failed to load (attempt 1): exited with status 7")
    status, body = chat(c.port, "a")
    assert status == 200, body
    # The answer can overtake the `loaded` event on its way to the listener: wait for it.
    sse.wait_for(lambda e: e.get("model") == "a" and e.get("status") == "loaded")
    assert sse.statuses("a") == ["loading", "unloaded", "loading", "loaded"]
    failed = next(e for e in sse.events if e.get("failed"))
    assert failed["status"] == "unloaded" and failed["exit_code"] == 7
    assert failed["exit"] == "exited with status 7" and "load failed" in failed["cause"]


def test_a_model_that_never_starts_backs_off_and_says_why(corral) -> None:
    cfg = toml_config({"broken": {"cmd": ["python3", "-c", "import sys; sys.exit(3)"]}},
                      restart_intensity=1, queue_timeout_s=0.2)
    c = corral(cfg)
    for attempt in (1, 2):
        status, body = chat(c.port, "broken")
        assert status == 503
        assert f"'broken' failed to load (attempt {attempt})" in body["error"]["message"]
        assert "exited with status 3" in body["error"]["message"]
    status = c.models()["broken"]["status"]
    assert status["value"] == "unloaded" and status["failed"] is True  # llama.cpp's values
    assert status["exit_code"] == 3 and 0 < status["retry_after_s"] <= 1
    # In the backoff, a request that would outwait its queue_timeout_s is told at once.
    status_, body, headers = request(c.port, "POST", "/v1/chat/completions",
                                     {"model": "broken", "messages": []})
    assert status_ == 503 and int(headers["retry-after"]) >= 1
    assert "the next load may start in" in body["error"]["message"]
    assert request(c.port, "GET", "/health")[0] == 200


def test_load_timeout_kills_a_child_that_never_gets_ready(corral) -> None:
    cfg = toml_config({"hang": {"cmd": fake_cmd("--hang-before-ready"), "load_timeout_s": 0.5}},
                      restart_intensity=0)
    c = corral(cfg)
    status, body = chat(c.port, "hang")
    assert status == 503
    assert "not ready within load_timeout_s=0.5" in body["error"]["message"]


def test_stop_escalates_to_sigkill_for_a_child_ignoring_sigterm(corral) -> None:
    cfg = toml_config({"stubborn": {"cmd": fake_cmd("--ignore-sigterm"),
                                    "stop_timeout_s": 0.3}})
    c = corral(cfg)
    assert chat(c.port, "stubborn")[0] == 200
    pid = c.models()["stubborn"]["pid"]
    sse = SSE(c.port)
    assert request(c.port, "POST", "/models/unload", {"model": "stubborn"})[0] == 200
    event = sse.wait_for(lambda e: e.get("status") == "unloaded")
    assert event["exit_code"] == -signal.SIGKILL
    assert not pid_alive(pid)


def test_a_request_whose_child_dies_before_answering_goes_to_the_next_instance(
        corral) -> None:
    c = corral(three_models(2, a=["--crash-after-requests", "1"],
                            b=["--crash-after-requests", "0"]))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    status, body = chat(c.port, "a")  # the child dies on this one, before any answer
    assert status == 200, body
    assert c.models()["a"]["pid"] != pid and c.models()["a"]["loads"] == 2
    assert "went away before answering" in c.log()
    status, body = chat(c.port, "b")  # b dies on every request: two replays, then a 502
    assert status == 502 and "unreachable" in body["error"]["message"]
    assert c.models()["b"]["loads"] == 3
    for model, n, replays, status in (("a", 2, 1, 200), ("b", 1, 2, 502)):  # the journal's
        path = f"/requests?model={model}"
        wait_until(lambda p=path, n=n: len(request(c.port, "GET", p)[1]["data"]) == n,
                   what=f"{model}'s records")  # (written as the answer has gone)
        newest = request(c.port, "GET", f"/requests?model={model}&limit=1")[1]["data"][0]
        assert (newest.get("replays"), newest["status"]) == (replays, status), newest
    c.wait_state("b", "failed")


def test_children_run_in_their_own_process_group(corral) -> None:
    c = corral(three_models(2))
    assert chat(c.port, "a")[0] == 200
    pid = c.models()["a"]["pid"]
    assert os.getpgid(pid) == pid
    assert psutil.Process(pid).ppid() == c.proc.pid


def test_shutdown_stops_children_and_exits_zero(corral) -> None:
    c = corral(three_models(3))
    for m in ("a", "b"):
        assert chat(c.port, m)[0] == 200
    pids = [m["pid"] for m in c.models().values() if m["pid"]]
    assert c.stop(signal.SIGTERM) == 0
    assert not any(pid_alive(p) for p in pids)


def test_health_answers_while_requests_wait(corral) -> None:
    c = corral(three_models(1, a=["--tokens-per-s", "20"]))
    done = threading.Event()

    def hold() -> None:
        chat(c.port, "a", 10)
        done.set()

    threading.Thread(target=hold, daemon=True).start()
    wait_until(lambda: c.models()["a"]["in_flight"] == 1, what="a in flight")
    status, body, _ = request(c.port, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["running"] == 1
    assert done.wait(30)
