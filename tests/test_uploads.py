"""Multipart uploads (issue 25): routed by their `model` field, streamed through unchanged.

Hostile first, on raw sockets: a body that breaks off, stalls, grows past the limit, names
no model or names it after a large file; an upload pipelined with a JSON request; an
answer that comes before the body is whole. The invariants, for any input: the child gets
the body byte for byte or the request fails with corral's own error; corral never holds
more than a few reads of an upload; nothing stays in flight.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import http.client
import io
import json
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.http.edge import Answer
from actors.http.upload import (
    HOLD_MAX,
    MODEL_MAX,
    FormSniffer,
    Upload,
    boundary_of,
    field_name,
)
from tests.helpers import Corral, chat, fake_cmd, toml_config, wait_until
from tests.rawhttp import Raw

BOUNDARY = "corral-test-boundary"
MiB = 1 << 20


def form(fields: list[tuple[str, bytes, str | None]], boundary: str = BOUNDARY) -> bytes:
    """A multipart/form-data body: (name, value, filename) per field, in order."""
    out = b""
    for name, value, filename in fields:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += (f"--{boundary}\r\nContent-Disposition: {disposition}\r\n"
                + ("Content-Type: application/octet-stream\r\n" if filename else "")
                + "\r\n").encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


def upload_head(length: int | None, path: str = "/v1/audio/transcriptions",
                extra: str = "") -> bytes:
    framing = f"Content-Length: {length}" if length is not None else \
        "Transfer-Encoding: chunked"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\n{framing}\r\n"
            f"{extra}\r\n").encode()


def chunks(data: bytes, size: int = 256 << 10) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(data[i:i + size]), data[i:i + size])
                    for i in range(0, len(data), size)) + b"0\r\n\r\n"


def peak_rss_reset(pid: int) -> None:
    """Start counting the peak resident size of `pid` from now (Linux: clear_refs 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    broken = [sys.executable, "-c", "import sys; sys.exit(3)"]
    c = Corral(toml_config({"whisper": {"cmd": fake_cmd()},
                            "sd": {"cmd": fake_cmd("--model", "sd")},
                            "slow": {"cmd": fake_cmd("--upload-bytes-per-s", str(12 * MiB))},
                            "broken": {"cmd": broken}},
                           models_max=4, http={"body_timeout_s": 1}),
               home=tmp_path_factory.mktemp("uploads"))
    try:
        yield c
    finally:
        c.stop()


def settled(c: Corral) -> None:
    wait_until(lambda: all(m["in_flight"] == 0 and m["waiting"] == 0
                           for m in c.models().values()), 15, "nothing in flight")


# ------------------------------------------------------------------ the form, read alone


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_the_model_field_is_found_however_the_body_is_cut(data: st.DataObject) -> None:
    """For any form and any cut of it into reads: the sniffer answers exactly the model
    field's value, or a 400 when there is none."""
    others = data.draw(st.lists(st.tuples(
        st.sampled_from(["file", "language", "prompt", "modelx", "xmodel"]),
        st.binary(max_size=300).filter(lambda b: b"--" + BOUNDARY.encode() not in b),
        st.none() | st.just("a.wav")), max_size=4))
    model = data.draw(st.none() | st.text(min_size=1, max_size=40).filter(
        lambda s: "\r" not in s and "\n" not in s))
    at = data.draw(st.integers(0, len(others)))
    fields = list(others)
    if model is not None:
        fields.insert(at, ("model", model.encode(), None))
    preamble = data.draw(st.sampled_from([b"", b"ignored preamble\r\n"]))
    body = preamble + form(fields)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=6)))
    sniffer = FormSniffer(BOUNDARY.encode())
    found = None
    for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
        found = sniffer.feed(body[a:b])
        if found is not None:
            break
    if found is None:
        found = sniffer.finish()
    if model is None:
        assert isinstance(found, Answer) and found.status == 400, found
    else:
        assert found == model


def test_a_quoted_filename_cannot_smuggle_a_field_name() -> None:
    """Review finding 9: `;` inside a quoted filename split the parameters, so a part
    named `file` was read as the model field."""
    assert field_name(b'Content-Disposition: form-data; filename="talk; name=model; '
                      b'x.wav"; name="file"') == "file"
    assert field_name(b"content-disposition: form-data; name=model") == "model"


def test_the_sniffer_bounds_what_it_holds() -> None:
    sniffer = FormSniffer(b"b")
    head = b'--b\r\nContent-Disposition: form-data; name="file"\r\n\r\n'
    assert sniffer.feed(head) is None
    found = None
    for _ in range(HOLD_MAX // (64 << 10) + 1):
        found = sniffer.feed(b"x" * (64 << 10))
    assert isinstance(found, Answer) and "send the `model` field before the file" in \
        found.message
    long = FormSniffer(b"b").feed(b'--b\r\nContent-Disposition: form-data; name=model\r\n\r\n'
                                  + b"m" * (MODEL_MAX + 1))
    assert isinstance(long, Answer) and "over" in long.message
    assert boundary_of(b"application/json") is None
    assert boundary_of(b'multipart/form-data; boundary="a b"') == b"a b"
    missing = boundary_of(b"multipart/form-data")
    assert isinstance(missing, Answer) and "boundary" in missing.message


# ------------------------------------------------------------------ as a user sends them


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the SDK's, for translations
def test_the_openai_sdk_uploads_go_to_the_model_they_name(up: Corral) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{up.port}/v1", api_key="none")
    audio = bytes(range(256)) * 4096  # 1 MiB
    said = client.audio.transcriptions.create(model="whisper",
                                              file=("a.wav", io.BytesIO(audio), "audio/wav"))
    extra = said.model_extra or {}
    assert (extra["received_model"], extra["model"], extra["path"]) == (
        "whisper", "whisper", "/v1/audio/transcriptions")
    assert extra["bytes"] > len(audio)
    moved = client.audio.translations.create(model="sd", file=("a.wav", io.BytesIO(audio)))
    assert (moved.model_extra or {})["model"] == "sd"
    image = client.images.edit(model="sd", image=("a.png", io.BytesIO(b"\x89PNG" * 10)),
                               prompt="a hat")
    assert (image.model_extra or {})["path"] == "/v1/images/edits"
    with pytest.raises(openai.BadRequestError, match="model 'nope' not found"):
        client.audio.transcriptions.create(model="nope", file=("a.wav", io.BytesIO(audio)))
    settled(up)


def test_a_50_mib_upload_passes_unchanged_and_corral_holds_little_of_it(up: Corral) -> None:
    body = form([("model", b"whisper", None), ("language", b"en", None),
                 ("file", bytes(range(256)) * (50 * MiB // 256), "a.wav")])
    chat(up.port, "whisper")  # loaded, and the front warmed up, before the count starts
    peak_rss_reset(up.proc.pid)
    before = rss_kib(up.proc.pid, "VmRSS")
    conn = http.client.HTTPConnection("127.0.0.1", up.port, timeout=60)
    conn.request("POST", "/v1/audio/transcriptions", body=body, headers={
        "Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
    answer = conn.getresponse()
    got = json.loads(answer.read())
    conn.close()
    assert answer.status == 200, got
    assert got["bytes"] == len(body) and got["sha256"] == hashlib.sha256(body).hexdigest()
    grew = rss_kib(up.proc.pid, "VmHWM") - before
    assert grew < 10 * 1024, f"corral's peak RSS grew {grew} KiB for a 50 MiB upload"


def test_a_child_that_reads_slowly_holds_the_client_back(up: Corral) -> None:
    """The child reads 12 MiB/s; the client could send at loopback speed: corral passes
    the child's pace back to the client instead of buffering the difference."""
    body = form([("model", b"slow", None), ("file", b"\x01" * (24 * MiB), "a.wav")])
    chat(up.port, "slow")
    peak_rss_reset(up.proc.pid)
    before = rss_kib(up.proc.pid, "VmRSS")
    with Raw(up.port, timeout_s=30) as raw:
        raw.send(upload_head(len(body)) + body)
        answer = raw.one()
    assert answer.status == 200 and answer.json()["sha256"] == hashlib.sha256(body).hexdigest()
    grew = rss_kib(up.proc.pid, "VmHWM") - before
    assert grew < 10 * 1024, f"corral's peak RSS grew {grew} KiB behind a slow child"


def test_chunked_uploads_and_fields_before_the_model_pass_unchanged(up: Corral) -> None:
    body = form([("prompt", b"x" * 5000, None), ("file", b"\r\n--not-it" * 3000, "a.wav"),
                 ("model", b"whisper", None)])
    with Raw(up.port) as raw:
        raw.send(upload_head(None) + chunks(body, 7000))
        answer = raw.one()
        assert answer.status == 200, answer
        assert answer.json()["sha256"] == hashlib.sha256(body).hexdigest()
        assert answer.headers["connection"] == "keep-alive"
        raw.send(upload_head(len(body)) + body)  # and again on the same connection
        assert raw.one().json()["received_model"] == "whisper"


def test_an_upload_pipelined_with_a_json_request_answers_both_in_order(up: Corral) -> None:
    body = form([("model", b"sd", None), ("file", b"\x02" * (3 * MiB), "a.png")])
    plain = (b'{"model": "whisper", "messages": [{"role": "user", "content": "hi"}], '
             b'"max_tokens": 2}')
    json_req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(plain), plain))
    with Raw(up.port, timeout_s=30) as raw:
        raw.send(upload_head(len(body), "/v1/images/edits") + body + json_req)
        first, second = raw.read(2)
    assert first.status == 200 and first.json()["model"] == "sd"
    assert first.json()["sha256"] == hashlib.sha256(body).hexdigest()
    assert second.status == 200 and second.json()["model"] == "whisper"


def test_expect_continue_is_met_before_the_upload(up: Corral) -> None:
    body = form([("model", b"whisper", None), ("file", b"abc", "a.wav")])
    with Raw(up.port) as raw:
        raw.send(upload_head(len(body), extra="Expect: 100-continue\r\n"))
        interim = raw.read(1, final=False)
        assert interim[0].status == 100
        raw.send(body)
        assert raw.one().json()["sha256"] == hashlib.sha256(body).hexdigest()


# ------------------------------------------------------------------ as an attacker sends them


@pytest.mark.parametrize(("fields", "says"), [
    ([("file", b"abc", "a.wav")], 'no "model" field'),
    ([("model", b"", None), ("file", b"abc", "a.wav")], "empty"),
    ([("model", b"nope", None)], "model 'nope' not found"),
    ([("model", b"\xff\xfe", None)], "not UTF-8"),
])
def test_an_upload_that_names_no_model_is_a_400_saying_why(up: Corral, fields: list,
                                                         says: str) -> None:
    body = form(fields)
    with Raw(up.port) as raw:
        raw.send(upload_head(len(body)) + body)
        answer = raw.one()
    assert answer.status == 400 and says in answer.json()["error"]["message"], answer


def test_a_model_field_after_a_large_file_is_refused_early(up: Corral) -> None:
    body = form([("file", b"\x03" * (3 * MiB), "a.wav"), ("model", b"whisper", None)])
    with Raw(up.port, timeout_s=30) as raw:
        raw.send(upload_head(len(body)))
        try:
            raw.send(body)
        except OSError:
            pass  # corral answered and closed before taking it all: fine
        answer = raw.one()
        assert answer.status == 400
        assert "before the file" in answer.json()["error"]["message"]
        assert raw.closed()
    settled(up)


def test_a_multipart_type_without_a_boundary_is_a_400(up: Corral) -> None:
    with Raw(up.port) as raw:
        raw.send(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: multipart/form-data\r\nContent-Length: 3\r\n\r\nabc")
        answer = raw.one()
    assert answer.status == 400 and "boundary" in answer.json()["error"]["message"]


def test_an_upload_over_the_body_limit_ends_with_a_413_midway(up: Corral) -> None:
    """Chunked, so no length tells it first: part of it has gone to the child when the
    limit is passed. The client gets the 413, the child's connection is dropped, and the
    model serves the next request."""
    head = form([("model", b"whisper", None), ("file", b"", "a.wav")])
    head = head[:-len(f"\r\n--{BOUNDARY}--\r\n")]  # the file part goes on and on
    block = b"%x\r\n%b\r\n" % (MiB, b"\x04" * MiB)
    with Raw(up.port, timeout_s=30) as raw:
        raw.send(upload_head(None) + b"%x\r\n%b\r\n" % (len(head), head))
        try:
            for _ in range(70):
                raw.send(block)
        except OSError:
            pass  # corral answered and closed: the rest is refused
        answer = raw.one()
        assert answer.status == 413 and "max_body_mib" in answer.json()["error"]["message"]
    settled(up)
    assert chat(up.port, "whisper")[0] == 200


def test_an_upload_that_stalls_is_a_408_and_frees_its_slot(up: Corral) -> None:
    body = form([("model", b"whisper", None), ("file", b"\x05" * 10000, "a.wav")])
    with Raw(up.port) as raw:
        raw.send(upload_head(len(body)) + body[:5000])
        wait_until(lambda: up.models()["whisper"]["in_flight"] == 1, 10, "upload in flight")
        answer = raw.one()  # http.body_timeout_s is 1 s
        assert answer.status == 408 and "body_timeout_s" in answer.json()["error"]["message"]
        assert raw.closed()
    settled(up)


@pytest.mark.parametrize("how", ["close", "half-close"])
def test_a_client_that_leaves_mid_upload_leaves_nothing_behind(up: Corral, how: str) -> None:
    body = form([("model", b"whisper", None), ("file", b"\x06" * MiB, "a.wav")])
    raw = Raw(up.port)
    try:
        raw.send(upload_head(len(body)) + body[:MiB // 2])
        wait_until(lambda: up.models()["whisper"]["in_flight"] == 1, 10, "upload in flight")
        if how == "half-close":
            raw.sock.shutdown(socket.SHUT_WR)
            answer = raw.one()
            assert answer.status == 400 and "before the request body was whole" in \
                answer.json()["error"]["message"]
    finally:
        raw.close()
    settled(up)
    assert chat(up.port, "whisper")[0] == 200


def test_a_multipart_post_to_an_open_path_is_no_upload(up: Corral) -> None:
    """Review finding 1: a multipart POST to /health (open to all, and without keys free
    of the Origin check) was routed by its form: a web page could load models."""
    body = form([("model", b"sd", None)])
    before = up.models()["sd"]["status"]["value"]
    for path in ("/health", "/", "/models/sse"):
        with Raw(up.port) as raw:
            raw.send(upload_head(len(body), path) + body)
            answer = raw.one()
        assert answer.status in (404, 405), (path, answer)
    assert up.models()["sd"]["status"]["value"] == before


def test_a_malformed_chunk_midway_ends_the_upload_with_a_400_at_once(up: Corral) -> None:
    """Review finding 8: it waited for the body timeout and answered 408."""
    head = form([("model", b"whisper", None), ("file", b"", "a.wav")])[:-40]
    with Raw(up.port) as raw:
        raw.send(upload_head(None) + b"%x\r\n%b\r\n" % (len(head), head))
        wait_until(lambda: up.models()["whisper"]["in_flight"] == 1, 10, "upload in flight")
        raw.send(b"zz-not-hex\r\n")
        answer = raw.one()
        assert answer.status == 400 and "malformed" in answer.json()["error"]["message"]
    settled(up)


def test_tiny_chunks_arrive_whole(up: Corral) -> None:
    body = form([("model", b"whisper", None), ("file", bytes(range(256)) * 80, "a.wav")])
    with Raw(up.port) as raw:
        raw.send(upload_head(None) + chunks(body, 7))
        assert raw.one().json()["sha256"] == hashlib.sha256(body).hexdigest()


def test_an_answer_before_the_body_is_whole_closes_the_connection(up: Corral) -> None:
    """The model cannot load: corral's refusal comes while the client still sends. The
    client gets it, the connection closes (the rest of the body is dropped, never read
    as a request), and nothing is left waiting."""
    body = form([("model", b"broken", None), ("file", b"\x07" * (2 * MiB), "a.wav")])
    with Raw(up.port, timeout_s=30) as raw:
        raw.send(upload_head(len(body)) + body[:64 << 10])
        answer = raw.one()
        assert answer.status in (502, 503), answer
        assert answer.headers["connection"] == "close"
        try:
            raw.send(body[64 << 10:] + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        except OSError:
            pass
        assert raw.closed()  # the /health hidden in the dropped body was never served
    settled(up)
    # Review finding 5: with more than HOLD_MAX held when the answer came, the rest was
    # never read, and a client still sending got a broken pipe instead of its answer.
    big = form([("model", b"broken", None), ("file", b"\x07" * (32 * MiB), "a.wav")])
    with Raw(up.port, timeout_s=30) as raw:
        raw.sock.sendall(upload_head(len(big)) + big)  # whole, without an error
        assert raw.one().status in (502, 503)
    settled(up)


@contextlib.contextmanager
def slot_taken(tmp_path: Path, body_timeout_s: float
               ) -> Iterator[tuple[Corral, concurrent.futures.Future[Any]]]:
    """A corral at models_max 1 whose model `a` is busy (~3 s of tokens, the future of
    that request): requests for `w` queue."""
    with Corral(toml_config({"a": {"cmd": fake_cmd("--tokens-per-s", "20")},
                             "w": {"cmd": fake_cmd()}}, models_max=1,
                            http={"body_timeout_s": body_timeout_s}), home=tmp_path) as c, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(chat, c.port, "a", 60)
        wait_until(lambda: c.models()["a"]["in_flight"] == 1, 10, "a busy")
        yield c, busy


def test_an_upload_waits_for_its_model_holding_only_the_start(tmp_path: Path) -> None:
    """models_max 1 and the other model busy: the upload queues. corral holds at most
    HOLD_MAX of it meanwhile (the client is not read), then sends it whole."""
    body = form([("model", b"w", None), ("file", b"\x08" * (16 * MiB), "a.wav")])
    with slot_taken(tmp_path, 2) as (c, busy):
        with Raw(c.port, timeout_s=30) as raw:
            raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 256 << 10)
            raw.sock.settimeout(0.5)
            sent = 0
            head = upload_head(len(body))
            raw.send(head)
            try:
                while sent < len(body):  # until corral stops reading
                    sent += raw.sock.send(body[sent:sent + (64 << 10)])
            except TimeoutError:
                pass
            assert c.models()["w"]["waiting"] == 1
            assert sent < len(body) // 2, f"corral read {sent} bytes of a queued upload"
            raw.sock.settimeout(30)
            raw.send(body[sent:])
            answer = raw.one()
        assert busy.result(30)[0] == 200
    assert answer.status == 200, answer
    assert answer.json()["sha256"] == hashlib.sha256(body).hexdigest()


def test_a_child_that_takes_none_of_an_upload_is_cut(tmp_path: Path) -> None:
    """Review finding 3: a child that stopped reading held the upload for ever (its
    first-byte timer waits for the whole body). It is cut after http.write_timeout_s."""
    with Corral(toml_config({"stuck": {"cmd": fake_cmd("--upload-bytes-per-s", "1")}},
                            http={"write_timeout_s": 2, "body_timeout_s": 1}),
                home=tmp_path) as c:
        body = form([("model", b"stuck", None), ("file", b"\x0a" * (8 * MiB), "a.wav")])
        with Raw(c.port, timeout_s=90) as raw:  # (a bound: 16 s quiet, over 30 on a busy run)
            raw.send(upload_head(len(body)))
            try:
                raw.sock.sendall(body)
            except OSError:
                pass  # cut: fine
            answer = raw.one()
        assert answer.status == 504 and "write_timeout_s" in answer.json()["error"]["message"]
        settled(c)


def test_a_queued_upload_whose_client_left_loads_nothing(tmp_path: Path) -> None:
    """Review finding 4: an upload held back in the queue did not see its client leave,
    and its model was loaded for nobody once the slot came free."""
    body = form([("model", b"w", None), ("file", b"\x0b" * (4 * MiB), "a.wav")])
    with slot_taken(tmp_path, 1) as (c, busy):
        raw = Raw(c.port, timeout_s=30)
        raw.sock.setblocking(False)
        raw.sock.send(upload_head(len(body)))
        try:
            raw.sock.send(body)
        except BlockingIOError:
            pass
        wait_until(lambda: c.models()["w"]["waiting"] == 1, 10, "w queued")
        raw.close()  # the client leaves, corral not reading it
        wait_until(lambda: c.models()["w"]["waiting"] == 0, 10, "w's waiter gone")
        assert busy.result(30)[0] == 200
        assert c.models()["w"]["status"]["value"] == "unloaded"


def test_uploads_pass_through_front_workers(tmp_path: Path) -> None:
    """With http.workers the upload is read by a worker process: the same rules hold."""
    with Corral(toml_config({"w": {"cmd": fake_cmd()}}, http={"workers": 2}),
                home=tmp_path) as c:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="none")
        for _ in range(4):  # over both workers, most likely
            data = bytes(range(256)) * 8192
            said = client.audio.transcriptions.create(model="w", file=("a.wav", data))
            assert (said.model_extra or {})["received_model"] == "w"
        body = form([("model", b"w", None), ("file", b"\x09" * (5 * MiB), "a.wav")])
        with Raw(c.port, timeout_s=30) as raw:
            raw.send(upload_head(len(body)) + body)
            assert raw.one().json()["sha256"] == hashlib.sha256(body).hexdigest()


def unread(port: int) -> tuple[int, int]:
    """corral's open connections on `port`, and the bytes they hold that it has not read
    (Linux: /proc/net/tcp's rx_queue of each established socket listening there)."""
    count = total = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":
            count += 1
            total += int(fields[4].split(":")[1], 16)
    return count, total


def reading_stopped(port: int) -> Callable[[], bool]:
    """A predicate: corral's connections on `port` have held the same unread bytes for
    half a second (it reads none of them any more)."""
    since: list[tuple[float, tuple[int, int]]] = []

    def check() -> bool:
        now = unread(port)
        if not since or since[0][1] != now:
            since[:] = [(time.monotonic(), now)]
        return time.monotonic() - since[0][0] >= 0.5
    return check


def test_an_upload_holds_its_start_once() -> None:
    """Review S11: the sniffer reads the upload's own buffer, not a copy of it."""

    class Client:
        paused = False

        def pause_reading(self) -> None:
            self.paused = True

        def resume_reading(self) -> None:
            self.paused = False

    client = Client()
    upload = Upload(BOUNDARY.encode(), None, client)
    part = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"\r\n\r\n'.encode()
    assert not upload.feed(part + b"x" * (64 << 10))
    assert upload.sniffer is not None and upload.sniffer.buf is upload.held
    assert len(upload.held) == len(part) + (64 << 10) and not client.paused
    upload.close()
    assert len(upload.held) == 0


def test_waiting_uploads_are_held_once_within_a_bound_and_given_back(tmp_path: Path) -> None:
    """Review S11: an upload whose model was not known yet was held twice (the sniffer's
    copy and the upload's), 1 MiB each: 150 of them took corral from 50 to 345 MiB, and
    it kept the memory after they ended. Now the start of an upload is held once, at
    most HOLD_MAX and one read of it, in memory that is returned when its request
    ends: 150 of them, stalled or waiting for their model's load, add less than 64 MiB
    (at the peak), and corral is back within 16 MiB of where it was once they end."""
    n, budget = 150, 64 * 1024
    file_head = b'--%b\r\nContent-Disposition: form-data; name="file"; filename="a"\r\n\r\n' % (
        BOUNDARY.encode())
    model = b'--%b\r\nContent-Disposition: form-data; name="model"\r\n\r\nw\r\n' % (
        BOUNDARY.encode())
    waves = {"a 1000 KiB part first, no model": (file_head + b"z" * (1000 << 10), None),
             "stalled below the bound, no model": (file_head + b"z" * (HOLD_MAX - 4096),
                                                   None),
             "queued for a loading model, 1 MiB sent": (model + file_head + b"q" * MiB, "w")}
    with Corral(toml_config({"w": {"cmd": fake_cmd("--load-delay", "120")}},
                            http={"body_timeout_s": 10}), home=tmp_path) as c:
        pid = c.proc.pid
        start = rss_kib(pid, "VmRSS")
        for wave, (body, names) in waves.items():
            peak_rss_reset(pid)
            clients = []
            try:
                for _ in range(n):
                    sock = socket.create_connection(("127.0.0.1", c.port), timeout=30)
                    sock.setblocking(False)
                    clients.append(sock)
                    with contextlib.suppress(BlockingIOError):
                        sock.send(upload_head(10 * MiB) + body)
                if names is None:  # every byte read (or the connection refused)
                    wait_until(lambda: unread(c.port)[1] == 0, 30, f"{wave}: all read")
                else:  # every one queued, and corral reading none of them any more
                    wait_until(lambda: c.models()["w"]["waiting"] == n, 30,
                               f"{wave}: all queued")
                    wait_until(reading_stopped(c.port), 30, f"{wave}: corral to stop reading")
                grew = rss_kib(pid, "VmHWM") - start
                assert grew < budget, f"{wave}: corral's peak RSS grew {grew >> 10} MiB"
            finally:
                for sock in clients:
                    sock.close()
            wait_until(lambda: unread(c.port)[0] == 0 and c.models()["w"]["waiting"] == 0,
                       40, f"{wave}: the clients gone (a held-back one: at its probe)")
            wait_until(lambda: rss_kib(pid, "VmRSS") - start < 16 * 1024, 15,
                       f"{wave}: corral to give the memory back (RSS "
                       f"{rss_kib(pid, 'VmRSS') >> 10} MiB, {start >> 10} MiB at start)")
