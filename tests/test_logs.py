"""Following a child's output (GET /models/logs?follow=1, `corral logs -f`): every line
once and in order, across restarts; a stalled reader is dropped, never waited for."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

from tests.helpers import ROOT, SSE, chat, fake_cmd, request, toml_config, wait_until

FOLLOW = "/models/logs?model={}&follow=1"


def follow(port: int, model: str) -> SSE:
    return SSE(port, path=FOLLOW.format(model), greeting=b": following")


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
            s.sendall(f"GET {FOLLOW.format('quiet')} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
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
    stalled.sendall(f"GET {FOLLOW.format('chatty')} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
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
        while b"event: dropped" not in got[-(1 << 16):]:
            chunk = stalled.recv(1 << 20)
            assert chunk, got[-500:]
            got += chunk
        text = re.sub(rb"\r\n[0-9a-f]+\r\n", b"", got).decode(errors="replace")  # dechunk
        seen = [int(i) for i in re.findall(r"fake_model: line (\d+) ", text)]
        assert seen == list(range(len(seen))) and len(seen) < n
        assert re.search(r'event: dropped\ndata: \{"lost":\d+,"reason":"this reader fell '
                         r'behind all the output corral keeps \(1,000 lines, or 4 MiB of '
                         r'short ones\)"\}', text), text[-300:]
    finally:
        stalled.close()
        reader.close()


def test_stop_ends_follow_streams_at_once_even_a_stalled_one(corral) -> None:
    c = corral(toml_config({"chatty": {"cmd": fake_cmd("--log-lines", "400",
                                                       "--log-line-bytes", "16384")}}))
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", c.port))
    stalled.sendall(f"GET {FOLLOW.format('chatty')} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    reader = follow(c.port, "chatty")
    try:
        assert chat(c.port, "chatty")[0] == 200
        wait_until(lambda: "fake_model: line 399 " in " ".join(lines_of(reader)[-2:]), 30,
                   "the reading follower to get the last line")
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
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            got = b""
            while got.count(b": ping\n\n") < 2:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
