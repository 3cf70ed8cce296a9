"""The benches' nginx runner (bench/nginx.py, issue 43): the config it writes, and, where
nginx is installed, that it starts in front of a real child, passes requests and streams
through, lets its CPU be read, and leaves no process behind."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from bench.common import cpu_seconds
from bench.nginx import available, config_text, free_port, nginx
from tests.helpers import wait_until


def test_the_config_is_an_operators_for_an_llm_server(tmp_path: Path) -> None:
    text = config_text(8123, "127.0.0.1:9000", 2, tmp_path)
    for line in ("worker_processes 2;", "listen 127.0.0.1:8123 reuseport;",
                 "server 127.0.0.1:9000;", "keepalive 64;", "proxy_http_version 1.1;",
                 'proxy_set_header Connection "";', "proxy_buffering off;",
                 "proxy_request_buffering off;", "access_log off;", "daemon off;",
                 f"pid {tmp_path / 'nginx.pid'};"):
        assert line in text, line
    assert "/var/" not in text, "every file of its own under the bench's folder"


@pytest.mark.skipif(available() is None, reason="nginx is not installed (apt install "
                    "nginx-light): the benches go on without it")
def test_nginx_runs_in_front_of_a_child_and_leaves_nothing(tmp_path: Path) -> None:
    port = free_port()
    child = subprocess.Popen([sys.executable, "-m", "actors.fake_model", "--host", "127.0.0.1",
                              "--port", str(port), "--model", "m", "--tokens-per-s", "200"],
                             stdin=subprocess.PIPE)
    try:
        with nginx(f"127.0.0.1:{port}", workers=2) as front:
            pids = front.pids()
            assert len(pids) == 3, "the master and its two workers"

            def answered() -> bool:
                conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
                try:
                    conn.request("POST", "/v1/chat/completions", json.dumps({
                        "model": "m", "max_tokens": 20, "stream": True,
                        "messages": [{"role": "user", "content": "hi"}]}),
                        {"Content-Type": "application/json"})
                    resp = conn.getresponse()
                    return resp.status == 200 and b"[DONE]" in resp.read()
                except OSError:
                    return False  # (the child still starting: nginx answers 502)
                finally:
                    conn.close()
            wait_until(answered, 30, "a stream through nginx")
            before = sum(map(cpu_seconds, pids))
            for _ in range(20):
                assert answered()
            assert sum(map(cpu_seconds, pids)) > before, "its CPU is read"
        wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status()
                                   != psutil.STATUS_ZOMBIE for p in pids), 10,
                   "nginx's processes gone")
    finally:
        child.terminate()
        child.wait(10)
