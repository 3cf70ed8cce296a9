"""The benches' floor relay (bench/floor.py, issue 43): in front of a real child it passes
requests, answers and streams through on kept connections, honours a child's
`Connection: close`, answers 502 when the child is gone, and leaves no process behind."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys

import psutil

from bench.floor import floor
from bench.nginx import free_port
from tests.helpers import wait_until


def ask(port: int, conn: http.client.HTTPConnection | None = None, stream: bool = False,
        ) -> tuple[int, bytes]:
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "m", "max_tokens": 5, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}]}), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def up(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def test_the_floor_relays_answers_and_streams_on_kept_connections() -> None:
    port = free_port()
    child = subprocess.Popen([sys.executable, "-m", "actors.fake_model", "--host", "127.0.0.1",
                              "--port", str(port), "--model", "m"], stdin=subprocess.PIPE)
    try:
        wait_until(lambda: up(port), 30, "the child listening")
        with floor(f"127.0.0.1:{port}") as (url, pid):
            relay_port = int(url.rsplit(":", 1)[1])
            conn = http.client.HTTPConnection("127.0.0.1", relay_port, timeout=10)
            for i in range(6):  # one client connection, answers and streams in turn
                status, body = ask(relay_port, conn, stream=i % 2 == 1)
                assert status == 200
                if i % 2:
                    assert body.endswith(b"data: [DONE]\n\n"), body
                else:
                    assert json.loads(body)["choices"][0]["message"]["content"] == \
                        "tok0 tok1 tok2 tok3 tok4 "
            conns = [c for c in psutil.Process(pid).net_connections("tcp")
                     if c.raddr and c.raddr.port == port]
            assert len(conns) == 1, "one kept connection to the child served them all"
            closing = http.client.HTTPConnection("127.0.0.1", relay_port, timeout=10)
            closing.request("GET", "/v1/models", headers={"Connection": "close"})
            assert closing.getresponse().status == 200
            assert ask(relay_port)[0] == 200, "the closed connection is not handed on"
        wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status()
                   == psutil.STATUS_ZOMBIE, 10, "the relay gone")
    finally:
        child.terminate()
        child.wait(10)


def test_the_floor_answers_502_without_a_child() -> None:
    with floor(f"127.0.0.1:{free_port()}") as (url, _):
        status, _body = ask(int(url.rsplit(":", 1)[1]))
        assert status == 502
