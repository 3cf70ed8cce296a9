"""Following a child's output (GET /models/logs?follow=1, `corral logs -f`): every line
once and in order, across restarts; a stalled reader is dropped, never waited for."""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import time

import psutil

from actors.childproc import CUT_MARK, MAX_LINE_BYTES, LogRing, bounded_lines, line_cost
from tests.helpers import ROOT, SSE, chat, fake_cmd, request, toml_config, wait_until

FOLLOW = "/models/logs?model={}&follow=1"


def follow(port: int, model: str) -> SSE:
    return SSE(port, path=FOLLOW.format(model), greeting=b": following")


def raw_get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def lines_of(stream: SSE) -> list[str]:
    return [e["line"] for e in list(stream.events) if "line" in e]


def numbered(lines: list[str]) -> list[int]:
    """The numbers of the fake model's `--log-lines` lines, in the order they came."""
    return [int(m.group(1)) for line in lines if (m := re.match(r"fake_model: line (\d+) ",
                                                                  line))]


def test_a_follower_sees_recent_lines_then_live_ones_across_restarts(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd("--log-lines", "3")}}))
    assert chat(c.port, "a")[0] == 200
    stream = follow(c.port, "a")  # joins after the first start: gets it from the ring
    try:
        wait_until(lambda: "fake_model: line 2 " in " ".join(lines_of(stream)), 10,
                   "the ring's lines")
        assert request(c.port, "POST", "/models/unload", {"model": "a"})[0] == 200
        c.wait_state("a", "unloaded")
        assert chat(c.port, "a")[0] == 200  # generation 2, followed live
        wait_until(lambda: lines_of(stream).count("fake_model a: ready") == 2, 10,
                   "the second start's lines")
        lines = lines_of(stream)
        starts = [i for i, line in enumerate(lines) if re.match(r"corral: a#\d+ starting", line)]
        assert [lines[i].split()[1] for i in starts] == ["a#1", "a#2"]
        assert any(re.match(r"corral: a#1 pid \d+ exited", line) for line in lines), lines
        assert numbered(lines[starts[0]:starts[1]]) == [0, 1, 2]  # once each, in order
        assert numbered(lines[starts[1]:]) == [0, 1, 2]
    finally:
        stream.close()


def test_a_burst_of_short_lines_drops_no_reader(corral) -> None:
    """20,000 lines at once, far more than the 1,000 the snapshot shows: a reader that
    keeps up on the whole gets them all (they fit in the followers' byte budget)."""
    n = 20_000
    c = corral(toml_config({"chatty": {"cmd": fake_cmd("--log-lines", str(n))}}))
    reader = follow(c.port, "chatty")
    try:
        assert chat(c.port, "chatty")[0] == 200
        wait_until(lambda: f"fake_model: line {n - 1} " in " ".join(lines_of(reader)[-3:]),
                   30, "the reader to get the last line")
        assert numbered(lines_of(reader)) == list(range(n))
        assert not any("event" in e for e in reader.events)
        _, text, _ = request(c.port, "GET", "/models/logs?model=chatty")
        assert len(text.splitlines()) == 1000  # the snapshot: the last 1,000 lines
    finally:
        reader.close()


def test_readers_that_leave_are_let_go(corral) -> None:
    """Followers of a silent model that close their connection are gone at once (not at
    the model's next line): the count of open log streams in /metrics goes back to 0."""
    c = corral(toml_config({"quiet": {"cmd": fake_cmd()}}))

    def streams() -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families
        text = request(c.port, "GET", "/metrics")[1]
        family = next(f for f in text_string_to_metric_families(text)
                      if f.name == "corral_event_streams")
        return {s.labels["kind"]: s.value for s in family.samples}

    for _ in range(30):
        with socket.create_connection(("127.0.0.1", c.port)) as s:
            s.sendall(raw_get(FOLLOW.format("quiet")))
            assert b": following" in s.recv(4096)
    kept = follow(c.port, "quiet")
    try:
        wait_until(lambda: streams() == {"events": 0, "logs": 1}, 10,
                   "the 30 closed followers to be let go")
    finally:
        kept.close()
    wait_until(lambda: streams()["logs"] == 0, 10, "the last one to be let go")


def test_a_stalled_follower_is_dropped_and_holds_up_nobody(corral) -> None:
    """One reader stops reading while the child prints far more than the ring and every
    socket buffer on the way hold; another reads on. The child is never held up (all its
    output reaches the ring), requests are served, the reading follower gets a gapless
    run of lines to the end (or, if this machine starves it, a `dropped` event), and the
    stalled one, once it reads again, finds a gapless start and then `event: dropped`."""
    n, size = 2500, 16_384  # 40 MiB: past the ring (1,000 lines) and the buffers between
    c = corral(toml_config({"a": {"cmd": fake_cmd()},
                            "chatty": {"cmd": fake_cmd("--log-lines", str(n),
                                                       "--log-line-bytes", str(size))}}))
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", c.port))
    stalled.sendall(raw_get(FOLLOW.format("chatty")))
    reader = follow(c.port, "chatty")
    last = f"fake_model: line {n - 1} "
    try:
        assert chat(c.port, "chatty")[0] == 200
        wait_until(lambda: last in request(c.port, "GET", "/models/logs?model=chatty")[1],
                   30, "the child's last line in the ring")
        assert chat(c.port, "a")[0] == 200  # and the front serves on meanwhile
        wait_until(lambda: reader.events and (reader.events[-1].get("event") == "dropped"
                                              or reader.events[-1].get("line", "")[:40]
                                              .startswith(last)),
                   30, "the reading follower to reach the end")
        got = numbered(lines_of(reader))
        assert got == list(range(len(got))) and (len(got) == n or "lost" in reader.events[-1])
        stalled.settimeout(30)
        got = bytearray()

        def dechunked(data: bytes) -> str:
            return re.sub(rb"\r\n[0-9a-f]+\r\n", b"", data).decode(errors="replace")
        # Until the whole `dropped` event is in: its bytes may come in more than one read.
        while not re.search(r"event: dropped\ndata: \{[^\n]*\}\n", dechunked(got[-(1 << 16):])):
            chunk = stalled.recv(1 << 20)
            assert chunk, got[-500:]
            got += chunk
        text = dechunked(got)
        seen = [int(i) for i in re.findall(r"fake_model: line (\d+) ", text)]
        assert seen == list(range(len(seen))) and len(seen) < n
        assert re.search(r'event: dropped\ndata: \{"lost":\d+,"reason":"this reader fell '
                         r'behind all the output corral keeps \(its last 4 MiB\)"\}', text), \
            text[-300:]
    finally:
        stalled.close()
        reader.close()


def test_stop_ends_follow_streams_at_once_even_a_stalled_one(corral) -> None:
    c = corral(toml_config({"chatty": {"cmd": fake_cmd("--log-lines", "400",
                                                       "--log-line-bytes", "16384")}}))
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", c.port))
    stalled.sendall(raw_get(FOLLOW.format("chatty")))
    reader = follow(c.port, "chatty")
    try:
        assert chat(c.port, "chatty")[0] == 200
        # 6.4 MiB: more than the ring keeps, so the reader may have been dropped already
        wait_until(lambda: "fake_model: line 399 " in request(
            c.port, "GET", "/models/logs?model=chatty")[1], 30, "the child's last line")
        started = time.monotonic()
        assert c.stop() == 0
        took = time.monotonic() - started
        assert took < 10, f"stop took {took:.1f} s (http.drain_timeout_s is 30)"
        assert reader.ended.wait(5)
    finally:
        stalled.close()
        reader.close()


def test_follow_asks_clearly(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}))
    status, body, _ = request(c.port, "GET", "/models/logs?model=a&follow=yes-please")
    assert status == 400 and "follow=1" in body["error"]["message"]
    status, body, _ = request(c.port, "GET", "/models/logs?model=nope&follow=1")
    assert status == 404 and "nope" in body["error"]["message"]


def test_corral_logs_prints_and_follows(corral) -> None:
    c = corral(toml_config({"a": {"cmd": fake_cmd()}}))
    assert chat(c.port, "a")[0] == 200
    cli = [sys.executable, str(ROOT / "supervisor.py"), "logs", "a",
           "--url", f"http://127.0.0.1:{c.port}"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "fake_model a: ready" in out.stdout
    with subprocess.Popen([*cli, "-f"], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # the ring first ...
                if line.strip() == "fake_model a: ready":
                    break
            assert request(c.port, "POST", "/models/unload", {"model": "a"})[0] == 200
            for line in proc.stdout:  # ... then live
                if re.match(r"corral: a#1 pid \d+ ", line):
                    break
            else:
                raise AssertionError("the follower ended before the exit line")
        finally:
            proc.kill()
    missing = subprocess.run([*cli[:3], "nope", *cli[4:]], capture_output=True, text=True,
                             timeout=30)
    assert missing.returncode == 1 and "404" in missing.stderr


def test_silent_streams_ping(corral) -> None:
    c = corral(toml_config({"quiet": {"cmd": fake_cmd()}}) + "\n[http]\nevent_ping_s = 0.2\n")
    for path in (FOLLOW.format("quiet"), "/models/sse"):
        with socket.create_connection(("127.0.0.1", c.port), timeout=10) as s:
            s.sendall(raw_get(path))
            got = b""
            while got.count(b": ping\n\n") < 2:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk


# ---------------------------------------------------------------- bounded output (R4)

def test_lines_are_cut_at_max_line_bytes_however_the_pipe_splits_them() -> None:
    """`bounded_lines` gives the same lines for any split of the stream into reads: short
    ones whole (a character split across two reads included), long ones cut and marked."""
    long = "é" * MAX_LINE_BYTES  # 2 bytes a character: cut inside one would be garbled
    text = f"one\r\n\ntwo ☃\n{long}\nthree\n{'x' * (MAX_LINE_BYTES - 1)}\nlast, no newline"
    data = text.encode()
    rng = random.Random(19)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        lines = list(bounded_lines(iter([*pieces, b""]).__next__))
        assert lines[:3] == ["one", "", "two ☃"]
        assert lines[3].endswith(CUT_MARK) and set(lines[3][:-len(CUT_MARK)]) == {"é"}
        assert len(lines[3].encode()) <= MAX_LINE_BYTES
        assert lines[4:] == ["three", "x" * (MAX_LINE_BYTES - 1), "last, no newline"]


def test_a_line_that_never_ends_is_given_out_cut_and_never_held_whole() -> None:
    held: list[int] = []

    def endless() -> bytes:  # 1 GiB of one line, 64 KiB a read
        held.append(len(held))
        return b"y" * (64 << 10) if len(held) <= 1 << 14 else b""

    lines = bounded_lines(endless)
    first = next(lines)  # given out after the first read, not at the line's end
    assert len(held) == 1 and first == "y" * (MAX_LINE_BYTES - len(CUT_MARK)) + CUT_MARK
    assert list(lines) == []


def test_the_ring_is_bounded_in_bytes_and_lines() -> None:
    ring = LogRing()
    for i in range(1000):
        ring.append(f"line {i} " + "z" * (1 << 20))  # 1 MB each: each one clipped
    kept = ring.lines()
    assert sum(map(line_cost, kept)) <= ring.max_bytes
    assert all(len(line.encode()) <= MAX_LINE_BYTES for line in kept)
    assert kept[-1].startswith("line 999 ") and kept[-1].endswith(CUT_MARK)
    assert len(kept) == (4 << 20) // line_cost(kept[-1])  # as many as fit, the newest
    for i in range(20_000):
        ring.append(f"short {i}")
    assert len(ring.lines()) == 1000  # the snapshot's line count ...
    assert ring.since(ring.recent() - 10_000)[2] == 0  # ... and more kept for followers


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / (1 << 20)


def test_a_child_printing_1000_lines_of_1_mb_costs_corral_a_few_mib(corral) -> None:
    """Issue 19, R4: these lines took corral's RSS from 47 MiB to 1 GiB, and one GET
    /models/logs to 1.9 GiB in 6.2 s."""
    n, size = 1000, 1 << 20
    c = corral(toml_config({"chatty": {"cmd": fake_cmd("--log-lines", str(n),
                                                       "--log-line-bytes", str(size))}}))
    assert request(c.port, "GET", "/health")[0] == 200
    before = rss_mib(c.proc.pid)
    assert chat(c.port, "chatty")[0] == 200  # it serves once all its lines are read
    last = f"fake_model: line {n - 1} "
    started = time.monotonic()
    status, text, _ = request(c.port, "GET", "/models/logs?model=chatty")
    took = time.monotonic() - started
    assert status == 200 and last in text, text[-300:]
    lines = text.splitlines()
    assert all(line.endswith(CUT_MARK) for line in lines if line.startswith("fake_model: line"))
    assert len(text) <= 4 << 20 and len(lines) < 300  # what the ring holds, no more
    assert took < 2, f"GET /models/logs took {took:.2f} s"
    grown = rss_mib(c.proc.pid) - before
    print(f"corral rss {before:.0f} MiB -> +{grown:.1f} MiB after {n} lines of {size} B "
          f"and one GET /models/logs ({took * 1000:.0f} ms, {len(text) >> 10} KiB)")
    assert grown < 48, f"corral's RSS grew by {grown:.0f} MiB"


def test_one_64_mib_line_without_a_newline_is_cut(corral) -> None:
    """The child writes 64 MiB with no newline before it starts serving (its first line
    ends that one): the ring gets the first 16 KiB, marked, then the child's next lines."""
    spew = [sys.executable, "-c",
            "import os, sys\n"
            "sys.stdout.buffer.write(b'w' * (64 << 20)); sys.stdout.flush()\n"
            "os.execvp(sys.executable, [sys.executable, *sys.argv[1:]])",
            *fake_cmd()[1:]]
    c = corral(toml_config({"spew": {"cmd": spew}}))
    assert request(c.port, "GET", "/health")[0] == 200
    before = rss_mib(c.proc.pid)
    assert chat(c.port, "spew")[0] == 200
    lines = request(c.port, "GET", "/models/logs?model=spew")[1].splitlines()
    [cut] = [i for i, line in enumerate(lines) if line.startswith("w")]
    assert lines[cut] == "w" * (MAX_LINE_BYTES - len(CUT_MARK)) + CUT_MARK
    assert lines[cut + 1] == "fake_model spew: ready"  # the rest of that line skipped
    grown = rss_mib(c.proc.pid) - before
    print(f"corral rss {before:.0f} MiB -> +{grown:.1f} MiB after a 64 MiB line")
    assert grown < 32, f"corral's RSS grew by {grown:.0f} MiB"
