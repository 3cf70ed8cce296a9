"""Resumable streams (issue 39, part 2; llama.cpp's `X-Conversation-Id`): a streamed
answer whose request carried the header outlives its client, is counted in flight until
the child ends it, and is read again from a byte offset (`?from=N`) or, EventSource's
way, after the `id:` of the last event read (`Last-Event-ID`); `DELETE` stops the
child's work; `POST /v1/streams/lookup` says which ids are kept. An id belongs to the
key that started it. Without the header, a client that leaves cancels the work."""

from __future__ import annotations

import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Corral, fake_cmd, key_files, request, serving, toml_config, wait_until

ALICE = {"Authorization": "Bearer alice-secret"}
BOB = {"Authorization": "Bearer bob-secret"}
OPS = {"Authorization": "Bearer ops-secret"}
TOKENS = 30


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    home = tmp_path_factory.mktemp("resumable")
    keys = key_files(home, "alice", "bob", "ops")
    with serving(home, toml_config(
            {"chat": {"cmd": fake_cmd("--tokens-per-s", "20")},
             "fast": {"cmd": fake_cmd()},
             "one": {"cmd": fake_cmd("--tokens-per-s", "20"), "max_concurrency": 1,
                     "queue_max": 1}},
            models_max=3, http={"resumable_ttl_s": 600, "resumable_max_mib": 4},
            keys={"alice": {"key_file": keys["alice"]}, "bob": {"key_file": keys["bob"]},
                  "ops": {"key_file": keys["ops"], "admin": True}}), "ops-secret") as c:
        yield c


def begin(port: int, conversation: str | None, headers: dict[str, str] = ALICE,
          model: str = "chat", tokens: int = TOKENS,
          ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    extra = {"X-Conversation-Id": conversation} if conversation is not None else {}
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"model": model, "max_tokens": tokens, "stream": True,
         "messages": [{"role": "user", "content": "hi"}]}),
        headers={"Content-Type": "application/json", **headers, **extra})
    return conn, conn.getresponse()


def read_events(resp: http.client.HTTPResponse, n: int) -> bytes:
    """The first `n` events' bytes, as the child sent them."""
    out = b""
    while out.count(b"\n\n") < n:
        line = resp.readline()
        assert line, f"the stream ended after {out!r}"
        out += line
    return out


def leave(conn: http.client.HTTPConnection) -> None:
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def follow(port: int, path: str, headers: dict[str, str] = ALICE,
           ) -> tuple[int, bytes, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def tokens_of(stream: bytes) -> list[str]:
    """The text of each event, and [DONE]."""
    out = []
    for event in stream.split(b"\n\n"):
        data = [line[6:] for line in event.split(b"\n") if line.startswith(b"data: ")]
        if data:
            out.append("[DONE]" if data[0] == b"[DONE]"
                       else json.loads(data[0])["choices"][0]["delta"]["content"])
    return out


WHOLE = [f"tok{i} " for i in range(TOKENS)] + ["[DONE]"]


def stats(c: Corral, model: str = "chat") -> dict[str, Any]:
    status, body, _ = request(c.port, "GET", f"/debug/stats?model={model}", headers=OPS)
    assert status == 200, body
    return body


def test_a_stream_outlives_its_client_and_resumes_from_a_byte_offset(served: Corral) -> None:
    before = stats(served)
    conn, resp = begin(served.port, "conv-1")
    assert resp.status == 200
    head = read_events(resp, 3)
    leave(conn)
    # Still counted in flight: the child goes on, and nothing was cancelled.
    assert served.models()["chat"]["in_flight"] == 1
    status, rest, headers = follow(served.port, f"/v1/stream/conv-1?from={len(head)}")
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert tokens_of(head + rest) == WHOLE
    wait_until(lambda: served.models()["chat"]["in_flight"] == 0, 15, "the answer ended")
    after = stats(served)
    assert after["cancelled"] == before["cancelled"]
    assert after["completed"] == before["completed"] + 1
    # Ended, it is still kept: read whole, from 0, as often as asked.
    status, again, _ = follow(served.port, "/v1/stream/conv-1?from=0")
    assert status == 200 and again == head + rest


def test_without_the_header_a_client_that_leaves_cancels_the_work(served: Corral) -> None:
    before = stats(served)
    conn, resp = begin(served.port, None)
    read_events(resp, 2)
    leave(conn)
    wait_until(lambda: stats(served)["cancelled"] == before["cancelled"] + 1, 15,
               "the child's work cancelled")
    assert served.models()["chat"]["in_flight"] == 0


def test_event_ids_and_last_event_id(served: Corral) -> None:
    conn, resp = begin(served.port, "conv-ids", tokens=6)
    resp.read()
    conn.close()
    status, body, _ = follow(served.port, "/v1/stream/conv-ids")
    assert status == 200
    events = [e for e in body.split(b"\n\n") if e]
    ids = [int(e.rsplit(b"id: ", 1)[1]) for e in events]
    assert len(events) == 7 and ids == sorted(ids)
    # EventSource reconnects with the last id it saw: the rest comes, ids and all.
    status, rest, _ = follow(served.port, "/v1/stream/conv-ids",
                             {**ALICE, "Last-Event-ID": str(ids[2])})
    assert status == 200 and rest == b"\n\n".join(events[3:]) + b"\n\n"
    assert tokens_of(rest) == ["tok3 ", "tok4 ", "tok5 ", "[DONE]"]
    # llama.cpp's query form reads the same bytes.
    _, raw, _ = follow(served.port, "/v1/stream?conv_id=conv-ids&from=0")
    assert tokens_of(raw) == [f"tok{i} " for i in range(6)] + ["[DONE]"]


def test_delete_stops_the_childs_work(served: Corral) -> None:
    before = stats(served)
    conn, resp = begin(served.port, "conv-stop", tokens=200)
    read_events(resp, 1)
    leave(conn)
    status, _, _ = request(served.port, "DELETE", "/v1/stream/conv-stop", headers=ALICE)
    assert status == 204
    wait_until(lambda: stats(served)["cancelled"] == before["cancelled"] + 1, 15,
               "the child's work cancelled")
    wait_until(lambda: served.models()["chat"]["in_flight"] == 0, 15, "nothing in flight")
    assert follow(served.port, "/v1/stream/conv-stop")[0] == 404
    # As in llama.cpp, stopping what is not there is not an error.
    assert request(served.port, "DELETE", "/v1/stream/conv-stop", headers=ALICE)[0] == 204


def test_delete_reaches_every_reader_still_there(served: Corral) -> None:
    conn, resp = begin(served.port, "conv-here", tokens=200)
    read_events(resp, 1)
    reader = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
    reader.request("GET", "/v1/stream/conv-here?from=0", headers=ALICE)
    following = reader.getresponse()
    read_events(following, 1)
    assert request(served.port, "DELETE", "/v1/stream/conv-here", headers=ALICE)[0] == 204
    rest = resp.read()  # the stream ends, with an error event that says why
    followed = following.read()  # and so does a reader's
    conn.close()
    reader.close()
    assert b"stopped by DELETE /v1/stream/conv-here" in rest
    assert b"stopped by DELETE /v1/stream/conv-here" in followed


def test_lookup_says_which_ids_are_kept(served: Corral) -> None:
    conn, resp = begin(served.port, "conv-done", tokens=2)
    resp.read()
    conn.close()
    conn, resp = begin(served.port, "conv-live", tokens=200)
    read_events(resp, 1)
    try:
        status, body, _ = request(served.port, "POST", "/v1/streams/lookup",
                                  {"conversation_ids": ["conv-live", "conv-done", "nope"]},
                                  headers=ALICE)
        assert status == 200
        by_id = {e["conversation_id"]: e for e in body}
        assert set(by_id) == {"conv-live", "conv-done"}
        assert by_id["conv-live"]["is_done"] is False and by_id["conv-done"]["is_done"] is True
        assert by_id["conv-live"]["model"] == "chat" and by_id["conv-done"]["total_bytes"] > 0
        status, mine, _ = request(served.port, "GET", "/v1/streams", headers=ALICE)
        assert status == 200 and {"conv-live", "conv-done"} <= {e["conversation_id"]
                                                                for e in mine}
    finally:
        request(served.port, "DELETE", "/v1/stream/conv-live", headers=ALICE)
        conn.close()


def test_an_id_belongs_to_the_key_that_started_it(served: Corral) -> None:
    conn, resp = begin(served.port, "conv-alice", tokens=4)
    resp.read()
    conn.close()
    assert follow(served.port, "/v1/stream/conv-alice", BOB)[0] == 404
    assert follow(served.port, "/v1/stream/conv-alice", OPS)[0] == 404  # admin too
    status, body, _ = request(served.port, "POST", "/v1/streams/lookup",
                              {"conversation_ids": ["conv-alice"]}, headers=BOB)
    assert status == 200 and body == []
    assert request(served.port, "DELETE", "/v1/stream/conv-alice", headers=BOB)[0] == 204
    assert follow(served.port, "/v1/stream/conv-alice?from=0")[0] == 200  # not stopped
    # Bob cannot take the id over with a request of his own.
    conn, resp = begin(served.port, "conv-alice", BOB, tokens=4)
    assert resp.status == 409 and b"belongs to another key" in resp.read()
    conn.close()
    # Without a key, nothing at all.
    assert follow(served.port, "/v1/stream/conv-alice", {})[0] == 401


def test_a_new_request_with_the_same_id_replaces_the_old(served: Corral) -> None:
    before = stats(served)
    first, resp = begin(served.port, "conv-again", tokens=200)
    read_events(resp, 1)
    leave(first)
    second, resp = begin(served.port, "conv-again", tokens=3)
    assert tokens_of(resp.read()) == ["tok0 ", "tok1 ", "tok2 ", "[DONE]"]
    second.close()
    wait_until(lambda: stats(served)["cancelled"] == before["cancelled"] + 1, 15,
               "the first request's work cancelled")
    _, body, _ = follow(served.port, "/v1/stream/conv-again?from=0")
    assert tokens_of(body) == ["tok0 ", "tok1 ", "tok2 ", "[DONE]"]


def test_a_whole_answer_is_not_kept(served: Corral) -> None:
    status, body, _ = request(served.port, "POST", "/v1/chat/completions",
                              {"model": "fast", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "hi"}]},
                              headers={**ALICE, "X-Conversation-Id": "conv-whole"})
    assert status == 200 and body["choices"][0]["message"]["content"] == "tok0 tok1 "
    assert follow(served.port, "/v1/stream/conv-whole")[0] == 404


@pytest.mark.parametrize(("headers", "why"), [
    ({"X-Conversation-Id": "x" * 129}, "1 to 128"),
    ({"X-Conversation-Id": "a b"}, "1 to 128"),
    ({"X-Conversation-Id": ""}, "1 to 128"),
])
def test_a_bad_conversation_id_is_a_400(served: Corral, headers: dict[str, str],
                                        why: str) -> None:
    status, body, _ = request(served.port, "POST", "/v1/chat/completions",
                              {"model": "fast", "stream": True, "messages": []},
                              headers={**ALICE, **headers})
    assert status == 400 and why in body["error"]["message"]


@pytest.mark.parametrize(("path", "headers", "status", "why"), [
    ("/v1/stream/conv-1?from=abc", {}, 400, "whole number"),
    ("/v1/stream/conv-1?from=99999999", {}, 400, "past the end"),
    ("/v1/stream/conv-1", {"Last-Event-ID": "-1"}, 400, "whole number"),
    ("/v1/stream/nope", {}, 404, "no stream kept"),
    ("/v1/stream?conv_id=", {}, 400, "conversation id"),
    ("/v1/stream/conv-1?from=%C2%B2", {}, 400, "whole number"),
    ("/v1/stream/conv-1", {"Last-Event-ID": "\u00b2"}, 400, "whole number"),
])
def test_bad_reads_say_what_is_wrong(served: Corral, path: str, headers: dict[str, str],
                                     status: int, why: str) -> None:
    if "conv-1" in path and follow(served.port, "/v1/stream/conv-1?from=0")[0] != 200:
        test_a_stream_outlives_its_client_and_resumes_from_a_byte_offset(served)
    got, body, _ = request(served.port, "GET", path, headers={**ALICE, **headers})
    assert got == status and why in body["error"]["message"], body


@pytest.mark.parametrize("body", [b"{", b'{"conversation_ids": "x"}', b'{"ids": []}',
                                  json.dumps({"conversation_ids": ["a"] * 1001}).encode(),
                                  json.dumps({"conversation_ids": ["a" * 100] * 5000}).encode()])
def test_a_bad_lookup_is_a_400(served: Corral, body: bytes) -> None:
    status, said, _ = request(served.port, "POST", "/v1/streams/lookup", raw=body,
                              headers=ALICE)
    assert status == 400
    assert "conversation_ids" in said["error"]["message"].replace(" ", "_")


def test_memory_is_bounded_and_a_reader_behind_it_is_told(tmp_path: Path) -> None:
    config = toml_config({"chat": {"cmd": fake_cmd()}},
                         http={"resumable_max_mib": 0.004, "resumable_ttl_s": 0.5})
    with Corral(config, home=tmp_path) as c:
        conn, resp = begin(c.port, "conv-big", {}, tokens=200)
        whole = resp.read()
        conn.close()
        assert tokens_of(whole)[-1] == "[DONE]" and len(whole) > 4 * 1024
        status, body, _ = request(c.port, "GET", "/v1/stream/conv-big?from=0")
        assert status == 400 and "no longer kept" in body["error"]["message"]
        kept_from = int(body["error"]["message"].split("first ")[1].split(" ")[0])
        status, tail, _ = follow(c.port, f"/v1/stream/conv-big?from={kept_from}", {})
        assert status == 200 and whole.endswith(tail) and len(tail) <= 4.1 * 1024
        # Ended, it is forgotten after resumable_ttl_s.
        wait_until(lambda: follow(c.port, "/v1/stream/conv-big", {})[0] == 404, 15,
                   "the ended answer forgotten")


def test_off_the_header_goes_to_the_child(tmp_path: Path) -> None:
    config = toml_config({"chat": {"cmd": fake_cmd()}}, http={"resumable_max_mib": 0})
    with Corral(config, home=tmp_path) as c:
        conn, resp = begin(c.port, "conv-off", {}, tokens=2)
        assert tokens_of(resp.read()) == ["tok0 ", "tok1 ", "[DONE]"]
        conn.close()
        assert follow(c.port, "/v1/stream/conv-off", {})[0] == 404


def test_any_front_worker_resumes_any_others_stream(tmp_path: Path) -> None:
    config = toml_config({"chat": {"cmd": fake_cmd("--tokens-per-s", "20")}},
                         http={"workers": 3})
    with Corral(config, home=tmp_path) as c:
        streams = []
        for i in range(6):  # each on a connection of its own: some reach each worker
            conn, resp = begin(c.port, f"w-{i}", {}, tokens=20)
            streams.append((conn, read_events(resp, 2)))
        for conn, _ in streams:
            leave(conn)
        for i, (_, head) in enumerate(streams):
            for _ in range(3):
                status, rest, _ = follow(c.port, f"/v1/stream/w-{i}?from={len(head)}", {})
                assert status == 200
                assert tokens_of(head + rest) == [f"tok{k} " for k in range(20)] + ["[DONE]"]
        status, _, _ = request(c.port, "DELETE", "/v1/stream/w-0")
        assert status == 204


def test_the_openai_client_leaves_and_resumes(served: Corral) -> None:
    import openai
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="alice-secret")
    stream = client.chat.completions.create(
        model="chat", max_tokens=12, stream=True, messages=[{"role": "user", "content": "hi"}],
        extra_headers={"X-Conversation-Id": "conv-sdk"})
    got = []
    for chunk in stream:
        got.append(chunk.choices[0].delta.content)
        if len(got) == 4:
            break
    stream.close()  # the client leaves mid-answer
    status, rest, _ = follow(served.port, "/v1/stream/conv-sdk?from=0")
    assert status == 200
    assert tokens_of(rest) == [f"tok{i} " for i in range(12)] + ["[DONE]"]
    assert got == [f"tok{i} " for i in range(4)]


def raw_post(conversation: bytes | None, model: bytes = b"chat", tokens: int = TOKENS,
             extra: bytes = b"") -> bytes:
    body = b'{"model": "%s", "max_tokens": %d, "stream": true, "messages": []}' % (model,
                                                                                   tokens)
    conv = b"X-Conversation-Id: " + conversation + b"\r\n" if conversation else b""
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer alice-secret\r\nContent-Type: application/json\r\n"
            + conv + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body)


def test_two_conversation_ids_are_a_400(served: Corral) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(raw_post(b"one", extra=b"X-Conversation-Id: two\r\n"))
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 400") and b"must be one header" in answer


def test_a_pipelined_request_behind_a_kept_one_never_runs(served: Corral) -> None:
    before = stats(served, "fast")
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as s:
        s.sendall(raw_post(b"conv-piped", tokens=10) + raw_post(None, b"fast", 2))
        got = b""
        while b"tok1 " not in got:
            got += s.recv(65536)
        s.shutdown(socket.SHUT_RDWR)
    status, rest, _ = follow(served.port, "/v1/stream/conv-piped?from=0")
    assert status == 200 and tokens_of(rest) == [f"tok{i} " for i in range(10)] + ["[DONE]"]
    assert stats(served, "fast")["started"] == before["started"]  # its client had left


def test_a_refused_request_with_the_same_id_leaves_the_kept_answer(served: Corral) -> None:
    conn, resp = begin(served.port, "conv-qq", model="one", tokens=200)
    read_events(resp, 1)
    leave(conn)
    waiting = socket.create_connection(("127.0.0.1", served.port), timeout=30)
    waiting.sendall(raw_post(None, b"one", 1))  # fills the queue
    try:
        wait_until(lambda: served.models()["one"]["waiting"] == 1, 15, "one waiting")
        again, resp = begin(served.port, "conv-qq", model="one", tokens=3)
        assert resp.status == 503  # queue_max: this one never runs
        again.close()
        _, body, _ = request(served.port, "POST", "/v1/streams/lookup",
                             {"conversation_ids": ["conv-qq"]}, headers=ALICE)
        assert [(e["is_done"], e["total_bytes"] > 0) for e in body] == [(False, True)]
    finally:
        request(served.port, "DELETE", "/v1/stream/conv-qq", headers=ALICE)
        waiting.close()


def test_a_kept_request_holds_its_connection_slot(tmp_path: Path) -> None:
    """A client that leaves a kept request does not free its connection slot until the
    child ends it: what runs for nobody stays bounded by http.max_connections."""
    config = toml_config({"chat": {"cmd": fake_cmd("--tokens-per-s", "20")}},
                         http={"max_connections": 3})
    with Corral(config, home=tmp_path) as c:
        for i in range(3):
            conn, resp = begin(c.port, f"slot-{i}", {}, tokens=40)
            read_events(resp, 1)
            leave(conn)
        status, body, _ = request(c.port, "GET", "/v1/streams")
        assert status == 503 and "http.max_connections" in body["error"]["message"]
        wait_until(lambda: request(c.port, "GET", "/v1/streams")[0] == 200, 30,
                   "the slots given back as the answers end")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_readers_that_read_nothing_hold_a_slice_each_not_the_answer(tmp_path: Path) -> None:
    config = toml_config({"chat": {"cmd": fake_cmd()}}, http={"resumable_max_mib": 64})
    with Corral(config, home=tmp_path) as c:
        conn, resp = begin(c.port, "big", {}, tokens=200_000)
        whole = resp.read()
        conn.close()
        assert len(whole) > 16 * 10**6
        before = rss_mib(c.proc.pid)
        readers = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", c.port), timeout=30)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(b"GET /v1/stream/big?from=0 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            readers.append(s)
        try:
            for s in readers:
                assert s.recv(12) == b"HTTP/1.1 200"
            # Each held the whole answer, but what the kernel took, when it was written at
            # once: corral grew 677 MiB for these 20; by slices, 15.
            grown = rss_mib(c.proc.pid) - before
            assert grown < 100, f"corral grew {grown:.0f} MiB for 20 readers"
        finally:
            for s in readers:
                s.close()
