"""The edge's faults of issue 19 (R1-R10, R13 of the robustness review), on raw sockets.

The invariants behind them: every answer a client gets belongs to the request it sent; what
corral holds for one connection is bounded whatever the client sends or does not read; a
child is sent a request a second time only where it never had it (a kept-alive connection
it had closed), and never after it answered, even badly.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.http.callers import PASSED_KEPT, Origins
from actors.http.relay import PARTIAL, Relay
from tests.helpers import Corral, fake_cmd, request, toml_config, wait_until
from tests.rawhttp import Raw, Response
from tests.test_edge_hostile import HTTP, KEY, ODD, ask, in_flight_zero, mine

FAULTS_HTTP = {**HTTP, "write_timeout_s": 2, "upstream_idle_timeout_s": 2}


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Corral]:
    c = Corral(toml_config(
        {"odd": {"cmd": ODD}, "fake": {"cmd": fake_cmd("--tokens-per-s", "50")}},
        api_key=KEY, http=FAULTS_HTTP), home=tmp_path_factory.mktemp("faults"))
    c.key = KEY
    try:
        yield c
    finally:
        c.stop()


def child_log(c: Corral, model: str = "odd") -> str:
    status, text, _ = request(c.port, "GET", f"/models/logs?model={model}",
                              headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    return str(text)


def times_received(c: Corral, rid: str) -> int:
    return child_log(c).count(f"request {rid} on connection")


def received_once(c: Corral, rid: str) -> None:
    """The child logged `rid` once: its log line may come after its answer did (it goes
    through corral's pipe from the child), so it is waited for, then counted."""
    wait_until(lambda: times_received(c, rid) >= 1, 10, f"the child's log of {rid}")
    assert times_received(c, rid) == 1


def timed_answer(port: int, rid: str, odd: str) -> tuple[Response, float]:
    """The answer to one request to the odd child, and how long it took."""
    t = time.monotonic()
    with ask(port, rid, odd) as raw:
        answer = raw.one()
    return answer, time.monotonic() - t


def stalled_client(port: int, requests: int, patience_s: float = 0.2) -> socket.socket:
    """A client that pipelines `requests` GET /ui and reads nothing (a 1 KiB buffer); it
    sends until corral has taken nothing for `patience_s`."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.setblocking(False)
    data = memoryview(b"GET /ui HTTP/1.1\r\nHost: x\r\n\r\n" * requests)
    last_taken = time.monotonic()
    while data and time.monotonic() - last_taken < patience_s:
        try:
            data = data[s.send(data):]
            last_taken = time.monotonic()
        except BlockingIOError:
            time.sleep(0.01)
    return s


# ---------------------------------------------------------------- what corral writes

def test_a_pipelining_client_that_never_reads_holds_one_answer(edge) -> None:
    """R1: 600 KB of pipelined GET /ui (open, no key) took corral from 47 to 510 MiB."""
    proc = psutil.Process(edge.proc.pid)
    before = proc.memory_info().rss
    # Each sends until corral takes nothing more for a second: with the fault, corral read
    # all 600 KB and answered them into its memory (23 KB each) as fast as it could.
    held = [stalled_client(edge.port, 20_000, patience_s=1.0) for _ in range(3)]
    try:
        grown = 0
        for _ in range(30):  # the most it holds while it would still be answering them
            grown = max(grown, proc.memory_info().rss - before)
            time.sleep(0.1)
        assert grown < 16 * 2**20, f"corral grew by {grown >> 20} MiB"
    finally:
        for s in held:
            s.close()
    health = request(edge.port, "GET", "/health")
    assert health[0] == 200


def test_a_client_that_takes_nothing_is_cut_and_frees_its_slot(edge) -> None:
    """R2: 60 connections that stop reading held every slot of max_connections for good."""
    held = [stalled_client(edge.port, 400) for _ in range(60)]
    try:
        def served() -> bool:
            try:
                return request(edge.port, "GET", "/health", timeout_s=2)[0] == 200
            except OSError:
                return False

        # Each gets 32 answers (MAX_PIPELINED), then a 503 and a close; one that takes
        # none of what does not fit in the kernel's buffers is cut after write_timeout_s.
        wait_until(served, 15, "a slot freed")
    finally:
        for s in held:
            s.close()


def test_a_stalled_stream_client_frees_its_grant_and_child(edge) -> None:
    """R2: a stream whose client stops reading kept its grant (in flight) for ever."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", edge.port))
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                  b"sekrit\r\nx-odd: big\r\nx-size: 67108864\r\nContent-Length: 15\r\n\r\n"
                  b'{"model":"odd"}')
        cut = "waiting for it in 2 s (http.write_timeout_s)"
        wait_until(lambda: edge.models()["odd"]["in_flight"] == 1 or cut in edge.log(), 60,
                   "the answer running")  # (or cut already: its 2 s can pass between
        in_flight_zero(edge)  # two polls beside busy cores, its child's start before them)
        assert cut in edge.log()
        # A cut is a reset: nothing of the answer is left in the kernel, still being sent
        # for as long as the client acknowledges (review of issue 19, F3).
        if shutil.which("ss") is not None:  # iproute2
            lingering = subprocess.run(["ss", "-tnH", "state", "fin-wait-1", "sport",
                                        f"= :{edge.port}"], capture_output=True, text=True)
            assert lingering.returncode == 0 and not lingering.stdout.strip(), lingering.stdout
        with pytest.raises(ConnectionResetError):
            while s.recv(1 << 20):
                pass
    finally:
        s.close()


# ---------------------------------------------------------------- clients that leave

def test_a_client_that_leaves_while_its_child_works_is_noticed(edge) -> None:
    """R3: a client's FIN while the child worked went unnoticed: a silent child stayed in
    flight for ever, and a fake child computed the whole answer for nobody."""
    raw = ask(edge.port, "left", "silent")
    wait_until(lambda: edge.models()["odd"]["in_flight"] == 1, 5, "forwarded")
    raw.close()  # a plain close: FIN, not RST
    in_flight_zero(edge)
    with Raw(edge.port) as raw:  # but a half-closed HTTP/1.0 request is answered
        raw.request("GET", "/health", version="1.0")
        raw.sock.shutdown(socket.SHUT_WR)
        assert raw.one().status == 200
    raw = Raw(edge.port).request("POST", "/v1/chat/completions",
                                 {"model": "fake", "max_tokens": 150})  # 3 s of tokens
    wait_until(lambda: edge.models()["fake"]["in_flight"] == 1, 20, "forwarded")
    raw.close()
    in_flight_zero(edge)

    def stats() -> dict[str, int]:
        status, body, _ = request(edge.port, "GET", "/debug/stats?model=fake",
                                  headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200
        return dict(body)

    wait_until(lambda: stats()["cancelled"] == 1, 10, "the child's work cancelled")
    assert stats()["completed"] == 0


# ---------------------------------------------------------------- what children send

def test_a_childs_huge_answer_head_is_cut_at_the_limit_without_stalling_others(edge) -> None:
    """R6: a 64 MiB header from a child stalled every client, /health too, for 6 s."""
    worst: list[float] = []
    stop = threading.Event()

    def health() -> None:
        while not stop.is_set():
            t = time.monotonic()
            assert request(edge.port, "GET", "/health")[0] == 200
            worst.append(time.monotonic() - t)
            time.sleep(0.02)

    watcher = threading.Thread(target=health)
    watcher.start()
    try:
        t = time.monotonic()
        with ask(edge.port, "huge", "huge-head") as raw:
            answer = raw.one()
        assert answer.status == 502 and "32 KiB" in answer.json()["error"]["message"]
        assert time.monotonic() - t < 5
    finally:
        stop.set()
        watcher.join()
    assert max(worst) < 1.0, max(worst)
    received_once(edge, "huge")


def test_a_child_silent_mid_answer_ends_the_stream_with_an_error(edge) -> None:
    """R7: a child silent after its head hung its client for as long as it lived."""
    t = time.monotonic()
    with ask(edge.port, "stalled", "stall") as raw:
        answer = raw.one()
        assert raw.closed(3)
    took = time.monotonic() - t
    assert answer.status == 200 and b'"n": 0' in answer.body
    assert b"upstream_idle_timeout_s" in answer.body and b'"code":502' in answer.body
    assert 1.5 < took < 6, took  # upstream_idle_timeout_s = 2, checked once a second
    wait_until(lambda: "liveness check 1 of" in edge.log(), 5, "a liveness failure counted")
    in_flight_zero(edge)


def test_a_child_gone_mid_event_leaves_its_client_whole_events_and_the_error(edge) -> None:
    """A child killed mid-event left half an event at the client, which its SSE reader
    took for an event of broken JSON: now every event the client gets is whole, and the
    last is corral's error."""
    with ask(edge.port, "cut-event", "sse-cut") as raw:
        answer = raw.one()
    events = [e for e in answer.body.split(b"\n\n") if e.strip()]
    assert answer.status == 200 and b"hal" not in answer.body, answer.body
    assert [json.loads(e.removeprefix(b"data: "))["n"] for e in events[:-1]] == [0]
    error = json.loads(events[-1].removeprefix(b"data: "))["error"]
    assert error["code"] == 502 and "stopped mid-response" in error["message"]


def test_events_cut_across_a_childs_writes_arrive_whole_and_unchanged(edge) -> None:
    """What is held back of an unended event is sent once its end comes (a blank line,
    or CRLFs), byte for byte, and the stream's end as the child ended it."""
    with ask(edge.port, "split-event", "sse-split") as raw:
        answer = raw.one()
    assert answer.status == 200 and answer.body == (
        b'data: {"n": 0, "id": "split-event"}\n\ndata: {"n": 1, "id": "split-event"}\r\n\r\n'
        b'data: {"n": 2, "id": "split-event"}\n\ndata: [DONE]\n\n'), answer.body


@settings(max_examples=300, deadline=None)
@given(events=st.lists(st.tuples(st.binary(min_size=1, max_size=40).filter(  # (an event's
           lambda b: b"\n\n" not in b and b"\r\n\r\n" not in b  # data: no blank line in it
           and not b.endswith((b"\n", b"\r\n\r")) and not b.startswith((b"\r", b"\n"))),
           st.sampled_from([b"\n\n", b"\r\n\r\n"])), max_size=8),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_events_held_back_come_out_whole_and_in_order(events: list[tuple[bytes, bytes]],
                                                      cuts: list[int]) -> None:
    """For any stream of events cut anywhere into reads: what is sent ends at an event's
    end each time, and what is sent and then held is the stream, byte for byte."""
    stream = b"".join(data + end for data, end in events)
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    relay, sent = SimpleNamespace(partial=None), []
    for a, b in itertools.pairwise(bounds):
        held = relay.partial
        sent.append(Relay._whole_events(relay, stream[a:b] if held is None  # type: ignore[arg-type]
                                        else held + stream[a:b]))
    assert b"".join(sent) + (relay.partial or b"") == stream
    ends = set(itertools.accumulate(len(data + end) for data, end in events))
    assert all(not part or n in ends for part, n in zip(
        sent, itertools.accumulate(map(len, sent)), strict=True))


def test_bytes_that_never_end_an_event_are_held_no_more_than_the_bound() -> None:
    """A stream that is not events (no blank line) still streams: past PARTIAL bytes
    what is held goes on as it came."""
    relay = SimpleNamespace(partial=None)
    assert Relay._whole_events(relay, b"x" * PARTIAL) == b""  # type: ignore[arg-type]
    assert relay.partial == b"x" * PARTIAL
    more = relay.partial + b"y"
    assert Relay._whole_events(relay, more) == more and relay.partial is None  # type: ignore[arg-type]


def test_a_reused_connection_the_child_closed_is_retried_at_once_and_only_then(edge) -> None:
    """R10: the keep-alive race cost 2 s; a malformed answer cost 2 s and ran twice."""
    with ask(edge.port, "first", "close-next") as raw:  # leaves a connection pooled
        mine(raw, "first")
    t = time.monotonic()
    with ask(edge.port, "second") as raw:  # on that connection: the child closes it
        mine(raw, "second")
    assert time.monotonic() - t < 0.5
    received_once(edge, "second")
    answer, took = timed_answer(edge.port, "bad", "garbage")
    assert answer.status == 502 and "malformed" in answer.json()["error"]["message"]
    assert took < 0.5
    received_once(edge, "bad")
    # A child that had the request a while, then closed without a byte (on a reused
    # connection): it may have run it, and it is still there: a 502 at once, never again.
    with ask(edge.port, "warm") as raw:
        mine(raw, "warm")
    answer, took = timed_answer(edge.port, "late-close", "close-late")
    assert answer.status == 502 and "still running" in answer.json()["error"]["message"]
    assert took < 1.5
    received_once(edge, "late-close")


def test_streams_from_a_child_that_closes_after_each_are_all_whole(edge) -> None:
    """Issue 19, 1: llama-server closes after every stream without saying so; the pool
    handed that connection on, and the next stream waited 2 s or got a 502."""
    def one(i: int) -> tuple[int, float, bool]:
        t = time.monotonic()
        with ask(edge.port, f"sc{i}", "stream-close") as raw:
            answer = raw.one()
        whole = answer.body.count(b"data:") == 3 and b"error" not in answer.body
        return answer.status, time.monotonic() - t, whole

    went_away = edge.log().count("went away before answering")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(5):
            results = list(pool.map(one, range(16)))
            assert all(status == 200 and whole for status, _, whole in results), results
            assert max(took for _, took, _ in results) < 1.5, results
    assert "closes its connection after a streamed answer" in edge.log()
    assert edge.log().count("went away before answering") == went_away


def test_smaller_answers_are_framed_right(edge) -> None:
    """R9: corral's own answers to HEAD carried a body; R13: a child's 204 kept its
    Content-Length, two Host headers passed, a child's HTML ran on corral's origin."""
    with Raw(edge.port) as raw:
        raw.send(b"HEAD /props?model=nope HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                 b"sekrit\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 5
        while raw.raw.count(b"HTTP/1.1 ") < 2 and time.monotonic() < deadline:
            raw.raw += raw.sock.recv(4096)
        head, _, rest = raw.raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"Content-Length: " in head
        assert rest.startswith(b"HTTP/1.1 200 OK"), raw.raw  # no body between the two
    with ask(edge.port, "nc", "no-content") as raw:
        answer = raw.one()
        assert answer.status == 204 and answer.headers["x-request-id"] == "nc"
        assert "content-length" not in answer.headers
        mine(raw.request("POST", "/v1/completions", {"model": "odd"},
                         headers={"x-request-id": "after-nc"}), "after-nc")
    with Raw(edge.port) as raw:
        raw.send(b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n")
        answer = raw.one()
        assert answer.status == 400 and "Host" in answer.json()["error"]["message"]
    with ask(edge.port, "page", "html") as raw:
        answer = raw.one()
        assert answer.headers["content-security-policy"] == "sandbox"
        assert answer.headers["x-content-type-options"] == "nosniff"


def test_a_slow_reader_that_keeps_reading_is_not_cut(edge) -> None:
    """R2's timeout is for clients that take nothing: one that reads 8 MiB slowly, for
    longer than write_timeout_s (2 s), gets all of it."""
    size = 8 * 2**20
    cuts = edge.log().count("took none of the")
    with ask(edge.port, "slowread", "big", **{"x-size": str(size)}) as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        got = 0
        t = time.monotonic()
        while got < size:
            chunk = raw.sock.recv(1 << 16)
            assert chunk, f"cut after {got} bytes"
            got += len(chunk)
            time.sleep(0.02)  # about 3 MiB/s at most: 8 MiB take several seconds
        assert time.monotonic() - t > 2
    assert edge.log().count("took none of the") == cuts


def test_a_request_behind_an_answer_that_ends_the_connection_is_never_run(edge) -> None:
    """Review of issue 19, F9: a pipelined request behind an answer corral ended by closing
    (its child died mid-answer) was started when the client drained the first."""
    with ask(edge.port, "cut1", "big-cut") as raw:
        raw.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        raw.request("POST", "/v1/completions", {"model": "odd"},
                    headers={"x-request-id": "behind-cut"})
        while raw.sock.recv(1 << 16):
            time.sleep(0.001)  # slowly, so corral's buffer to it fills, then drains
    in_flight_zero(edge)
    assert times_received(edge, "behind-cut") == 0


def test_an_unload_is_not_undone_by_the_requests_it_cut(edge) -> None:
    """Review of issue 19, F10: a request cut by an operator's unload was sent on to the
    next instance, which loaded the model again at once."""
    with ask(edge.port, "pre") as raw:
        mine(raw, "pre")
    loads = edge.models()["odd"]["loads"]
    raw = ask(edge.port, "cut-by-unload", "silent")
    try:
        wait_until(lambda: edge.models()["odd"]["in_flight"] == 1, 5, "forwarded")
        status, _, _ = request(edge.port, "POST", "/models/unload", {"model": "odd"},
                               headers={"Authorization": f"Bearer {KEY}"})
        assert status == 200
        answer = raw.one()
        assert answer.status == 503 and "was stopped" in answer.json()["error"]["message"]
    finally:
        raw.close()
    edge.wait_state("odd", "unloaded")
    assert edge.models()["odd"]["loads"] == loads  # not loaded again for it


# ---------------------------------------------------------------- without a key

def test_without_a_key_web_pages_cannot_drive_or_read_corral(tmp_path: Path) -> None:
    """R5: with no key (the default) any web page could load and unload models (CSRF)
    and, its name rebound to 127.0.0.1, read /models/logs (DNS rebinding)."""
    c = Corral(toml_config({"odd": {"cmd": ODD}},
                           http={"allowed_hosts": ["corral.lan"],
                                 "allowed_origins": ["https://app.example"]}), home=tmp_path)
    try:
        def send(method: str, path: str, host: str, origin: str | None = None) -> int:
            headers = {"Content-Type": "text/plain"}
            if origin is not None:
                headers["Origin"] = origin
            with Raw(c.port) as raw:
                body = b'{"model": "odd"}' if method == "POST" else None
                lines = [f"{method} {path} HTTP/1.1", f"Host: {host}",
                         *(f"{k}: {v}" for k, v in headers.items())]
                if body:
                    lines.append(f"Content-Length: {len(body)}")
                raw.send(("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b""))
                return raw.one().status

        own = f"127.0.0.1:{c.port}"
        assert send("POST", "/models/load", own, "http://evil.example") == 403
        assert send("POST", "/v1/completions", own, "http://evil.example") == 403
        assert send("POST", "/models/load", own, "null") == 403
        assert send("GET", "/models/logs?model=odd", f"rebound.evil.example:{c.port}") == 403
        assert send("GET", "/models", f"rebound.evil.example:{c.port}") == 403
        assert send("GET", "/health", "anything.example") == 200  # probes from anywhere
        assert send("POST", "/models/load", own, f"http://{own}") == 200  # the dashboard
        assert send("GET", "/models", f"localhost:{c.port}") == 200
        assert send("GET", "/models", f"[::1]:{c.port}") == 200
        assert send("GET", "/models", "corral.lan") == 200  # allowed_hosts
        assert send("POST", "/v1/completions", own, "https://app.example") == 200
        assert send("GET", "/models", own) == 200  # curl, the SDKs: no Origin
        assert send("GET", "/models", f"localhost.:{c.port}") == 200

        def fetch(site: str) -> int:  # what an <img src> on another page sends: no Origin
            with Raw(c.port) as raw:
                raw.send(f"GET /props?model=odd HTTP/1.1\r\nHost: {own}\r\n"
                         f"Sec-Fetch-Site: {site}\r\nSec-Fetch-Dest: image\r\n\r\n".encode())
                return raw.one().status

        assert fetch("cross-site") == 403 and fetch("same-site") == 403
        assert fetch("same-origin") == 200 and fetch("none") == 200
        with Raw(c.port) as raw:  # HTTP/1.0 with no Host: no browser sends it
            assert raw.send(b"GET /models HTTP/1.0\r\n\r\n").one().status == 200
        api = int(c.log().split("management API on 127.0.0.1:")[1].split()[0])
        assert request(api, "POST", "/models/unload", {"model": "odd"})[0] == 403
    finally:
        c.stop()


def test_a_host_remembered_as_passed_decides_nothing_else() -> None:
    """The Host values that passed are remembered (the lone request's cost): what a
    remembered Host comes with is still checked every time, a refused Host is never
    remembered, and no client can grow the memory past PASSED_KEPT."""
    gate = Origins("127.0.0.1", [], ["https://app.example"])
    own = b"127.0.0.1:8080"
    for _ in range(2):  # the first check and the remembered one answer alike
        assert gate.check(own, None) is None
        assert gate.check(own, b"https://app.example") is None
        assert gate.check(own, b"http://127.0.0.1:8080") is None  # corral's own page
        refused = gate.check(own, b"http://evil.example")
        assert refused is not None and refused.status == 403
        refused = gate.check(own, None, b"cross-site")
        assert refused is not None and refused.status == 403
        refused = gate.check(b"rebound.evil.example:8080", None)
        assert refused is not None and refused.status == 403
    assert b"rebound.evil.example:8080" not in gate.passed
    for port in range(PASSED_KEPT * 3):
        assert gate.check(b"127.0.0.1:%d" % port, None) is None
    assert len(gate.passed) == PASSED_KEPT
    assert gate.check(b"127.0.0.1:%d" % (PASSED_KEPT * 3 - 1), b"http://evil.example")


def test_the_write_timeout_counts_progress_not_pauses() -> None:
    """Review of issue 19, F5: the timer ran from pause_writing to resume_writing, so a
    reader taking one large read at 40 KiB/s was cut; now it is cut only when the bytes
    waiting for it have not gone down in write_timeout_s, and with a reset (F3)."""
    import asyncio

    from actors.config.model import HttpConfig
    from actors.http.connection import Connection
    from actors.http.request import Limits

    class Transport:
        def __init__(self) -> None:
            self.waiting = 300_000
            self.aborted = False

        def get_write_buffer_size(self) -> int:
            return self.waiting

        def get_extra_info(self, name: str) -> None:
            return None

        def pause_reading(self) -> None:
            pass

        def abort(self) -> None:
            self.aborted = True

    class Front:
        http = HttpConfig(write_timeout_s=2)
        limits = Limits(http, 1.0)
        origins = api_key = None
        warnings: list[str] = []

        def warn(self, what: str, message: str) -> None:
            self.warnings.append(message)

    async def main() -> tuple[bool, bool, list[str]]:
        conn = Connection(Front())  # type: ignore[arg-type]
        transport = Transport()
        conn.transport = transport  # type: ignore[assignment]
        conn.pause_writing()
        start = conn.loop.time()
        transport.waiting = 250_000  # it took 50 KB in those 2 s: slow, not stalled
        conn.check_deadline(start + 2.5)
        cut_when_slow = transport.aborted
        conn.check_deadline(start + 5.0)  # nothing taken since: cut
        return cut_when_slow, transport.aborted, Front.warnings

    cut_when_slow, cut_when_stalled, warnings = asyncio.run(main())
    assert not cut_when_slow and cut_when_stalled
    assert warnings == ["cut a client that took none of the 250000 bytes waiting for it in "
                        "2 s (http.write_timeout_s)"]


def test_a_pipelining_client_is_bounded_and_noticed_when_it_leaves(edge) -> None:
    """Review of issue 19, F2 and F4: one read of tiny pipelined requests became thousands
    of parsed requests (1.2-1.7 MiB a connection), 32 KiB of tiny headers 750 KiB; and a
    pipelining client that left was never noticed (reading stops behind a running
    request, so its EOF was not read), its request in flight for good."""
    # 33 answers of 0.25 s each, one after another: 8 s on a quiet machine, so the reads
    # wait up to 60 s (a busy one takes longer; what is asserted is which answers come)
    with Raw(edge.port, timeout_s=60.0) as raw:  # more than MAX_PIPELINED behind a running one
        one = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekrit\r\n"
               b"x-odd: slow\r\nContent-Length: 15\r\n\r\n{\"model\":\"odd\"}")
        raw.send(one * 40)
        answers = [a for a in raw.read(34) if a.status >= 200]  # (a busy machine's first
        assert [a.status for a in answers] == [200] * 33 + [503], answers[-2:]  # answer
        # came late enough for corral to probe the client with a 100 Continue first)
        assert "pipelined" in answers[-1].json()["error"]["message"]
        assert raw.closed(3)
    with Raw(edge.port) as raw:
        raw.send(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"a: b\r\n" * 101 + b"\r\n")
        answer = raw.one()
        assert answer.status == 431 and "100 header fields" in answer.json()["error"]["message"]
    raw = ask(edge.port, "pipelined-leaver", "silent")
    raw.request("POST", "/v1/completions", {"model": "odd"},
                headers={"x-request-id": "behind-leaver"})
    wait_until(lambda: edge.models()["odd"]["in_flight"] == 1, 5, "forwarded")
    raw.close()
    in_flight_zero(edge)
    assert times_received(edge, "behind-leaver") == 0
