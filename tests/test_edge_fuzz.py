"""Hypothesis against a running corral: sequences of requests on a few raw connections.

The invariant, for any input: every answer a client gets carries the id of the request it
sent at that place on that connection, or is corral's own error; afterwards nothing is in
flight or waiting, the pools never held a connection twice (corral runs with
CORRAL_CHECK_INVARIANTS=1, which asserts it after every pool change), and a plain request
is answered.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import Corral, wait_until
from tests.rawhttp import Raw
from tests.test_edge_hostile import KEY, edge_config
from tests.test_uploads import BOUNDARY, form

# A connection has at most 4 requests whose answers take well under a second each; a read
# waits 15 s at most, so an example still running after this is corral holding an answer.
EXAMPLE_S = 45.0
ODDS = ["", "", "early-hints", "extra", "http10", "http10-sse", "slow", "stream-close",
        "close-next", "garbage", "no-content"]


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    os.environ["CORRAL_CHECK_INVARIANTS"] = "1"
    try:
        # (a short drain: the stop at the end waits for no example's answers)
        c = Corral(edge_config(keep_alive_timeout_s=5, drain_timeout_s=3),
                   home=tmp_path_factory.mktemp("fuzz"))
    finally:
        del os.environ["CORRAL_CHECK_INVARIANTS"]
    c.key = KEY
    try:
        yield c
    finally:
        c.stop()


request_st = st.fixed_dictionaries({
    "odd": st.sampled_from(ODDS),
    "model": st.sampled_from(["odd", "odd", "odd", "fake", "nope"]),
    "key": st.sampled_from(["good", "good", "good", "wrong", "none", "twice"]),
    "expect": st.sampled_from([None, None, "100-continue", "bogus"]),
    "chunked": st.booleans(),
    "trailer": st.booleans(),
    "upgrade": st.integers(0, 9).map(lambda n: n == 0),
    "upload": st.sampled_from([None, None, None, "model-first", "file-first"]),
})
connection_st = st.fixed_dictionaries({
    "requests": st.lists(request_st, min_size=1, max_size=4),
    "mode": st.sampled_from(["sequential", "pipelined"]),
    "ending": st.sampled_from(["read", "read", "half-close", "close-early", "cut-body",
                               "slow-read"]),
})


def encode(req: dict[str, Any], rid: str) -> bytes:
    body = json.dumps({"model": req["model"], "max_tokens": 2}).encode()
    lines = ["POST /v1/completions HTTP/1.1", "Host: corral", f"x-request-id: {rid}"]
    if req.get("upload"):  # a multipart upload (upload.py): routed by its model field
        fields = [("model", req["model"].encode(), None), ("file", b"\x00\r\n-" * 700, "a")]
        body = form(fields if req["upload"] == "model-first" else fields[::-1])
        lines = ["POST /v1/audio/transcriptions HTTP/1.1", "Host: corral",
                 f"x-request-id: {rid}",
                 f"Content-Type: multipart/form-data; boundary={BOUNDARY}"]
    if req["odd"]:
        lines.append(f"x-odd: {req['odd']}")
    key = {"good": [KEY], "wrong": ["nope"], "none": [], "twice": [KEY, KEY]}[req["key"]]
    lines += [f"Authorization: Bearer {k}" for k in key]
    if req["expect"]:
        lines.append(f"Expect: {req['expect']}")
    if req["upgrade"]:
        lines += ["Connection: Upgrade", "Upgrade: websocket"]
    if req["chunked"]:
        lines.append("Transfer-Encoding: chunked")
        payload = b"%x\r\n%s\r\n0\r\n" % (len(body), body)
        payload += b"x-trailer: 1\r\n\r\n" if req["trailer"] else b"\r\n"
    else:
        lines.append(f"Content-Length: {len(body)}")
        payload = body
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def check_answers(ids: list[str], answers: list[Any]) -> None:
    """The invariant: answer i belongs to request i, or is corral's own error."""
    finals = [a for a in answers if a.status >= 200]
    assert len(finals) <= len(ids), (ids, finals)
    for rid, answer in zip(ids, finals, strict=False):
        if answer.status == 200 and answer.headers.get("content-type", "").startswith(
                "application/json"):
            data = answer.json()
            if "url" in data:  # the odd child: echoes the id
                assert data["id"] == rid, (rid, answer)
            else:  # the fake model: its own completion
                assert data["model"] == "fake", (rid, answer)
        elif answer.status == 200:  # a stream from the odd child carries the id per event
            events = [line for line in answer.body.split(b"\n") if line.startswith(b"data: {")]
            for event in events:
                got = json.loads(event[6:]).get("id")
                assert got in (rid, None), (rid, answer)
        elif answer.status == 204:
            assert answer.headers["x-request-id"] == rid and not answer.body, (rid, answer)
        elif answer.status >= 400:
            assert "error" in answer.json(), answer  # corral's own error, OpenAI-shaped
        else:
            raise AssertionError(f"unexpected answer {answer} for {rid}")


def run_connection(port: int, conn_no: int, spec: dict[str, Any], failures: list[str]) -> None:
    ids = [f"c{conn_no}r{i}-{time.monotonic_ns()}" for i in range(len(spec["requests"]))]
    raw = Raw(port, timeout_s=15)
    answers: list[Any] = []
    try:
        data = [encode(r, rid) for r, rid in zip(spec["requests"], ids, strict=True)]
        ending = spec["ending"]
        if ending == "cut-body":
            data[-1] = data[-1][:-5]
        if spec["mode"] == "pipelined" or ending in ("half-close", "close-early", "cut-body"):
            raw.send(b"".join(data))
            if ending == "close-early":
                return
            if ending in ("half-close", "cut-body"):
                raw.sock.shutdown(socket.SHUT_WR)
            try:
                while True:
                    answers += raw.read(1)
            except AssertionError:
                pass  # closed, or nothing more to read
        else:
            for chunk in data:
                try:
                    raw.send(chunk)
                    if ending == "slow-read":
                        time.sleep(0.05)
                    answers += raw.read(1)
                except (AssertionError, OSError):
                    break  # corral closed after an error: fine, checked below
        check_answers(ids, answers)
    except AssertionError as e:
        failures.append(f"connection {conn_no} {spec}: {e}")
    except OSError:
        pass  # the client's own end: a reset after corral closed
    finally:
        raw.close()


@settings(max_examples=int(os.environ.get("CORRAL_FUZZ_EXAMPLES", "30")), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow], derandomize=False)
@given(st.lists(connection_st, min_size=1, max_size=3))
def test_every_answer_belongs_to_its_request(fuzzed: Corral,
                                             connections: list[dict[str, Any]]) -> None:
    failures: list[str] = []
    threads = [threading.Thread(target=run_connection, args=(fuzzed.port, i, spec, failures))
               for i, spec in enumerate(connections)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + EXAMPLE_S  # the whole example's, not each thread's
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [spec for t, spec in zip(threads, connections, strict=True) if t.is_alive()]
    assert not hung, f"connections still waiting after {EXAMPLE_S} s: {hung}\n" + \
        fuzzed.log()[-6000:]
    assert not failures, failures
    wait_until(lambda: all(m["in_flight"] == 0 and m["waiting"] == 0
                           for m in fuzzed.models().values()), 15, "nothing in flight")
    with Raw(fuzzed.port) as raw:
        raw.send(encode({"odd": "", "model": "odd", "key": "good", "expect": None,
                         "chunked": False, "trailer": False, "upgrade": False,
                         "upload": None}, "plain"))
        answer = raw.one()
        assert answer.status == 200 and answer.json()["id"] == "plain"
    log = fuzzed.log()
    assert "Traceback" not in log and "AssertionError" not in log, log[-3000:]
