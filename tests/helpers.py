"""Test helpers: fake children that misbehave, a chat request, an SSE follower, a pid
check. A corral process, fake commands, TOML configs, one HTTP exchange and polling come
from `bench.support`, which the benches share; they are re-exported here."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.support import ROOT, Corral, fake_cmd, request, toml_config, wait_until

__all__ = ["ROOT", "SSE", "Corral", "chat", "fails_first", "fake_cmd", "key_files", "pid_alive",
           "request", "serving", "toml_config", "wait_until"]


def fails_first(starts: int, counter: Path) -> list[str]:
    """argv of a child whose first `starts` starts exit with status 7 (no shell: python
    counts them in `counter`); after that it is the fake model server."""
    return ["python3", "-c",
            "import os, sys; p = sys.argv[1]\n"
            "n = int(open(p).read()) if os.path.exists(p) else 0\n"
            "open(p, 'w').write(str(n + 1))\n"
            f"if n < {starts}: sys.exit(7)\n"
            "os.execvp(sys.executable, [sys.executable, *sys.argv[2:]])",
            str(counter), *fake_cmd()[1:]]


def chat(port: int, model: str, max_tokens: int = 4, headers: dict[str, str] | None = None,
         **extra: Any) -> tuple[int, Any]:
    status, body, _ = request(port, "POST", "/v1/chat/completions",
                              {"model": model, "max_tokens": max_tokens,
                               "messages": [{"role": "user", "content": "hi"}], **extra},
                              headers=headers)
    return status, body


class Call(threading.Thread):
    """A chat request (X-Request-Id `id_`) on a thread; a stream's lines are kept as they
    come."""

    def __init__(self, port: int, model: str, id_: str, headers: dict[str, str] | None = None,
                 stream: bool = False, max_tokens: int = 2000) -> None:
        super().__init__(daemon=True)
        self.port, self.model, self.id, self.stream = port, model, id_, stream
        self.max_tokens = max_tokens
        self.headers = headers or {}
        self.status = 0
        self.lines: list[bytes] = []
        self.body: Any = None
        self.start()

    def run(self) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"model": self.model, "max_tokens": self.max_tokens, "stream": self.stream,
                 "messages": [{"role": "user", "content": "hi"}]}),
                {**self.headers, "Content-Type": "application/json", "X-Request-Id": self.id})
            resp = conn.getresponse()
            self.status = resp.status
            if self.stream:
                while line := resp.readline():
                    self.lines.append(line)
            else:
                self.body = json.loads(resp.read())
        finally:
            conn.close()


class SSE:
    """Follows an event stream (GET /models/sse unless told) on a thread; `wait_for`
    blocks until a matching event. A named event's data gets its name as "event"."""

    def __init__(self, port: int, headers: dict[str, str] | None = None,
                 path: str = "/models/sse", greeting: bytes = b": connected") -> None:
        self.events: list[dict[str, Any]] = []
        self.ended = threading.Event()
        """Set when the server ended the stream (or it was closed)."""
        self._cv = threading.Condition()
        self._conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        self._conn.request("GET", path, headers=headers or {})
        self._resp = self._conn.getresponse()
        assert self._resp.status == 200
        assert self._resp.readline().startswith(greeting)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        name = None
        try:
            while line := self._resp.readline():
                if line.startswith(b"event: "):
                    name = line[7:].strip().decode()
                elif line.startswith(b"data: "):
                    event = json.loads(line[6:])
                    if name is not None:
                        event["event"], name = name, None
                    with self._cv:
                        self.events.append(event)
                        self._cv.notify_all()
        except (OSError, ValueError, AttributeError):
            pass  # closed under the reader (http.client drops its file: AttributeError)
        finally:
            self.ended.set()
            with self._cv:
                self._cv.notify_all()

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool],
                 timeout_s: float = 15.0) -> dict[str, Any]:
        with self._cv:
            deadline = time.monotonic() + timeout_s
            while True:
                for e in self.events:
                    if predicate(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no matching event in {self.events}")
                self._cv.wait(left)

    def statuses(self, model: str) -> list[str]:
        """The transitions of `model` (loading progress reports left out)."""
        with self._cv:
            return [e["status"] for e in self.events
                    if e["type"] == "status_change" and e["model"] == model
                    and "progress" not in e]

    def close(self) -> None:
        # Shut the socket down first: closing alone waits for the reader thread's
        # blocked read (up to the 60 s timeout) on the buffered file's lock.
        if self._conn.sock is not None:
            with contextlib.suppress(OSError):
                self._conn.sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()


def key_files(home: Path, *names: str) -> dict[str, str]:
    """A key file `NAME.key` holding `NAME-secret` for each name; name -> its path."""
    for name in names:
        (home / f"{name}.key").write_text(f"{name}-secret\n")
    return {name: str(home / f"{name}.key") for name in names}


@contextlib.contextmanager
def serving(home: Path, config: str, admin_key: str | None = None) -> Iterator[Corral]:
    """A corral on `config` for a module's tests (`admin_key`: what its `models()` and
    `state()` ask with), stopped after them."""
    c = Corral(config, home=home)
    c.key = admin_key
    try:
        yield c
    finally:
        c.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
