"""corral as a drop-in for llama-server's router, over real llama-server children (R-2.4).

The binary comes from `bash scripts/llama-server.sh` (which `.ci/run` runs first); the
models are tiny random-weight GGUF files written by scripts/tiny_gguf.py. Without the
binary these tests skip, naming the script.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from scripts.tiny_gguf import write_tiny_gguf
from tests.helpers import ROOT, SSE, pid_alive, request, wait_until


def find_llama_server() -> str | None:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "llama-server.sh"), "--where"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip() if out.returncode == 0 else None


BINARY = find_llama_server()
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no llama-server here: run `bash scripts/llama-server.sh` "
    "(or set LLAMA_SERVER) to build it")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    for seed in range(3):
        write_tiny_gguf(folder / f"m{seed}.gguf", seed=seed)
    return folder


def preset(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.ini"
    path.write_text(text)
    return path


def serve(corral: Any, ini: Path, *flags: str) -> Any:
    assert BINARY is not None
    return corral(None, "--models-preset", str(ini), "--llama-server", BINARY, *flags)


def three(models: Path, extra: str = "") -> str:
    return "[*]\nc = 256\nno-warmup = true\n" + extra + "".join(
        f"\n[m{i}]\nmodel = {models}/m{i}.gguf\n" for i in range(3))


def chat(port: int, model: str, n: int = 4, **extra: Any) -> tuple[int, Any]:
    status, body, _ = request(port, "POST", "/v1/chat/completions", {
        "model": model, "max_tokens": n, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}], **extra})
    return status, body


def stream(port: int, model: str, max_tokens: int) -> tuple[http.client.HTTPConnection,
                                                              http.client.HTTPResponse]:
    """Start a streamed chat completion; the caller reads the response and closes."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}]}),
        headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def test_on_demand_load_ready_from_the_ready_line_and_streaming(corral, tmp_path,
                                                                models) -> None:
    c = serve(corral, preset(tmp_path, three(models)))
    assert c.state("m0") == "unloaded"
    conn, resp = stream(c.port, "m0", 8)
    assert resp.status == 200 and resp.getheader("Content-Type", "").startswith(
        "text/event-stream")
    events = [line for line in resp.read().decode().splitlines() if line.startswith("data: ")]
    conn.close()
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert sum(1 for ch in chunks if ch["choices"] and ch["choices"][0]["delta"].get(
        "content")) >= 1
    entry = c.models()["m0"]
    assert entry["status"]["value"] == "loaded"
    assert "meta" in entry  # the model info llama-server sent with `ready`
    assert "m0#1 ready on port" in c.log()


def test_lru_eviction_at_models_max_and_unload_by_the_exit_command(corral, tmp_path,
                                                                   models) -> None:
    c = serve(corral, preset(tmp_path, three(models)), "--models-max", "2")
    sse = SSE(c.port)
    for m in ("m0", "m1", "m2"):
        assert chat(c.port, m)[0] == 200
    assert c.models()["m0"]["last_eviction"]["reason"] == "lru"
    assert {c.state(m) for m in ("m1", "m2")} == {"loaded"}
    assert request(c.port, "POST", "/models/unload", {"model": "m1"})[0] == 200
    gone = sse.wait_for(lambda e: e["model"] == "m1" and e.get("status") == "unloaded")
    assert gone["exit_code"] == 0  # it left on the exit command: no signal needed
    assert "ignored the exit command" not in c.log()
    sse.close()


def test_a_child_killed_mid_request_gives_a_clean_error_and_reloads(corral, tmp_path,
                                                                   models) -> None:
    # context-shift: generation goes on past the small context, until the kill
    c = serve(corral, preset(tmp_path, three(models, "context-shift = true\n")))
    assert chat(c.port, "m0")[0] == 200
    pid = c.models()["m0"]["pid"]
    conn, resp = stream(c.port, "m0", 200_000)
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # it is streaming
    os.kill(pid, signal.SIGKILL)
    rest = resp.read().decode()
    conn.close()
    last = [line for line in rest.splitlines() if line.startswith("data: ")][-1]
    error = json.loads(last[6:])["error"]
    assert error["code"] == 502 and "stopped mid-response" in error["message"]
    c.wait_state("m0", "failed")
    status, body = chat(c.port, "m0")
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert c.models()["m0"]["pid"] != pid


def test_sleep_and_wake(corral, tmp_path, models) -> None:
    c = serve(corral, preset(tmp_path, three(models, "sleep-idle-seconds = 1\n")))
    sse = SSE(c.port)
    assert chat(c.port, "m0")[0] == 200
    c.wait_state("m0", "sleeping", timeout_s=15)
    pid = c.models()["m0"]["pid"]
    assert chat(c.port, "m0")[0] == 200  # proxied at once; the request wakes it
    wait_until(lambda: sse.statuses("m0")[-2:] == ["sleeping", "loaded"] or None, 10,
               "m0 to wake up")
    assert c.models()["m0"]["pid"] == pid  # the same process
    sse.close()


def test_preset_reload_keeps_unchanged_children(corral, tmp_path, models) -> None:
    ini = preset(tmp_path, three(models))
    c = serve(corral, ini)
    for m in ("m0", "m1"):
        assert chat(c.port, m)[0] == 200
    pids = {m: c.models()[m]["pid"] for m in ("m0", "m1")}
    # m1 removed, m2 changed (not running), m0 untouched, m3 new
    ini.write_text(three(models).replace(f"[m1]\nmodel = {models}/m1.gguf\n", "")
                   .replace("m2.gguf\n", "m2.gguf\nc = 128\n")
                   + f"\n[m3]\nmodel = {models}/m1.gguf\n")
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 200
    assert [m["id"] for m in body["data"]] == ["m0", "m2", "m3"]
    wait_until(lambda: not pid_alive(pids["m1"]), 10, "the removed model's child to exit")
    assert c.models()["m0"]["pid"] == pids["m0"]  # unchanged: still the same child
    assert "--ctx-size 128" in " ".join(c.models()["m2"]["status"]["args"])
    assert chat(c.port, "m3")[0] == 200
    assert chat(c.port, "m1")[0] == 400
    # now change the running m0: it restarts with the new arguments
    ini.write_text(ini.read_text().replace("m0.gguf\n", "m0.gguf\nc = 128\n", 1))
    assert request(c.port, "GET", "/models?reload=1")[0] == 200
    wait_until(lambda: not pid_alive(pids["m0"]), 10, "the changed model's child to exit")
    assert c.models()["m0"]["last_eviction"]["reason"] == "reload"
    assert chat(c.port, "m0")[0] == 200
    # a broken preset is refused, and nothing changes
    ini.write_text(ini.read_text() + "\n[bad]\nmodel = x.gguf\nno-such-option = 1\n")
    status, body, _ = request(c.port, "GET", "/models?reload=1")
    assert status == 400 and "[bad]: no-such-option: not a llama-server argument" in \
        body["error"]["message"]
    assert [m["id"] for m in c.models().values()] == ["m0", "m2", "m3"]


def test_models_dir_offers_each_gguf_by_its_stem(corral, tmp_path, models) -> None:
    folder = tmp_path / "dir"
    (folder / "multi").mkdir(parents=True)
    write_tiny_gguf(folder / "solo.gguf", seed=5)
    write_tiny_gguf(folder / "multi" / "weights.gguf", seed=6)
    (folder / "mmproj-solo.gguf").write_bytes(b"")  # a companion file, not a model
    assert BINARY is not None
    c = corral(None, "--models-dir", str(folder), "--llama-server", BINARY)
    assert sorted(c.models()) == ["multi", "solo"]
    assert chat(c.port, "multi")[0] == 200


def test_a_preset_error_names_the_file_section_and_key(tmp_path, models) -> None:
    ini = preset(tmp_path, f"[m0]\nmodel = {models}/m0.gguf\nctx = 5\n")
    assert BINARY is not None
    out = subprocess.run(
        [sys.executable, str(ROOT / "supervisor.py"), "--models-preset", str(ini),
         "--llama-server", BINARY], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"{ini}: [m0]: ctx: not a llama-server argument" in out.stderr


def test_concurrent_requests_to_one_cold_model_load_it_once(corral, tmp_path,
                                                             models) -> None:
    c = serve(corral, preset(tmp_path, three(models)))
    results: list[int] = []
    threads = [threading.Thread(target=lambda: results.append(chat(c.port, "m1")[0]))
               for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 6
    assert c.models()["m1"]["loads"] == 1


def test_a_burst_wider_than_the_childs_http_threads_is_not_held_up(corral, tmp_path,
                                                                   models) -> None:
    # llama-server gives each open connection one of its HTTP threads (8 or so here).
    # Through pooled keep-alive connections, half of 16 concurrent requests waited 5 s
    # for kept-alive ones to time out; corral now opens one connection per request.
    c = serve(corral, preset(tmp_path, three(models)))
    assert chat(c.port, "m0")[0] == 200
    child_port = c.models()["m0"]["port"]
    took: list[tuple[int, float]] = []

    def one() -> None:
        start = time.monotonic()
        status = chat(c.port, "m0", 1)[0]
        took.append((status, time.monotonic() - start))

    for _ in range(2):
        threads = [threading.Thread(target=one) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [s for s, _ in took] == [200] * 32
    assert max(t for _, t in took) < 4.0, sorted(t for _, t in took)  # the stall was 5.4 s
    assert wait_until(lambda: not [
        k for k in psutil.Process(c.proc.pid).net_connections("tcp")
        if k.raddr and k.raddr.port == child_port and k.status == psutil.CONN_ESTABLISHED])


def test_the_router_paths_reach_a_real_child(corral, tmp_path, models) -> None:
    """Issue 39: the token counters (with the official clients), the stream control and
    a child's own settings, answered by llama-server itself."""
    import anthropic
    import openai

    c = serve(corral, preset(tmp_path, three(models)))
    counted = anthropic.Anthropic(api_key="none", base_url=c.url, max_retries=0) \
        .messages.count_tokens(model="m0", messages=[{"role": "user", "content": "hi there"}])
    assert counted.input_tokens > 0
    assert c.state("m0") == "loaded"
    counted = openai.OpenAI(api_key="none", base_url=f"{c.url}/v1", max_retries=0) \
        .responses.input_tokens.count(model="m1", input="hi there")
    assert counted.input_tokens > 0
    status, body, headers = request(c.port, "POST", "/v1/chat/completions/input_tokens", {
        "model": "m0", "messages": [{"role": "user", "content": "hi there"}]})
    assert status == 200 and body["input_tokens"] > 0, body
    for path, body in (("/slots/0?action=erase&model=m0", {}),
                       ("/props?model=m0", {}), ("/lora-adapters", {"model": "m0"})):
        status, said, headers = request(c.port, "POST", path, body)
        # the child's own answer (POST /props needs its --props: a 403 of its own)
        assert headers.get("content-security-policy") == "sandbox", (path, status, said)
        assert status in (200, 400, 403, 501), (path, status, said)


def test_a_resumable_stream_from_a_real_child(corral, tmp_path, models) -> None:
    """Issue 39: a stream with X-Conversation-Id outlives its client; the rest is read
    back from where the client left, byte for byte as llama-server sent it."""
    c = serve(corral, preset(tmp_path, three(models)))
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "m0", "stream": True, "max_tokens": 64, "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}]}),
        headers={"Content-Type": "application/json", "X-Conversation-Id": "real-1"})
    resp = conn.getresponse()
    head = b""
    while head.count(b"\n\n") < 2:
        head += resp.readline()
    assert conn.sock is not None
    conn.sock.close()  # the client leaves
    conn.close()

    def get(offset: int) -> bytes:
        reader = http.client.HTTPConnection("127.0.0.1", c.port, timeout=30)
        try:
            reader.request("GET", f"/v1/stream/real-1?from={offset}")
            answer = reader.getresponse()
            assert answer.status == 200
            return answer.read()
        finally:
            reader.close()
    whole = head + get(len(head))
    assert get(0) == whole  # what the client had, then the rest: the answer, once
    events = [e[6:] for e in whole.decode().split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 64
    wait_until(lambda: c.models()["m0"]["in_flight"] == 0, 15, "nothing in flight")


def test_speeds_tokens_and_the_childs_own_metrics(corral, tmp_path, models) -> None:
    """Issue 40: a real child's `usage` and `timings` reach /metrics and the journal
    (its speeds among them), and its own /metrics (--metrics) is merged, labelled."""
    c = serve(corral, preset(tmp_path, three(models, "metrics = true\n")))
    conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({
        "model": "m0", "stream": True, "max_tokens": 16, "ignore_eos": True,
        "messages": [{"role": "user", "content": "hi"}]}),
        headers={"Content-Type": "application/json", "X-Request-Id": "speedy"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.read().rstrip().endswith(b"data: [DONE]")
    conn.close()

    def journaled() -> dict[str, Any] | None:
        status, body, _ = request(c.port, "GET", "/requests/speedy")
        return body["data"][0] if status == 200 else None
    record = wait_until(journaled, 15, "the record")
    assert record["tokens_out"] == 16 and record["tokens_in"] > 0, record
    assert record["predicted_per_s"] > 0 and record["ttft_s"] > 0, record
    status, text, _ = request(c.port, "GET", "/metrics?children=1")
    assert status == 200
    lines = text.splitlines()
    assert 'corral_model_tokens_total{kind="completion",model="m0"} 16.0' in lines
    assert 'corral_model_tokens_per_second_count{model="m0"} 1.0' in lines
    assert 'corral_child_scrape_ok{copy="",model="m0"} 1.0' in lines
    assert any(line.startswith("llamacpp:") and 'model="m0"' in line for line in lines), text
