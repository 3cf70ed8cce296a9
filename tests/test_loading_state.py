"""Progress inside the stream (issue 40, part 5): with `send_loading_state`, a streamed
chat that waits for its model gets its head at once and an SSE comment each second
saying why (its place, a load, the load's progress, an ETA from the measured loads), or
with "reasoning" the same as `reasoning_content` deltas; nothing once the child's first
byte comes; an error after the head ends the stream with an error event. A model may
turn it off for itself, and a request that is not a stream never gets it."""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import Corral, chat, fake_cmd, request, serving, toml_config, wait_until

SLOW = fake_cmd("--load-delay", "3", "--llama-protocol")
"""Loads in 3 s, saying it is half loaded halfway (llama-server's state lines: its
models have `health = "llama"`)."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    with serving(tmp_path_factory.mktemp("loading"), toml_config(
            {"slow": {"cmd": SLOW, "health": "llama"},
             "thinking": {"cmd": SLOW, "health": "llama", "send_loading_state": "reasoning"},
             "quiet": {"cmd": SLOW, "health": "llama", "send_loading_state": False},
             "broken": {"cmd": fake_cmd("--load-delay", "3", "--crash-after-s", "1")}},
            models_max=4, send_loading_state=True)) as c:
        yield c


def stream(port: int, model: str) -> tuple[float, list[bytes], http.client.HTTPConnection]:
    """A streamed chat: how long its head took, and its lines as they came."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    began = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": model, "stream": True, "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}]}),
        {"Content-Type": "application/json"})
    resp = conn.getresponse()
    took = time.monotonic() - began
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    lines = [line for line in iter(resp.readline, b"") if line.strip()]
    return took, lines, conn


def test_a_waiting_stream_is_told_why_then_gets_its_answer(served: Corral) -> None:
    took, lines, conn = stream(served.port, "slow")
    conn.close()
    assert took < 2.5, f"the head came after {took:.1f} s: with the child's, not at once"
    comments = [line.decode() for line in lines if line.startswith(b":")]
    data = [line for line in lines if line.startswith(b"data: ")]
    assert comments and all(c.startswith(": corral: waiting for ") for c in comments), comments
    assert any("a load of 'slow'" in c and "place 1 here" in c for c in comments), comments
    assert any("% loaded" in c for c in comments), comments  # the child's progress
    assert lines.index(data[0].rstrip(b"\n") + b"\n") > lines.index(comments[-1].encode())
    assert data[-1] == b"data: [DONE]\n" and len(data) == 4  # 3 tokens: the child's own
    # Loaded once, a second load has an ETA from the first.
    assert request(served.port, "POST", "/models/unload", {"model": "slow"})[0] == 200
    wait_until(lambda: served.state("slow") == "unloaded", 15, "slow unloaded")
    _, lines, conn = stream(served.port, "slow")
    conn.close()
    assert any(b"s left" in line for line in lines if line.startswith(b":")), lines


def test_reasoning_deltas_with_the_openai_client(served: Corral) -> None:
    import openai

    client = openai.OpenAI(api_key="none", base_url=f"{served.url}/v1", max_retries=0)
    reasoning, content = [], []
    for chunk in client.chat.completions.create(
            model="thinking", stream=True, max_tokens=3,
            messages=[{"role": "user", "content": "hi"}]):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
        if delta is not None and delta.content:
            content.append(delta.content)
    assert reasoning and all(r.startswith("corral: waiting for") for r in reasoning)
    assert "".join(content) == "tok0 tok1 tok2 "


def test_a_model_that_says_no_and_a_request_not_streamed_get_nothing(served: Corral) -> None:
    took, lines, conn = stream(served.port, "quiet")
    conn.close()
    assert took > 2.5 and not any(line.startswith(b":") for line in lines)
    assert request(served.port, "POST", "/models/unload", {"model": "quiet"})[0] == 200
    wait_until(lambda: served.state("quiet") == "unloaded", 15, "quiet unloaded")
    status, body = chat(served.port, "quiet")  # it waits for a load, but is not a stream
    assert status == 200 and body["object"] == "chat.completion"


def test_an_error_after_the_head_ends_the_stream_with_an_error_event(served: Corral) -> None:
    took, lines, conn = stream(served.port, "broken")
    assert took < 2.5
    last = json.loads(lines[-1][6:]) if lines[-1].startswith(b"data: ") else None
    assert last is not None and last["error"]["code"] == 503, lines
    assert any(line.startswith(b": corral: waiting for a load") for line in lines)
    # The stream ended whole: the connection serves the next request.
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()
    rows: list[dict[str, Any]] = wait_until(lambda: request(
        served.port, "GET", "/requests?model=broken")[1]["data"], 15, "its record")
    assert rows[0]["status"] == 503 and rows[0]["error"]


def unloaded(c: Corral, model: str) -> None:
    if c.state(model) != "unloaded":
        assert request(c.port, "POST", "/models/unload", {"model": model})[0] == 200
    wait_until(lambda: c.state(model) == "unloaded", 15, f"{model} unloaded")


def chunks(data: bytes) -> tuple[list[bytes], bytes]:
    """A chunked body's chunks and what follows its end (an AssertionError: not chunked)."""
    out = []
    while True:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)  # (a ValueError: bytes that are no chunk, an interim answer say)
        if n == 0:
            assert data.startswith(b"\r\n"), data[:80]
            return out, data[2:]
        out.append(data[:n])
        assert data[n:n + 2] == b"\r\n"
        data = data[n + 2:]


def test_a_loading_stream_is_chunks_only_and_its_close_is_said(served: Corral) -> None:
    """Review of issue 40: corral's own probe (100 Continue, for a client behind a
    pipelined request) and a child's interim answers must not come inside the chunks;
    a client that says close is told close."""
    unloaded(served, "slow")
    body = json.dumps({"model": "slow", "stream": True, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(head + body + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")  # pipelined
        data = b""
        while b"\r\n0\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            more = s.recv(65536)
            assert more, data[-300:]
            data += more
    first, _, rest = data.partition(b"\r\n\r\n")
    assert first.startswith(b"HTTP/1.1 200") and b"Connection: keep-alive" in first
    events, after = chunks(rest)
    assert b"100 Continue" not in b"".join(events)
    assert any(e.startswith(b": corral: waiting") for e in events)
    assert events[-1].rstrip().endswith(b"data: [DONE]")
    assert after.startswith(b"HTTP/1.1 200")  # the pipelined request's, after the stream

    unloaded(served, "slow")
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + body)
        data = b""
        while more := s.recv(65536):  # (to the close)
            data += more
    assert b"Connection: close" in data.partition(b"\r\n\r\n")[0]
