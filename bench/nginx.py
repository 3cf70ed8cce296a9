"""nginx beside corral in the benches (issue 43): the best general-purpose reverse proxy,
started by the bench on a free loopback port in front of the same child corral serves, so
that a reader compares corral with the floor a user would, in the same run.

Its config is the one a careful operator would write for an LLM server: an upstream with
`keepalive 64`, HTTP/1.1 to it with the Connection header cleared, no buffering either
way (streams pass as they come), no access log, one worker per core corral may use. Where
nginx is not installed the bench says so and goes on without it (`available`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

SEARCHED = ("/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/local/nginx/sbin/nginx")


def available() -> str | None:
    """nginx's path, or None where it is not installed (say so, and go on without it)."""
    found = shutil.which("nginx")
    return found or next((p for p in SEARCHED if os.access(p, os.X_OK)), None)


def config_text(port: int, upstream: str, workers: int, root: Path,
                keepalive: int = 64) -> str:
    """The whole nginx.conf: listen on 127.0.0.1:`port`, pass everything to `upstream`
    (`host:port`) keeping up to `keepalive` idle connections to it, all its files under
    `root`."""
    temp = "".join(f"    {kind}_temp_path {root / kind};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return f"""worker_processes {workers};
daemon off;
pid {root / 'nginx.pid'};
error_log {root / 'error.log'} warn;
events {{
    worker_connections 4096;
}}
http {{
    access_log off;
{temp}    upstream child {{
        server {upstream};
        keepalive {keepalive};
    }}
    server {{
        listen 127.0.0.1:{port} reuseport;
        client_max_body_size 0;
        location / {{
            proxy_pass http://child;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
            proxy_send_timeout 600s;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Nginx:
    """A running nginx (master and workers) in front of one upstream."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, root: Path) -> None:
        self.proc = proc
        self.port = port
        self.root = root
        self.url = f"http://127.0.0.1:{port}"

    def pids(self) -> tuple[int, ...]:
        """The master and its workers: what its CPU time is read from."""
        try:
            return (self.proc.pid, *(c.pid for c in psutil.Process(self.proc.pid).children()))
        except psutil.Error:
            return (self.proc.pid,)

    def log(self) -> str:
        try:
            return (self.root / "error.log").read_text(errors="replace")
        except OSError:
            return ""


@contextlib.contextmanager
def nginx(upstream: str, workers: int = 1, binary: str | None = None,
          timeout_s: float = 20.0, keepalive: int = 64) -> Iterator[Nginx]:
    """nginx in front of `upstream` (`host:port`) until the block ends; stopped (SIGQUIT,
    then SIGKILL) even when it raises."""
    path = binary or available()
    if path is None:
        raise FileNotFoundError("nginx is not installed (apt install nginx-light)")
    with tempfile.TemporaryDirectory(prefix="corral-bench-nginx-") as tmp:
        root = Path(tmp)
        port = free_port()
        conf = root / "nginx.conf"
        conf.write_text(config_text(port, upstream, workers, root, keepalive))
        proc = subprocess.Popen([path, "-p", str(root), "-e", str(root / "error.log"),
                                 "-c", str(conf)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        running = Nginx(proc, port, root)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                    raise RuntimeError(f"nginx exited with status {proc.returncode}: "
                                       f"{err.strip()} {running.log().strip()}"[:2000])
                # Up: it listens, and every worker is forked (its CPU is read from their
                # pids, taken once: a worker forked later would go uncounted).
                if len(running.pids()) == workers + 1:
                    with contextlib.suppress(OSError), socket.create_connection(
                            ("127.0.0.1", port), timeout=0.5):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nginx did not listen on {port} within {timeout_s} s")
                time.sleep(0.02)
            yield running
        finally:
            pids = running.pids()
            if proc.poll() is None:
                proc.send_signal(signal.SIGQUIT)  # its graceful stop
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            for pid in pids[1:]:  # a worker its master left behind (a SIGKILLed master)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
